"""Torch-free code the router and the nodes share: tokenizer, detokenizing, sampling schema, fingerprint, config."""
