"""CPU checks of the MoE and WO-A references (plugins/refs.py) against the model's layers, and of their registry ops.

`moe_ref` must equal `model_def.v41.MoE` in deploy numerics (fp32 model) and `wo_a_ref` the attention's inverse
RoPE + `GroupedLinear`; no Triton, no GPU.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dsflash.model_def import layers, quant
from dsflash.model_def.csa2 import GroupedLinear
from dsflash.model_def.v41 import Gate, MoE
from dsflash.plugins import refs


def _mx(e: int, n: int, k: int, lo: int = 118, hi: int = 124, gen=None):
    """Random MXFP4 experts: int8 [E, N, K/2] (every code), e8m0 [E, N, K/32] scales 2^(lo-127)..2^(hi-127)."""
    q = torch.randint(-128, 128, (e, n, k // 2), dtype=torch.int8, generator=gen)
    s = torch.randint(lo, hi + 1, (e, n, k // 32), dtype=torch.uint8, generator=gen).view(refs.E8M0)
    return q, s


def _args(dim: int, inter: int, temp: float = 1.0):
    return SimpleNamespace(hidden_size=dim, moe_intermediate_size=inter, swiglu_limit=10.0, gate_temp=temp,
                           routed_scaling_factor=1.5, norm_topk_prob=True)


def test_mxfp4_dequant_ref_equals_model(seed):
    q, s = _mx(2, 8, 64)
    for e in range(2):
        assert torch.equal(refs.mxfp4_dequant_ref(q[e], s[e]), quant.dequant_mxfp4(q[e], s[e]))
    assert torch.equal(refs.mxfp4_dequant_ref(q, s)[1], quant.dequant_mxfp4(q[1], s[1]))


@pytest.mark.parametrize("temp", [1.0, 0.7])
def test_router_ref_equals_gate(seed, temp):
    t, d, e, k = 7, 64, 16, 4
    gate = Gate(_args(d, 32, temp), e, k, torch.float32)
    gate.weight.data.copy_(torch.randn(e, d).to(torch.bfloat16).float())
    gate.bias.data.copy_(torch.randn(e) * 0.3)
    x = torch.randn(t, d).to(torch.bfloat16)
    with torch.no_grad():
        w_model, idx_model = gate(x.float())
    w, idx = refs.router_ref(x, gate.weight.to(torch.bfloat16), gate.bias, k, 1.5, temp)
    assert torch.equal(idx, idx_model)
    assert torch.equal(w, w_model)


def _moe_module(d: int, inter: int, e: int, k: int):
    m = MoE(_args(d, inter), e, k, layers.Numerics("deploy"), None, layers.LocalComm(), torch.float32)
    w1q, w1s = _mx(e, inter, d)
    w3q, w3s = _mx(e, inter, d)
    w2q, w2s = _mx(e, d, inter)
    with torch.no_grad():
        m.gate.weight.copy_((torch.randn(e, d) * 0.2).to(torch.bfloat16).float())
        m.gate.bias.copy_(torch.randn(e) * 0.1)
        for i in range(e):
            ex = m.experts[str(i)]
            ex.w1.weight.copy_(quant.dequant_mxfp4(w1q[i], w1s[i]))
            ex.w3.weight.copy_(quant.dequant_mxfp4(w3q[i], w3s[i]))
            ex.w2.weight.copy_(quant.dequant_mxfp4(w2q[i], w2s[i]))
        sh = [refs.quant_weight_fp8_ref(torch.randn(*shape) * 0.05) for shape in ((inter, d), (inter, d), (d, inter))]
        se = m.shared_experts
        for lin, (q, s) in zip((se.w1, se.w3, se.w2), sh):
            lin.weight.copy_(refs.dequant_weight_ref(q, s))
    return m, (w1q, w1s, w3q, w3s, w2q, w2s), sh


@torch.no_grad()
def test_moe_ref_equals_model_moe(seed):
    t, d, inter, e, k = 9, 64, 96, 8, 3
    m, (w1q, w1s, w3q, w3s, w2q, w2s), sh = _moe_module(d, inter, e, k)
    x = (torch.randn(t, d) * 2).to(torch.bfloat16)
    with torch.no_grad():
        want = m(x.float())
    shared = refs.shared_expert_ref(x, *sh[0], *sh[1], *sh[2], 10.0)
    got = refs.moe_ref(x, m.gate.weight.to(torch.bfloat16), m.gate.bias, k, 1.5, w1q, w1s, w3q, w3s, w2q, w2s, 10.0,
                       shared=shared)
    assert refs.rel_err(got, want) < 1e-6
    # the routed part alone, from the model's own routing
    with torch.no_grad():
        w, idx = m.gate(x.float())
    routed = refs.moe_experts_ref(x, w, idx, w1q, w1s, w3q, w3s, w2q, w2s, 10.0)
    assert refs.rel_err(routed + shared, want) < 1e-6


def test_moe_ref_expert_parallel_blocks_sum_to_the_whole(seed):
    """EP: each rank's block of experts with the routing made local to it; the blocks' outputs sum to all experts'
    (the TP all-reduce of the ranks), ids of another rank's experts contribute nothing."""
    t, d, inter, e, k, ep = 7, 64, 64, 8, 3, 4
    gw = (torch.randn(e, d) * 0.3).to(torch.bfloat16)
    bias = torch.randn(e) * 0.1
    x = (torch.randn(t, d) * 2).to(torch.bfloat16)
    w1q, w1s = _mx(e, inter, d)
    w3q, w3s = _mx(e, inter, d)
    w2q, w2s = _mx(e, d, inter)
    whole = refs.moe_ref(x, gw, bias, k, 1.5, w1q, w1s, w3q, w3s, w2q, w2s, 10.0)
    n = e // ep
    parts = [refs.moe_ref(x, gw, bias, k, 1.5, *(a[r * n:(r + 1) * n] for a in (w1q, w1s, w3q, w3s, w2q, w2s)), 10.0,
                          expert_start=r * n) for r in range(ep)]
    assert refs.rel_err(sum(parts), whole) < 1e-6 and all(p.abs().sum() > 0 for p in parts)
    ids = torch.tensor([[0, 2, 5], [7, 1, 3]])
    assert refs.local_expert_ids(ids, 2, 2).tolist() == [[2, 0, 2], [2, 2, 1]]


