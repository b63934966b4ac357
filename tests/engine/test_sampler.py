"""Tests for engine.sampler: greedy, seeded reproducibility, filters, distribution, penalties, logprobs."""

from __future__ import annotations

import pytest
import torch

from engine.core import Req, SamplingParams
from engine.noise import uniform_noise
from engine.sampler import Sampler

V = 50


def mk(
    rid: str = "a", slot: int = 1, seed: int = 123, prompt: list[int] | None = None, out: list[int] | None = None, **kw
) -> Req:
    return Req(
        rid=rid,
        prompt_ids=list(prompt or [1, 2, 3]),
        params=SamplingParams(**kw),
        output_ids=list(out or []),
        slot=slot,
        sampling_seed=seed,
    )


def fixed_logits(v: int = V, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(v, generator=g) * scale


def sample_tokens(s: Sampler, reqs: list[Req], logits: torch.Tensor, rows_per_req: int = 1) -> torch.Tensor:
    sb = s.prepare(reqs, rows_per_req)
    return s.sample(logits, sb).tokens


# ---- uniform_noise -------------------------------------------------------------------------


def test_uniform_noise_range_mean_and_determinism() -> None:
    seeds = torch.tensor([0, 1, 2**63 - 1, 123456789, 42] * 40, dtype=torch.int64)
    pos = torch.arange(200, dtype=torch.int64)
    u = uniform_noise(seeds, pos, 1000)
    assert u.dtype == torch.float32 and u.shape == (200, 1000)
    assert bool((u > 0).all()) and bool((u < 1).all())
    # 200k draws: the mean's std is 0.289/sqrt(2e5) ~ 6.5e-4, so 0.005 is ~8 sigma.
    assert abs(u.mean().item() - 0.5) < 5e-3
    assert abs(u.std().item() - (1 / 12) ** 0.5) < 5e-3
    hist = torch.histc(u, bins=10, min=0.0, max=1.0) / u.numel()
    assert float((hist - 0.1).abs().max()) < 5e-3
    assert torch.equal(u, uniform_noise(seeds.clone(), pos.clone(), 1000))
    # a row depends only on its own (seed, position), and streams are independent
    assert torch.equal(uniform_noise(seeds[7:8], pos[7:8], 1000)[0], u[7])
    assert not torch.equal(uniform_noise(seeds, pos, 1000, stream=1), u)
    assert not torch.equal(u[0], uniform_noise(seeds[:1], pos[:1] + 1, 1000)[0])


# ---- greedy ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kw", [dict(temperature=0.0), dict(top_k=1, temperature=1.3)])
def test_greedy_is_argmax(kw: dict) -> None:
    s = Sampler(V, 8, "cpu")
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(1)) * 3
    reqs = [mk(str(i), slot=i + 1, seed=i, **kw) for i in range(6)]
    sb = s.prepare(reqs)
    assert sb.all_greedy
    assert torch.equal(s.sample(logits, sb).tokens, logits.argmax(-1))
    probs = s.processed_probs(logits, sb)
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), V).float())


def test_greedy_rows_in_mixed_batch() -> None:
    s = Sampler(V, 8, "cpu")
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(2)) * 3
    reqs = [
        mk("g0", 1, temperature=0.0),
        mk("s1", 2, temperature=1.0, top_p=0.9),
        mk("g2", 3, top_k=1),
        mk("s3", 4, temperature=0.8),
    ]
    sb = s.prepare(reqs)
    assert not sb.all_greedy and sb.any_greedy
    tok = s.sample(logits, sb).tokens
    assert tok[0] == logits[0].argmax() and tok[2] == logits[2].argmax()


# ---- seeded reproducibility ------------------------------------------------------------------


