"""One attempt's tokens as the client gets them: the decode stream, after the prefill's first token
when the router relayed that one early, each token once and in order."""

from __future__ import annotations

import logging

from smg_grpc_proto import sglang_scheduler_pb2 as pb

from router.contract import TokenEvent
from router.wire import token_event

log = logging.getLogger(__name__)


class TokenRelay:
    """Output positions: `sent` tokens went to the client (from either leg), `seen` tokens came in
    the decode's chunks. The decode streams every token from the first one on, so a token the
    prefill's answer already gave the client comes again from the decode and is skipped then."""

    def __init__(self, request_id: str) -> None:
        self.rid = request_id
        self.sent = 0
        self.seen = 0
        self.early: int | None = None  # the prefill's token the client got before the decode spoke

    def prefill_token(self, token: int) -> TokenEvent:
        """The prefill's first token, sent before any decode token."""
        assert self.sent == 0, "the first token goes out once"
        self.sent, self.early = 1, token
        return TokenEvent((token,))

    def chunk(self, c: pb.GenerateStreamChunk) -> TokenEvent | None:
        """The part of a decode chunk the client has not got; None when nothing is left."""
        start, self.seen = self.seen, self.seen + len(c.token_ids)
        lp = c.output_logprobs if c.HasField("output_logprobs") else None
        return self._unsent(list(c.token_ids), lp, start)

    def complete(self, done: pb.GenerateComplete) -> TokenEvent | None:
        """What the decode's GenerateComplete (all its tokens) adds: the tokens it did not stream."""
        lp = done.output_logprobs if done.HasField("output_logprobs") else None
        return self._unsent(list(done.output_ids), lp, 0)

    def _unsent(self, ids: list[int], lp: pb.OutputLogProbs | None, start: int) -> TokenEvent | None:
        """`ids` hold output positions start, start+1, ...; those below `sent` went out already."""
        if start == 0 and ids and self.early is not None and ids[0] != self.early:
            # Both legs carry the token the prefill sampled; a difference is a node bug, and the
            # client already has the prefill's: say so rather than send a second first token.
            log.warning(
                "%s: decode's first token %d differs from the prefill's %d already sent", self.rid, ids[0], self.early
            )
        skip = max(0, self.sent - start)
        if skip >= len(ids):
            return None
        if skip and lp is not None and lp.token_logprobs:
            lp = pb.OutputLogProbs(
                token_logprobs=lp.token_logprobs[skip:],
                token_ids=lp.token_ids[skip:],
                top_logprobs=lp.top_logprobs[skip:],
            )
        self.sent = start + len(ids)
        return token_event(ids[skip:], lp)
