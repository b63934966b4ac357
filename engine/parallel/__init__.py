"""Tensor parallelism: the rank group, sharded layers and loading, and the lockstep runtime."""
