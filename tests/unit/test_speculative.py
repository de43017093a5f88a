"""Accept/reject maths of speculative decoding (serve/speculative.py) and its AL/DAR accounting.

Distribution test: a context-free target (position j's distribution p_j does not depend on the prefix) on V = 8
tokens with random p_j and draft distributions q_j; 200 000 independent rows run `rejection_accept` on K = 3 drafts
drawn from q. Every token a row emits at output position t must then be distributed as p_t (whatever happened
before). A chi-square goodness-of-fit test on each position must pass at significance 1e-3 (p-value > 1e-3, fixed
seed), and the same test must reject (p-value < 1e-12) deliberately broken rules: accepting every draft, and
resampling from p instead of the residual norm(max(p − q, 0)) after a rejection.
"""
from __future__ import annotations

import pytest
import torch

from dsflash.serve.speculative import (SpecStats, greedy_accept, rejection_accept, simulated_accept,
                                       target_probs_from_logits)

V, K, N = 8, 3, 200_000
ALPHA = 1e-3


def chi2_pvalue(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of token samples to probs [V] (p-value of Pearson's statistic, V − 1 degrees of freedom)."""
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    stat = ((counts - expected) ** 2 / expected).sum()
    dof = torch.tensor((probs.numel() - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, stat / 2))   # chi-square survival function


def emitted_at(t: int, drafts: torch.Tensor, accepted: torch.Tensor, nxt: torch.Tensor) -> torch.Tensor:
    """Tokens rows emit at output position t (rows that reach it): the accepted draft, or the closing token."""
    reach = accepted >= t
    tok = torch.where(accepted > t, drafts[:, min(t, drafts.shape[1] - 1)], nxt)
    return tok[reach]


@pytest.fixture(scope="module")
def setup():
    g = torch.Generator().manual_seed(1234)
    p = torch.softmax(torch.randn(K + 1, V, generator=g, dtype=torch.float64) * 1.5, -1)   # target per position
    q = torch.softmax(torch.randn(K, V, generator=g, dtype=torch.float64) * 1.5, -1)       # draft per position
    drafts = torch.stack([torch.multinomial(q[j], N, replacement=True, generator=g) for j in range(K)], 1)
    return p, q, drafts, g


def test_rejection_sampling_preserves_the_target_distribution(setup):
    p, q, drafts, g = setup
    acc, nxt = rejection_accept(drafts, q.expand(N, K, V), p.expand(N, K + 1, V), g)
    assert acc.min() >= 0 and acc.max() == K
    for t in range(K + 1):
        tok = emitted_at(t, drafts, acc, nxt)
        assert tok.numel() > 10_000
        assert chi2_pvalue(tok, p[t]) > ALPHA, t
    # the acceptance rate of position 0 is Σ min(p, q) (Leviathan et al.)
    rate = (acc >= 1).double().mean()
    assert abs(rate - torch.minimum(p[0], q[0]).sum()) < 5e-3


def test_broken_rules_fail_the_test(setup):
    p, q, drafts, g = setup
    # accept always: position 0 emits draft tokens, distributed as q
    assert chi2_pvalue(drafts[:, 0], p[0]) < 1e-12
    # correct accept test, but resample from p (not the residual) after a rejection
    u = torch.rand(N, generator=g, dtype=torch.float64)
    d = drafts[:, 0]
    ok = u * q[0, d] < p[0, d]
    bad = torch.where(ok, d, torch.multinomial(p[0], N, replacement=True, generator=g))
    assert chi2_pvalue(bad, p[0]) < 1e-12


def test_deterministic_drafter_one_hot_q(setup):
    """draft_probs=None: q is one-hot at the proposal (accept with p(d), resample from p without d)."""
    p, _, _, g = setup
    drafts = torch.tensor([[2, 5, 7]]).expand(N, K)       # a greedy drafter proposes the same tokens every time
    acc, nxt = rejection_accept(drafts, None, p.expand(N, K + 1, V), g)
    assert abs((acc >= 1).double().mean() - p[0, 2]) < 5e-3
    for t in range(K + 1):
        assert chi2_pvalue(emitted_at(t, drafts, acc, nxt), p[t]) > ALPHA, t


def test_per_row_draft_counts(setup):
    p, q, drafts, g = setup
    n = torch.arange(N) % (K + 1)                          # rows drafted 0..K tokens
    acc, nxt = rejection_accept(drafts, q.expand(N, K, V), p.expand(N, K + 1, V), g, num_draft=n)
    assert bool((acc <= n).all())
    none = n == 0                                          # nothing drafted: a plain draw from p_0
    assert bool((acc[none] == 0).all())
    assert chi2_pvalue(nxt[none], p[0]) > ALPHA
    full = n == K
    assert chi2_pvalue(emitted_at(K, drafts[full], acc[full], nxt[full]), p[K]) > ALPHA
    with pytest.raises(ValueError, match="num_draft"):
        rejection_accept(drafts[:2], None, p.expand(2, K + 1, V), g, num_draft=torch.tensor([0, K + 1]))


def test_identical_draft_and_target_accept_everything(setup):
    p, _, _, g = setup
    d = torch.stack([torch.multinomial(p[j], 1000, replacement=True, generator=g) for j in range(K)], 1)
    acc, _ = rejection_accept(d, p[:K].expand(1000, K, V), p.expand(1000, K + 1, V), g)
    assert bool((acc == K).all())


def test_greedy_accept():
    logits = torch.full((4, K + 1, V), -1.0)
    best = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [5, 2, 3, 4], [1, 2, 6, 7]])
    logits.scatter_(2, best[..., None], 1.0)
    drafts = torch.tensor([[1, 2, 3], [1, 0, 3], [1, 2, 3], [1, 2, 6]])
    acc, nxt = greedy_accept(drafts, logits)
    assert acc.tolist() == [3, 1, 0, 3]
    assert nxt.tolist() == [4, 2, 5, 7]          # the target's token after the accepted prefix (bonus when all kept)
    acc, nxt = greedy_accept(drafts, logits, num_draft=torch.tensor([2, 3, 3, 0]))
    assert acc.tolist() == [2, 1, 0, 0] and nxt.tolist() == [3, 2, 5, 1]
    acc, nxt = greedy_accept(drafts[:, :0], logits[:, :1])       # K = 0: a plain decode step
    assert acc.tolist() == [0] * 4 and nxt.tolist() == [1, 1, 5, 1]
    with pytest.raises(ValueError, match="K\\+1"):
        greedy_accept(drafts, logits[:, :K])


