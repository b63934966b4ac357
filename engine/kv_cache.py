"""Paged KV cache: request table and KV pools over the page allocator's ids, and the prefix cache.

Layout: one tensor per pool shaped (layers, 2, pages, page_size, kv_heads, head_dim), so each
(layer, k|v, page) is one contiguous region: one descriptor for a NIXL transfer. Token slot
`s` lives in page `s // page_size` at offset `s % page_size`. Page 0 is never handed out: padded
entries (graph padding, request row 0) point at it and may scribble there harmlessly.
A draft model's pool uses the same page ids, so one page list addresses both pools.

With a prefix cache (engine/radix_cache.py) a request's first pages may be the cache's: matched
at admission, read-only and referenced while the request runs, never freed by it. When it ends,
its whole pages with final KV go to the cache, and the cache's unreferenced pages count as
available: allocation evicts them, least recently used first, when the free pages run short.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.core import Req
from engine.h2d import to_device
from engine.page_allocator import OutOfPages, PageAllocator
from engine.radix_cache import Match, RadixCache


# Tokens one decode step may write beyond seq_len (a speculative verify window).
MAX_DECODE_WINDOW = 64
# Name of this buffer layout in the PD fingerprint. Historical: nodes have always called these
# per-layer slabs "page-major" (pages are the unit inside each layer's K|V slab); the
# page-major-across-layers layout once tried had its own name, so a pair of mixed layouts
# refuses to handshake instead of writing one layout's bytes into the other.
KV_LAYOUT = "page-major"


class KVPool:
    """K and V tensors of one model (target or draft) over the shared page ids."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.num_layers, self.page_size = num_layers, page_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.buffer = torch.zeros(
            num_layers, 2, num_pages, page_size, num_kv_heads, head_dim, dtype=dtype, device=device
        )

    def k(self, layer: int) -> torch.Tensor:
        """Keys of a layer viewed per token slot: (pages * page_size, kv_heads, head_dim)."""
        return self.buffer[layer, 0].view(-1, self.num_kv_heads, self.head_dim)

    def v(self, layer: int) -> torch.Tensor:
        return self.buffer[layer, 1].view(-1, self.num_kv_heads, self.head_dim)

    def store(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k(layer)[loc] = k.to(self.buffer.dtype)
        self.v(layer)[loc] = v.to(self.buffer.dtype)

    @property
    def page_bytes(self) -> int:
        """Bytes of one (layer, k|v, page) region."""
        return self.page_size * self.num_kv_heads * self.head_dim * self.buffer.element_size()


@dataclass(frozen=True)
class KVCacheConfig:
    num_pages: int
    page_size: int
    max_reqs: int
    max_context_len: int


# The most cached pages, in multiples of an allocation's size, evicted beyond its shortfall to
# give it one run: a simulated decode node with its cache full (fresh 1-2K-token prompts, 100
# decoding) went from 95 runs per prompt of 64-128 pages to 1, keeping 81% of the pages cached.
RUN_EVICTION_FACTOR = 4
# Prompts and their chunks, not decode growth (speculation reserves a page or two a step): the
# step's host time stays free of the search, and growth never evicts beyond its need
WHOLE_RUN_MIN_PAGES = 8


class KVCacheManager:
    """Owns the page allocator and the request table (request slot -> token slots).

    Pools (target, draft) are registered separately and share this manager's page ids.
    """

    def __init__(self, cfg: KVCacheConfig, device: torch.device | str) -> None:
        self.cfg = cfg
        self.page_size = cfg.page_size
        self.allocator = PageAllocator(cfg.num_pages)
        # row 0 is padding: it stays all-zero so padded lookups hit page 0
        self.req_to_token = torch.zeros(cfg.max_reqs + 1, cfg.max_context_len, dtype=torch.int64, device=device)
        self._free_slots = list(range(cfg.max_reqs, 0, -1))
        self._pages: dict[int, list[int]] = {}  # slot -> pages in order
        self.cache: RadixCache | None = None
        self._matched: dict[int, Match] = {}  # slot -> the cached prefix it reads
        # Tensor parallelism: every write to the request table, as (slot, first page, pages) or
        # (slot, None, None) for a cleared row, for the follower ranks to repeat (None: not kept)
        self.journal: list[tuple[int, int | None, list[int] | None]] | None = None
        # Nodes that move KV between them (PD) turn this on: an allocation of a prompt's size then
        # evicts cached pages until one free run holds it (`alloc_pages`)
        self.whole_runs = False

    def enable_prefix_cache(self, shift: int) -> RadixCache:
        """Cache finished requests' pages by token prefix (`shift`: see engine/radix_cache.py)."""
        self.cache = RadixCache(self.page_size, self.allocator.free, shift)
        return self.cache

    # ---- capacity ----
    @property
    def num_available(self) -> int:
        """Pages an allocation may have: free ones and cached ones no request reads."""
        return self.allocator.num_free + (self.cache.num_evictable if self.cache else 0)

    @property
    def num_held(self) -> int:
        """Pages requests hold or read (cached pages nobody reads are not counted)."""
        return self.allocator.total - self.num_available

    # ---- request slots ----
    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def assign_slot(self, req: Req) -> None:
        if req.slot:
            return
        if not self._free_slots:
            raise OutOfPages("no free request slot")
        req.slot = self._free_slots.pop()
        self._pages[req.slot] = []
        req.num_pages = 0

    # ---- the cached prefix ----
    def match_prefix(self, req: Req) -> Match | None:
        """The cached whole pages `req`'s tokens start with, leaving at least its last token to
        compute (its logits); None without a cache. A request with output (retracted) keeps two:
        with one left it would look like a decoding request, whose next input the FutureMap
        holds, while its row was invalidated when it gave its pages back."""
        if self.cache is None:
            return None
        keep = 2 if req.output_ids else 1
        return self.cache.match(req.tokens(0, req.total_len), limit=req.total_len - keep)

    def adopt_prefix(self, req: Req, match: Match) -> None:
        """`req` (a slot, no pages yet) reads the matched pages: their KV counts as computed."""
        assert self.cache is not None and req.slot and not self._pages[req.slot], req.rid
        if not len(match):
            return
        self.cache.lock(match)
        self._matched[req.slot] = match
        pages = match.pages
        self._pages[req.slot] = list(pages)
        req.num_pages = len(pages)
        self.write_pages(req.slot, 0, list(pages))
        req.seq_len = len(pages) * self.page_size

    def admit(self, req: Req, reserve_tokens: int, need_tokens: int, headroom_pages: int = 0) -> bool:
        """A slot, the cached prefix and pages for [0, reserve_tokens), if `need_tokens` (less what
        the cache has) and `headroom_pages` fit in what is available; False leaves `req` as it was."""
        if not self._free_slots:
            return False
        match = self.match_prefix(req)
        hit = len(match) if match is not None else 0
        # cached pages it reads are no longer available to anyone else (nor to itself)
        taken = sum(n.refs == 0 for n in match.nodes) if match is not None else 0
        if self.pages_for(need_tokens) - hit + headroom_pages > self.num_available - taken:
            return False
        self.assign_slot(req)
        if match is not None:
            self.adopt_prefix(req, match)
        try:
            self.reserve(req, reserve_tokens)
        except OutOfPages:
            self.release(req)
            return False
        return True

    def share_prefix(self, req: Req, cacheable: int) -> None:
        """A running request's prompt is computed: its first `cacheable` tokens' whole pages go to
        the cache now, so requests arriving meanwhile with the same prefix read them. It keeps
        reading them (referenced); pages whose tokens the cache held already stay its own."""
        if self.cache is None or not req.slot:
            return
        old = self._matched.get(req.slot)
        n = max(cacheable, len(old) * self.page_size if old is not None else 0)
        if n < self.page_size:
            return
        tokens = req.tokens(0, req.total_len)
        self.cache.insert(tokens, self._pages[req.slot], n)  # it keeps the pages the tree did not take
        path = self.cache.path(tokens, n)
        self.cache.lock(path, count_hit=False)  # before the old references go: nothing evictable meanwhile
        if old is not None:
            self.cache.unlock(old)
        self._matched[req.slot] = path

    def _shared(self, slot: int) -> int:
        """Pages of the request in `slot` that are the cache's (it reads them, never frees them)."""
        match = self._matched.get(slot)
        if match is None:
            return 0
        pages = self._pages[slot]
        return sum(node.page == pages[j] for j, node in enumerate(match.nodes))

    def cached_pages(self, req: Req) -> int:
        """Leading pages of `req` that are the cache's (read, never written)."""
        match = self._matched.get(req.slot)
        return len(match) if match is not None else 0

    def cached_tokens(self, req: Req) -> int:
        """Tokens of `req`'s prefix that came from the cache."""
        return self.cached_pages(req) * self.page_size

    # ---- pages ----
    def alloc_pages(self, n: int) -> list[int]:
        """`n` pages, evicting cached pages nobody reads when too few are free; on a node that
        moves KV (`whole_runs`), a prompt's pages as one run where eviction can make one."""
        short = n - self.allocator.num_free
        if short > 0 and self.cache is not None:
            self.cache.evict(short)
        if self.whole_runs and n >= WHOLE_RUN_MIN_PAGES and self.cache is not None:
            self._evict_for_one_run(self.cache, n)
        return self.allocator.alloc(n)

    def _evict_for_one_run(self, cache: RadixCache, n: int) -> None:
        """Evict least recently used cached pages, at most RUN_EVICTION_FACTOR * n of them, until
        one free run holds `n` pages. A KV write takes a descriptor per run of pages on both
        sides, and with the cache full the pages an eviction frees come one by one (decode growth
        takes single pages in between), so a prompt's pages would be about one run each."""
        budget = RUN_EVICTION_FACTOR * n
        while budget > 0 and self.allocator.longest_run < n:
            freed = cache.evict(min(n, budget))
            if not freed:
                return
            budget -= freed

    def reserve(self, req: Req, num_tokens: int) -> None:
        """Make sure `req` owns pages covering token positions [0, num_tokens)."""
        if num_tokens > self.cfg.max_context_len:
            raise OutOfPages(f"{num_tokens} tokens exceed the context length {self.cfg.max_context_len}")
        pages = self._pages[req.slot]
        need = self.pages_for(num_tokens) - len(pages)
        if need <= 0:
            return
        new = self.alloc_pages(need)
        start = len(pages)
        pages.extend(new)
        req.num_pages = len(pages)
        self.write_pages(req.slot, start, new)

    def shrink(self, req: Req, num_tokens: int) -> None:
        """Return pages beyond those covering [0, num_tokens) (rejected speculative slots)."""
        pages = self._pages[req.slot]
        keep = self.pages_for(num_tokens)
        if keep < len(pages):
            self.allocator.free(pages[keep:])
            del pages[keep:]
            req.num_pages = len(pages)

    def release(self, req: Req, cacheable: int = 0) -> None:
        """Give back every page and the slot of `req`; safe to call twice. With a cache, its
        first `cacheable` tokens (final KV in every pool) go to it, in whole pages."""
        if not req.slot:
            return
        pages = self._pages.pop(req.slot)
        match = self._matched.pop(req.slot, None)
        matched = len(match) if match is not None else 0
        if match is not None:
            self.cache.unlock(match)  # type: ignore[union-attr]
        if self.cache is not None and max(cacheable, matched * self.page_size) >= self.page_size:
            # never less than the prefix it read: those pages are the cache's already
            cacheable = max(cacheable, matched * self.page_size)
            self.allocator.free(self.cache.insert(req.tokens(0, req.total_len), pages, cacheable).to_free)
        else:
            self.allocator.free(pages[matched:])
        self.clear_row(req.slot)
        self._free_slots.append(req.slot)
        req.slot, req.num_pages, req.seq_len = 0, 0, 0

    def write_pages(self, slot: int, first: int, pages: list[int]) -> None:
        """Pages `first`, `first + 1`, ... of the request in `slot` are `pages`."""
        slots = self._slots_of_pages(pages)
        self.req_to_token[slot, first * self.page_size : first * self.page_size + slots.numel()] = slots
        if self.journal is not None:
            self.journal.append((slot, first, pages))

    def clear_row(self, slot: int) -> None:
        self.req_to_token[slot].zero_()
        if self.journal is not None:
            self.journal.append((slot, None, None))

    def page_list(self, req: Req) -> list[int]:
        return list(self._pages.get(req.slot, []))

    def _slots_of_pages(self, pages: list[int]) -> torch.Tensor:
        base = torch.tensor(pages, dtype=torch.int64).unsqueeze(1) * self.page_size
        slots = (base + torch.arange(self.page_size).unsqueeze(0)).flatten()
        return to_device(slots, self.req_to_token.device)  # no stall behind a forward in flight

    def check(self) -> None:
        """Every used page is a request's own or the cache's, exactly once."""
        self.allocator.check()
        owned = sum(len(p) for p in self._pages.values()) - sum(self._shared(s) for s in self._matched)
        cached = 0
        if self.cache is not None:
            self.cache.check()
            cached = self.cache.num_pages
        assert owned + cached == self.allocator.num_used, (owned, cached, self.allocator.num_used)
        assert len(self._free_slots) + len(self._pages) == self.cfg.max_reqs

    @property
    def all_free(self) -> bool:
        """No request holds or reads a page or a slot (the cache may keep pages nobody reads)."""
        return self.num_held == 0 and len(self._free_slots) == self.cfg.max_reqs
