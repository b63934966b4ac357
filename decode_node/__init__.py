"""Decode node role: Generate after a prefill's KV arrives, prefill peers, completion waiting, and its role object."""
