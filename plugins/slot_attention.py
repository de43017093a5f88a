"""V4.1's decode attention over the decode slots in one kernel (plugin op `attention`).

A decoding request attends to its window ring (the last W positions, oldest first; rows before position 0 masked)
and, on compressing layers, to the top-k compressed entries the indexer picked (−1: an empty pick, masked), with a
per-head sink logit in the softmax denominator. As torch ops that is ~20 launches per layer (the window gather, the
entry gather, two casts to fp32, two batched GEMMs, mask, sink, softmax, ...); here the keys are streamed once,
flash-decoding style (online softmax): one program per request, head block and split of the key blocks (one request
of 8 heads has only 20 blocks of 32 keys: one program would run them in series, ~44 µs on an H100), then one launch
combines the splits' partial softmaxes. Numerics: Q·K on BF16 tensor cores with fp32
accumulation (the products are exact, as in the fp32 reference); P·V with P split into a BF16 main term and a BF16
correction term, so P keeps ~16 significant bits (the fp32 reference's result to ~1e-5). Imports Triton: load
lazily.
"""
from __future__ import annotations

import functools

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
def _slot_attention_kernel(q_ptr, ring_ptr, slot_ptr, pos_ptr, kv_ptr, sel_ptr, sink_ptr, o_ptr, m_ptr, l_ptr,
                           H, K, E1, scale, SPLIT,
                           W: tl.constexpr, D: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr,
                           HAS_SEL: tl.constexpr, PARTIAL: tl.constexpr):
    """Program (request n, head block, split s) attends to the key blocks b = s, s + SPLIT, ... of the request's
    sequence: the window ring's blocks (position order), then the top-k entries' blocks. PARTIAL: writes the
    unnormalised (acc, m, l) of its blocks for `_slot_attention_combine_kernel`; else (SPLIT 1) the output."""
    n = tl.program_id(0)
    hb = tl.program_id(1)
    s = tl.program_id(2)
    heads = hb * BH + tl.arange(0, BH)
    hmask = heads < H
    dd = tl.arange(0, D)
    q_offs = (n * H + heads).to(tl.int64)[:, None] * D + dd[None, :]
    q = tl.load(q_ptr + q_offs, mask=hmask[:, None], other=0.0)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    pos = tl.load(pos_ptr + n).to(tl.int64)
    # every split's running max starts at the sink logit (finite, so a split without a valid key stays NaN-free);
    # the sink's own term (e^0 = 1 in l) is counted once, by split 0
    m = tl.load(sink_ptr + heads, mask=hmask, other=0.0).to(tl.float32)
    l = tl.full([BH], 1.0, tl.float32) * (s == 0).to(tl.float32)
    acc = tl.zeros([BH, D], tl.float32)
    nbw = tl.cdiv(W, BK)
    nb = nbw
    if HAS_SEL:
        nb += tl.cdiv(K, BK)
    for b in range(s, nb, SPLIT):
        if b < nbw:                                                             # window ring, position order
            j = b * BK + tl.arange(0, BK)
            kpos = pos - (W - 1) + j
            valid = (kpos >= 0) & (j < W)
            row = slot * W + tl.where(valid, kpos, 0) % W
            k = tl.load(ring_ptr + row[:, None] * D + dd[None, :], mask=(j < W)[:, None], other=0.0)
        else:                                                                   # the indexer's top-k entries
            t = (b - nbw) * BK + tl.arange(0, BK)
            e = tl.load(sel_ptr + n * K + t, mask=t < K, other=-1).to(tl.int64)
            valid = e >= 0
            row = slot * E1 + tl.where(valid, e, E1 - 1)                        # row E1 - 1 is zero
            k = tl.load(kv_ptr + row[:, None] * D + dd[None, :])
        m, l, acc = _attend_block(q, k, valid, scale, m, l, acc)
    if PARTIAL:
        hp = tl.num_programs(1) * BH                                            # heads, padded to whole blocks
        r = (n * SPLIT + s) * hp + heads                                        # [BH] rows of the split scratch
        tl.store(o_ptr + r.to(tl.int64)[:, None] * D + dd[None, :], acc)
        tl.store(m_ptr + r, m)
        tl.store(l_ptr + r, l)
    else:
        o = tl.math.div_rn(acc, tl.broadcast_to(l[:, None], (BH, D)))
        tl.store(o_ptr + q_offs, o.to(o_ptr.dtype.element_ty), mask=hmask[:, None])