def test_same_seed_same_token_regardless_of_batch() -> None:
    s = Sampler(V, 16, "cpu")
    row = fixed_logits(scale=0.5)  # flat-ish so draws vary a lot
    gen = torch.Generator().manual_seed(3)
    for n_out in range(8):
        a = mk("a", slot=5, seed=777, out=[4] * n_out, temperature=0.9, top_p=0.95)
        alone = sample_tokens(s, [a], row[None])[0]
        others = [mk(f"o{i}", slot=i + 6, seed=i, temperature=1.0 + i / 10, top_k=5 * (i % 3)) for i in range(5)]
        for order in ([a] + others, others[:2] + [a] + others[2:], others[::-1] + [a]):
            logits = torch.randn(len(order), V, generator=gen)
            logits[order.index(a)] = row
            assert sample_tokens(s, order, logits)[order.index(a)] == alone
    # rows_per_req: row j samples the token at position + j
    a = mk("a", slot=5, seed=777, temperature=0.9)
    multi = sample_tokens(s, [a], row.expand(4, V).clone(), rows_per_req=4)
    single = [sample_tokens(s, [mk("a", 5, 777, out=[0] * j, temperature=0.9)], row[None])[0] for j in range(4)]
    assert multi.tolist() == [int(t) for t in single]


def test_different_seeds_give_different_draws() -> None:
    s = Sampler(1000, 4, "cpu")
    reqs = [mk(str(i), slot=1, seed=1000 + i) for i in range(400)]
    tok = sample_tokens(s, reqs, torch.zeros(400, 1000))
    # 400 uniform draws over 1000 tokens: ~330 distinct expected; identical seeds would give 1.
    assert len(set(tok.tolist())) > 250
    # and successive positions of one seed vary as well
    tok = sample_tokens(s, [mk(seed=5)], torch.zeros(400, 1000), rows_per_req=400)
    assert len(set(tok.tolist())) > 250


# ---- filters ----------------------------------------------------------------------------------


def allowed_set(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> set[int]:
    """Independent reference: top-k, then top-p on the renormalised rest, then min-p."""
    x = logits.double() / temperature
    order = sorted(range(len(x)), key=lambda i: -float(x[i]))
    keep = order[:top_k] if top_k > 0 else order
    p = torch.softmax(x[keep], 0).tolist()
    cum, kept = 0.0, []
    for i, pi in zip(keep, p):
        kept.append(i)
        cum += pi
        if cum >= top_p:
            break
    pmax = float(torch.softmax(x, 0).max())
    full = torch.softmax(x, 0)
    return {i for i in kept if float(full[i]) >= min_p * pmax}


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p",
    [
        (1.0, 5, 1.0, 0.0),
        (1.0, -1, 0.6, 0.0),
        (0.7, 0, 1.0, 0.1),
        (1.3, 10, 0.8, 0.05),
        (1.0, 3, 0.999, 0.0),
        (2.0, 0, 0.3, 0.0),
    ],
)
def test_filters_never_leave_the_allowed_set(temperature: float, top_k: int, top_p: float, min_p: float) -> None:
    s = Sampler(V, 4, "cpu")
    row = fixed_logits(seed=4)
    allowed = allowed_set(row, temperature, top_k, top_p, min_p)
    req = mk(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=9)
    n = 2000
    sb = s.prepare([req], rows_per_req=n)
    logits = row.expand(n, V).clone()
    probs = s.processed_probs(logits, sb)
    support = set(torch.nonzero(probs[0] > 0).flatten().tolist())
    assert support == allowed
    assert torch.allclose(probs.sum(-1), torch.ones(n))
    tok = s.sample(logits, sb).tokens
    assert set(tok.tolist()) <= allowed
    assert len(set(tok.tolist())) > 1 or len(allowed) == 1


def test_filters_only_touch_their_rows() -> None:
    """Rows with different settings in one batch get the same probs as when sampled alone."""
    s = Sampler(V, 8, "cpu")
    reqs = [
        mk("a", 1, top_k=4),
        mk("b", 2),
        mk("c", 3, temperature=0.0),
        mk("d", 4, top_p=0.5),
        mk("e", 5, min_p=0.2, temperature=0.5),
    ]
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(5)) * 2
    batch = s.processed_probs(logits, s.prepare(reqs))
    for i, r in enumerate(reqs):
        alone = s.processed_probs(logits[i : i + 1], s.prepare([r]))
        torch.testing.assert_close(batch[i : i + 1], alone)


# ---- distribution --------------------------------------------------------------------------


