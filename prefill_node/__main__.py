"""`python -m prefill_node`: the same node as `pdserve prefill` (the same flags and PDSERVE_* variables)."""

import sys

from pdserve.cli import app

if __name__ == "__main__":
    app(["prefill", *sys.argv[1:]], prog_name="python -m prefill_node")