@triton.jit
def _slot_attention_combine_kernel(acc_ptr, m_ptr, l_ptr, o_ptr, H, SPLIT, HP,
                                   D: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr, SP: tl.constexpr):
    """o[n, heads, d block] = Σ_s acc_s · e^(m_s − M) / Σ_s l_s · e^(m_s − M), M = max_s m_s: all SPLIT (≤ SP)
    splits' partials loaded at once (one memory round trip, not one per split)."""
    n = tl.program_id(0)
    heads = tl.program_id(1) * BH + tl.arange(0, BH)
    dd = tl.program_id(2) * BD + tl.arange(0, BD)
    sp = tl.arange(0, SP)
    r = (n * SPLIT + sp)[:, None] * HP + heads[None, :]                     # [SP, BH] rows of the split scratch
    live = (sp < SPLIT)[:, None]
    m = tl.load(m_ptr + r, mask=live, other=float("-inf"))
    f = tl.exp(m - tl.max(m, axis=0)[None, :])                               # 0 for the padding splits
    den = tl.sum(tl.load(l_ptr + r, mask=live, other=0.0) * f, axis=0)       # [BH]
    part = tl.load(acc_ptr + r.to(tl.int64)[:, :, None] * D + dd[None, None, :], mask=live[:, :, None], other=0.0)
    acc = tl.sum(part * f[:, :, None], axis=0)                               # [BH, BD]
    o = tl.math.div_rn(acc, tl.broadcast_to(den[:, None], (BH, BD)))
    hmask = heads < H
    tl.store(o_ptr + (n * H + heads).to(tl.int64)[:, None] * D + dd[None, :], o.to(o_ptr.dtype.element_ty),
             mask=hmask[:, None])


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def default_split(n: int, head_blocks: int, key_blocks: int, sms: int) -> int:
    """Key-block splits per (request, head block): enough programs for two per SM, at most one split per block."""
    return max(1, min(key_blocks, -(-2 * sms // max(1, n * head_blocks))))


def slot_attention(q: torch.Tensor, ring: torch.Tensor, slot_ids: torch.Tensor, pos: torch.Tensor,
                   kv: torch.Tensor | None, sel: torch.Tensor | None, sink: torch.Tensor, scale: float,
                   split: int | None = None) -> torch.Tensor:
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
    k = sel.shape[1] if sel is not None else 0
    hbs = triton.cdiv(h, bh)
    if split is None:
        split = default_split(n, hbs, triton.cdiv(w, bk) + triton.cdiv(k, bk), _sm_count(q.device))
    assert split >= 1, split
    if not n:
        return o
    partial = split > 1
    if partial:   # per (request, split, padded head) scratch: unnormalised output, running max, denominator
        acc = torch.empty((n, split, hbs * bh, d), dtype=torch.float32, device=q.device)
        ml = torch.empty((2, n, split, hbs * bh), dtype=torch.float32, device=q.device)
    else:
        acc, ml = o, o.new_empty((2, 1), dtype=torch.float32)
    _slot_attention_kernel[(n, hbs, split)](
        q, ring, slot_ids.contiguous(), pos.contiguous(), kv if kv is not None else ring,
        sel.contiguous() if sel is not None else slot_ids, sink.float().contiguous(), acc, ml[0], ml[1],
        h, k, kv.shape[1] if kv is not None else 0, float(scale), split,
        W=w, D=d, BH=bh, BK=bk, HAS_SEL=kv is not None, PARTIAL=partial, num_warps=8 if d >= 512 else 4)
    if partial:
        sp = triton.next_power_of_2(split)
        bd = max(16, min(d, 8192 // (sp * bh)))   # the [SP, BH, BD] fp32 partials tile: at most 8192 values
        _slot_attention_combine_kernel[(n, hbs, triton.cdiv(d, bd))](acc, ml[0], ml[1], o, h, split, hbs * bh,
                                                                     D=d, BH=bh, BD=bd, SP=sp, num_warps=4)
    return o
