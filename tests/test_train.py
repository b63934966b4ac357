"""trainer: a toy pair trains, saves, loads in the engine (EAGLE on = off), reproducibly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.core import SamplingParams
from engine.engine import Engine, EngineConfig
from common.tokenizer import Tokenizer
from trainer.corpus import is_heldout, load_corpus, source_files
from trainer.main import PRESETS, train_pair
from trainer.save import save_weights
from spec.config import SpecConfig
from spec.registry import bind

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("pair")
    return out, train_pair(out, tiny=True, seed=0, device="cpu", progress=False, log=lambda _: None)


def test_pair_serves_with_and_without_eagle(pair: tuple[Path, dict]) -> None:
    out, metrics = pair
    config = EngineConfig(str(out / "target"), dtype="float32", page_size=4)
    plain = Engine(config)
    prompts = [plain.tokenizer.encode("def main():\n    "), plain.tokenizer.encode("import os\nimport")]
    want = [o.output_ids for o in plain.generate(prompts, GREEDY)]
    spec = Engine(config, algorithm=bind(SpecConfig("EAGLE", str(out / "eagle"), 4, 1)))
    assert [o.output_ids for o in spec.generate(prompts, GREEDY)] == want
    assert spec.executor.stats.verifies > 0
    acc = metrics["acceptance"]
    assert acc["greedy_equals_plain"] and 1.0 <= acc["mean_accept_len"] <= 5.0


def test_metrics_report_files_sizes_and_corpus(pair: tuple[Path, dict]) -> None:
    out, metrics = pair
    meta = json.loads((out / "train_meta.json").read_text())
    assert meta["seed"] == 0 and meta["corpus"]["python_version"] and meta["corpus"]["test_files"] >= 1
    for rel, size in metrics["files"].items():
        assert (out / rel).stat().st_size == size
    assert {"target/config.json", "target/tokenizer.json", "eagle/config.json"} <= set(metrics["files"])
    assert metrics["total_bytes"] == metrics["target_bytes"] + metrics["head_bytes"] > 0
    assert metrics["target"]["heldout_loss"] > 0 and metrics["head"]["loss_history"]
    head_cfg = json.loads((out / "eagle" / "config.json").read_text())
    assert head_cfg["architectures"] == ["LlamaForCausalLMEagle"] and head_cfg["torch_dtype"] == "bfloat16"


def test_tokenizer_has_specials_and_chat_template(pair: tuple[Path, dict]) -> None:
    out, _ = pair
    tok = Tokenizer.from_dir(out / "target")
    ids = tok.encode("x = 1\n")
    assert ids[0] == tok.bos_token_id and tok.decode(ids) == "x = 1\n"
    assert tok.token_to_id("<|pad|>") is not None and tok.eos_token_ids
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "<|bos|><|user|>hi<|eos|><|assistant|>"
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(out / "target"))
    assert hf("x = 1\n")["input_ids"] == ids and hf.chat_template == tok._chat_templates["default"]


def test_target_matches_transformers(pair: tuple[Path, dict]) -> None:
    out, _ = pair
    transformers = pytest.importorskip("transformers")
    from trainer.layers import LlamaShape
    from trainer.target import TrainLlama
    from safetensors.torch import load_file

    cfg = json.loads((out / "target" / "config.json").read_text())
    shape = LlamaShape(
        cfg["hidden_size"],
        cfg["num_hidden_layers"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["intermediate_size"],
        cfg["vocab_size"],
        cfg["max_position_embeddings"],
        cfg["rope_theta"],
        cfg["rms_norm_eps"],
    )
    ours = TrainLlama(shape)
    ours.load_state_dict({k: v.float() for k, v in load_file(out / "target" / "model.safetensors").items()})
    hf = transformers.LlamaForCausalLM.from_pretrained(str(out / "target"), dtype=torch.float32)
    ids = torch.tensor([[0, 5, 17, 42, 7, 99, 3, 11]])
    with torch.no_grad():
        torch.testing.assert_close(ours.logits(ours.hidden(ids)), hf(ids).logits, atol=1e-4, rtol=1e-4)


def test_same_seed_same_weights(pair: tuple[Path, dict], tmp_path: Path) -> None:
    out, _ = pair
    again = train_pair(tmp_path, tiny=True, seed=0, device="cpu", progress=False, evaluate=False, log=lambda _: None)
    for rel in ("target/model.safetensors", "eagle/model.safetensors", "target/tokenizer.json"):
        assert (tmp_path / rel).read_bytes() == (out / rel).read_bytes(), rel
    assert again["target"]["loss_history"] == pair[1]["target"]["loss_history"]


def test_split_is_by_file_and_skips_tests(tmp_path: Path) -> None:
    for rel in ("a.py", "pkg/b.py", "test/t.py", "pkg/tests/t.py", "site-packages/x.py", "c.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(f"# {rel}\n")
    assert source_files(tmp_path) == ["a.py", "pkg/b.py"]
    corpus = load_corpus(tmp_path, heldout=0.0)  # none by hash: the smallest hash is held out anyway
    assert len(corpus.test) == 1 and sorted(corpus.train_names + corpus.test_names) == ["a.py", "pkg/b.py"]
    assert is_heldout("x/y.py", 1.0) and not is_heldout("x/y.py", 0.0)


def test_sharded_weights_load(tmp_path: Path) -> None:
    from engine.loader import checkpoint_files

    tensors = {f"w{i}": torch.full((100,), float(i)) for i in range(6)}
    save_weights(tmp_path, tensors, max_file_bytes=1000)
    files = checkpoint_files(tmp_path)
    assert len(files) > 1 and all(f.stat().st_size <= 1000 for f in files)


def test_full_preset_fits_the_size_budget() -> None:
    from trainer.eagle_head import build_head
    from trainer.target import build_target

    p = PRESETS["full"]
    target = build_target(p.shape, 0, torch.device("cpu"))
    head = build_head(target, p.head_intermediate, 0, torch.device("cpu"))
    t_bytes = 2 * sum(v.numel() for v in target.state_dict().values())  # bf16
    h_bytes = 2 * sum(v.numel() for v in head.state_dict().values())
    assert t_bytes / 2 <= 15_000_000 * 0.95 and h_bytes <= 15_000_000  # target: two shards
    assert t_bytes + h_bytes <= 25_000_000 - 600_000  # room for the tokenizer and config files