@pytest.mark.parametrize("temperature,top_k", [(0.7, -1), (1.5, -1), (1.0, 4)])
def test_empirical_distribution_matches_softmax(temperature: float, top_k: int) -> None:
    v, n = 6, 20000
    s = Sampler(v, 4, "cpu")
    row = torch.tensor([1.0, 0.5, -0.3, 0.0, 1.2, -1.0])
    req = mk(temperature=temperature, top_k=top_k, seed=31337)
    tok = sample_tokens(s, [req], row.expand(n, v).clone(), rows_per_req=n)
    x = row.double() / temperature
    if top_k > 0:
        x[x < x.topk(top_k).values[-1]] = float("-inf")
    expected = torch.softmax(x, 0) * n
    observed = torch.bincount(tok, minlength=v).double()
    assert observed[expected == 0].sum() == 0
    m = expected > 0
    chi2 = float(((observed[m] - expected[m]) ** 2 / expected[m]).sum())
    # df <= 5; the chi-square 99.99% quantile for df=5 is 25.7 (a fair sampler fails 1 in 10^4).
    assert chi2 < 25.7, chi2


# ---- penalties ------------------------------------------------------------------------------

PEN_LOGITS = torch.tensor([0.5, 2.0, -1.0, 1.5, -0.5, 3.0, 0.0, -2.0])


def hand_penalised(
    x: torch.Tensor, prompt: list[int], out: list[int], rep: float, freq: float, pres: float
) -> torch.Tensor:
    x = x.clone()
    for t in range(len(x)):
        c = out.count(t)
        if t in prompt or c > 0:
            x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
        x[t] -= freq * c + pres * (c > 0)
    return x


@pytest.mark.parametrize(
    "rep,freq,pres", [(1.5, 0.0, 0.0), (1.0, 0.5, 0.0), (1.0, 0.0, 0.3), (1.3, 0.7, -0.4), (0.8, -1.0, 1.0)]
)
def test_penalties_match_hand_computation(rep: float, freq: float, pres: float) -> None:
    prompt, out = [1, 2, 2], [3, 3, 5, 7]
    s = Sampler(8, 4, "cpu")
    pen = mk(slot=2, prompt=prompt, out=out, repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres)
    plain = mk("b", slot=3, prompt=prompt, out=out)
    for r in (plain, pen):
        s.on_admit(r)
    sb = s.prepare([plain, pen])
    assert sb.any_penalties
    logits = PEN_LOGITS.expand(2, 8).clone()
    probs = s.processed_probs(logits, sb)
    expected = hand_penalised(PEN_LOGITS, prompt, out, rep, freq, pres)
    torch.testing.assert_close(probs[1], torch.softmax(expected, 0))
    torch.testing.assert_close(probs[0], torch.softmax(PEN_LOGITS, 0))
    # greedy with penalties takes the argmax of the penalised logits
    g = mk(
        "g",
        slot=2,
        prompt=prompt,
        out=out,
        temperature=0.0,
        repetition_penalty=rep,
        frequency_penalty=freq,
        presence_penalty=pres,
    )
    s.on_admit(g)
    assert sample_tokens(s, [g], PEN_LOGITS[None])[0] == expected.argmax()


def test_record_and_retraction_rebuild_state() -> None:
    kw = dict(repetition_penalty=1.4, frequency_penalty=0.3, presence_penalty=0.2)
    prompt = [0, 6]
    s = Sampler(8, 4, "cpu")
    a = mk("a", slot=1, prompt=prompt, **kw)
    b = mk("b", slot=2, prompt=[4])  # no penalties: record must skip it
    s.on_admit(a)
    s.on_admit(b)
    for step in ([3, 1], [5, 1], [3, 2]):
        s.record([a, b], torch.tensor(step))
        a.output_ids.append(step[0])
        b.output_ids.append(step[1])
    # multi-token record with per-row counts (padding -1 beyond the count is ignored)
    s.record([b, a], torch.tensor([[1, 1, 1], [7, 3, -1]]), counts=torch.tensor([3, 2]))
    a.output_ids += [7, 3]
    expected = torch.softmax(hand_penalised(PEN_LOGITS, prompt, a.output_ids, 1.4, 0.3, 0.2), 0)
    got = s.processed_probs(PEN_LOGITS[None], s.prepare([a]))[0]
    torch.testing.assert_close(got, expected)
    # retraction: the slot is reused by someone else, then `a` comes back in another slot
    c = mk("c", slot=1, prompt=[2, 2, 5], out=[5], **kw)
    s.on_admit(c)
    s.record([c], torch.tensor([2]))
    a.slot = 3
    s.on_admit(a)
    got = s.processed_probs(PEN_LOGITS[None], s.prepare([a]))[0]
    torch.testing.assert_close(got, expected)
    a.slot = 1  # back into slot 1: on_admit must wipe c's state there
    s.on_admit(a)
    torch.testing.assert_close(s.processed_probs(PEN_LOGITS[None], s.prepare([a]))[0], expected)


