"""What a prompt chunk costs inside a decode step against beside it, on the 8B shape (GPU).

`python -m bench.gpu.profile_mixed --out DIR` writes DIR/profile_mixed_<gpu>.json. One engine
(Triton attention, CUDA graphs: decode, prompt and mixed), requests holding 1,024 tokens of
context each. For decode batches B and chunks C it times, as wall time per forward over a run of
forwards launched back to back (the host's work overlapping the device's, as in serving):
- `decode`: B requests' decode step alone (a decode graph);
- `chunk`: a C-token prompt chunk alone over a 1,024-token cached prefix (a prompt graph);
- `mixed`: both in one forward (a mixed graph), and `mixed_eager` without its graph.
`mixed_over_apart` = mixed / (decode + chunk): what a decode node saves by mixing.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Callable

import torch

from bench.gpu.goodput import prepare_model
from engine.core import ForwardMode, Req, SamplingParams
from engine.engine import Engine, EngineConfig

CONTEXT = 1024
REPEATS = 30
BATCHES = (16, 64, 128)
CHUNKS = (128, 256, 512)


def timed(fn: Callable[[], Any]) -> float:
    """Wall time per call over REPEATS calls launched back to back (ms)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(REPEATS):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / REPEATS * 1e3


def requests(eng: Engine, n: int, window: int) -> list[Req]:
    reqs = []
    for i in range(n):
        req = Req(f"p{i}", [1] * CONTEXT, SamplingParams(max_new_tokens=1))
        eng.kv.assign_slot(req)
        eng.kv.reserve(req, CONTEXT + window)
        reqs.append(req)
    return reqs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    args = ap.parse_args()
    model_dir, _ = prepare_model("llama8b", None, eagle=False)
    max_bs = max(BATCHES)
    config = EngineConfig(
        str(model_dir),
        device="cuda:0",
        attention_backend="triton",
        cuda_graph_max_bs=max_bs,
        cuda_graph_prompt_tokens=512,
        max_total_tokens=(max_bs + 2) * (CONTEXT + 600),
        max_running=max_bs + 1,
        tpot_guard_ms=12.0,  # a decode node running prompts, mixing: mixed graphs are captured
        mixed_chunk=True,
    )
    eng = Engine(config)
    runner = eng.parts.runner
    graphs = runner.graphs
    assert graphs is not None and graphs.mixed_buckets is not None
    reqs = requests(eng, max_bs + 1, max(CHUNKS))
    vocab = eng.model_config.vocab_size
    gen = torch.Generator(device="cuda").manual_seed(0)

    def forward(batch: list[Req], extend: list[int], decode_rows: int) -> Callable[[], Any]:
        prefix = [CONTEXT] * len(batch)
        ids = torch.randint(1, vocab, (sum(extend),), generator=gen, device="cuda")

        def run() -> Any:
            ctx = runner.make_context(
                ForwardMode.DECODE if set(extend) == {1} and not decode_rows else ForwardMode.EXTEND,
                [r.slot for r in batch],
                prefix,
                extend,
                decode_rows=decode_rows,
            )
            return runner.forward(ids, ctx)

        return run

    rows: list[dict[str, Any]] = []
    chunk_req = reqs[-1]
    for b in BATCHES:
        decoding = reqs[:b]
        decode_ms = timed(forward(decoding, [1] * b, 0))
        for c in CHUNKS:
            chunk_ms = timed(forward([chunk_req], [c], 0))
            mixed_fn = forward(decoding + [chunk_req], [1] * b + [c], b)
            before = graphs.stats.hits
            mixed_ms = timed(mixed_fn)
            assert graphs.stats.hits > before, "the mixed forward did not replay a graph"
            buckets, graphs.mixed_buckets = graphs.mixed_buckets, None
            mixed_eager_ms = timed(mixed_fn)
            graphs.mixed_buckets = buckets
            row = {
                "decode_batch": b,
                "chunk_tokens": c,
                "decode_ms": round(decode_ms, 3),
                "chunk_ms": round(chunk_ms, 3),
                "mixed_ms": round(mixed_ms, 3),
                "mixed_eager_ms": round(mixed_eager_ms, 3),
                "mixed_over_apart": round(mixed_ms / (decode_ms + chunk_ms), 3),
                "chunk_marginal_tokens_per_s": round(c / max(1e-6, (mixed_ms - decode_ms) / 1e3)),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    report = {"device": torch.cuda.get_device_name(0), "context": CONTEXT, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    name = "h100" if "H100" in report["device"] else "h200" if "H200" in report["device"] else "gpu"
    (args.out / f"profile_mixed_{name}.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
