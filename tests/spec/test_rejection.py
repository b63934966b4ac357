"""Verification math: greedy acceptance on hand-built chains/trees, and sampled verification
reproducing the target distribution exactly (chi-square) whatever the draft proposes."""

from __future__ import annotations

import torch

from spec.tree import ancestor_mask, chain_tree, tree_from_candidates
from spec.rejection import verify_greedy, verify_sampled

# chi-square critical value for df=5 at p=0.999 (so a correct sampler fails 1 in 1000 runs;
# seeds below are fixed, so the test is deterministic)
CHI2_DF5_999 = 20.515


def test_greedy_chain_accepts_the_matching_prefix():
    tree = chain_tree(torch.tensor([[9, 1, 2, 3], [9, 1, 2, 3], [9, 7, 2, 3]]))
    # target choice after each row: row0 -> 1, row1 -> 2, row2 -> 5 (mismatch with draft 3)
    target = torch.tensor([[1, 2, 5, 6], [1, 2, 3, 4], [1, 2, 3, 4]])
    r = verify_greedy(tree, target)
    assert r.accept_lens.tolist() == [3, 4, 1]
    assert r.emitted.tolist() == [[1, 2, 5, -1], [1, 2, 3, 4], [1, -1, -1, -1]]
    assert r.bonus.tolist() == [5, 4, 1]


def _small_tree():
    # root(9) -> a(1, p=.6), b(2, p=.3); a -> c(3, .6*.5), d(4, .6*.4); b -> e(5, .3*.9)
    tokens = torch.tensor([[1, 2, 3, 4, 5]])
    scores = torch.tensor([[0.6, 0.3, 0.30, 0.24, 0.27]])
    parents = torch.tensor([[-1, -1, 0, 0, 1]])
    depth = torch.tensor([[1, 1, 2, 2, 2]])
    return tree_from_candidates(torch.tensor([9]), tokens, scores, parents, depth, ntok=5, depth_bound=2, branching=2)


def test_tree_from_candidates_keeps_best_nodes_and_their_parents():
    tree = _small_tree()  # keeps a, b, c, e (d is the worst); parents before children
    assert tree.tokens.tolist() == [[9, 1, 2, 3, 5]]
    assert tree.parents.tolist() == [[-1, 0, 0, 1, 2]]
    assert tree.depth.tolist() == [[0, 1, 1, 2, 2]]
    assert tree.first_child[0, 0].item() == 1 and tree.next_sibling[0, 1].item() == 2
    mask = ancestor_mask(tree.parents)[0]
    assert mask[3].tolist() == [True, True, False, True, False]  # c sees root, a, itself
    assert mask[4].tolist() == [True, False, True, False, True]  # e sees root, b, itself


def test_greedy_tree_follows_the_matching_branch():
    tree = _small_tree()
    # target: after root -> 2 (branch b), after b -> 5 (node e), after e -> 7
    target = torch.tensor([[2, 0, 5, 0, 7]])
    r = verify_greedy(tree, target)
    assert r.accept_lens.tolist() == [3]
    assert r.path.tolist() == [[0, 2, 4]]
    assert r.emitted.tolist() == [[2, 5, 7]]


def _first_token_counts(tree, p_rows, n, vocab):
    bs, ntok = tree.tokens.shape
    rep = lambda t: t.repeat(n, *([1] * (t.dim() - 1)))  # noqa: E731
    big = type(tree)(
        rep(tree.tokens),
        rep(tree.parents),
        rep(tree.depth),
        rep(tree.first_child),
        rep(tree.next_sibling),
        tree.is_chain,
        tree.depth_bound,
        tree.branching,
    )
    probs = p_rows.unsqueeze(0).expand(n, ntok, vocab)
    seeds = torch.arange(n, dtype=torch.int64) * 7919 + 11
    r = verify_sampled(big, probs, seeds, torch.full((n,), 5, dtype=torch.int64))
    first = r.emitted[:, 0]
    return torch.bincount(first, minlength=vocab).double(), r


def _chi2(counts, p):
    expected = p.double() * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "emitted a token the target gives probability 0"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_sampled_chain_matches_target_distribution_with_a_disagreeing_draft():
    vocab = 6
    p = torch.tensor([0.05, 0.4, 0.25, 0.15, 0.1, 0.05])
    # the draft proposes the target's least likely tokens
    tree = chain_tree(torch.tensor([[0, 5, 0, 5]]))
    counts, r = _first_token_counts(tree, p.expand(4, vocab), 40000, vocab)
    assert _chi2(counts, p) < CHI2_DF5_999
    assert 0 < (r.accept_lens > 1).float().mean() < 0.2  # drafts are accepted, rarely


def test_sampled_tree_matches_target_distribution():
    vocab = 6
    p = torch.tensor([0.3, 0.02, 0.08, 0.2, 0.25, 0.15])
    tree = tree_from_candidates(
        torch.tensor([0]),
        torch.tensor([[1, 2, 3, 1, 2]]),
        torch.tensor([[0.5, 0.3, 0.2, 0.25, 0.1]]),
        torch.tensor([[-1, -1, -1, 0, 0]]),
        torch.tensor([[1, 1, 1, 2, 2]]),
        6,
    )
    counts, _ = _first_token_counts(tree, p.expand(6, vocab), 40000, vocab)
    assert _chi2(counts, p) < CHI2_DF5_999


