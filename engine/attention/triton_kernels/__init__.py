"""Triton kernels over the paged KV cache: K/V store, split-K decode, extend/verify attention."""
