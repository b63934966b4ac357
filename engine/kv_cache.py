"""Paged KV cache: request table and KV pools over the page allocator's ids.

Layout: one tensor per pool shaped (layers, 2, pages, page_size, kv_heads, head_dim), so each
(layer, k|v, page) is one contiguous region: one descriptor for a NIXL transfer. Token slot
`s` lives in page `s // page_size` at offset `s % page_size`. Page 0 is never handed out: padded
entries (graph padding, request row 0) point at it and may scribble there harmlessly.
A draft model's pool uses the same page ids, so one page list addresses both pools.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.core import Req
from engine.h2d import to_device
from engine.page_allocator import OutOfPages, PageAllocator


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

    # ---- request slots ----
    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_admit(self, num_tokens: int) -> bool:
        return bool(self._free_slots) and self.pages_for(num_tokens) <= self.allocator.num_free

    def assign_slot(self, req: Req) -> None:
        if req.slot:
            return
        if not self._free_slots:
            raise OutOfPages("no free request slot")
        req.slot = self._free_slots.pop()
        self._pages[req.slot] = []
        req.num_pages = 0

    # ---- pages ----
    def reserve(self, req: Req, num_tokens: int) -> None:
        """Make sure `req` owns pages covering token positions [0, num_tokens)."""
        if num_tokens > self.cfg.max_context_len:
            raise OutOfPages(f"{num_tokens} tokens exceed the context length {self.cfg.max_context_len}")
        pages = self._pages[req.slot]
        need = self.pages_for(num_tokens) - len(pages)
        if need <= 0:
            return
        new = self.allocator.alloc(need)
        start = len(pages)
        pages.extend(new)
        req.num_pages = len(pages)
        slots = self._slots_of_pages(new)
        self.req_to_token[req.slot, start * self.page_size : start * self.page_size + slots.numel()] = slots

    def shrink(self, req: Req, num_tokens: int) -> None:
        """Return pages beyond those covering [0, num_tokens) (rejected speculative slots)."""
        pages = self._pages[req.slot]
        keep = self.pages_for(num_tokens)
        if keep < len(pages):
            self.allocator.free(pages[keep:])
            del pages[keep:]
            req.num_pages = len(pages)

    def release(self, req: Req) -> None:
        """Free every page and the slot of `req`; safe to call twice."""
        if not req.slot:
            return
        pages = self._pages.pop(req.slot)
        self.allocator.free(pages)
        self.req_to_token[req.slot].zero_()
        self._free_slots.append(req.slot)
        req.slot, req.num_pages, req.seq_len = 0, 0, 0

    def page_list(self, req: Req) -> list[int]:
        return list(self._pages.get(req.slot, []))

    def _slots_of_pages(self, pages: list[int]) -> torch.Tensor:
        base = torch.tensor(pages, dtype=torch.int64).unsqueeze(1) * self.page_size
        slots = (base + torch.arange(self.page_size).unsqueeze(0)).flatten()
        return to_device(slots, self.req_to_token.device)  # no stall behind a forward in flight

    def check(self) -> None:
        self.allocator.check()
        owned = sum(len(p) for p in self._pages.values())
        assert owned == self.allocator.num_used, (owned, self.allocator.num_used)
        assert len(self._free_slots) + len(self._pages) == self.cfg.max_reqs

    @property
    def all_free(self) -> bool:
        return self.allocator.num_used == 0 and len(self._free_slots) == self.cfg.max_reqs
