"""Radix tree of cached KV pages, keyed by token ids one whole page per edge; LRU eviction.

Matching works at page granularity: a request reuses whole pages whose tokens (and everything
before them) equal its own. One node per page keeps it simple and loses nothing: a partial page
is never shared (its KV would be overwritten by whoever owns it next), so a longer edge could
only be split at page boundaries anyway.

Ownership: the tree owns the pages of its nodes. A request that matched a prefix holds a
reference on every node of the path (`lock`); while any reference is held the node's page is
never evicted. When a request ends, `insert` adopts its full pages that the tree does not hold
yet; the caller frees the rest of the request's pages (the partial last page, and pages whose
tokens the tree already held: duplicates computed concurrently).

Speculative drafts shift by one: EAGLE's draft KV at position i is computed from token i + 1.
With `shift=1` an edge is a page's tokens plus the token that followed the page when its KV was
computed, so a request reuses a page only if it continues with that same token (otherwise the
draft's KV at the page's last position would belong to another continuation), and two copies of
one page with different continuations are siblings. A multi-turn chat needs both: the previous
turn's sequence continues a page with the reply the model generated, the next turn's prompt with
that reply as the client sent it back (re-tokenized, often other ids). A page whose next token is
unknown (the end of a sequence) is not cached under a shift. Event hashes cover the page's tokens
only, as routers compute them, so siblings share a hash: it is announced with the first copy and
withdrawn with the last.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from common.prefix_hash import ROOT, block_hash


@dataclass(eq=False, slots=True)  # one per cached page: no per-instance dict
class Node:
    key: tuple[int, ...]  # the page's tokens; () at the root
    page: int  # the KV page holding them (0 at the root)
    parent: Node | None
    refs: int = 0  # requests reading this page now
    last_used: int = 0  # a tick of the cache's clock
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)
    hash: int = ROOT  # the chained hash of the path up to and including this page (ROOT at the root)
    edge: tuple[int, ...] = ()  # its key in the parent's children: `key`, plus `next_token` under a shift

    @property
    def next_token(self) -> int | None:
        """The token after the page when its KV was computed (kept under a shift only)."""
        return self.edge[len(self.key)] if len(self.edge) > len(self.key) else None


@dataclass(frozen=True)
class Inserted:
    unadopted: list[int]  # the caller's pages the tree did not take

    @property
    def to_free(self) -> list[int]:
        """What a caller that is done with its pages frees."""
        return self.unadopted


@dataclass(frozen=True)
class Match:
    nodes: tuple[Node, ...]  # the path, root excluded, one node per matched page

    @property
    def pages(self) -> list[int]:
        return [n.page for n in self.nodes]

    def __len__(self) -> int:
        return len(self.nodes)


class CacheListener(Protocol):
    """Told of pages the tree gains and drops, on the thread that changes it."""

    def stored(self, parent: int, blocks: list[tuple[int, tuple[int, ...]]]) -> None:
        """A chain of new pages, (hash, tokens) each, the first a child of the page hashed `parent`."""

    def removed(self, hashes: list[int]) -> None:
        """Pages the tree dropped (evicted or cleared)."""


class RadixCache:
    """Cached pages by token prefix; `free_pages` gives evicted and unused pages back to the pool."""

    def __init__(self, page_size: int, free_pages: Callable[[list[int]], None], shift: int = 0) -> None:
        if shift not in (0, 1):
            raise ValueError(f"shift must be 0 or 1, got {shift}")
        self.page_size, self.free_pages, self.shift = page_size, free_pages, shift
        self.root = Node((), 0, None, refs=1)  # never evicted
        self.num_pages = 0  # pages the tree owns
        self.num_evictable = 0  # of them, pages no request reads (refs == 0)
        self._clock = itertools.count(1)
        # Candidates for eviction, (last_used, seq, node), kept as nodes become unreferenced leaves
        # or are used again; an entry that no longer describes an unreferenced leaf at that tick is
        # skipped when popped. Evicting is then O(k log n), not a walk of the whole tree per call:
        # a full pool evicts on almost every page a decode step allocates.
        self._lru: list[tuple[int, int, Node]] = []
        self._seq = itertools.count()
        self.stats = {"matched_tokens": 0, "inserted_pages": 0, "evicted_pages": 0}
        self._hashes: Counter[int] = Counter()  # nodes per event hash (siblings under a shift share one)
        self.listener: CacheListener | None = None

    def set_listener(self, listener: CacheListener | None) -> None:
        """Report changes to `listener` from now on; it first hears of every page cached already,
        parents before children, so its view starts complete. Call it on the thread that mutates the tree."""
        self.listener = listener
        if listener is None:
            return
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            assert node.parent is not None
            listener.stored(node.parent.hash, [(node.hash, node.key)])
            stack.extend(node.children.values())

    # ---- lookup ----
    def match(self, tokens: Sequence[int], limit: int | None = None) -> Match:
        """The longest cached path of whole pages that `tokens` starts with, covering at most
        `limit` tokens (a request recomputes at least its last prompt token, for its logits)."""
        path = self._walk(tokens, len(tokens) if limit is None else min(limit, len(tokens)))
        tick = next(self._clock)
        for node in path:
            node.last_used = tick
        if path:
            self._offer(path[-1])  # used again: its place in the LRU order moved
        return Match(tuple(path))

    def _walk(self, tokens: Sequence[int], limit: int) -> list[Node]:
        """The nodes of `tokens`' whole pages within its first `limit` tokens, as far as the tree holds them."""
        ps, node, nodes = self.page_size, self.root, []
        for start in range(0, limit - ps + 1, ps):
            edge = self._edge(tokens, start)
            child = node.children.get(edge) if edge is not None else None
            if child is None:
                break
            nodes.append(child)
            node = child
        return nodes

    def _edge(self, tokens: Sequence[int], start: int) -> tuple[int, ...] | None:
        """The edge of the page of `tokens` at `start`: its tokens, and under a shift the token after
        it (None when `tokens` ends with the page: its draft KV at the last position is unknown)."""
        end = start + self.page_size
        key = tuple(tokens[start:end])
        if not self.shift:
            return key
        return (*key, tokens[end]) if end < len(tokens) else None

    def path(self, tokens: Sequence[int], num_tokens: int) -> Match:
        """The nodes holding `tokens`' first whole pages, at most `num_tokens` tokens: what a running
        request that inserted them reads (no tick: reading them is not a new use)."""
        return Match(tuple(self._walk(tokens, min(num_tokens, len(tokens)))))

    # ---- references ----
    def lock(self, match: Match, count_hit: bool = True) -> None:
        for node in match.nodes:
            if node.refs == 0:
                self.num_evictable -= 1
            node.refs += 1
        if count_hit:
            self.stats["matched_tokens"] += len(match) * self.page_size

    def unlock(self, match: Match) -> None:
        for node in match.nodes:
            if node.refs <= 0:
                raise RuntimeError(f"page {node.page} unlocked more often than locked")
            node.refs -= 1
            if node.refs == 0:
                self.num_evictable += 1
                self._offer(node)

    # ---- insertion ----
    def insert(self, tokens: Sequence[int], pages: Sequence[int], num_tokens: int) -> Inserted:
        """Cache the first `num_tokens` tokens of a sequence whose KV lives in `pages` (page j holds
        tokens [j*page_size, (j+1)*page_size)); only whole pages are cached, and under a shift
        only pages whose next token `tokens` has. `num_tokens` covers at least the prefix the
        sequence matched (whose pages are the tree's already). Returns the caller's pages the tree
        did not adopt: a partial or uncacheable page, or tokens the tree held already under
        another page."""
        ps = self.page_size
        whole = min(num_tokens, len(tokens), len(pages) * ps) // ps
        node, tick = self.root, next(self._clock)
        unadopted: list[int] = []
        created: list[Node] = []  # new nodes form one chain: a new node has no children to walk into
        j = 0
        while j < whole and (edge := self._edge(tokens, j * ps)) is not None:
            child = node.children.get(edge)
            if child is None:
                key = edge[:ps]
                child = Node(key, pages[j], node, last_used=tick, hash=block_hash(node.hash, key), edge=edge)
                node.children[edge] = child
                created.append(child)
                self.num_pages += 1
                self.num_evictable += 1
                self.stats["inserted_pages"] += 1
            elif child.page != pages[j]:
                unadopted.append(pages[j])
            child.last_used = tick
            node = child
            j += 1
        unadopted.extend(pages[j:])
        self._offer(node)
        self._announce(created)
        return Inserted(unadopted)

    def _announce(self, created: list[Node]) -> None:
        """Tell the listener of a new chain's hashes, from its first hash no other node has."""
        fresh = None
        for i, n in enumerate(created):
            self._hashes[n.hash] += 1
            if fresh is None and self._hashes[n.hash] == 1:
                fresh = i
        if fresh is not None and self.listener is not None:
            first = created[fresh].parent
            assert first is not None
            self.listener.stored(first.hash, [(n.hash, n.key) for n in created[fresh:]])

    # ---- eviction ----
    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` pages no request reads, least recently used leaves first;
        returns how many were freed."""
        if num_pages <= 0 or not self.num_evictable:
            return 0
        freed: list[int] = []
        gone: list[int] = []  # their hashes, for the listener
        while self._lru and len(freed) < num_pages:
            entry = heapq.heappop(self._lru)
            if not self._evictable_leaf(entry):
                continue
            node = entry[2]
            parent = node.parent
            assert parent is not None
            del parent.children[node.edge]
            freed.append(node.page)
            self._hashes[node.hash] -= 1
            if not self._hashes[node.hash]:  # its last copy: routers may forget the hash
                del self._hashes[node.hash]
                gone.append(node.hash)
            self._offer(parent)  # its last child gone, it may be a leaf no request reads now
        self.num_pages -= len(freed)
        self.num_evictable -= len(freed)
        self.stats["evicted_pages"] += len(freed)
        if freed:
            self.free_pages(freed)
            if self.listener is not None:
                self.listener.removed(gone)
        return len(freed)

    def reset_stats(self) -> None:
        """Zero the counters (a node's warm-up pages are nobody's hits or evictions)."""
        self.stats = dict.fromkeys(self.stats, 0)

    def clear(self) -> int:
        """Evict every page no request reads."""
        return self.evict(self.num_evictable)

    def _offer(self, node: Node) -> None:
        """Queue `node` for eviction at its current tick if it is a leaf no request reads."""
        if node is not self.root and node.refs == 0 and not node.children:
            heapq.heappush(self._lru, (node.last_used, next(self._seq), node))
            if len(self._lru) > 4 * max(1024, self.num_pages):  # mostly stale entries: rebuild
                self._lru = [e for e in self._lru if self._evictable_leaf(e)]
                heapq.heapify(self._lru)

    def _evictable_leaf(self, entry: tuple[int, int, Node]) -> bool:
        """Whether a queued entry still describes an unreferenced leaf of the tree, last used then."""
        last_used, _, node = entry
        parent = node.parent
        return (
            node.refs == 0
            and not node.children
            and node.last_used == last_used
            and parent is not None
            and parent.children.get(node.edge) is node
        )

    def _leaves(self) -> list[Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root:
                out.append(node)
        return out

    # ---- checks ----
    def pages(self) -> list[int]:
        """Every page the tree owns."""
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node.page)
            stack.extend(node.children.values())
        return out

    def check(self) -> None:
        """The counters add up; a referenced node's ancestors are referenced at least as often."""
        nodes, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
            parent = node.parent
            assert parent is not None and parent.children.get(node.edge) is node
            assert node.hash == block_hash(parent.hash, node.key) and node.edge[: self.page_size] == node.key
            assert parent is self.root or parent.refs >= node.refs, (parent.refs, node.refs)
        assert len(nodes) == self.num_pages, (len(nodes), self.num_pages)
        assert sum(n.refs == 0 for n in nodes) == self.num_evictable
        assert len({n.page for n in nodes}) == len(nodes), "a page cached twice"
        assert Counter(n.hash for n in nodes) == self._hashes, "event hashes out of step with the nodes"
        queued = {id(e[2]) for e in self._lru if self._evictable_leaf(e)}
        assert all(id(n) in queued for n in self._leaves() if n.refs == 0), "an evictable leaf not queued"
