"""Train the built-in model pair (a small Llama target and its EAGLE head) from scratch.

Entry points: `pdserve.train.main.train_pair(out_dir, ...)` and `python -m pdserve.train --out DIR`.
Imported lazily (torch), never from pdserve/__init__.py.
"""
