"""V4.1's decode attention over the decode slots in one kernel (plugin op `attention`).

A decoding request attends to its window ring (the last W positions, oldest first; rows before position 0 masked)
and, on compressing layers, to the top-k compressed entries the indexer picked (−1: an empty pick, masked), with a
per-head sink logit in the softmax denominator. As torch ops that is ~20 launches per layer (the window gather, the
entry gather, two casts to fp32, two batched GEMMs, mask, sink, softmax, ...); here one program per request and head
block streams its keys once, flash-decoding style (online softmax). Numerics: Q·K on BF16 tensor cores with fp32
accumulation (the products are exact, as in the fp32 reference); P·V with P split into a BF16 main term and a BF16
correction term, so P keeps ~16 significant bits (the fp32 reference's result to ~1e-5). Imports Triton: load
lazily.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsflash.plugins.kernel_device import on_kernel_device


@triton.jit
def _attend_block(q, k, valid, scale, m, l, acc):
    """Online-softmax step over one key block: q [BH, D] bf16, k [BK, D] bf16, valid [BK]; (m, l, acc) the running
    max [BH], denominator [BH] and unnormalised output [BH, D] fp32."""
    s = tl.dot(q, tl.trans(k)) * scale                                          # [BH, BK] fp32
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    p_hi = p.to(tl.bfloat16)
    p_lo = (p - p_hi.to(tl.float32)).to(tl.bfloat16)
    acc = tl.dot(p_hi, k, acc * alpha[:, None])
    acc = tl.dot(p_lo, k, acc)
    return m_new, l, acc


@triton.jit
def _slot_attention_kernel(q_ptr, ring_ptr, slot_ptr, pos_ptr, kv_ptr, sel_ptr, sink_ptr, o_ptr,
                           H, K, E1, scale,
                           W: tl.constexpr, D: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr,
                           HAS_SEL: tl.constexpr):
    n = tl.program_id(0)
    heads = tl.program_id(1) * BH + tl.arange(0, BH)
    hmask = heads < H
    dd = tl.arange(0, D)
    q_offs = (n * H + heads).to(tl.int64)[:, None] * D + dd[None, :]
    q = tl.load(q_ptr + q_offs, mask=hmask[:, None], other=0.0)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    pos = tl.load(pos_ptr + n).to(tl.int64)
    # the sink is a logit of the denominator only: start the running softmax from it
    m = tl.load(sink_ptr + heads, mask=hmask, other=0.0).to(tl.float32)
    l = tl.full([BH], 1.0, tl.float32)
    acc = tl.zeros([BH, D], tl.float32)
    for j0 in range(0, W, BK):                                                  # window ring, position order
        j = j0 + tl.arange(0, BK)
        kpos = pos - (W - 1) + j
        valid = (kpos >= 0) & (j < W)
        row = slot * W + tl.where(valid, kpos, 0) % W
        k = tl.load(ring_ptr + row[:, None] * D + dd[None, :], mask=(j < W)[:, None], other=0.0)
        m, l, acc = _attend_block(q, k, valid, scale, m, l, acc)
    if HAS_SEL:
        for t0 in range(0, K, BK):                                              # the indexer's top-k entries
            t = t0 + tl.arange(0, BK)
            e = tl.load(sel_ptr + n * K + t, mask=t < K, other=-1).to(tl.int64)
            valid = e >= 0
            row = slot * E1 + tl.where(valid, e, E1 - 1)                        # row E1 - 1 is zero
            k = tl.load(kv_ptr + row[:, None] * D + dd[None, :])
            m, l, acc = _attend_block(q, k, valid, scale, m, l, acc)
    o = tl.math.div_rn(acc, tl.broadcast_to(l[:, None], (BH, D)))
    tl.store(o_ptr + q_offs, o.to(o_ptr.dtype.element_ty), mask=hmask[:, None])


def slot_attention(q: torch.Tensor, ring: torch.Tensor, slot_ids: torch.Tensor, pos: torch.Tensor,
                   kv: torch.Tensor | None, sel: torch.Tensor | None, sink: torch.Tensor, scale: float) -> torch.Tensor:
    """q [N, H, d] BF16 (one decode token per request); ring [S, W, d] (row p % W holds position p), slot_ids [N],
    pos [N] (the token's position, its window row already written); kv [S, E + 1, d] with row E zero and sel [N, k]
    (−1 padded entry ids), or both None on a layer without compressed entries; sink [H] fp32 -> o [N, H, d]
    (`refs.slot_attention_ref`)."""
    assert on_kernel_device(q, ring, kv) and q.dim() == 3 and q.dtype == torch.bfloat16, (q.dtype, tuple(q.shape))
    n, h, d = q.shape
    assert d & (d - 1) == 0 and d >= 16, f"head dim {d}: a power of two"
    assert ring.dim() == 3 and ring.shape[2] == d and ring.dtype == q.dtype and ring.is_contiguous()
    assert slot_ids.shape == (n,) and pos.shape == (n,) and sink.shape == (h,), (slot_ids.shape, pos.shape)
    assert (kv is None) == (sel is None)
    if kv is not None:
        assert kv.dim() == 3 and kv.shape[2] == d and kv.dtype == q.dtype and kv.is_contiguous()
        assert sel.dim() == 2 and sel.shape[0] == n, tuple(sel.shape)
    w = ring.shape[1]
    q = q.contiguous()
    o = torch.empty_like(q)
    bh, bk = 16, 32   # (tl.dot's smallest tile; a TP8 rank has 8 heads) × 32 keys per step
    if n:
        _slot_attention_kernel[(n, triton.cdiv(h, bh))](
            q, ring, slot_ids.contiguous(), pos.contiguous(), kv if kv is not None else ring,
            sel.contiguous() if sel is not None else slot_ids, sink.float().contiguous(), o,
            h, sel.shape[1] if sel is not None else 0, kv.shape[1] if kv is not None else 0, float(scale),
            W=w, D=d, BH=bh, BK=bk, HAS_SEL=kv is not None, num_warps=8 if d >= 512 else 4)
    return o