def test_greedy_is_the_zero_temperature_limit(setup):
    """At a vanishing temperature rejection sampling makes greedy's decisions."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(500, K + 1, V, generator=g, dtype=torch.float64)
    drafts = torch.where(torch.rand(500, K, generator=g) < 0.7, logits[:, :K].argmax(-1),
                         torch.randint(0, V, (500, K), generator=g))
    want = greedy_accept(drafts, logits)
    got = rejection_accept(drafts, None, target_probs_from_logits(logits, 1e-6), g)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])


def test_simulated_accept_mean_and_cap():
    g = torch.Generator().manual_seed(0)
    for L in (1.0, 1.7, 2.5, 3.0, 4.2):
        acc = simulated_accept(L, torch.full((100_000,), 5), g)
        assert abs((acc.double() + 1).mean() - L) < 0.01 * L
        assert set(acc.unique().tolist()) <= {int(L - 1), int(L - 1) + 1}
    capped = simulated_accept(4.5, torch.tensor([0, 1, 2, 5]), g)
    assert bool((capped <= torch.tensor([0, 1, 2, 5])).all()) and capped[:3].tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match=">= 1"):
        simulated_accept(0.5, torch.tensor([3]), g)


def test_spec_stats():
    s = SpecStats()
    assert s.mean_al == 0.0 and s.dar == 0.0 and s.histogram() == {}
    for acc, drafted in ((0, 3), (3, 3), (1, 3), (3, 3), (0, 0)):
        s.observe(acc, drafted)
    assert s.histogram() == {1: 2, 2: 1, 4: 2}
    assert s.mean_al == pytest.approx((1 + 4 + 2 + 4 + 1) / 5)       # emitted tokens per verify step
    assert s.dar == pytest.approx(7 / 12)
    t = s.merge(SpecStats()).merge(s)
    assert t.steps == 10 and t.histogram() == {1: 4, 2: 2, 4: 4} and t.dar == s.dar
    d = s.to_dict()
    assert d["acceptance_length"] == s.mean_al and d["acceptance_length_histogram"] == {"1": 2, "2": 1, "4": 2}
    with pytest.raises(ValueError):
        s.observe(4, 3)
