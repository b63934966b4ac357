"""OpenAI-compatible router (never imports torch): API, tokenization, pair selection, node clients."""
