"""How scattered a decode node's PD destination pages get under serving churn: runs of
consecutive pages per new prompt (each run costs one NIXL descriptor per layer and K|V), for the
run-aware page allocator against a LIFO free list, on one simulated workload.

The workload: a decode node with a pool of 8K pages (about half held at any time); 48 requests
run at once; each arrives with a 1K-token prompt (64 pages of 16 tokens), reserves its prompt
pages at once (the PD destination), then grows a page every 16 decode steps, interleaved with
every other running request, and finishes after 16-1,024 output tokens (seeded, deterministic).
Run: `python -m bench.page_runs` (well under a second).
"""

from __future__ import annotations

import json
import random
import statistics
import sys
from typing import Protocol

from engine.kv_transfer import page_runs
from engine.page_allocator import PageAllocator

POOLS, PROMPT_PAGES, PAGE_TOKENS, RUNNING, ARRIVALS = (8192,), 64, 16, 48, 3000
DESCRIPTORS_PER_RUN = 64  # Llama-3.1-8B: 32 layers x (K, V)


class Allocator(Protocol):
    def alloc(self, n: int) -> list[int]: ...

    def free(self, pages: list[int]) -> None: ...


class LifoPages:
    """A free list that hands out the most recently freed pages first."""

    def __init__(self, num_pages: int) -> None:
        self._free = list(range(num_pages - 1, 0, -1))

    def alloc(self, n: int) -> list[int]:
        return [self._free.pop() for _ in range(n)]

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))


def simulate(alloc: Allocator, seed: int = 0) -> list[int]:
    """Runs per new prompt's destination pages over the workload."""
    rng = random.Random(seed)
    live: list[tuple[list[int], int]] = []  # (pages, decode tokens left)
    out = []
    step = 0
    held = []
    for _ in range(ARRIVALS):
        while len(live) >= RUNNING:  # decode until a request finishes
            step += 1
            for i, (pages, left) in enumerate(live):
                if step % PAGE_TOKENS == 0:
                    pages += alloc.alloc(1)
                live[i] = (pages, left - 1)
            for pages, _left in [r for r in live if r[1] <= 0]:
                alloc.free(pages)
            live = [r for r in live if r[1] > 0]
            held.append(sum(len(p) for p, _ in live))
        prompt = alloc.alloc(PROMPT_PAGES)
        out.append(page_runs(prompt))
        live.append((prompt, rng.randint(16, 1024)))
    out.append(statistics.mean(held))  # the caller splits this off
    return out


def main() -> int:
    report: dict = {"prompt_pages": PROMPT_PAGES, "running": RUNNING, "arrivals": ARRIVALS, "pools": {}}
    for pool in POOLS:
        row = report["pools"][str(pool)] = {}
        for name, alloc in (("lifo_free_list", LifoPages(pool)), ("run_aware", PageAllocator(pool))):
            *r, mean_held = simulate(alloc)
            r = r[RUNNING:]  # after the pool has churned once
            row["mean_pages_held"] = round(mean_held)
            row[name] = {
                "mean_runs_per_prompt": round(statistics.mean(r), 2),
                "p90_runs": sorted(r)[int(0.9 * len(r))],
                "max_runs": max(r),
                "mean_descriptors_8b": round(statistics.mean(r) * DESCRIPTORS_PER_RUN),
            }
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
