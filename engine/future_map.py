"""FutureMap: device-side relay rows through which one forward hands the next its inputs.

Under overlap scheduling the CPU prepares batch N+1 while the device still runs batch N, so
batch N+1's inputs (next input token, new sequence lengths, draft top-k and hidden state) are not
known on the host yet. Batch N's forward writes them here and batch N+1's forward gathers them,
in device stream order, with no host sync. Every algorithm relays through one map, plain decoding
included (its next input token is a bonus token like any other); the scheduler builds it with the
algorithm's `create_future_map` and hands each launch the rows of its batch (`BatchRelay`).

Rows are keyed by request slot. Row 0 is padding: it mirrors the KV padding row, so graph-padded
entries may read and write it without touching a real request. A row is safe without a ring of
future slots because a request is in at most one in-flight forward and its slot is freed only
after its result was processed.

Protocol per iteration:

* ``on_publish(new_seq_lens)`` (``publish``) between verify and draft-extend: scatters the new
  lengths and (re)records ``publish_ready``, chained onto the previous record.
* ``stash(payload)`` after the forward, on the forward stream: bonus tokens, top-k, hidden states.
* ``resolve_seq_lens()`` / ``resolve()`` for the next batch: wait the event, then gather.

Guards. Unwritten and released rows hold a negative sentinel. Every resolve checks on the device
that no row it read is a sentinel (``torch._assert_async``: no host sync; on the CPU the check is
immediate), so a read of a row that was never published fails instead of decoding from length 0.
``debug=True`` also re-poisons rows once consumed, catching a second read without a new write.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from engine.device_event import DeviceEvent, make_event
from engine.h2d import to_device

__all__ = ["BatchRelay", "DraftInput", "FutureMap", "FutureMapError", "RelayPayload", "plain_future_map"]

_SENTINEL = -1


class FutureMapError(RuntimeError):
    """A relay row was misused: read before being written, read twice (debug), or bad input."""


def _unwritten(name: str) -> str:
    return f"FutureMap: {name} row read before being written (never published, or released)"


# --------------------------------------------------------------------------- payload


@dataclass
class RelayPayload:
    """Per-request values one forward hands to the next; all tensors have ``n`` rows."""

    bonus_tokens: torch.Tensor  # (n,) int64: the next input token per request
    topk_p: torch.Tensor | None = None  # (n, topk) float32
    topk_index: torch.Tensor | None = None  # (n, topk) int64
    hidden_states: torch.Tensor | None = None  # (n, H) draft dtype


class DraftInput(Protocol):
    """What an algorithm's draft input offers the engine: its rows as a relay payload (PD decode
    seeds a prebuilt request's FutureMap row from it)."""

    def relay_payload(self) -> RelayPayload: ...

    def __len__(self) -> int: ...


# --------------------------------------------------------------------------- the map


