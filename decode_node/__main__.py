"""`python -m decode_node`: the same node as `pdserve decode` (the same flags and PDSERVE_* variables)."""

import sys

from pdserve.cli import app

if __name__ == "__main__":
    app(["decode", *sys.argv[1:]], prog_name="python -m decode_node")
