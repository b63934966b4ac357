"""Prefill node role: Generate for prompts, rooms, the KVControl servicer decode nodes call, and its role object."""