class FutureMap:
    """Relay buffers with one row per request slot (row 0 = padding)."""

    def __init__(
        self, num_rows: int, device: torch.device | str, *, need_topk: bool, need_hidden: bool, debug: bool = False
    ) -> None:
        if num_rows < 2:
            raise ValueError(f"num_rows must count the padding row and one slot, got {num_rows}")
        self.num_rows = num_rows
        self.device = torch.device(device)
        self.need_topk = need_topk
        self.need_hidden = need_hidden
        self.debug = debug
        # Eager: every path relays tokens and lengths. Row 0 stays 0: padded reads pass the guard.
        self.output_tokens_buf = self._full((num_rows,), _SENTINEL, torch.int64)
        self.new_seq_lens_buf = self._full((num_rows,), _SENTINEL, torch.int64)
        # Lazy: shapes (topk, hidden size) and dtypes are only known from the first payload.
        self.topk_p_buf: torch.Tensor | None = None
        self.topk_index_buf: torch.Tensor | None = None
        self.hidden_states_buf: torch.Tensor | None = None
        self._publish_ready: DeviceEvent | None = None

    @property
    def published_event(self) -> DeviceEvent | None:
        """The ``publish_ready`` event; None until the first non-empty publish."""
        return self._publish_ready

    def batch(self, slots: Sequence[int] | torch.Tensor) -> "BatchRelay":
        """The rows of one batch (request slots in batch order)."""
        return BatchRelay(self, slots if isinstance(slots, torch.Tensor) else to_device(list(slots), self.device))

    # ----------------------------------------------------------------- writes

    def publish(self, indices: torch.Tensor, new_seq_lens: torch.Tensor, *, record: bool = True) -> None:
        """Scatter ``new_seq_lens`` into their rows and record ``publish_ready`` (chained).
        `record=False` inside a captured graph: the caller records after the replay."""
        if indices.numel() == 0:  # empty batch: nothing to fence
            return
        self._check_rows("new_seq_lens", new_seq_lens, indices)
        idx = self._idx(indices)
        if not record:
            self.new_seq_lens_buf[idx] = new_seq_lens.to(self.device, torch.int64, non_blocking=True)
            return
        if self._publish_ready is None:
            self._publish_ready = make_event(self.device)
        else:
            # Chained record: re-recording overwrites the event, so without this wait a publish
            # from another stream (PD prebuilt seeding) could fire before an in-flight forward's
            # publish and a resolve would read that forward's rows too early.
            self._publish_ready.wait()
        self.new_seq_lens_buf[idx] = new_seq_lens.to(self.device, torch.int64, non_blocking=True)
        self._publish_ready.record()

    def stash(
        self, indices: torch.Tensor, payload: RelayPayload, *, keep_topk: bool = False, keep_hidden: bool = False
    ) -> None:
        """Write the payload rows; call after the forward, on the forward stream. `keep_topk` /
        `keep_hidden`: the rows keep their top-k / hidden state (the payload has none: a forward
        that deferred computing them)."""
        if indices.numel() == 0:
            return
        self._check_rows("bonus_tokens", payload.bonus_tokens, indices)
        idx = self._idx(indices)
        self.output_tokens_buf[idx] = payload.bonus_tokens.to(self.device, torch.int64, non_blocking=True)
        # Which extras travel is decided by the algorithm (need_*), not by the payload's shape:
        # a map that does not need them ignores them, one that does refuses a payload without.
        if self.need_topk and not keep_topk:
            if payload.topk_p is None or payload.topk_index is None:
                raise FutureMapError("this FutureMap relays top-k but the payload has none")
            self.topk_p_buf = self._store("topk_p", self.topk_p_buf, idx, payload.topk_p, indices)
            self.topk_index_buf = self._store("topk_index", self.topk_index_buf, idx, payload.topk_index, indices)
        if self.need_hidden and not keep_hidden:
            if payload.hidden_states is None:
                raise FutureMapError("this FutureMap relays hidden states but the payload has none")
            self.stash_hidden(indices, payload.hidden_states)

    def stash_hidden(self, indices: torch.Tensor, hidden: torch.Tensor) -> None:
        """Write the hidden-state rows alone (a draft that caught up after deferring them)."""
        if not self.need_hidden or indices.numel() == 0:
            return
        self.hidden_states_buf = self._store(
            "hidden_states", self.hidden_states_buf, self._idx(indices), hidden, indices
        )

    # ----------------------------------------------------------------- reads

    def mark_published(self) -> None:
        """Record ``publish_ready`` (chained) after publishes made with `record=False`."""
        if self._publish_ready is None:
            self._publish_ready = make_event(self.device)
        else:
            self._publish_ready.wait()
        self._publish_ready.record()

    def wait_published(self) -> None:
        """Order the current stream after every publish so far (before a captured resolve)."""
        self._wait_published()

    def reserve_extras(self, topk: int, hidden_size: int, hidden_dtype: torch.dtype) -> None:
        """Allocate the top-k and hidden-state rows now (a captured graph needs fixed buffers)."""
        if self.need_topk and self.topk_p_buf is None:
            self.topk_p_buf = self._full((self.num_rows, topk), 0, torch.float32)
            self.topk_index_buf = self._full((self.num_rows, topk), 0, torch.int64)
        if self.need_hidden and self.hidden_states_buf is None:
            self.hidden_states_buf = self._full((self.num_rows, hidden_size), 0, hidden_dtype)

    def resolve_seq_lens(self, indices: torch.Tensor, *, wait: bool = True, consume: bool = True) -> torch.Tensor:
        """Device tensor of the rows' published lengths, ordered after ``publish_ready``
        (`wait=False` inside a captured graph: the caller waits before the replay; `consume=False`:
        a look that leaves the rows for the forward that reads them, in debug mode too)."""
        idx = self._idx(indices)
        if wait:
            self._wait_published()
        seq_lens = self.new_seq_lens_buf[idx]  # advanced indexing copies: safe to poison after
        self._guard(self.new_seq_lens_buf, seq_lens, idx, "new_seq_lens", minimum=1, consume=consume)
        return seq_lens

    def resolve(
        self, indices: torch.Tensor, *, wait: bool = True, consume: bool = True, extras: bool = True
    ) -> RelayPayload:
        """Gather the stashed payload rows on the device (`extras=False`: the tokens alone, for a
        forward that drafts nothing)."""
        idx = self._idx(indices)
        if wait:
            self._wait_published()
        tokens = self.output_tokens_buf[idx]
        topk_p = topk_index = hidden = None
        if self.need_topk and extras and idx.numel() > 0:
            if self.topk_p_buf is None or self.topk_index_buf is None:
                raise FutureMapError("resolve of top-k before any stash carried it")
            topk_p, topk_index = self.topk_p_buf[idx], self.topk_index_buf[idx]
        if self.need_hidden and extras and idx.numel() > 0:
            if self.hidden_states_buf is None:
                raise FutureMapError("resolve of hidden states before any stash carried them")
            hidden = self.hidden_states_buf[idx]
        # The token row stands for the whole stash: stash writes all fields together.
        self._guard(self.output_tokens_buf, tokens, idx, "output_tokens", minimum=0, consume=consume)
        return RelayPayload(tokens, topk_p, topk_index, hidden)

    def check_resolved(self, ok: torch.Tensor, name: str) -> None:
        """Fail unless `ok` (a device bool: no row read held the sentinel). No host sync on an
        accelerator: the failure surfaces at the next synchronize."""
        if self.device.type == "cpu":
            if not bool(ok):
                raise FutureMapError(_unwritten(name))
            return
        torch._assert_async(ok, _unwritten(name))

    def invalidate(self, indices: torch.Tensor) -> None:
        """A request slot went back to its pool: reset its rows to the sentinel, so whoever gets
        the slot next fails its first read unless it publishes and stashes first."""
        if indices.numel() == 0:
            return
        idx = self._idx(indices)
        sentinel = torch.where(idx == 0, 0, _SENTINEL)
        self.output_tokens_buf[idx] = sentinel
        self.new_seq_lens_buf[idx] = sentinel

    def rows_free(self) -> bool:
        """Every real row holds the sentinel: released, or (debug) consumed. For tests."""
        return bool((self.output_tokens_buf[1:] < 0).all() and (self.new_seq_lens_buf[1:] < 0).all())

    # ----------------------------------------------------------------- helpers

    def _full(self, shape: tuple[int, ...], fill: float, dtype: torch.dtype) -> torch.Tensor:
        # Never an inference tensor, even when the first stash runs under inference_mode: PD
        # seeding writes rows from outside it, which inference tensors refuse.
        with torch.inference_mode(False):
            buf = torch.full(shape, fill, dtype=dtype, device=self.device)
            buf[0] = 0
        return buf

    def _idx(self, indices: torch.Tensor) -> torch.Tensor:
        if indices.dim() != 1:
            raise FutureMapError(f"indices must be 1-D, got shape {tuple(indices.shape)}")
        if indices.device.type == "cpu" and self.device.type != "cpu":
            return to_device(indices.to(torch.int64), self.device)  # pinned: never stall a forward
        return indices.to(self.device, torch.int64)

    @staticmethod
    def _check_rows(name: str, values: torch.Tensor, indices: torch.Tensor) -> None:
        if values.dim() == 0 or values.shape[0] != indices.shape[0]:
            raise FutureMapError(f"{name} has shape {tuple(values.shape)}, expected {indices.shape[0]} rows")

    def _store(
        self, name: str, buf: torch.Tensor | None, idx: torch.Tensor, values: torch.Tensor, indices: torch.Tensor
    ) -> torch.Tensor:
        self._check_rows(name, values, indices)
        if buf is None:
            buf = self._full((self.num_rows, *values.shape[1:]), 0, values.dtype)
        elif buf.shape[1:] != values.shape[1:]:
            raise FutureMapError(
                f"{name} rows have shape {tuple(values.shape[1:])}, buffer holds {tuple(buf.shape[1:])}"
            )
        buf[idx] = values.to(self.device, buf.dtype, non_blocking=True)
        return buf

    def _wait_published(self) -> None:
        if self._publish_ready is not None:
            self._publish_ready.wait()

    def _guard(
        self, buf: torch.Tensor, values: torch.Tensor, idx: torch.Tensor, name: str, minimum: int, consume: bool = True
    ) -> None:
        """Fail a read of a sentinel row (never written, released or, in debug, consumed).
        Row 0 is exempt: padding reads it freely."""
        if values.numel() == 0:
            return
        ok = ((values >= minimum) | (idx == 0)).all()
        if self.device.type == "cpu" and not bool(ok):
            bad = idx[(values < minimum) & (idx != 0)].tolist()
            raise FutureMapError(f"{_unwritten(name)} (rows {bad})")
        self.check_resolved(ok, name)
        if self.debug and consume:  # consume once: a second read without a new write fails too
            buf[idx] = torch.where(idx == 0, 0, _SENTINEL).to(buf.dtype)


