"""Batched token sampling: penalties, logit bias, min-token bans, grammar masks, temperature,
top-k/top-p/min-p and seeded noise."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from engine.core import Req
from engine.grammar.bitmask import MaskRows, apply_token_mask, batch_masks
from engine.h2d import to_device
from engine.noise import signed64, uniform_noise

_MIN_TEMPERATURE = 1e-6  # positive temperatures below this are clamped (logits / T must stay finite)


def plain_argmax_ok(reqs: list[Req]) -> bool:
    """Requests whose next token is the argmax of the raw logits: greedy, with no penalties,
    min_tokens bans, logit bias, grammar or logprobs to compute (what whole-step graphs may do alone)."""
    return masked_argmax_ok(reqs) and all(r.params.constraint is None for r in reqs)


def masked_argmax_ok(reqs: list[Req]) -> bool:
    """Requests whose next token is the argmax of the logits under their grammar's mask (if any):
    as `plain_argmax_ok`, constraints allowed."""
    for r in reqs:
        p = r.params
        if not p.is_greedy or p.has_penalties or p.min_new_tokens or p.logit_bias or p.logprobs or p.top_logprobs:
            return False
    return True


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling controls on the device, built once per batch by `Sampler.prepare`."""

    temperature: torch.Tensor  # (rows,) float32; 1.0 on greedy rows
    top_p: torch.Tensor  # (rows,) float32
    top_k: torch.Tensor  # (rows,) int64; vocab_size when off
    min_p: torch.Tensor  # (rows,) float32
    greedy: torch.Tensor  # (rows,) bool
    frequency_penalty: torch.Tensor  # (rows,) float32
    presence_penalty: torch.Tensor  # (rows,) float32
    repetition_penalty: torch.Tensor  # (rows,) float32
    slots: torch.Tensor  # (rows,) int64
    seeds: torch.Tensor  # (rows,) int64
    positions: torch.Tensor  # (rows,) int64; index of the token being sampled
    any_penalties: bool
    all_greedy: bool
    any_greedy: bool = False
    any_min_p: bool = False
    need_sort: bool = False  # some non-greedy row has top-k or top-p active
    penalty_rows: torch.Tensor | None = None  # rows with penalties; None means all rows
    sort_rows: torch.Tensor | None = None  # rows needing the sort; None means all rows
    num_rows: int = 0
    # min_new_tokens: (row, token) pairs masked while the row samples a position < ban_until
    ban_rows: torch.Tensor | None = None  # (pairs,) int64
    ban_ids: torch.Tensor | None = None  # (pairs,) int64
    ban_until: torch.Tensor | None = None  # (pairs,) int64: prompt length + min_new_tokens
    # logit_bias: (row, token) pairs and what is added to their logits
    bias_rows: torch.Tensor | None = None  # (pairs,) int64
    bias_ids: torch.Tensor | None = None  # (pairs,) int64
    bias_values: torch.Tensor | None = None  # (pairs,) float32
    grammar: MaskRows | None = None  # rows a grammar constrains and their allowed-token masks


@dataclass(slots=True)
class SampleResult:
    tokens: torch.Tensor  # (rows,) int64
    logprobs: torch.Tensor | None  # (rows,) float32
    top_ids: torch.Tensor | None  # (rows, n) int64
    top_values: torch.Tensor | None  # (rows, n) float32


