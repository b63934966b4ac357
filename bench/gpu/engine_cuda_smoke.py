"""GPU smoke: the CPU-oracle-tested engine on CUDA gives the same greedy tokens (plain and
speculative), on the eager torch path and on the fast path (Triton attention and layers, CUDA
graphs, overlap), and runs in bf16. Run on the GPU machine: python -m bench.gpu.engine_cuda_smoke."""

from __future__ import annotations

import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from engine.core import SamplingParams
from engine.engine import Engine, EngineConfig
from fixtures.tiny_eagle import write_tiny_eagle_head
from fixtures.tiny_model import write_tiny_model
from spec.config import SpecConfig
from spec.registry import bind, register_class, registered_names

PROMPTS = [[5, 17, 42, 7, 99, 3, 11, 250], [300] * 5, list(range(100, 121)), [8, 1]]
GREEDY = SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True)


FAST = dict(attention_backend="triton", overlap=True, cuda_graph_max_bs=8)


def outputs(model: Path, device: str, spec: SpecConfig | None = None, dtype: str | None = None, **fast: object) -> list:
    eng = Engine(
        EngineConfig(str(model), device=device, page_size=4, dtype=dtype, **fast),
        algorithm=bind(spec) if spec else None,
    )
    t = time.perf_counter()
    out = [o.output_ids for o in eng.generate(PROMPTS, GREEDY)]
    return out, time.perf_counter() - t, eng.kv.all_free


def main() -> int:
    if "NGRAM" not in registered_names():  # not pip-installed here: no entry point to find it by
        from spec.ngram import NgramAlgo

        register_class("NGRAM", NgramAlgo)
    root = Path(tempfile.mkdtemp())
    target = write_tiny_model(root / "t", seed=1)
    head = write_tiny_eagle_head(root / "h", target, "eagle", mode="repeat")
    head3 = write_tiny_eagle_head(root / "h3", target, "eagle3", draft_vocab_size=300)
    want, _, _ = outputs(target, "cpu")
    cases = {
        "plain": None,
        "eagle-chain": SpecConfig("EAGLE", str(head), 3, 1),
        "eagle-tree": SpecConfig("EAGLE", str(head), 3, 2, 5),
        "eagle3-chain": SpecConfig("EAGLE3", str(head3), 3, 1),
        "ngram": SpecConfig("NGRAM", None, 3),
    }
    report, ok = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}, True
    for name, spec in cases.items():
        for path, fast in (("eager", {}), ("fast", FAST)):
            try:
                got, secs, free = outputs(target, "cuda", spec, **fast)
            except Exception:  # noqa: BLE001 - report every case, then fail
                ok = False
                report[f"{name}-{path}"] = {"error": traceback.format_exc()[:5000]}
                continue
            same = got == want
            ok &= same and free
            report[f"{name}-{path}"] = {"equal_to_cpu": same, "seconds": round(secs, 3), "pages_free": free}
    got, secs, free = outputs(target, "cuda", None, "bfloat16")
    report["plain-bf16"] = {
        "first_tokens_equal": [g[0] for g in got] == [w[0] for w in want],
        "seconds": round(secs, 3),
        "pages_free": free,
    }
    print(json.dumps(report, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
