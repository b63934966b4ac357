"""The prefill/decode compatibility fingerprint (DESIGN.md §5), exchanged at KV handshake.

A prefill and a decode node may pair only when they serve the same weights in the same dtype and
lay their KV pages and aux rows out the same way; otherwise the KV bytes that NIXL moves would be
read as something else. `build_fingerprint` gathers those facts, `first_mismatch` names the first
that differs (the KVControl servicer turns it into FAILED_PRECONDITION), and `pairing_protocol`
folds the fingerprint into a short token for SMG's `GetServerInfo.server_args.pairing_protocol`,
so SMG itself never pairs mismatched nodes.

Model hash trade-off: hashing every weight byte of a multi-GB checkpoint takes seconds to minutes
at each node start. `model_hash` instead hashes config.json, each safetensors file's name, size and
header (tensor names, dtypes, shapes, offsets) and a sample of its tensor bytes (64 KiB at 16
evenly spaced offsets of the data region; files whose data fits in the sample are read whole).
This reads about 1 MiB per file and catches a different model, config, revision, quantization or
layout, and any re-save that moves bytes; it misses an edit confined to unsampled bytes of a same-
shaped tensor (e.g. a fine-tune that changed only a few values), which is an accepted risk: two
nodes are given the same checkpoint path by the same deployment, and the hash only guards
against mistakes, not adversaries.

Torch-free: imports only the standard library and the generated pdserve.v1 messages.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.v1 import kv_control_pb2

SAMPLE_COUNT = 16
"""Tensor-byte samples taken per safetensors file."""
SAMPLE_BYTES = 64 * 1024
"""Bytes per sample."""
MAX_HEADER_BYTES = 100 * 1024 * 1024
"""safetensors' own limit on the JSON header size; a larger length means a corrupt file."""
_HASH_DOMAIN = b"pdserve-model-hash-v1\0"


def _update_field(h: Any, tag: str, data: bytes) -> None:
    """Feed one length-prefixed, tagged chunk, so concatenations of different parts never collide."""
    h.update(tag.encode() + b"\0" + struct.pack("<Q", len(data)))
    h.update(data)


def _sample_offsets(start: int, end: int, count: int = SAMPLE_COUNT, size: int = SAMPLE_BYTES) -> list[tuple[int, int]]:
    """(offset, length) reads covering [start, end): whole if small, else `count` spread samples."""
    length = end - start
    if length <= count * size:
        return [(start, length)] if length > 0 else []
    step = (length - size) / (count - 1)
    return [(start + int(i * step), size) for i in range(count)]


def _hash_safetensors(h: Any, path: Path) -> None:
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path}: too short to be a safetensors file ({size} bytes)")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
            raise ValueError(f"{path}: corrupt safetensors header length {header_len} (file is {size} bytes)")
        header = f.read(header_len)
        _update_field(h, "file", path.name.encode())
        _update_field(h, "size", struct.pack("<Q", size))
        _update_field(h, "header", prefix + header)
        for offset, length in _sample_offsets(8 + header_len, size):
            f.seek(offset)
            _update_field(h, f"sample@{offset}", f.read(length))


def model_hash(model_dir: str | os.PathLike[str]) -> str:
    """sha256 (hex) over config.json and every safetensors file's size, header and sampled bytes.

    Content-sensitive but not exhaustive: see the module docstring for what it reads and misses.
    """
    root = Path(model_dir)
    config = root / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{root}: no config.json (is this a model directory?)")
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{root}: no *.safetensors files")
    h = hashlib.sha256(_HASH_DOMAIN)
    _update_field(h, "config.json", config.read_bytes())
    for path in files:
        _hash_safetensors(h, path)
    return h.hexdigest()


@dataclass(frozen=True)
class Fingerprint:
    """What must agree between a prefill and a decode node; mirrors pdserve.v1.Fingerprint."""

    model_hash: str
    """`model_hash` of the target model directory."""
    dtype: str
    """Weight and KV cache dtype name, e.g. "bfloat16"."""
    page_size: int
    """Tokens per KV page."""
    kv_layout: str
    """Name of the KV buffer layout."""
    spec_algorithm: str
    """Speculative algorithm name; "" when off."""
    draft_model_hash: str
    """`model_hash` of the draft model directory; "" when there is none."""
    aux_row_bytes: int
    """Bytes per handoff row (room echo, the shared header, the algorithm's payload)."""
    version: str
    """pdserve version."""
    tp_layout: str
    """Tensor-parallel ranks and the target's KV heads each holds (`describe_tp_layout`). Carried,
    not compared (INFORMATIONAL): nodes of different TP sizes pair, their transports mapping heads
    rank to rank, and refusing by name a pair whose heads cannot map (engine/kv_transfer/tp.py)."""

    def to_proto(self) -> kv_control_pb2.Fingerprint:
        """The wire message for the KVControl handshake."""
        from pdserve.v1 import kv_control_pb2

        return kv_control_pb2.Fingerprint(**dataclasses.asdict(self))

    @classmethod
    def from_proto(cls, msg: kv_control_pb2.Fingerprint) -> Fingerprint:
        """Read a wire message; unset fields read as proto3 defaults ("" and 0)."""
        return cls(**{f.name: getattr(msg, f.name) for f in dataclasses.fields(cls)})


