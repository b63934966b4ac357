"""CPU benchmark of the grammar backends (llguidance, xgrammar) on our vocabularies: compile and mask time.

Run: `python -m bench.grammar_backends [--quick] [--out PATH]`. For each vocabulary (the built-in
pair's tokenizer, the test fixtures' tiny one, and a 128k-token byte-level vocabulary of the most
frequent chunks of the Python standard library's sources, the size of Llama 3's) and each grammar
(an OpenAI tool schema, a nested object, a regex), it compiles the grammar cold (no cache)
several times, then walks a valid output token by token, timing every mask fill (what a decode
step pays per constrained request on the host) and every advance. The large vocabulary has no
merges (its outputs are walked byte by byte): mask cost depends on the vocabulary's strings, not
on how text is split into them.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from bench.common import write_report
from common.tokenizer import Tokenizer
from engine.grammar.base import GrammarBackend, mask_words
from engine.grammar.compiler import make_backend
from fixtures.tiny_model import write_tiny_model

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "grammar_backends.json"
BUILTIN = Path(__file__).resolve().parents[1] / "pdserve" / "models" / "pycoder"
BACKENDS = ("llguidance", "xgrammar")
LARGE_VOCAB = 128256  # Llama 3's
_CHUNK = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z_]+| ?[0-9]{1,3}| ?[^\sA-Za-z_0-9]+|\s+""")

TOOL_SCHEMA = {  # what a router sends for a named tool_choice: the function's parameters
    "type": "object",
    "properties": {
        "location": {"type": "string", "description": "City and country"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
    },
    "required": ["location", "unit"],
    "additionalProperties": False,
}
NESTED_SCHEMA = {
    "type": "object",
    "properties": {
        "user": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
                "address": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"],
                },
            },
            "required": ["name", "tags", "address"],
        },
        "score": {"type": "number"},
        "active": {"type": "boolean"},
    },
    "required": ["user", "score", "active"],
}
REGEX = r"(\+1 )?\(?[0-9]{3}\)? [0-9]{3}-[0-9]{4}( ext\. [0-9]{1,5})?"
GRAMMARS: dict[str, tuple[str, str, str]] = {  # name -> (kind, spec, a valid output)
    "tool schema": (
        "json_schema",
        json.dumps(TOOL_SCHEMA),
        '{"location": "Paris, France", "unit": "celsius", "days": 3}',
    ),
    "nested object": (
        "json_schema",
        json.dumps(NESTED_SCHEMA),
        '{"user": {"name": "Ada", "tags": ["math", "engines"], "address": {"city": "London", "zip": "12345"}}, '
        '"score": 9.5, "active": true}',
    ),
    "regex (phone)": ("regex", REGEX, "+1 (555) 867-5309 ext. 42"),
}


def large_vocab(out: Path, size: int = LARGE_VOCAB) -> Path:
    """A byte-level vocabulary of `size` ids: the 256 bytes, the most frequent chunks of the
    standard library's sources (as a GPT-2-style pre-tokenizer splits them), and an EOS."""
    counts: collections.Counter[str] = collections.Counter()
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        counts.update(_CHUNK.findall(f.read_text(errors="ignore")))
        if len(counts) > 4 * size:
            break
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_map = {b: c for b, c in zip(range(256), sorted(alphabet, key=lambda c: _byte_of(c)))}
    vocab: dict[str, int] = {byte_map[b]: b for b in range(256)}
    for chunk, _ in counts.most_common():
        if len(vocab) >= size - 1:
            break
        key = "".join(byte_map[b] for b in chunk.encode())
        vocab.setdefault(key, len(vocab))
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|eos|>"])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    eos = tok.token_to_id("<|eos|>")
    (out / "config.json").write_text(json.dumps({"vocab_size": tok.get_vocab_size(), "eos_token_id": eos}))
    return out


def _byte_of(c: str) -> int:
    """The byte GPT-2's byte-to-unicode table maps to `c` (printable bytes map to themselves)."""
    o = ord(c)
    if 33 <= o <= 126 or 161 <= o <= 172 or 174 <= o <= 255:
        return o
    shifted = [b for b in range(256) if not (33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255)]
    return shifted[o - 256]


