"""Shared building blocks with hand-checkable expectations: Sinkhorn, mHC, clipped SwiGLU, RoPE/YaRN, sink attention."""
import math

import torch

from dsflash.model_def import layers as L


def test_sinkhorn_is_doubly_stochastic():
    """Columns sum to 1 within eps after the last (column) step; rows converge: within 1e-4 after the model's 20
    iterations for logits of unit scale, and to eps given enough iterations."""
    logits = torch.randn(1000, 4, 4, generator=torch.Generator().manual_seed(0))
    c = L.sinkhorn(logits, iters=20, eps=1e-6)
    assert (c > 0).all()
    assert (c.sum(-2) - 1).abs().max() < 2e-6
    assert (c.sum(-1) - 1).abs().max() < 1e-4
    c = L.sinkhorn(logits.double(), iters=300, eps=1e-6)
    assert (c.sum(-1) - 1).abs().max() < 2e-6 and (c.sum(-2) - 1).abs().max() < 2e-6


def test_sinkhorn_one_iteration_by_hand():
    logits = torch.zeros(1, 2, 2)
    logits[0, 0, 0] = math.log(3.0)  # softmax rows: [3/4, 1/4], [1/2, 1/2]
    c = L.sinkhorn(logits, iters=1, eps=0.0)
    col = torch.tensor([0.75 + 0.5, 0.25 + 0.5])
    exp = torch.tensor([[0.75, 0.25], [0.5, 0.5]]) / col
    assert torch.allclose(c[0], exp, atol=1e-7)


def test_hc_mix_formulas():
    n, d = 4, 8
    x = torch.randn(3, n * d)
    fn, base, scale = torch.randn(24, n * d) * 0.1, torch.randn(24) * 0.1, torch.tensor([0.5, 1.5, 2.0])
    pre, post, comb = L.hc_mix(x, fn, base, scale, n, 20, 1e-6, 1e-6)
    m = (x @ fn.t()) / torch.sqrt(x.square().mean(-1, keepdim=True) + 1e-6)
    assert torch.allclose(pre, torch.sigmoid(m[:, :4] * 0.5 + base[:4]) + 1e-6, atol=1e-6)
    assert torch.allclose(post, 2 * torch.sigmoid(m[:, 4:8] * 1.5 + base[4:8]), atol=1e-6)
    assert torch.allclose(comb, L.sinkhorn((m[:, 8:] * 2.0 + base[8:]).view(3, 4, 4), 20, 1e-6), atol=1e-6)


def test_hc_collapse_and_expand_by_hand():
    X = torch.arange(8.0).view(1, 4, 2)          # streams j = 0..3, D = 2
    pre = torch.tensor([[1.0, 0.0, 0.0, 2.0]])
    assert torch.equal(L.hc_collapse(X, pre), torch.tensor([[0 + 2 * 6.0, 1 + 2 * 7.0]]))
    comb = torch.eye(4).flip(0).unsqueeze(0)     # stream j goes to k = 3 - j
    post = torch.tensor([[1.0, 0.0, 0.0, 0.5]])
    fx = torch.tensor([[10.0, 20.0]])
    out = L.hc_expand(X, fx, post, comb)
    assert torch.equal(out[0, 0], X[0, 3] + fx[0]) and torch.equal(out[0, 3], X[0, 0] + 0.5 * fx[0])


def test_clipped_swiglu():
    g = torch.tensor([-1.0, 2.0, 15.0, 15.0])
    u = torch.tensor([3.0, -20.0, 12.0, -5.0])
    out = L.clipped_swiglu(g, u, 10.0)
    exp = torch.stack([torch.nn.functional.silu(torch.tensor(v)) * w for v, w in
                       [(-1.0, 3.0), (2.0, -10.0), (10.0, 10.0), (10.0, -5.0)]])
    assert torch.allclose(out, exp)


def test_rope_rotates_interleaved_pairs_of_the_last_dims_and_inverts():
    x = torch.randn(1, 3, 2, 16)                 # [B, S, H, d]; rope on the last 8 channels
    inv = L.rope_inv_freq(8, 10000.0)
    pos = torch.tensor([[0, 5, 9]])
    y = L.apply_rope(x, pos, inv)
    assert torch.equal(y[..., :8], x[..., :8]) and torch.equal(y[:, 0], x[:, 0])
    a, b = x[0, 1, 0, 8], x[0, 1, 0, 9]          # first pair, frequency 1
    assert torch.allclose(y[0, 1, 0, 8:10], torch.stack([a * math.cos(5) - b * math.sin(5),
                                                         a * math.sin(5) + b * math.cos(5)]), atol=1e-6)
    assert torch.allclose(L.apply_rope(y, pos, inv, inverse=True), x, atol=1e-6)


def test_yarn_interpolation_range():
    """V4 YaRN (factor 16, original 65536, beta 32/1, base 160000, 64 dims): pairs below 15 keep their frequency,
    pairs from 25 on are divided by 16, with a linear ramp between; no mscale anywhere."""
    yarn = {"factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1}
    plain, scaled = L.rope_inv_freq(64, 160000.0), L.rope_inv_freq(64, 160000.0, yarn)
    assert torch.allclose(scaled[:15], plain[:15]) and torch.allclose(scaled[25:], plain[25:] / 16)
    mid = (scaled[20] / plain[20]).item()
    assert 1 / 16 < mid < 1


def test_sink_attention_sink_only_in_denominator():
    q = torch.zeros(1, 1, 1, 4)
    kv = torch.tensor([[[1.0, 0, 0, 0], [0, 2.0, 0, 0]]])
    allowed = torch.tensor([[[True, True]]])
    out = L.sink_attention(q, kv, allowed, torch.tensor([0.0]), 1.0)  # equal logits 0: weights 1/3 each, sink 1/3
    assert torch.allclose(out[0, 0, 0], torch.tensor([1 / 3, 2 / 3, 0, 0]))
    idx = torch.tensor([[[1, -1, 0]]])
    assert torch.allclose(L.gather_sink_attention(q, kv, idx, torch.tensor([0.0]), 1.0), out)