def test_sampled_with_one_hot_rows_is_greedy():
    tree = _small_tree()
    target = torch.tensor([[2, 0, 5, 0, 7]])
    one_hot = torch.nn.functional.one_hot(target, 10).float()
    r = verify_sampled(tree, one_hot, torch.tensor([3]), torch.tensor([4]))
    assert r.emitted.tolist() == verify_greedy(tree, target).emitted.tolist()


def test_second_token_is_distributed_as_the_target_given_the_first():
    # condition on an accepted first draft: the next token must follow the row-1 distribution
    vocab = 6
    p0 = torch.tensor([0.0, 0.9, 0.02, 0.03, 0.03, 0.02])  # first draft (1) usually accepted
    p1 = torch.tensor([0.1, 0.1, 0.3, 0.1, 0.2, 0.2])
    tree = chain_tree(torch.tensor([[0, 1, 4]]))
    n = 40000
    _, r = _first_token_counts(tree, torch.stack([p0, p1, p1]), n, vocab)
    took = r.emitted[:, 0] == 1
    second = torch.bincount(r.emitted[took, 1], minlength=vocab).double()
    assert _chi2(second, p1) < CHI2_DF5_999


def test_chain_fast_path_equals_the_walk():
    from spec.rejection import _walk

    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        ntok = int(torch.randint(2, 7, (1,), generator=gen))
        tokens = torch.randint(0, 3, (4, ntok), generator=gen)  # a tiny alphabet: every match length
        target = torch.randint(0, 3, (4, ntok), generator=gen)
        tree = chain_tree(tokens)
        fast = verify_greedy(tree, target)
        walk = _walk(tree, lambda cur: torch.gather(target, 1, cur.unsqueeze(1)).squeeze(1), None, None, None)
        for field in ("accept_lens", "path", "emitted", "bonus"):
            assert torch.equal(getattr(fast, field), getattr(walk, field)), field


def test_host_output_of_a_one_token_iteration_equals_the_general_form():
    """A 0-step iteration copies only its tokens: the host half fills in accept lengths of 1."""
    from engine.spec_stats import SpecStats
    from spec.verify_step import host_output

    emitted = torch.tensor([[7], [3], [11]])
    general, short = SpecStats(max_drafts=3), SpecStats(max_drafts=3)
    a = host_output(general, {"accept_lens": torch.ones(3, dtype=torch.int64), "emitted": emitted}, 0)
    b = host_output(short, {"emitted": emitted}, 0)
    assert (a.tokens, a.accepted_drafts) == (b.tokens, b.accepted_drafts) == ([[7], [3], [11]], [0, 0, 0])
    assert general == short


class _AllowEveryStep:
    """A matcher of the language allowed*: the same tokens may come at every step."""

    def __init__(self, allowed: set[int], vocab: int) -> None:
        self.allowed, self.vocab, self.taken = allowed, vocab, 0

    def advance(self, tokens):
        if any(t not in self.allowed for t in tokens):
            return False
        self.taken += len(tokens)
        return True

    def rollback(self, k):
        self.taken -= k

    def validate(self, tokens):
        n = 0
        while n < len(tokens) and tokens[n] in self.allowed:
            n += 1
        return n

    def fill_mask(self, words):
        words.zero_()
        for t in self.allowed:
            words[t // 32] |= 1 << t

    def is_finished(self):
        return False

    def is_accepting(self):
        return True

    def forced_tokens(self):
        return []


def test_sampled_verify_keeps_the_constrained_target_distribution():
    """Masks at every window row (the drafts walked through the matcher) and the sampler's
    processing, then rejection sampling: the first token follows the target renormalised over
    what the grammar allows, whatever the draft proposes (here a forbidden token first)."""
    from engine.core import Req, SamplingParams
    from engine.sampler import Sampler
    from spec.verify_step import grammar_rows

    vocab, n = 6, 40000
    allowed = {1, 3, 4}
    logits = torch.log(torch.tensor([0.3, 0.02, 0.08, 0.2, 0.25, 0.15]))
    sampler = Sampler(vocab, 1, "cpu")
    req = Req("r", [0], SamplingParams(temperature=1.0, max_new_tokens=8))
    req.grammar = _AllowEveryStep(allowed, vocab)
    tree = chain_tree(torch.tensor([[0, 5, 3, 1]]))  # draft 5 is forbidden: nothing under it counts
    masks = grammar_rows(sampler, [req], tree)
    assert masks is not None and masks.rows.tolist() == [0]  # rows under the refused draft get none
    sb = sampler.prepare([req], rows_per_req=4, grammar=masks)
    p_rows = sampler.processed_probs(logits.expand(4, vocab).clone(), sb)
    counts, r = _first_token_counts(tree, p_rows, n, vocab)
    want = torch.zeros(vocab)
    for t in allowed:
        want[t] = logits.exp()[t]
    assert _chi2(counts, want / want.sum()) < CHI2_DF5_999
    assert (r.accept_lens == 1).all()  # the forbidden draft is never accepted
    # an allowed draft is accepted exactly as often as the constrained target picks it
    tree = chain_tree(torch.tensor([[0, 4, 3, 1]]))
    masks = grammar_rows(sampler, [req], tree)
    assert masks is not None and masks.rows.tolist() == [0, 1, 2, 3]
    sb = sampler.prepare([req], rows_per_req=4, grammar=masks)
    counts, r = _first_token_counts(tree, sampler.processed_probs(logits.expand(4, vocab).clone(), sb), n, vocab)
    assert _chi2(counts, want / want.sum()) < CHI2_DF5_999
    assert req.grammar.taken == 0  # the walk rolled back
