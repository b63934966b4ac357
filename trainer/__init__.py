"""Train the built-in model pair (a small Llama target and its EAGLE head) from scratch.

Entry points: `trainer.main.train_pair(out_dir, ...)` and `python -m trainer --out DIR`.
Imported lazily by `pdserve train` (it needs torch).
"""
