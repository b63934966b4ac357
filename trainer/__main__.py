"""`python -m trainer --out DIR [...]`: the same as `pdserve train` (the same flags)."""

import sys

from pdserve.cli import app

if __name__ == "__main__":
    app(["train", *sys.argv[1:]], prog_name="python -m trainer")
