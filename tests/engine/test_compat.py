"""common.fingerprint: the model hash, the fingerprint's field-naming mismatch and the pairing token."""

from __future__ import annotations

import dataclasses
import json
import shutil
import struct
from pathlib import Path

import pytest

from common.fingerprint import (
    SAMPLE_BYTES,
    SAMPLE_COUNT,
    Fingerprint,
    build_fingerprint,
    first_mismatch,
    model_hash,
    INFORMATIONAL,
    pairing_protocol,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fixtures.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("compat") / "tiny", seed=0)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _data_start(path: Path) -> int:
    (header_len,) = struct.unpack("<Q", path.read_bytes()[:8])
    return 8 + header_len


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _fingerprint(model: Path, **overrides: object) -> Fingerprint:
    kwargs: dict = dict(
        dtype="bfloat16",
        page_size=16,
        kv_layout="nhd",
        spec_algorithm="EAGLE3",
        draft_model_dir=None,
        aux_row_bytes=4096,
    )
    kwargs.update(overrides)
    return build_fingerprint(model, **kwargs)


def test_same_directory_same_hash(model_dir: Path, tmp_path: Path) -> None:
    h = model_hash(model_dir)
    assert len(h) == 64 and h == model_hash(model_dir)
    assert model_hash(_copy(model_dir, tmp_path / "copy")) == h  # content, not location


def test_same_seed_rewritten_same_hash(model_dir: Path, tmp_path: Path) -> None:
    from fixtures.tiny_model import write_tiny_model

    assert model_hash(write_tiny_model(tmp_path / "again", seed=0)) == model_hash(model_dir)
    assert model_hash(write_tiny_model(tmp_path / "other", seed=1)) != model_hash(model_dir)


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_changed_weight_byte_changes_hash(model_dir: Path, tmp_path: Path, where: str) -> None:
    copy = _copy(model_dir, tmp_path / "copy")
    weights = sorted(copy.glob("*.safetensors"))[0]
    start, end = _data_start(weights), weights.stat().st_size
    _flip_byte(weights, {"first": start, "middle": (start + end) // 2, "last": end - 1}[where])
    assert model_hash(copy) != model_hash(model_dir)


def test_changed_config_changes_hash(model_dir: Path, tmp_path: Path) -> None:
    copy = _copy(model_dir, tmp_path / "copy")
    config = json.loads((copy / "config.json").read_text())
    config["rope_theta"] = config["rope_theta"] * 2
    (copy / "config.json").write_text(json.dumps(config))
    assert model_hash(copy) != model_hash(model_dir)


def test_large_file_is_sampled_not_read_whole(tmp_path: Path) -> None:
    """The documented trade-off: sampled bytes count, bytes between samples do not."""
    import numpy as np
    from safetensors.numpy import save_file

    model = tmp_path / "big"
    model.mkdir()
    (model / "config.json").write_text("{}")
    n = 4 * SAMPLE_COUNT * SAMPLE_BYTES  # 4 MiB of data, so 16 x 64 KiB samples cover a quarter
    save_file({"w": np.zeros(n, dtype=np.uint8)}, str(model / "model.safetensors"))
    before = model_hash(model)
    path = model / "model.safetensors"
    start = _data_start(path)
    _flip_byte(path, start + SAMPLE_BYTES + 10)  # between the first and second sample
    assert model_hash(model) == before
    _flip_byte(path, start + 10)  # inside the first sample (the previous flip stays)
    assert model_hash(model) != before


def test_missing_or_corrupt_model_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        model_hash(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        model_hash(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 10**6) + b"{}")
    with pytest.raises(ValueError, match="header length"):
        model_hash(tmp_path)


def test_build_fingerprint(model_dir: Path, tmp_path: Path) -> None:
    from fixtures.tiny_model import write_tiny_model

    draft = write_tiny_model(tmp_path / "draft", seed=3, num_layers=1)
    fp = _fingerprint(model_dir, dtype="torch.bfloat16", draft_model_dir=draft)
    assert fp.model_hash == model_hash(model_dir) and fp.draft_model_hash == model_hash(draft)
    assert fp.dtype == "bfloat16" and fp.page_size == 16 and fp.aux_row_bytes == 4096
    import pdserve

    assert fp.version == pdserve.__version__
    assert _fingerprint(model_dir, spec_algorithm="", draft_model_dir=None).draft_model_hash == ""
    assert Fingerprint.from_proto(fp.to_proto()) == fp


def test_first_mismatch_names_the_field(model_dir: Path) -> None:
    fp = _fingerprint(model_dir)
    assert first_mismatch(fp, fp) is None
    assert first_mismatch(fp, dataclasses.replace(fp, page_size=4)) == "page_size differs: prefill 16, decode 4"
    assert (
        first_mismatch(fp, dataclasses.replace(fp, spec_algorithm=""))
        == "spec_algorithm differs: prefill 'EAGLE3', decode ''"
    )
    msg = first_mismatch(dataclasses.replace(fp, dtype="float16"), fp, "decode", "prefill")
    assert msg == "dtype differs: decode 'float16', prefill 'bfloat16'"
    for field in dataclasses.fields(Fingerprint):
        value = getattr(fp, field.name)
        other = dataclasses.replace(fp, **{field.name: value + 1 if isinstance(value, int) else value + "x"})
        want = None if field.name in INFORMATIONAL else f"{field.name} differs: "
        got = first_mismatch(fp, other)
        assert got is None if want is None else (got or "").startswith(want)


def test_pairing_protocol_equal_iff_fingerprints_equal(model_dir: Path) -> None:
    fp = _fingerprint(model_dir)
    token = pairing_protocol(fp)
    assert token == pairing_protocol(_fingerprint(model_dir)) == pairing_protocol(dataclasses.replace(fp))
    assert token.startswith("pdserve-") and len(token) <= 32
    variants = [
        dataclasses.replace(
            fp,
            **{
                f.name: (getattr(fp, f.name) + 1 if isinstance(getattr(fp, f.name), int) else getattr(fp, f.name) + "x")
            },
        )
        for f in dataclasses.fields(Fingerprint)
        if f.name not in INFORMATIONAL
    ]
    tokens = {pairing_protocol(v) for v in variants}
    assert token not in tokens and len(tokens) == len(variants)


def test_tp_layout_names_each_ranks_kv_heads_and_nodes_of_different_sizes_pair(model_dir: Path, tmp_path: Path) -> None:
    """The layout names each rank's KV heads; nodes at different TP sizes still pair (their
    transports map heads rank to rank), so routers pair them too."""
    from fixtures.tiny_model import write_tiny_model

    one, two = _fingerprint(model_dir), _fingerprint(model_dir, tp_size=2)
    assert (one.tp_layout, two.tp_layout) == ("tp=1;kv_heads=0-1", "tp=2;kv_heads=0-0,1-1")  # 4 heads, 2 KV
    assert first_mismatch(one, two) is None
    assert pairing_protocol(one) == pairing_protocol(two)
    assert first_mismatch(two, _fingerprint(model_dir, tp_size=2)) is None
    assert Fingerprint.from_proto(two.to_proto()) == two
    few_kv = write_tiny_model(tmp_path / "mqa", seed=1, num_heads=4, num_kv_heads=1)
    assert _fingerprint(few_kv, tp_size=4).tp_layout == "tp=4;kv_heads=0-0,0-0,0-0,0-0"  # replicated
