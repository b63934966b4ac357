"""`pdserve bench`: a streaming load generator and report for any OpenAI-compatible server.

Torch-free and engine-free on purpose: it is a client, usable against pdserve or any other server.
Modules: dataset (prompts), client (one streamed request), metrics (the math), sweep (load
points), plots (PNG), cli (the typer command).
"""