def vocabularies(tmp: Path, large: bool) -> dict[str, tuple[Path, int, list[int]]]:
    """name -> (model dir, model vocabulary size, EOS ids)."""
    dirs = [("built-in pycoder", BUILTIN), ("fixtures tiny", write_tiny_model(tmp / "tiny", seed=0))]
    if large:
        dirs.append(("stdlib 128k", large_vocab(tmp / "large")))
    out = {}
    for name, d in dirs:
        cfg = json.loads((d / "config.json").read_text())
        eos = cfg["eos_token_id"]
        out[name] = (d, int(cfg["vocab_size"]), eos if isinstance(eos, list) else [eos])
    return out


def _ms(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {
        "mean_ms": 1e3 * statistics.fmean(xs),
        "p50_ms": 1e3 * xs[len(xs) // 2],
        "p99_ms": 1e3 * xs[min(len(xs) - 1, int(0.99 * len(xs)))],
        "n": len(xs),
    }


def measure(
    backend: GrammarBackend, vocab: int, kind: str, spec: str, tokens: list[int], compiles: int, walks: int
) -> dict:
    """Cold compiles of the grammar (neither backend caches grammars here; the vocabulary's own
    index is warm, as on a serving node), then `walks` walks of `tokens`."""
    compile_s, first_s = [], []
    words = torch.zeros(mask_words(vocab), dtype=torch.int32)
    for _ in range(compiles):
        t0 = time.perf_counter()
        grammar = backend.compile(kind, spec)
        t1 = time.perf_counter()
        grammar.matcher().fill_mask(words)  # llguidance builds its lexer lazily, on the first mask
        compile_s.append(t1 - t0)
        first_s.append(time.perf_counter() - t0)
    mask_s, advance_s = [], []
    for _ in range(walks):
        m = grammar.matcher()
        for tok in tokens:
            t0 = time.perf_counter()
            m.fill_mask(words)
            t1 = time.perf_counter()
            if not (int(words[tok // 32]) >> (tok % 32)) & 1:
                raise AssertionError(f"{kind}: the valid output's token {tok} is masked out")
            ok = m.advance([tok])
            advance_s.append(time.perf_counter() - t1)
            mask_s.append(t1 - t0)
            assert ok
        assert m.is_accepting()
    return {
        "compile": _ms(compile_s),
        "to_first_mask": _ms(first_s),
        "mask": _ms(mask_s),
        "advance": _ms(advance_s),
        "tokens": len(tokens),
    }


def run(quick: bool = False, large: bool = True) -> dict[str, Any]:
    compiles, walks = (2, 1) if quick else (10, 20)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for vname, (d, vocab, eos) in vocabularies(Path(tmp), large).items():
            tok = Tokenizer.from_dir(d)
            for bname in BACKENDS:
                t0 = time.perf_counter()
                backend = make_backend(bname, d, vocab, eos)
                backend.compile("regex", "[a-z]+").matcher().fill_mask(
                    torch.zeros(mask_words(vocab), dtype=torch.int32)
                )
                setup = time.perf_counter() - t0  # the vocabulary's index, built once per node
                for gname, (kind, spec, text) in GRAMMARS.items():
                    tokens = tok.encode(text, add_special_tokens=False)
                    r = measure(backend, vocab, kind, spec, tokens, compiles, walks)
                    results.append({"vocab": vname, "vocab_size": vocab, "backend": bname, "grammar": gname,
                                    "backend_setup_ms": 1e3 * setup, **r})  # fmt: skip
    return {"quick": quick, "torch_threads": torch.get_num_threads(), "results": results}


def format_table(report: dict[str, Any]) -> str:
    lines = [
        "| vocabulary | grammar | backend | setup ms | compile mean / p99 ms | compile + first mask mean / p99 ms "
        "| mask mean / p50 / p99 ms | advance mean ms |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in report["results"]:
        c, f, m, a = r["compile"], r["to_first_mask"], r["mask"], r["advance"]
        lines.append(
            f"| {r['vocab']} ({r['vocab_size']}) | {r['grammar']} | {r['backend']} | {r['backend_setup_ms']:.0f} | "
            f"{c['mean_ms']:.2f} / {c['p99_ms']:.2f} | {f['mean_ms']:.2f} / {f['p99_ms']:.2f} | "
            f"{m['mean_ms']:.3f} / {m['p50_ms']:.3f} / {m['p99_ms']:.3f} | "
            f"{a['mean_ms']:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 compiles and 1 walk per cell (a smoke run)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--no-large", action="store_true", help="skip the 128k-token vocabulary")
    args = ap.parse_args()
    report = run(args.quick, large=not args.no_large)
    write_report(args.out, report)
    print(format_table(report))


if __name__ == "__main__":
    main()
