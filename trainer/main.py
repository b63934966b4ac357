"""train_pair: corpus -> tokenizer -> target -> EAGLE head -> HF dirs + metrics; `run` for `pdserve train`."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch

from trainer.corpus import load_corpus
from trainer.data import encode_stream
from trainer.eagle_head import build_head, head_agreement, train_head
from trainer.eagle_head import hf_tensors as head_tensors
from trainer.evaluate import heldout_prompts, measure_acceptance
from trainer.layers import LlamaShape
from trainer.loop import Schedule
from trainer.options import TrainOptions
from trainer.save import file_sizes, save_head, save_target, write_json
from trainer.target import build_target, train_target
from trainer.target import hf_tensors as target_tensors
from trainer.tokenizer import save_tokenizer, special_ids, train_tokenizer

MAX_PAIR_BYTES = 25_000_000


@dataclass(frozen=True)
class Preset:
    shape: LlamaShape
    head_intermediate: int
    target_steps: int
    head_steps: int
    batch: int  # target windows per step
    head_batch: int
    target_lr: float
    head_lr: float
    max_train_bytes: int | None  # None: the whole corpus
    max_test_files: int | None
    eval_prompts: int
    prompt_tokens: int
    new_tokens: int


PRESETS: dict[str, Preset] = {
    # The built-in pair: every file <= 15 MB, both <= 25 MB in bf16. About 0.5 + 2 minutes on an
    # H200 (budget: 6 + 3 on an H100). The stdlib is only ~3M tokens: past ~800 steps (~8 epochs)
    # the target's held-out loss rises again, so more target steps would not help.
    "full": Preset(
        LlamaShape(hidden=384, layers=6, heads=6, kv_heads=2, intermediate=960, vocab=4096, max_positions=1024),
        head_intermediate=704,
        target_steps=800,
        head_steps=3000,
        batch=32,
        head_batch=16,
        target_lr=3e-3,
        head_lr=3e-3,
        max_train_bytes=None,
        max_test_files=None,
        eval_prompts=20,
        prompt_tokens=96,
        new_tokens=64,
    ),
    # A CPU dry run of a minute or two: loss must fall and the acceptance evaluation must run.
    "medium": Preset(
        LlamaShape(hidden=128, layers=4, heads=4, kv_heads=2, intermediate=384, vocab=1024, max_positions=128),
        head_intermediate=256,
        target_steps=600,
        head_steps=300,
        batch=4,
        head_batch=4,
        target_lr=3e-3,
        head_lr=3e-3,
        max_train_bytes=1_000_000,
        max_test_files=8,
        eval_prompts=6,
        prompt_tokens=32,
        new_tokens=24,
    ),
    # Tests: seconds on CPU.
    "tiny": Preset(
        LlamaShape(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=320, max_positions=128),
        head_intermediate=128,
        target_steps=12,
        head_steps=8,
        batch=4,
        head_batch=4,
        target_lr=3e-3,
        head_lr=3e-3,
        max_train_bytes=40_000,
        max_test_files=2,
        eval_prompts=3,
        prompt_tokens=16,
        new_tokens=10,
    ),
}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def train_pair(
    out_dir: str | Path,
    *,
    seed: int = 0,
    device: str = "auto",
    preset: str | None = None,
    tiny: bool = False,
    target_steps: int | None = None,
    head_steps: int | None = None,
    batch_size: int | None = None,
    head_batch_size: int | None = None,
    target_lr: float | None = None,
    head_lr: float | None = None,
    vocab_size: int | None = None,
    ttt_steps: int = 4,
    eval_prompts: int | None = None,
    eval_every: int = 0,
    evaluate: bool = True,
    eval_dtype: str = "float32",
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Train the target and its EAGLE head from scratch, deterministic from `seed`.

    Writes `out_dir/target` and `out_dir/eagle` (HF format, bf16) and `out_dir/train_meta.json`;
    returns the metrics (also in the meta file). `preset` is "full" (default), "medium" or "tiny"
    (`tiny=True` is short for the latter); the other options override the preset. The
    acceptance evaluation (greedy, chain of 4 drafts, held-out prompts) runs the engine in
    `eval_dtype`: float32 by default, where speculative output must equal plain output exactly
    (in bf16, near-ties may flip between batch shapes).
    """
    p = PRESETS[preset or ("tiny" if tiny else "full")]
    p = replace(
        p,
        target_steps=target_steps or p.target_steps,
        head_steps=head_steps or p.head_steps,
        batch=batch_size or p.batch,
        head_batch=head_batch_size or p.head_batch,
        target_lr=target_lr or p.target_lr,
        head_lr=head_lr or p.head_lr,
        eval_prompts=p.eval_prompts if eval_prompts is None else eval_prompts,
        shape=replace(p.shape, vocab=vocab_size or p.shape.vocab),
    )
    out, dev, t0 = Path(out_dir), resolve_device(device), time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True

    corpus = load_corpus(max_train_bytes=p.max_train_bytes, max_test_files=p.max_test_files)
    log(
        f"corpus: {corpus.stats['train_files']} train files ({corpus.stats['train_bytes']:,} bytes), "
        f"{corpus.stats['test_files']} held out, python {corpus.stats['python_version']}"
    )
    tok = train_tokenizer(corpus.train, p.shape.vocab)
    ids = special_ids(tok)
    shape = replace(p.shape, vocab=_padded_vocab(tok.get_vocab_size(with_added_tokens=True)))
    tok_dir = out / "target"
    save_tokenizer(tok, tok_dir, shape.max_positions)
    train_stream = encode_stream(tok, corpus.train, ids["eos"])
    test_stream = encode_stream(tok, corpus.test, ids["eos"])
    log(f"tokens: {train_stream.numel():,} train, {test_stream.numel():,} held out (vocab {shape.vocab})")

    ctx = shape.max_positions
    target = build_target(shape, seed, dev)
    t_res = train_target(
        target,
        train_stream,
        test_stream,
        device=dev,
        ctx=ctx,
        seed=seed,
        log=log,
        sched=Schedule(p.target_steps, p.target_lr),
        batch=p.batch,
        progress=progress,
        eval_every=eval_every,
    )
    head = build_head(target, p.head_intermediate, seed, dev)
    h_res = train_head(
        head,
        target,
        train_stream,
        sched=Schedule(p.head_steps, p.head_lr),
        batch=p.head_batch,
        ctx=ctx,
        seed=seed,
        device=dev,
        log=log,
        progress=progress,
        ttt_steps=ttt_steps,
    )
    h_res.update(head_agreement(head, target, test_stream, ctx, dev, steps=4))
    log(
        f"head held-out top-1 agreement per draft step {_fmt(h_res['top1_agreement'])}, "
        f"expected accept length {h_res['expected_accept_len']:.2f}"
    )

    save_target(out / "target", shape, target_tensors(target), tok_dir, ids)
    save_head(out / "eagle", head.shape, head_tensors(head), ids)
    metrics = _metrics(out, seed, dev, p, shape, corpus.stats, t_res, h_res, ttt_steps)
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    if evaluate and p.eval_prompts:
        prompts = heldout_prompts(tok, corpus.test, p.eval_prompts, p.prompt_tokens)
        metrics["acceptance"] = measure_acceptance(
            out / "target",
            out / "eagle",
            prompts,
            new_tokens=p.new_tokens,
            num_steps=4,
            device=str(dev),
            dtype=eval_dtype,
        )
        log(
            f"acceptance (engine, greedy, chain of 4): mean accepted length "
            f"{metrics['acceptance']['mean_accept_len']:.2f} per verify, greedy equal "
            f"{metrics['acceptance']['greedy_equals_plain']}"
        )
    metrics["seconds"] = time.perf_counter() - t0
    write_json(out / "train_meta.json", metrics)
    return metrics


