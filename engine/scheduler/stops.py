"""When a new token ends its request: EOS and stop ids, the length limits, and the grammar."""

from __future__ import annotations

from dataclasses import dataclass

from engine.core import FinishReason, Req


@dataclass(frozen=True)
class StopRules:
    eos_token_ids: frozenset[int]
    max_context_len: int

    def append(self, req: Req, new: list[int]) -> list[int]:
        """Append `new` to `req`'s output up to the first token that ends it (which finishes the
        request); returns the tokens appended."""
        for n, tok in enumerate(new, 1):
            req.output_ids.append(tok)
            reason = self.reason(req, tok)
            if reason is not None:
                req.finish(reason, "" if reason is not FinishReason.ABORT else f"token {tok} is outside the grammar")
                return new[:n]
        return list(new)

    def reason(self, req: Req, tok: int) -> FinishReason | None:
        """Why `tok`, just appended to `req`'s output, ends it (None: it goes on). A constrained
        request's matcher takes the token here."""
        return self._grammar(req, tok) or self._stop(req, tok)

    def _stop(self, req: Req, tok: int) -> FinishReason | None:
        p = req.params
        if not p.ignore_eos and tok in self.eos_token_ids:
            return FinishReason.STOP
        if tok in p.stop_token_ids:
            return FinishReason.STOP
        if len(req.output_ids) >= p.max_new_tokens or req.total_len >= self.max_context_len:
            return FinishReason.LENGTH
        return None

    def _grammar(self, req: Req, tok: int) -> FinishReason | None:
        """Advance a constrained request's matcher by its new token: STOP once the grammar has
        taken its last token (what follows could only be EOS), ABORT if it refuses the token
        (masks make that impossible; a broken invariant ends the request, not the node)."""
        if req.grammar is None or (tok in self.eos_token_ids and not req.params.ignore_eos):
            return None
        if not req.grammar.advance((tok,)):
            return FinishReason.ABORT
        return FinishReason.STOP if req.grammar.is_finished() else None