def test_penalty_buffers_are_lazy() -> None:
    s = Sampler(V, 4, "cpu")
    r = mk(temperature=0.8)
    s.on_admit(r)
    sb = s.prepare([r])
    assert not sb.any_penalties
    tok = s.sample(torch.randn(1, V), sb).tokens
    s.record([r], tok)
    assert s._counts is None and s._prompt_seen is None
    s.on_admit(mk("p", slot=2, presence_penalty=0.5))
    assert s._counts is not None and s._counts.shape == (5, V) and s._counts.dtype == torch.int32


# ---- logprobs -------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax() -> None:
    s = Sampler(V, 8, "cpu")
    reqs = [
        mk("a", 1, temperature=0.5, repetition_penalty=1.5, top_k=3, out=[1, 2]),
        mk("b", 2, temperature=0.0),
        mk("c", 3, top_p=0.4),
    ]
    for r in reqs:
        s.on_admit(r)
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    res = s.sample(logits, s.prepare(reqs), want_logprobs=True, top_logprobs=5)
    ref = torch.log_softmax(logits.float(), -1)
    assert res.logprobs is not None and res.logprobs.dtype == torch.float32
    torch.testing.assert_close(res.logprobs, ref.gather(1, res.tokens[:, None]).squeeze(1))
    assert res.top_ids is not None and res.top_values is not None
    assert res.top_ids.shape == (3, 5) and res.top_ids.dtype == torch.int64
    torch.testing.assert_close(res.top_values, ref.gather(1, res.top_ids))
    assert bool((res.top_values[:, :-1] >= res.top_values[:, 1:]).all())
    torch.testing.assert_close(res.top_values[:, 0], ref.max(-1).values)
    plain = s.sample(logits, s.prepare(reqs))
    assert plain.logprobs is None and plain.top_ids is None and plain.top_values is None
    assert torch.equal(plain.tokens, res.tokens)


# ---- min_new_tokens -------------------------------------------------------------------------

EOS, STOP = 7, 9


def _favouring(rows: int, *ids: int) -> torch.Tensor:
    """Logits where `ids` (in that order) are the most likely tokens of every row."""
    x = torch.randn(rows, V, generator=torch.Generator().manual_seed(3))
    for rank, t in enumerate(ids):
        x[:, t] = 20.0 - rank
    return x


def test_min_new_tokens_validated() -> None:
    from engine.core import InvalidRequest

    SamplingParams(max_new_tokens=4, min_new_tokens=4)
    for bad in (-1, 5):
        with pytest.raises(InvalidRequest, match="min_new_tokens"):
            SamplingParams(max_new_tokens=4, min_new_tokens=bad)


@pytest.mark.parametrize("kw", [dict(temperature=0.0), dict(temperature=0.8, top_p=0.9, seed=5)])
def test_min_new_tokens_bans_eos_and_stop_ids_until_reached(kw: dict) -> None:
    s = Sampler(V, 8, "cpu", eos_token_ids=[EOS])
    logits = _favouring(1, EOS, STOP, 11)
    for n_out, want in ((0, 11), (2, 11), (3, EOS)):  # min 3: outputs 1..3 may not be EOS/STOP
        r = mk(out=[4] * n_out, min_new_tokens=3, max_new_tokens=8, stop_token_ids=(STOP,), **kw)
        assert sample_tokens(s, [r], logits).item() == want, n_out
    # ignore_eos: EOS is an ordinary token, never banned; stop ids still are
    r = mk(min_new_tokens=3, max_new_tokens=8, stop_token_ids=(STOP,), ignore_eos=True, **kw)
    assert sample_tokens(s, [r], logits).item() == EOS
    r = mk(min_new_tokens=3, max_new_tokens=8, stop_token_ids=(STOP,), ignore_eos=True, **kw)
    assert sample_tokens(s, [r], _favouring(1, STOP, 11)).item() == 11
    # a neighbour without min_new_tokens in the same batch is untouched
    plain = mk("b", 2, **kw)
    toks = sample_tokens(s, [mk(min_new_tokens=2, max_new_tokens=8, **kw), plain], _favouring(2, EOS, 11))
    assert toks.tolist() == [11, EOS]


