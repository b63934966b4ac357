"""The engine both node roles run (torch): models, KV pool, scheduler, model runner, attention, sampler."""
