"""V4.1's index scores over the decode slots' visible entries in one kernel (plugin op `index`).

A decode slot holds E = ceil(max_seq_len / ratio) entry rows of index keys. The torch path gathers all E rows of
every request, widens them to fp32 and scores them all (~150 MB per index layer at 64 requests and E = 9216), though
a query may read only the (pos + 1) // ratio complete groups. Here a program scores one block of entries of one
request straight from its slot, and loads nothing past the request's visible count (it writes zeros there, which
`_select` masks like any invisible entry). Numerics: q · k on BF16 tensor cores with fp32 accumulation (the products
are exact, as in the fp32 reference), ReLU, the head weights summed in fp32. Imports Triton: load lazily.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsflash.plugins.kernel_device import on_kernel_device


@triton.jit
def _slot_index_kernel(q_ptr, w_ptr, k_ptr, slot_ptr, pos_ptr, out_ptr, H, E, RATIO, scale,
                       DI: tl.constexpr, BH: tl.constexpr, BT: tl.constexpr):
    n = tl.program_id(0)
    t = tl.program_id(1) * BT + tl.arange(0, BT)
    visible = (tl.load(pos_ptr + n).to(tl.int32) + 1) // RATIO
    tmask = t < visible          # a block past the visible entries loads nothing (its masked dot is a few cycles)
    heads = tl.arange(0, BH)
    hmask = heads < H
    dd = tl.arange(0, DI)
    q = tl.load(q_ptr + (n * H + heads).to(tl.int64)[:, None] * DI + dd[None, :], mask=hmask[:, None], other=0.0)
    w = tl.load(w_ptr + n * H + heads, mask=hmask, other=0.0)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    k = tl.load(k_ptr + (slot * E + t)[:, None] * DI + dd[None, :], mask=tmask[:, None], other=0.0)
    s = tl.maximum(tl.dot(q, tl.trans(k)), 0.0) * scale                         # [BH, BT] fp32
    score = tl.sum(s * w[:, None], axis=0)
    tl.store(out_ptr + n.to(tl.int64) * E + t, tl.where(tmask, score, 0.0), mask=t < E)


def slot_index_scores(q: torch.Tensor, w: torch.Tensor, index_k: torch.Tensor, slot_ids: torch.Tensor,
                      pos: torch.Tensor, ratio: int, scale: float) -> torch.Tensor:
    """q [N, H, di] BF16 (this rank's index heads), w [N, H] fp32 head weights, index_k [S, E, di] (the slots' index
    keys), slot_ids / pos [N] -> [N, E] fp32: Σ_h w_h · ReLU(q_h · k_t) · scale for the (pos + 1) // ratio visible
    entries t, 0 past them (`refs.slot_index_scores_ref`)."""
    assert on_kernel_device(q, w, index_k) and q.dim() == 3 and q.dtype == torch.bfloat16, (q.dtype, tuple(q.shape))
    n, h, di = q.shape
    assert di & (di - 1) == 0 and di >= 16 and h <= 64, f"index heads {h} of {di}: a power of two"
    assert index_k.dim() == 3 and index_k.shape[2] == di and index_k.dtype == q.dtype and index_k.is_contiguous()
    assert w.shape == (n, h) and slot_ids.shape == (n,) and pos.shape == (n,), (w.shape, slot_ids.shape, pos.shape)
    e = index_k.shape[1]
    out = torch.empty((n, e), dtype=torch.float32, device=q.device)
    bt = 64
    if n and e:
        _slot_index_kernel[(n, triton.cdiv(e, bt))](
            q.contiguous(), w.float().contiguous(), index_k, slot_ids.contiguous(), pos.contiguous(), out, h, e,
            int(ratio), float(scale), DI=di, BH=max(16, triton.next_power_of_2(h)), BT=bt, num_warps=4)
    return out
