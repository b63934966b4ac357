"""The training corpus: the running interpreter's standard-library Python sources, split by file.

It exists offline on every machine, but differs between Python versions, so `stats` records the
interpreter, the file counts and bytes, and a fingerprint of the exact text used.
"""

from __future__ import annotations

import hashlib
import platform
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Test suites are huge, repetitive and full of deliberately odd code; site-packages is not stdlib.
EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})


@dataclass
class Corpus:
    train_names: list[str]
    train: list[str]
    test_names: list[str]
    test: list[str]
    stats: dict[str, Any] = field(default_factory=dict)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path) -> list[str]:
    """Relative paths (posix, sorted) of the .py files under `root`, test dirs excluded."""
    rels = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if EXCLUDED_DIRS.isdisjoint(rel.parts[:-1]) and path.is_file():
            rels.append(rel.as_posix())
    return sorted(rels)


def is_heldout(rel: str, fraction: float) -> bool:
    """Deterministic on every machine: a hash of the relative path, not of the file's bytes."""
    h = int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "big")
    return h < fraction * 2**64


def _read(path: Path) -> str:
    # A few stdlib files are not UTF-8; replacement characters are harmless for training.
    return path.read_bytes().decode("utf-8", errors="replace")


def load_corpus(
    root: Path | None = None,
    *,
    heldout: float = 0.02,
    max_train_bytes: int | None = None,
    max_test_files: int | None = None,
    min_test_files: int = 1,
) -> Corpus:
    """Split by file; `max_train_bytes` / `max_test_files` take a deterministic prefix (tiny runs).

    At least `min_test_files` are held out even from a tiny slice (the first files by path whose
    hash is smallest), so a held-out evaluation always has data.
    """
    root = root or stdlib_root()
    rels = source_files(root)
    if not rels:
        raise FileNotFoundError(f"no .py files under {root}")
    test_rels = [r for r in rels if is_heldout(r, heldout)]
    if len(test_rels) < min_test_files:
        by_hash = sorted(rels, key=lambda r: hashlib.sha256(r.encode()).digest())
        test_rels = sorted(by_hash[:min_test_files])
    test_set = set(test_rels)
    train_rels = [r for r in rels if r not in test_set]
    if max_test_files is not None:
        test_rels = test_rels[:max_test_files]
    train_names, train, used = [], [], 0
    for rel in train_rels:
        if max_train_bytes is not None and used >= max_train_bytes:
            break
        text = _read(root / rel)
        train_names.append(rel)
        train.append(text)
        used += len(text.encode())
    test = [_read(root / rel) for rel in test_rels]
    return Corpus(train_names, train, test_rels, test, _stats(root, train_names, train, test_rels, test))


def _stats(
    root: Path, train_names: list[str], train: list[str], test_names: list[str], test: list[str]
) -> dict[str, Any]:
    digest = hashlib.sha256()
    for name, text in zip(train_names + test_names, train + test):
        digest.update(name.encode() + b"\0" + text.encode() + b"\0")
    return {
        "source": "python stdlib",
        "python_version": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "stdlib_path": str(root),
        "train_files": len(train),
        "train_bytes": sum(len(t.encode()) for t in train),
        "test_files": len(test),
        "test_bytes": sum(len(t.encode()) for t in test),
        "test_file_names": test_names,
        "sha256": digest.hexdigest(),
    }