def test_moe_ref_padding_contributes_nothing(seed):
    """A TP8-style padded intermediate (288 -> 320 here 64 -> 96): zero rows/columns past `inter` change nothing."""
    t, d, inter, pad, e, k = 5, 64, 64, 96, 4, 2
    w1q, w1s = _mx(e, inter, d)
    w3q, w3s = _mx(e, inter, d)
    w2q, w2s = _mx(e, d, inter)

    def padw(q, s, rows):
        qp = torch.zeros(e, rows, q.shape[2], dtype=q.dtype)
        sp = torch.full((e, rows, s.shape[2]), 127, dtype=torch.uint8)
        qp[:, :q.shape[1]] = q
        sp[:, :s.shape[1]] = s.view(torch.uint8)
        return qp, sp.view(refs.E8M0)
    w2qp = torch.zeros(e, d, pad // 2, dtype=torch.int8)
    w2sp = torch.full((e, d, pad // 32), 127, dtype=torch.uint8)
    w2qp[..., :inter // 2] = w2q
    w2sp[..., :inter // 32] = w2s.view(torch.uint8)
    x = torch.randn(t, d).to(torch.bfloat16)
    w = torch.rand(t, k)
    idx = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    ref = refs.moe_experts_ref(x, w, idx, w1q, w1s, w3q, w3s, w2q, w2s, 10.0)
    got = refs.moe_experts_ref(x, w, idx, *padw(w1q, w1s, pad), *padw(w3q, w3s, pad), w2qp, w2sp.view(refs.E8M0),
                               10.0, inter=inter)
    assert torch.equal(got, ref)


@torch.no_grad()
def test_inverse_rope_and_wo_a_ref_equal_model(seed):
    t, h, d, g, r, rd = 3, 8, 64, 2, 16, 16
    inv = layers.rope_inv_freq(rd, 10000.0)
    pos = torch.tensor([0, 7, 123456])
    o = torch.randn(t, h, d).to(torch.bfloat16)
    cos, sin = refs.rope_cos_sin_ref(pos, inv)
    o_model = layers.apply_rope(o.unsqueeze(0), pos.unsqueeze(0), inv, inverse=True).squeeze(0)
    assert torch.equal(refs.inverse_rope_ref(o, cos, sin), o_model)
    lin = GroupedLinear(g, r, h * d // g, torch.float32)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(g * r, h * d // g).to(torch.bfloat16).float())
    with torch.no_grad():
        want = lin(o_model.float().flatten(-2).unflatten(-1, (g, -1)))
    got = refs.wo_a_ref(o, cos, sin, lin.weight.to(torch.bfloat16), torch.float32)
    assert refs.rel_err(got, want) < 1e-6


def test_moe_and_wo_a_registry_cpu_ops(seed):
    from dsflash.plugins import registry  # noqa: F401
    ops = torch.ops.dsflash
    t, d, inter, e, k = 4, 64, 64, 8, 2
    x = torch.randn(t, d).to(torch.bfloat16)
    gw = (torch.randn(e, d) * 0.2).to(torch.bfloat16)
    bias = torch.randn(e) * 0.1
    w, ids = ops.moe_router(x, gw, bias, k, 1.5)
    wr, ir = refs.router_ref(x, gw, bias, k, 1.5)
    assert ids.dtype == torch.int32 and torch.equal(ids.long(), ir) and torch.equal(w, wr)
    w1q, w1s = _mx(e, inter, d)
    w3q, w3s = _mx(e, inter, d)
    w2q, w2s = _mx(e, d, inter)
    w13q, w13s = torch.cat([w1q, w3q], 1), torch.cat([w1s.view(torch.uint8), w3s.view(torch.uint8)], 1).view(refs.E8M0)
    shared = torch.randn(t, d)
    y = ops.moe(x, gw, bias, k, 1.5, w13q, w13s, w2q, w2s, 10.0, inter, shared)
    assert torch.equal(y, refs.moe_ref(x, gw, bias, k, 1.5, w1q, w1s, w3q, w3s, w2q, w2s, 10.0, shared=shared))
    # an EP rank's block (experts 4..7 of 8): the op passes expert_start through
    y2 = ops.moe(x, gw, bias, k, 1.5, w13q[4:], w13s[4:], w2q[4:], w2s[4:], 10.0, inter, None, 1.0, 4)
    assert torch.equal(y2, refs.moe_ref(x, gw, bias, k, 1.5, w1q[4:], w1s[4:], w3q[4:], w3s[4:], w2q[4:], w2s[4:],
                                        10.0, expert_start=4))
    o = torch.randn(2, 4, 32).to(torch.bfloat16)
    cos, sin = refs.rope_cos_sin_ref(torch.tensor([3, 9]), layers.rope_inv_freq(8, 10000.0))
    wa = torch.randn(2 * 16, 64).to(torch.bfloat16)
    z = ops.wo_a(o, cos, sin, wa)
    assert z.shape == (2, 32) and torch.equal(z, refs.wo_a_ref(o, cos, sin, wa))
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        fy = ops.moe(torch.empty(5, d, dtype=torch.bfloat16), torch.empty(e, d, dtype=torch.bfloat16), torch.empty(e),
                     k, 1.5, torch.empty(e, 2 * inter, d // 2, dtype=torch.int8),
                     torch.empty(e, 2 * inter, d // 32, dtype=refs.E8M0),
                     torch.empty(e, d, inter // 2, dtype=torch.int8),
                     torch.empty(e, d, inter // 32, dtype=refs.E8M0), 10.0, inter)
        assert fy.shape == (5, d) and fy.dtype == torch.float32
        fz = ops.wo_a(torch.empty(5, 8, 512, dtype=torch.bfloat16), torch.empty(5, 32), torch.empty(5, 32),
                      torch.empty(1024, 4096, dtype=torch.bfloat16))
        assert fz.shape == (5, 1024)
