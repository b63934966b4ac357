"""Regenerate the committed wire code in pdserve/v1 from the .proto sources under proto/.

    python proto/generate.py            # rewrite pdserve/v1/*_pb2.py, *_pb2.pyi, *_pb2_grpc.py
    python proto/generate.py --out DIR  # write DIR/pdserve/v1/... instead (tests diff this)

`proto/` is the include root (Buf layout: directory == package, `proto/pdserve/v1/*.proto` holds
`package pdserve.v1;`), so the generated modules land at `pdserve/v1/` and import each other as
`from pdserve.v1 import kv_control_pb2` with no rewriting. The output is committed: images and
CI need no grpcio-tools. Use the grpcio-tools version pinned in pyproject's `test` extra; its
gencode version sets the `protobuf>=` floor and its own version the `grpcio>=` floor.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
REPO_ROOT = PROTO_ROOT.parent
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_sources(root: Path = PROTO_ROOT) -> list[Path]:
    """Every .proto file under `root`, as paths relative to it, in a stable order."""
    return sorted(p.relative_to(root) for p in root.rglob("*.proto"))


def generated_files(out: Path) -> list[Path]:
    """The generated files under `out` (relative to it) in the sources' top-level packages."""
    tops = sorted({src.parts[0] for src in proto_sources()})
    return sorted(
        p.relative_to(out) for top in tops for suffix in GENERATED_SUFFIXES for p in (out / top).rglob(f"*{suffix}")
    )


def generate(out: Path = REPO_ROOT) -> list[Path]:
    """Run protoc over every source into `out`; stale generated files are removed first.

    Returns the generated files relative to `out`.
    """
    sources = proto_sources()
    if not sources:
        raise SystemExit(f"no .proto files under {PROTO_ROOT}")
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    for stale in generated_files(out):
        (out / stale).unlink()
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *map(str, sources),
    ]
    # Sources are given relative to the include root so `# source:` lines do not depend on
    # where the checkout lives.
    proc = subprocess.run(cmd, cwd=PROTO_ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"protoc failed ({proc.returncode}):\n{proc.stderr}")
    return generated_files(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=REPO_ROOT, help="output root; files go to OUT/pdserve/v1 (default: the repo root)"
    )
    args = parser.parse_args(argv)
    try:
        import grpc_tools  # noqa: F401
    except ModuleNotFoundError:
        print("grpcio-tools is missing: pip install -e '.[test]'", file=sys.stderr)
        return 1
    for path in generate(args.out):
        print(args.out / path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
