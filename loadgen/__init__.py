"""`pdserve bench`: a streaming load generator and report for any OpenAI-compatible server.

Torch-free and engine-free on purpose: it is a client, usable against pdserve or any other server.
Modules: dataset (prompts), client (one streamed request), metrics (the math), sweep (load
points), plots (PNG), runner (the options and `run_bench`). The prefix-reuse workloads:
workloads (multi-turn conversations and shared system prompts, from a seed), reuse_points (their
load points), reuse (cached vs reusable prompt tokens, latency per turn).
"""
