"""The router's time to first token over a conversation's turns, its prefix token cache on and off.

Run: `python -m bench.router_chat_turns [--quick] [--conversations N] [--turns T] [--out PATH]`.
Instant fake prefill + decode nodes (`bench.router_nodes`) sit behind two real router processes, one
with its prefix token cache (router/prefix_tokens.py) and one with `--prompt-prefix-cache-mb 0`,
all on 127.0.0.1. Each conversation is sent turn by turn, every turn re-sending the whole history
(a user message of 150 words and a reply of 100 per turn, about 470 tokens a turn), to one router
then the other, so both see the same prompts in the same order under the same machine load. TTFT
is the client's, to the first content token; with instant nodes it is the router's own time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.engine_cpu import _cpu_model, _loadavg, _nproc
from bench.router_overhead import Proc, summary_ms

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "bench" / "results" / "router_chat_turns.json"
WORDS = "def return self import class for while if else print the of and to in is value result data".split()
ROUTERS = {"cache": [], "no_cache": ["--prompt-prefix-cache-mb", "0"]}
LATE_TURN = 3  # turns from here on carry a history worth caching (DESIGN: "turns 3+")


def conversation(rng: random.Random, turns: int) -> list[list[dict[str, str]]]:
    """The messages each turn sends: the whole history, then the new user message."""
    history: list[dict[str, str]] = []
    out = []
    for _ in range(turns):
        history.append({"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(150))})
        out.append(list(history))
        history.append({"role": "assistant", "content": " ".join(rng.choice(WORDS) for _ in range(100))})
    return out


async def first_token_s(client: httpx.AsyncClient, url: str, messages: list[dict[str, str]]) -> float:
    """Seconds to the first content token of one streaming chat request."""
    body = {"model": "bench-model", "messages": messages, "max_tokens": 4, "stream": True, "temperature": 0}
    t0 = time.perf_counter()
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"content"' in line:
                return time.perf_counter() - t0
    raise RuntimeError("the stream ended before a content token")


async def measure(urls: dict[str, str], conversations: int, turns: int, seed: int) -> dict[str, list[list[float]]]:
    """Per router, per turn, the TTFTs (s) of every conversation (warm-up conversations left out)."""
    rng = random.Random(seed)
    out: dict[str, list[list[float]]] = {name: [[] for _ in range(turns)] for name in urls}
    async with httpx.AsyncClient(timeout=60) as client:
        for i in range(conversations + 2):  # two to warm up
            for t, messages in enumerate(conversation(rng, turns)):
                for name, url in urls.items():
                    s = await first_token_s(client, url, messages)
                    if i >= 2:
                        out[name][t].append(s)
    return out


def run(conversations: int, turns: int, seed: int = 0) -> dict[str, Any]:
    """Start the nodes and both routers, measure, stop them; returns the report."""
    from fixtures.tiny_model import write_tiny_model  # torch: this process only

    env = {"cpu": _cpu_model(), "cores": _nproc(), "python": sys.version.split()[0], "loadavg_before": _loadavg()}
    with tempfile.TemporaryDirectory(prefix="pdserve-chat-turns-") as tmp:
        model = write_tiny_model(Path(tmp) / "tiny", "LlamaForCausalLM", seed=0)
        nodes = Proc(["bench.router_nodes", "--tokenizer", str(model)], Path(tmp) / "nodes.log")
        routers: dict[str, Proc] = {}
        try:
            for name, flags in ROUTERS.items():
                argv = ["pdserve.cli", "router", "--port", "0", "--prefill", f"{nodes.addrs['prefill']},9100"]
                routers[name] = Proc([*argv, "--decode", nodes.addrs["decode"], *flags], Path(tmp) / f"{name}.log")
            urls = {name: f"http://{p.addrs['http']}/v1/chat/completions" for name, p in routers.items()}
            ttfts = asyncio.run(measure(urls, conversations, turns, seed))
            metrics = httpx.get(f"http://{routers['cache'].addrs['http']}/metrics", timeout=10).text
        finally:
            for p in routers.values():
                p.stop()
            nodes.stop()
    env["loadavg_after"] = _loadavg()
    return report(ttfts, conversations, turns, env, metrics)


def report(
    ttfts: dict[str, list[list[float]]], conversations: int, turns: int, env: dict[str, Any], metrics: str
) -> dict[str, Any]:
    by_turn = {name: [summary_ms(per) for per in turn_lists] for name, turn_lists in ttfts.items()}
    late = {
        name: summary_ms([s for per in turn_lists[LATE_TURN - 1 :] for s in per]) for name, turn_lists in ttfts.items()
    }
    reused = [line for line in metrics.splitlines() if line.startswith("pdserve_router_prompt_")]
    return {
        "benchmark": "router_chat_turns",
        "conversations": conversations,
        "turns": turns,
        "env": env,
        "ttft_by_turn": by_turn,
        f"ttft_turn{LATE_TURN}plus": late,
        "p50_saving_turn3plus_ms": late["no_cache"]["p50_ms"] - late["cache"]["p50_ms"],
        "p50_ratio_turn3plus": late["no_cache"]["p50_ms"] / late["cache"]["p50_ms"],
        "cache_metrics": reused,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 conversations of 4 turns")
    ap.add_argument("--conversations", type=int, default=30)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    n, turns = (3, 4) if args.quick else (args.conversations, args.turns)
    if n < 1 or turns < LATE_TURN:
        ap.error(f"need --conversations >= 1 and --turns >= {LATE_TURN}")
    result = run(n, turns)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print("turn  " + "  ".join(f"{name} p50 ms" for name in ROUTERS))
    for t in range(turns):
        print(f"{t + 1:4d}  " + "  ".join(f"{result['ttft_by_turn'][name][t]['p50_ms']:11.2f}" for name in ROUTERS))
    saving, ratio = result["p50_saving_turn3plus_ms"], result["p50_ratio_turn3plus"]
    print(f"turns {LATE_TURN}+: saving {saving:.2f} ms, ratio {ratio:.2f}")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
