"""KV transfer between prefill and decode nodes: contract (base), handoff rows, layouts, transports.

NIXL is optional at import time: `engine.kv_transfer` imports without it, and only
`create_transport("nixl", ...)` (or importing `engine.kv_transfer.nixl`) needs `nixl_cu13`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from engine.kv_cache import KVPool
from engine.kv_transfer.rows import HandoffRows, row_bytes_for
from engine.kv_transfer.base import (
    KVPoll,
    KVTransport,
    MemoryLayout,
    Region,
    TransferError,
    TransferRequest,
    completion_tag,
    failure_tag,
    parse_tag,
)
from engine.kv_transfer.fake import FakeTransport
from engine.kv_transfer.layout import coalesce_runs, kv_regions, page_descs, page_runs, run_descs

__all__ = [
    "FakeTransport",
    "HandoffRows",
    "KVPoll",
    "KVTransport",
    "MemoryLayout",
    "Region",
    "TransferError",
    "TransferRequest",
    "coalesce_runs",
    "page_runs",
    "completion_tag",
    "create_transport",
    "failure_tag",
    "kv_regions",
    "nixl_available",
    "page_descs",
    "parse_tag",
    "row_bytes_for",
    "run_descs",
]


def nixl_available() -> bool:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # its logger reads this once, at import
    try:
        import nixl_cu13._api  # noqa: F401
    except Exception:  # ImportError, or a broken wheel failing to load its native libs
        return False
    return True


def create_transport(kind: str, name: str, pools: Sequence[KVPool], aux: HandoffRows, **kwargs: object) -> KVTransport:
    """`kind` "nixl" (production) or "fake" (in-process, tests only); kwargs go to NixlTransport."""
    if kind == "fake":
        if kwargs:
            raise TypeError(f"FakeTransport takes no options, got {sorted(kwargs)}")
        return FakeTransport(name, pools, aux)
    if kind == "nixl":
        try:
            from engine.kv_transfer.nixl import NixlTransport
        except ImportError as e:
            raise RuntimeError(
                "KV transfer backend 'nixl' needs the nixl-cu13 package: "
                "`.venv/bin/pip install --no-deps nixl-cu13==1.5.1` "
                f"(import failed: {e})"
            ) from e
        return NixlTransport(name, pools, aux, **kwargs)  # type: ignore[arg-type]
    raise ValueError(f"unknown transport kind {kind!r} (expected 'nixl' or 'fake')")