def test_min_new_tokens_is_per_row_in_a_verify_window() -> None:
    """Row j of a request with n outputs samples output number n + j + 1: only rows before
    min_new_tokens are banned, in the default layout and with explicit (tree) row positions."""
    s = Sampler(V, 8, "cpu", eos_token_ids=[EOS])
    ntok = 4
    a = mk("a", 1, prompt=[1, 2, 3], out=[5], temperature=0.0, min_new_tokens=3, max_new_tokens=9)
    b = mk("b", 2, prompt=[1, 2], out=[5, 6], temperature=0.0, max_new_tokens=9)
    logits = _favouring(2 * ntok, EOS, 11)
    sb = s.prepare([a, b], rows_per_req=ntok)
    got = s.sample(logits, sb).tokens.view(2, ntok).tolist()
    assert got == [[11, 11, EOS, EOS], [EOS] * ntok]  # a: outputs 2, 3 banned; 4, 5 free
    probs = s.processed_probs(logits, sb).view(2, ntok, V)
    assert probs[0, :2, EOS].sum() == 0 and probs[0, 2:, EOS].min() == 1
    # a tree: rows at depths 0, 1, 1, 2 sample positions 4, 5, 5, 6 (prompt 3: outputs 2, 3, 3, 4)
    rows_at = torch.tensor([4, 5, 5, 6, 3, 4, 4, 5])
    sb = s.prepare([a, b], rows_per_req=ntok, row_positions=rows_at)
    assert s.sample(logits, sb).tokens.view(2, ntok).tolist() == [[11, 11, 11, EOS], [EOS] * ntok]
    # sampled rows obey it too
    hot = mk("a", 1, prompt=[1, 2, 3], out=[5], temperature=1.0, min_new_tokens=3, max_new_tokens=9)
    probs = s.processed_probs(logits, s.prepare([hot, b], rows_per_req=ntok)).view(2, ntok, V)
    assert probs[0, :2, EOS].sum() == 0 and probs[0, 2:, EOS].min() > 0


def test_logit_bias_shifts_each_row_of_its_request() -> None:
    s = Sampler(V, 8, "cpu")
    logits = _favouring(6, 11, 12)
    biased = mk("a", 1, temperature=0.0, logit_bias=((12, 5.0), (3, -100.0), (V + 7, 50.0)))  # unknown id ignored
    plain = mk("b", 2, temperature=0.0)
    assert sample_tokens(s, [biased, plain], logits, rows_per_req=3).tolist() == [12] * 3 + [11] * 3
    sb = s.prepare([biased, plain], rows_per_req=3)
    probs = s.processed_probs(
        logits, s.prepare([mk("a", 1, temperature=1.0, logit_bias=((3, -100.0),)), plain], rows_per_req=3)
    )
    assert float(probs[:3, 3].max()) < 1e-30
    assert sb.bias_rows is not None and sb.bias_rows.tolist() == [0, 0, 1, 1, 2, 2]
    from engine.core import InvalidRequest

    with pytest.raises(InvalidRequest, match="logit_bias"):
        SamplingParams(logit_bias=((1, 101.0),))


# ---- device ---------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu() -> None:
    seeds = torch.randint(0, 2**62, (64,), generator=torch.Generator().manual_seed(7))
    pos = torch.arange(64)
    assert torch.equal(uniform_noise(seeds, pos, 5000), uniform_noise(seeds.cuda(), pos.cuda(), 5000).cpu())
    reqs = [
        mk(
            str(i),
            slot=i + 1,
            seed=i,
            temperature=0.9,
            top_p=0.9,
            top_k=20 * (i % 2),
            frequency_penalty=0.2 * (i % 3),
            out=[i % V],
        )
        for i in range(8)
    ]
    logits = torch.randn(8 * 250, V, generator=torch.Generator().manual_seed(8))
    toks = []
    for dev in ("cpu", "cuda"):
        s = Sampler(V, 8, dev)
        for r in reqs:
            s.on_admit(r)
        toks.append(s.sample(logits.to(dev), s.prepare(reqs, rows_per_req=250)).tokens.cpu())
    # float rounding may differ in the last bit between devices; a flip needs a near-tie.
    assert (toks[0] == toks[1]).float().mean() > 0.995