class BatchRelay:
    """One batch's rows of a FutureMap, with the callback that publishes them (`on_publish`).

    Executors get one per launch from the scheduler; they never see other requests' rows."""

    def __init__(self, future_map: FutureMap, indices: torch.Tensor) -> None:
        self.future_map, self.indices = future_map, indices

    def __len__(self) -> int:
        return int(self.indices.shape[0])

    def on_publish(self, new_seq_lens: torch.Tensor) -> None:
        """The batch's new committed lengths are final (called between verify and draft-extend)."""
        self.future_map.publish(self.indices, new_seq_lens)

    def stash(self, payload: RelayPayload, *, keep_topk: bool = False) -> None:
        if keep_topk:
            self.future_map.stash(self.indices, payload, keep_topk=True)
        else:  # the plain call: a plugin's FutureMap may override stash(indices, payload)
            self.future_map.stash(self.indices, payload)

    def resolve_seq_lens(self) -> torch.Tensor:
        return self.future_map.resolve_seq_lens(self.indices)

    def resolve(self) -> RelayPayload:
        return self.future_map.resolve(self.indices)

    def peek(self) -> tuple[torch.Tensor, RelayPayload]:
        """(lengths, payload) as the next forward will read them, leaving the rows to it."""
        fm = self.future_map
        return fm.resolve_seq_lens(self.indices, consume=False), fm.resolve(self.indices, consume=False)

    def seed(self, seq_lens: torch.Tensor, payload: RelayPayload) -> None:
        """Rows of requests that did not come from a forward (PD decode prebuilt requests):
        publish then stash, like a forward would. The chained publish keeps the fence of a
        forward in flight; the stash becomes visible to the next forward by stream order."""
        self.on_publish(seq_lens)
        self.stash(payload)

    def head(self, n: int) -> "BatchRelay":
        """The rows of the batch's first `n` requests (a mixed batch's decode rows)."""
        return self if n == len(self) else BatchRelay(self.future_map, self.indices[:n])

    def select(self, mask: Sequence[bool]) -> "BatchRelay":
        """The rows of the requests where `mask` is true (e.g. those that sample this step)."""
        if all(mask):
            return self
        keep = [i for i, m in enumerate(mask) if m]
        return BatchRelay(self.future_map, self.indices[to_device(keep, self.indices.device)])


def plain_future_map(
    max_running_requests: int,
    chunked_prefill_size: int,
    context_len: int,
    device: torch.device | str,
    *,
    debug: bool = False,
) -> FutureMap:
    """The map of decoding without speculation: next input tokens and lengths, nothing else.
    (chunked_prefill_size and context_len are part of the factory signature; rows are per slot.)"""
    return FutureMap(max_running_requests + 1, device, need_topk=False, need_hidden=False, debug=debug)
