"""How scattered a decode node's PD destination pages get under serving churn: runs of
consecutive pages per new prompt (each run costs one NIXL descriptor per layer and K|V), for the
run-aware page allocator against a LIFO free list, on one simulated workload.

The workload: a decode node with a pool of 8K pages (about half held at any time); 48 requests
run at once; each arrives with a 1K-token prompt (64 pages of 16 tokens), reserves its prompt
pages at once (the PD destination), then grows a page every 16 decode steps, interleaved with
every other running request, and finishes after 16-1,024 output tokens (seeded, deterministic).

The same workload then runs with the prefix cache on and its pool full: every finished request's
pages stay cached (fresh prompts, so nothing is ever hit) and each allocation evicts. Evicting
only the shortfall (a colocated node) is set against `whole_runs` (a PD node: a prompt's
allocation evicts further least recently used pages, at most 4x its size, until one free run
holds it). Run: `python -m bench.page_runs` (a few seconds).
"""

from __future__ import annotations

import json
import random
import statistics
import sys
from typing import Protocol

from engine.kv_cache import KVCacheConfig, KVCacheManager
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


class CachedPages:
    """The KV manager with its prefix cache on: a finished request's pages are cached (its tokens
    fresh, so never hit), not freed, so once the pool is full every allocation evicts."""

    def __init__(self, num_pages: int, whole_runs: bool, seed: int = 0) -> None:
        self.kv = KVCacheManager(KVCacheConfig(num_pages, PAGE_TOKENS, RUNNING, 16), "cpu")
        self.cache = self.kv.enable_prefix_cache(0)
        self.kv.whole_runs = whole_runs
        self._rng = random.Random(seed)

    def alloc(self, n: int) -> list[int]:
        return self.kv.alloc_pages(n)

    def free(self, pages: list[int]) -> None:
        tokens = [self._rng.randrange(1, 1 << 30) for _ in range(len(pages) * PAGE_TOKENS)]
        self.kv.allocator.free(self.cache.insert(tokens, pages, len(tokens)).to_free)


def simulate_full_cache(whole_runs: bool, pool: int, seed: int = 0) -> tuple[list[int], int]:
    """Runs per new prompt's pages under the workload with every finished request cached, and
    the pages cached at the end."""
    pages = CachedPages(pool, whole_runs, seed)
    *runs, _held = simulate(pages, seed)
    return runs, pages.cache.num_pages


def _summary(runs: list[int]) -> dict[str, float]:
    return {
        "mean_runs_per_prompt": round(statistics.mean(runs), 2),
        "p90_runs": sorted(runs)[int(0.9 * len(runs))],
        "max_runs": max(runs),
        "mean_descriptors_8b": round(statistics.mean(runs) * DESCRIPTORS_PER_RUN),
    }


def main() -> int:
    report: dict = {"prompt_pages": PROMPT_PAGES, "running": RUNNING, "arrivals": ARRIVALS, "pools": {}}
    for pool in POOLS:
        row = report["pools"][str(pool)] = {}
        for name, alloc in (("lifo_free_list", LifoPages(pool)), ("run_aware", PageAllocator(pool))):
            *r, mean_held = simulate(alloc)
            r = r[RUNNING:]  # after the pool has churned once
            row["mean_pages_held"] = round(mean_held)
            row[name] = _summary(r)
        full = row["full_prefix_cache"] = {}
        for name, whole in (("evict_shortfall", False), ("whole_runs", True)):
            r, cached = simulate_full_cache(whole, pool)
            full[name] = {**_summary(r[len(r) // 3 :]), "pages_cached_at_end": cached}  # once full
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