def _padded_vocab(n: int) -> int:
    return -(-n // 64) * 64  # a round embedding size; the extra rows are never produced


def _fmt(values: Any) -> str:
    return "[" + ", ".join(f"{v:.3f}" for v in values) + "]"


def _metrics(
    out: Path,
    seed: int,
    dev: torch.device,
    p: Preset,
    shape: LlamaShape,
    corpus: dict[str, Any],
    t_res: dict[str, Any],
    h_res: dict[str, Any],
    ttt_steps: int,
) -> dict[str, Any]:
    files = {k: v for k, v in file_sizes(out).items() if k != "train_meta.json"}
    target_b = sum(v for k, v in files.items() if k.startswith("target/"))
    head_b = sum(v for k, v in files.items() if k.startswith("eagle/"))
    return {
        "seed": seed,
        "device": str(dev),
        "torch": torch.__version__,
        "target_shape": shape.to_dict(),
        "head_intermediate": p.head_intermediate,
        "target": {"steps": p.target_steps, "batch": p.batch, "lr": p.target_lr, **t_res},
        "head": {"steps": p.head_steps, "batch": p.head_batch, "lr": p.head_lr, "ttt_steps": ttt_steps, **h_res},
        "corpus": corpus,
        "files": files,
        "target_bytes": target_b,
        "head_bytes": head_b,
        "total_bytes": target_b + head_b,
        "max_file_bytes": max(files.values()),
        "within_size_budget": max(files.values()) <= 15_000_000 and target_b + head_b <= MAX_PAIR_BYTES,
    }


def run(opts: TrainOptions) -> dict[str, Any]:
    """`pdserve train`: train_pair with the command's options; returns the metrics."""
    return train_pair(
        opts.out,
        seed=opts.seed,
        device=opts.device,
        preset=opts.preset,
        tiny=opts.tiny,
        target_steps=opts.target_steps,
        head_steps=opts.head_steps,
        batch_size=opts.batch_size,
        head_batch_size=opts.head_batch_size,
        target_lr=opts.target_lr,
        head_lr=opts.head_lr,
        vocab_size=opts.vocab_size,
        ttt_steps=opts.ttt_steps,
        eval_prompts=opts.eval_prompts,
        eval_every=opts.eval_every,
        eval_dtype=opts.eval_dtype,
        progress=opts.progress,
    )


def summary(m: dict[str, Any]) -> dict[str, Any]:
    """The headline numbers (the full metrics are in train_meta.json)."""
    acc = m.get("acceptance", {})
    return {
        "target_heldout_loss": m["target"]["heldout_loss"],
        "target_train_loss": m["target"]["final_train_loss"],
        "head_final_loss": m["head"]["final_train_loss"],
        "head_top1_agreement": m["head"]["top1_agreement"],
        "mean_accept_len": acc.get("mean_accept_len"),
        "greedy_equals_plain": acc.get("greedy_equals_plain"),
        "target_bytes": m["target_bytes"],
        "head_bytes": m["head_bytes"],
        "total_bytes": m["total_bytes"],
        "within_size_budget": m["within_size_budget"],
        "seconds": m["seconds"],
    }
