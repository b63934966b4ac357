"""Tokens per streamed message from a streamed token rate against a message budget.

Every streamed message costs the router a read, a relay and an SSE write on its one event loop
(0.1 ms of a 2-core VM's CPU, bench/RESULTS.md's router_paced). A fixed interval trades every
client's granularity for the router's relief at all loads; a budget asks for it only when more
tokens a second stream than it allows messages: one token a message below it, then as many as keep
the messages within it. A node paces its own streams with it (`--stream-interval auto`,
engine/service/stream.py); the router paces all of its streams together with one
(`--stream-messages-per-s` on the router, router/attempt.py), which is the budget that counts
every node's messages. Torch-free.
"""

from __future__ import annotations

import math
import time
from typing import Callable

from common.defaults import DEFAULT_STREAM_MESSAGES_PER_S as DEFAULT_MESSAGES_PER_S

WINDOW_S = 0.5  # the rate is re-read this often: a load change reaches the interval within it
MOST_TOKENS = 16  # a message never waits for more (at 10 ms a token, 160 ms between messages)


class StreamPacer:
    """Streamed tokens (a node's, or all that a router relays) counted as they are handed on;
    `interval` is what a message gathers after a stream's first: `fixed` where set
    (`--stream-interval N`), else (auto) from the last window's token rate against the message
    budget. Used on one event loop only."""

    def __init__(
        self,
        fixed: int | None = None,
        messages_per_s: float = DEFAULT_MESSAGES_PER_S,
        window_s: float = WINDOW_S,
        most: int = MOST_TOKENS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if fixed is not None and fixed < 1:
            raise ValueError(f"--stream-interval must be >= 1 or auto, got {fixed}")
        if messages_per_s <= 0:
            raise ValueError(f"--stream-messages-per-s must be > 0, got {messages_per_s:g}")
        self.fixed, self.messages_per_s, self.window_s, self.most = fixed, messages_per_s, window_s, most
        self._clock = clock
        self._since, self._tokens = clock(), 0
        self.interval = fixed or 1
        self.tokens_per_s = 0.0

    def observe(self, tokens: int) -> None:
        """Tokens handed to a streaming request (per update); a window's end re-reads the rate."""
        self._tokens += tokens
        now = self._clock()
        if now - self._since < self.window_s:
            return
        self.tokens_per_s = self._tokens / (now - self._since)
        self._since, self._tokens = now, 0
        if self.fixed is None:
            self.interval = max(1, min(self.most, math.ceil(self.tokens_per_s / self.messages_per_s)))

    def interval_now(self) -> int:
        """`interval`, unless the current window has run past its length: then what its tokens so
        far say (a quiet spell brings it back to one before the next token closes the window)."""
        elapsed = self._clock() - self._since
        if self.fixed is not None or elapsed < self.window_s:
            return self.interval
        return max(1, min(self.most, math.ceil(self._tokens / elapsed / self.messages_per_s)))
