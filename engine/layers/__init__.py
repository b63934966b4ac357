"""Model building blocks: norms, rotary embeddings, attention and MLP layers."""
