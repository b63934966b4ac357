"""Speculative decoding: algorithm registry and plugin API, EAGLE/EAGLE-3 worker, verification, FutureMap."""