# Fields that describe a node without having to agree with its peer's
INFORMATIONAL = frozenset({"tp_layout"})


def _dtype_name(dtype: object) -> str:
    """ "bfloat16" for "bfloat16", "torch.bfloat16" or torch.bfloat16 (without importing torch)."""
    return str(dtype).removeprefix("torch.")


def build_fingerprint(
    model_dir: str | os.PathLike[str],
    dtype: str,
    page_size: int,
    kv_layout: str,
    spec_algorithm: str,
    draft_model_dir: str | os.PathLike[str] | None,
    aux_row_bytes: int,
    *,
    tp_size: int = 1,
    version: str | None = None,
) -> Fingerprint:
    """Fingerprint of a node serving `model_dir` (and `draft_model_dir`, if any) this way, over
    `tp_size` tensor-parallel ranks.

    `version` defaults to the installed pdserve distribution's version (pyproject's, the same
    string as `pdserve.__version__`): the engine may not import the umbrella package itself
    (DESIGN.md §2), so a node that wants the module attribute passes it in.
    """
    return Fingerprint(
        model_hash=model_hash(model_dir),
        dtype=_dtype_name(dtype),
        page_size=int(page_size),
        kv_layout=kv_layout,
        spec_algorithm=spec_algorithm or "",
        draft_model_hash=model_hash(draft_model_dir) if draft_model_dir else "",
        aux_row_bytes=int(aux_row_bytes),
        version=version if version is not None else _pdserve_version(),
        tp_layout=describe_tp_layout(model_dir, tp_size),
    )


def describe_tp_layout(model_dir: str | os.PathLike[str], tp_size: int) -> str:
    """ "tp=2;kv_heads=0-3,4-7": the ranks and the KV heads of the target each rank holds (ranges
    overlap where KV heads are replicated); a KV write between nodes maps heads rank to rank."""
    from common.tp_layout import TpLayout

    config = Path(model_dir) / "config.json"
    raw = json.loads(config.read_text())
    try:
        heads = int(raw["num_attention_heads"])
        dims = (
            heads,
            int(raw.get("num_key_value_heads") or heads),
            int(raw["intermediate_size"]),
            int(raw["vocab_size"]),
        )
    except KeyError as e:
        raise ValueError(f"{config}: missing {e.args[0]!r}, needed for the tensor-parallel layout") from None
    per_rank = (TpLayout(r, tp_size, *dims).kv_heads for r in range(tp_size))
    return f"tp={tp_size};kv_heads=" + ",".join(f"{kv.start}-{kv.stop - 1}" for kv in per_rank)


def _pdserve_version() -> str:
    try:
        return importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"  # running from a checkout that was never installed


def _show(value: object) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def first_mismatch(a: Fingerprint, b: Fingerprint, a_name: str = "prefill", b_name: str = "decode") -> str | None:
    """None when the fingerprints match, else e.g. "page_size differs: prefill 16, decode 4"."""
    for f in dataclasses.fields(Fingerprint):
        if f.name in INFORMATIONAL:
            continue
        va, vb = getattr(a, f.name), getattr(b, f.name)
        if va != vb:
            return f"{f.name} differs: {a_name} {_show(va)}, {b_name} {_show(vb)}"
    return None


def pairing_protocol(fp: Fingerprint) -> str:
    """Short stable token of the whole fingerprint, for SMG's GetServerInfo `pairing_protocol`.

    Equal fingerprints give equal tokens; any differing field gives a different one (64-bit
    truncated sha256, so collisions are negligible for this purpose).
    """
    fields = {k: v for k, v in dataclasses.asdict(fp).items() if k not in INFORMATIONAL}
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return "pdserve-" + hashlib.sha256(canonical.encode()).hexdigest()[:16]