class Sampler:
    """Turns logits into tokens for a batch of requests; owns per-slot penalty state on the device."""

    def __init__(
        self, vocab_size: int, max_reqs: int, device: torch.device | str, eos_token_ids: Sequence[int] = ()
    ) -> None:
        self.vocab_size = vocab_size
        self.max_reqs = max_reqs
        self.device = torch.device(device)
        self.eos_token_ids = frozenset(eos_token_ids)  # banned before min_new_tokens (unless ignore_eos)
        self._counts: torch.Tensor | None = None  # (max_reqs+1, V) int32 output token counts
        self._prompt_seen: torch.Tensor | None = None  # (max_reqs+1, V) bool

    # ---- penalty state -------------------------------------------------------------------
    def _ensure_buffers(self) -> None:
        if self._counts is None:
            shape = (self.max_reqs + 1, self.vocab_size)
            self._counts = torch.zeros(shape, dtype=torch.int32, device=self.device)
            self._prompt_seen = torch.zeros(shape, dtype=torch.bool, device=self.device)

    def on_admit(self, req: Req) -> None:
        """(Re)build penalty state for `req.slot` from its prompt and outputs so far."""
        if not req.params.has_penalties:
            return
        if not 0 < req.slot <= self.max_reqs:
            raise ValueError(f"slot {req.slot} outside 1..{self.max_reqs}")
        self._ensure_buffers()
        assert self._counts is not None and self._prompt_seen is not None
        counts, seen = self._counts[req.slot], self._prompt_seen[req.slot]
        counts.zero_()
        seen.zero_()
        if req.prompt_ids:
            seen[self._ids(req.prompt_ids)] = True
        if req.output_ids:
            out = self._ids(req.output_ids)
            counts.scatter_add_(0, out, torch.ones_like(out, dtype=torch.int32))

    def _ids(self, ids: list[int]) -> torch.Tensor:
        return self._to_device(torch.tensor(ids, dtype=torch.int64))

    def record(self, reqs: list[Req], tokens: torch.Tensor, *, counts: torch.Tensor | None = None) -> None:
        """Add newly emitted tokens to the output counts of requests with penalties.

        `tokens` is (n,) or (n, k); with (n, k), `counts[i]` (default k) leading entries of row i
        are real tokens and the rest are ignored (they may hold any value, e.g. -1 padding).
        """
        pen = [i for i, r in enumerate(reqs) if r.params.has_penalties]
        if not pen:
            return
        if self._counts is None:
            raise RuntimeError("record() for a request with penalties that was never on_admit()-ed")
        V = self.vocab_size
        tokens = tokens.to(self.device, torch.int64)
        if tokens.dim() == 1:
            tokens = tokens[:, None]
        valid = None
        if counts is not None:
            k = tokens.shape[1]
            valid = torch.arange(k, device=self.device)[None, :] < counts.to(self.device)[:, None]
        if len(pen) != len(reqs):
            sel = self._ids(pen)
            tokens = tokens.index_select(0, sel)
            valid = None if valid is None else valid.index_select(0, sel)
        slots = self._ids([reqs[i].slot for i in pen])
        flat = (slots[:, None] * V + tokens.clamp(0, V - 1)).reshape(-1)
        ones = (torch.ones_like(tokens, dtype=torch.int32) if valid is None else valid.to(torch.int32)).reshape(-1)
        self._counts.view(-1).scatter_add_(0, flat, ones)

    # ---- batch preparation ---------------------------------------------------------------
    def prepare(
        self,
        reqs: list[Req],
        rows_per_req: int = 1,
        positions: list[int] | None = None,
        row_positions: torch.Tensor | None = None,
        grammar: MaskRows | None = None,
    ) -> SamplingBatch:
        """Device tensors for `reqs`, each request's values repeated over `rows_per_req` rows.

        `positions[i]`: index of the token request i samples (default: prompt + output length).
        The overlap scheduler passes it because tokens still on the device are not in
        `output_ids` yet, and the seeded noise is keyed by that index. With several rows per
        request, row j defaults to position + j; `row_positions` (rows,) on the device replaces
        them all (a verify window knows each row's exact index there, tree depths included).
        `grammar`: the constrained rows' masks; with one row per request they default to each
        request's matcher as it stands (a verify window's rows need the drafts walked: the
        caller's `window_masks`).
        """
        V, r = self.vocab_size, rows_per_req
        ps = [q.params for q in reqs]
        greedy = [p.is_greedy for p in ps]
        top_k = [V if p.top_k <= 0 else min(p.top_k, V) for p in ps]
        has_pen = [p.has_penalties for p in ps]
        need_sort = [not g and (k < V or p.top_p < 1.0) for g, k, p in zip(greedy, top_k, ps)]
        floats = torch.tensor(
            [
                [1.0 if g else max(p.temperature, _MIN_TEMPERATURE) for g, p in zip(greedy, ps)],
                [p.top_p for p in ps],
                [p.min_p for p in ps],
                [p.frequency_penalty for p in ps],
                [p.presence_penalty for p in ps],
                [p.repetition_penalty for p in ps],
            ],
            dtype=torch.float32,
        ).reshape(6, len(reqs))
        ints = torch.tensor(
            [
                top_k,
                [q.slot for q in reqs],
                [signed64(q.sampling_seed) for q in reqs],
                positions if positions is not None else [len(q.prompt_ids) + len(q.output_ids) for q in reqs],
            ],
            dtype=torch.int64,
        ).reshape(4, len(reqs))
        flags = torch.tensor(greedy, dtype=torch.bool)
        if r > 1:
            floats = floats.repeat_interleave(r, dim=1)
            ints = ints.repeat_interleave(r, dim=1)
            ints[3] += torch.arange(r).repeat(len(reqs))
            flags = flags.repeat_interleave(r)
        floats, ints, flags = (self._to_device(t) for t in (floats, ints, flags))
        any_pen = any(has_pen)
        if any_pen and self._counts is None:
            raise RuntimeError("a request with penalties was never on_admit()-ed")
        bans = self._min_token_bans(reqs, r)
        bias = self._logit_bias(reqs, r)
        if grammar is None and r == 1:
            grammar = batch_masks([q.live_grammar for q in reqs], self.vocab_size, self.device)
        return SamplingBatch(
            temperature=floats[0],
            top_p=floats[1],
            min_p=floats[2],
            frequency_penalty=floats[3],
            presence_penalty=floats[4],
            repetition_penalty=floats[5],
            top_k=ints[0],
            slots=ints[1],
            seeds=ints[2],
            greedy=flags,
            positions=ints[3] if row_positions is None else row_positions.to(torch.int64),
            any_penalties=any_pen,
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            any_min_p=any(p.min_p > 0.0 and not g for p, g in zip(ps, greedy)),
            need_sort=any(need_sort),
            penalty_rows=self._rows(has_pen, r),
            sort_rows=self._rows(need_sort, r),
            num_rows=len(reqs) * r,
            ban_rows=bans[0],
            ban_ids=bans[1],
            ban_until=bans[2],
            bias_rows=bias[0],
            bias_ids=bias[1],
            bias_values=bias[2],
            grammar=grammar,
        )

    def _logit_bias(self, reqs: list[Req], r: int) -> tuple[torch.Tensor | None, ...]:
        """(rows, ids, values) of every request's logit_bias, repeated over its rows."""
        rows: list[int] = []
        pairs: list[tuple[int, float]] = []
        for i, q in enumerate(reqs):
            mine = [(t, b) for t, b in q.params.logit_bias if t < self.vocab_size]
            for j in range(r):
                rows += [i * r + j] * len(mine)
                pairs += mine
        if not rows:
            return None, None, None
        idx = self._to_device(torch.tensor([rows, [t for t, _ in pairs]], dtype=torch.int64))
        return idx[0], idx[1], self._to_device(torch.tensor([b for _, b in pairs], dtype=torch.float32))

    def _min_token_bans(self, reqs: list[Req], r: int) -> tuple[torch.Tensor | None, ...]:
        """(rows, ids, until) of every token a request may not sample yet: its stop token ids and
        (unless ignore_eos) EOS, while fewer than min_new_tokens outputs exist. Which rows are
        still short is decided on the device from their positions, so a verify window's rows
        (position + depth) and an overlapped batch (tokens not on the host yet) are exact."""
        rows: list[int] = []
        ids: list[int] = []
        until: list[int] = []
        for i, q in enumerate(reqs):
            p = q.params
            if p.min_new_tokens <= 0:
                continue
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)
            banned_ids = sorted(t for t in banned if 0 <= t < self.vocab_size)
            for j in range(r):
                rows += [i * r + j] * len(banned_ids)
                ids += banned_ids
                until += [len(q.prompt_ids) + p.min_new_tokens] * len(banned_ids)
        if not rows:
            return None, None, None
        t = self._to_device(torch.tensor([rows, ids, until], dtype=torch.int64))
        return t[0], t[1], t[2]

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return to_device(t, self.device)

    def _rows(self, mask: list[bool], r: int) -> torch.Tensor | None:
        """Row indices where `mask` (per request) holds; None when it holds for every row."""
        if all(mask):
            return None
        rows = [i * r + j for i, m in enumerate(mask) if m for j in range(r)]
        return self._to_device(torch.tensor(rows, dtype=torch.int64))

    # ---- logits processing ---------------------------------------------------------------
    def _penalised(self, logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
        """float32 copy of `logits` with repetition, frequency and presence penalties, logit bias, the
        min-token bans and grammar masks applied (before greedy's argmax, so greedy rows obey them
        too)."""
        if logits.dim() != 2 or logits.shape[0] != sb.num_rows:
            raise ValueError(f"logits {tuple(logits.shape)} do not match {sb.num_rows} rows")
        x = self._apply_penalties(logits.to(torch.float32, copy=True), sb)
        if sb.bias_rows is not None:
            assert sb.bias_ids is not None and sb.bias_values is not None
            x.index_put_((sb.bias_rows, sb.bias_ids), sb.bias_values, accumulate=True)
        if sb.ban_rows is not None:
            assert sb.ban_ids is not None and sb.ban_until is not None
            short = sb.positions.index_select(0, sb.ban_rows) < sb.ban_until
            kept = x[sb.ban_rows, sb.ban_ids]
            x.index_put_((sb.ban_rows, sb.ban_ids), torch.where(short, float("-inf"), kept))
        if sb.grammar is not None:
            apply_token_mask(x, sb.grammar)
        return x

    def _apply_penalties(self, x: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
        """Repetition, frequency and presence penalties on float32 logits (in place where it can)."""
        if not sb.any_penalties:
            return x
        assert self._counts is not None and self._prompt_seen is not None
        rows = sb.penalty_rows
        sub = x if rows is None else x.index_select(0, rows)
        pick = (lambda t: t) if rows is None else (lambda t: t.index_select(0, rows))
        slots = pick(sb.slots)
        counts = self._counts.index_select(0, slots)
        present = counts > 0
        seen = self._prompt_seen.index_select(0, slots).logical_or_(present)
        rep = pick(sb.repetition_penalty)[:, None]
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        sub -= pick(sb.frequency_penalty)[:, None] * counts.to(torch.float32)
        sub -= pick(sb.presence_penalty)[:, None] * present.to(torch.float32)
        if rows is None:
            return sub
        return x.index_copy_(0, rows, sub)

    def _filtered_logits(self, x: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
        """Temperature, then top-k, top-p and min-p as -inf masks, on penalised float32 logits."""
        x = x.div_(sb.temperature[:, None])
        if sb.need_sort:
            rows = sb.sort_rows
            sub = x if rows is None else x.index_select(0, rows)
            pick = (lambda t: t) if rows is None else (lambda t: t.index_select(0, rows))
            sub = self._top_k_top_p(sub, pick(sb.top_k), pick(sb.top_p))
            x = sub if rows is None else x.index_copy_(0, rows, sub)
        if sb.any_min_p:  # p < min_p * p_max  <=>  logit < max_logit + log(min_p)
            cut = x.amax(dim=-1, keepdim=True) + torch.log(sb.min_p)[:, None]
            x = x.masked_fill_(x < cut, float("-inf"))
        return x

    @staticmethod
    def _top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        """Mask all but the top-k, then all but the smallest prefix reaching top_p probability."""
        xs = torch.sort(x, dim=-1, descending=True).values
        ranks = torch.arange(x.shape[-1], device=x.device)[None, :]
        keep = ranks < top_k[:, None]
        xs = xs.masked_fill_(~keep, float("-inf"))
        ps = torch.softmax(xs, dim=-1)
        before = torch.cumsum(ps, dim=-1).sub_(ps)  # probability mass ranked above each token
        keep &= (before < top_p[:, None]) | (top_p[:, None] >= 1.0)
        n_keep = keep.sum(dim=-1, keepdim=True).clamp_(min=1)
        cutoff = xs.gather(1, n_keep - 1)  # smallest kept logit (ties with it are kept too)
        return x.masked_fill_(x < cutoff, float("-inf"))

    @staticmethod
    def _one_hot(idx: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(like).scatter_(1, idx[:, None], 1.0)

    def processed_probs(self, logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
        """The distribution each row samples from: float32 (rows, V); one-hot on greedy rows."""
        x = self._penalised(logits, sb)
        if sb.all_greedy:
            return self._one_hot(x.argmax(dim=-1), x)
        greedy_tok = x.argmax(dim=-1) if sb.any_greedy else None
        probs = torch.softmax(self._filtered_logits(x, sb), dim=-1)
        if greedy_tok is not None:
            probs = torch.where(sb.greedy[:, None], self._one_hot(greedy_tok, probs), probs)
        return probs

    def sample(
        self, logits: torch.Tensor, sb: SamplingBatch, *, want_logprobs: bool = False, top_logprobs: int = 0
    ) -> SampleResult:
        """One token per row; greedy rows take the argmax, others an exponential race on seeded noise."""
        x = self._penalised(logits, sb)
        if sb.all_greedy:
            tokens = x.argmax(dim=-1)
        else:
            greedy_tok = x.argmax(dim=-1) if sb.any_greedy else None
            probs = torch.softmax(self._filtered_logits(x, sb), dim=-1)
            # argmax(p / E), E ~ Exp(1): picks token v with probability p[v] (Gumbel-max trick).
            race = uniform_noise(sb.seeds, sb.positions, self.vocab_size, stream=0).log_().neg_()
            tokens = probs.div_(race).argmax(dim=-1)
            if greedy_tok is not None:
                tokens = torch.where(sb.greedy, greedy_tok, tokens)
        lp = top_ids = top_vals = None
        if want_logprobs or top_logprobs > 0:
            raw = torch.log_softmax(logits.to(torch.float32), dim=-1)
            if want_logprobs:
                lp = raw.gather(1, tokens[:, None]).squeeze(1)
            if top_logprobs > 0:
                top_vals, top_ids = torch.topk(raw, min(top_logprobs, self.vocab_size), dim=-1)
        return SampleResult(tokens=tokens, logprobs=lp, top_ids=top_ids, top_values=top_vals)
