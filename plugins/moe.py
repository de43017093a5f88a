"""V4.1 / V4 MoE on Hopper: router kernel, expert-sorted layout, and MXFP4-weight × BF16-activation grouped GEMMs.

V4-Flash (`qblock=128`): x and h are quantized per 1×128 (scales still one per 32 columns, a 128-block's repeated:
the kernels' one format; a w13 tile then holds whole 128-blocks of h, `moe_config.for_qblock`), and its hash-routed
layers give the router their picks (`hash_ids`: `tid2eid` of the tokens) instead of a top-k.

Pipeline (five launches, no host sync, CUDA-graph capturable):
1. `_router_logits_kernel`: logits [T, E] = x·Wgᵀ (BF16 operands, fp32 accumulation: the reference's fp32 linear
   on BF16 values has the same products); the programs of the first expert tile also write the deploy activation
   xq = FP8 1×32 fake-quant of x (BF16, exact), which both expert GEMMs and nothing else read.
2. `_router_topk_kernel`: s = sqrt(softplus(logits / gate_temp)), top-k of s + bias (bias for selection only; one
   row per token when image tokens select with `bias_vl`),
   weights = s at the ids / (Σ + eps) × routed_scaling_factor -> ids int32 [T, k], weights fp32 [T, k].
3. `_moe_align_kernel` (one program): the (token, slot) pairs sorted by expert, each expert's run padded to a
   multiple of BLOCK_M with a sentinel; expert offsets [E + 1]. The GEMMs launch the worst-case number of M blocks
   (cdiv(T·k, BM) + min(E, T·k)) and idle blocks past the end return at once.
4. `_moe_w13_kernel`: per (M block of one expert, N tile of the intermediate): g = xq·W1ᵀ, u = xq·W3ᵀ with the MXFP4
   weights dequantized in registers (`tl.dot_scaled`: e2m1 × e8m0 -> BF16, exact) on BF16 tensor cores, fp32
   accumulation; epilogue = clipped SwiGLU, × routing weight, round to BF16, FP8 1×32 fake quant along the
   intermediate (what the reference's w2 input goes through), columns past the logical width forced to 0 -> h BF16.
5. `_moe_w2_kernel`: y = h·W2ᵀ per expert block, fp32 atomically added into the output, which starts as the shared
   expert's output (so the weighted reduction over experts and the shared-expert add are one pass).

Deterministic mode (`moe_config.set_deterministic`, or torch's deterministic algorithms; GPU only): the w2 kernels
write each pair's output to a row of its own (they take k = 1: the same atomic add, one per element, into a zeroed
[T·k, D] buffer) and `_moe_pair_sum_kernel` adds the rows to the shared expert's output in slot order, one launch
more: the atomic sum's order, which varies from run to run, no longer reaches the output's bits.

On sm90 the sorted path's GEMMs (4-5) run on FP8 tensor cores instead (`moe_f8`, Gluon: the MXFP4 codes re-biased
into e4m3 in registers, one k32 MMA per 32-block, h passed to w2 as e4m3 codes), 2.0-2.4x faster.

Decode (T·k <= 2E): steps 3-5 are replaced by two CUDA-core GEMVs, one (token, expert) pair per program
(`_moe_w13_gemv_kernel` with the same epilogue, which also writes the output's starting value, `_moe_w2_gemv_kernel`
adding atomically; for a short intermediate, one TP8 rank, w2 is `moe_gluon`'s row-per-thread kernel). The default
(`MoeConfig.acc16`) sums each 32-block's exact products as packed f16x2 FMAs and promotes once per block to fp32
(`_mx_gemv16_step`): ~2.5 instead of ~4.6 instructions per weight element, 64-89 % of copy bandwidth at TP1 on the
H200 (benchmarks/README.md, "Session 3"). Its only difference from the fp32 path is the f16 rounding of the running
in-block sums (~1e-3 relative in g and u), which the FP8 requantization of h turns into 1.4-4.6e-3 ‖Δ‖/‖ref‖ of the
MoE output (9.6e-3 on the worst single-token site measured); acc16=False keeps fp32 accumulation (~1e-7).

Expert parallelism (moe_ep > 1): each rank holds a contiguous block of the experts and routes over all of them. The
top-k kernel writes ids local to that block and marks another rank's pick with the block size; the align kernel
leaves those pairs out and every decode program of such a pair returns after the output's initialisation, so a
rank reads only its own experts' bytes and the TP all-reduce adds the ranks' shares. With the router's pair list the
decode GEMVs launch about T·k/ep rows of programs, the rows on the grid's slowest axis, so the listed pairs'
programs are dispatched before the spare rows' empty ones.

Weights are consumed in the plain reference MXFP4 layout stacked over experts (int8 [E, N, K/2], low nibble = even
k; e8m0 [E, N, K/32]), not the hopper Marlin repack: the Marlin order is the register-fragment order of
`mma.sync.m16n8k16`, which Triton does not expose; `tl.dot_scaled` takes the K-packed OCP layout as is.
The GEMMs are swap-AB (weight rows on the MMA's M side, the block's ≤ BLOCK_M tokens on its N side), so a decode
block of one token wastes MMA lanes, not weight bytes. Imports Triton: load this module lazily.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from dsflash.plugins.refs import (  # noqa: F401  (re-exported: name_ref lives beside name)
    ROUTER_NORM_EPS, moe_experts_ref, moe_ref, mxfp4_dequant_ref, pair_sum_ref, router_ref)
from dsflash.plugins.moe_config import (  # noqa: F401  (re-exported: configs live beside their kernels' users)
    MoeConfig, _div, default_moe_config, deterministic, gemv_warps, local_pair_slots, lookup, moe_candidates,
    unrolled_steps)
from dsflash.plugins.splitk import split_counter, splitk_arrive, splitk_total
from dsflash.plugins.tl_helpers import e8m0_to_f32, exp2i, scale_exp, split4
from dsflash.plugins.tuning import k_slices

QBLOCK = 32
# An EP rank's pair-list entry is pair << PAIR_BITS | local expert (`pair_entry`): the decode GEMVs read one word per
# pair
PAIR_BITS = tl.constexpr(16)
PAIR_SHIFT = tl.constexpr(1 << PAIR_BITS.value)


# -- shared helpers ---------------------------------------------------------------------------------------------------
@triton.jit
def _quant_cols(v, ROWS: tl.constexpr, COLS: tl.constexpr, QB: tl.constexpr = 32):
    """v [ROWS, COLS] fp32 (values already BF16-exact) -> FP8 e4m3 1×QB quantization (QB 32: V4.1, 128: V4) with one
    pow2 scale per QB consecutive ROWS of each column (the reference's 1×QB blocks run along dim 0 of this transposed
    tile): (codes fp32 [ROWS, COLS] (e4m3 values), scales fp32 [ROWS/32, COLS], a QB-block's scale repeated for each
    of its 32-blocks: the kernels' one format). Scale 2^e, e = ceil(log2(max(amax, 1e-4) / 448))
    (`tl_helpers.scale_exp`, as act_quant._quant_g32)."""
    v3 = tl.reshape(v, (ROWS // QB, QB, COLS))
    e = scale_exp(tl.max(tl.abs(v3), axis=1))                            # [ROWS/QB, COLS]
    q = tl.minimum(tl.maximum(v3 * exp2i(-e)[:, None, :], -448.0), 448.0).to(tl.float8e4nv)
    sc = exp2i(e)
    if QB != 32:
        sc = tl.reshape(tl.broadcast_to(sc[:, None, :], (ROWS // QB, QB // 32, COLS)), (ROWS // 32, COLS))
    return tl.reshape(q.to(tl.float32), (ROWS, COLS)), sc


@triton.jit
def _fake_quant_cols(v, ROWS: tl.constexpr, COLS: tl.constexpr, QB: tl.constexpr = 32):
    """`_quant_cols`, dequantized: the FP8 1×QB fake quant of v (fp32 out, exact)."""
    q, sc = _quant_cols(v, ROWS, COLS, QB)
    return tl.reshape(tl.reshape(q, (ROWS // 32, 32, COLS)) * sc[:, None, :], (ROWS, COLS))


# -- 1. router logits (+ the deploy activation) -----------------------------------------------------------------------
@triton.jit
def _router_logits_kernel(x_ptr, wg_ptr, logits_ptr, xq_ptr, xs_ptr, count_ptr, T, E, K, stride_x, stride_w, stride_l,
                          stride_xq, SPLIT, SPLIT_STRIDE,
                          BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                          NUM_STAGES: tl.constexpr, WRITE_XQ: tl.constexpr, XQ_MODE: tl.constexpr,
                          ZERO_COUNT: tl.constexpr, QB: tl.constexpr):
    """Partial logits of K slice pid_k -> logits[pid_k] (the top-k kernel sums the slices in order: deterministic).
    The programs of the first expert tile also write xq (FP8 1×QB, QB | BLOCK_K) for their K slice, in layout
    XQ_MODE: 0 natural BF16,
    1 the fp32 GEMV layout (`gemv_act`), 2 the f16-code GEMV layout (`gemv16_act`: codes to xq_ptr, scales to
    xs_ptr). ZERO_COUNT: program (0, 0, 0) also zeroes the local-pair counter the top-k kernel appends to."""
    pid_e = tl.program_id(0)
    pid_t = tl.program_id(1)
    pid_k = tl.program_id(2)
    if ZERO_COUNT:
        if pid_e + pid_t + pid_k == 0:
            tl.store(count_ptr, 0)
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_k = tl.arange(0, BLOCK_K)
    me = offs_e < E
    mt = offs_t < T
    w_ptrs = wg_ptr + offs_e.to(tl.int64)[:, None] * stride_w + offs_k[None, :]
    x_ptrs = x_ptr + offs_t.to(tl.int64)[None, :] * stride_x + offs_k[:, None]
    per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT) * BLOCK_K
    k_lo = pid_k * per
    k_hi = tl.minimum(k_lo + per, K)
    acc = tl.zeros([BLOCK_E, BLOCK_T], dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
        w = tl.load(w_ptrs + k0, mask=me[:, None], other=0.0)
        xt = tl.load(x_ptrs + k0, mask=mt[None, :], other=0.0)            # [BLOCK_K, BLOCK_T] bf16
        acc = tl.dot(w, xt, acc)
        if WRITE_XQ:
            if pid_e == 0:
                xrow = xq_ptr + offs_t.to(tl.int64)[None, :] * stride_xq
                if XQ_MODE == 2:
                    q, sc = _quant_cols(xt.to(tl.float32), BLOCK_K, BLOCK_T, QB)
                    tl.store(xrow + _pair_perm16(k0 + offs_k, K)[:, None], (q * 0.0625).to(tl.float16),
                             mask=mt[None, :])
                    offs_b = tl.arange(0, BLOCK_K // 32)
                    tl.store(xs_ptr + offs_t.to(tl.int64)[None, :] * (K // 32) + (k0 // 32 + offs_b)[:, None],
                             sc * 1024.0, mask=mt[None, :])
                else:
                    xq = _fake_quant_cols(xt.to(tl.float32), BLOCK_K, BLOCK_T, QB)
                    if XQ_MODE == 1:   # the decode GEMV's pair-permuted fp32 layout, ×2^6 (exact)
                        tl.store(xrow + _pair_perm(k0 + offs_k, K)[:, None], xq * 64.0, mask=mt[None, :])
                    else:
                        tl.store(xrow + (k0 + offs_k)[:, None], xq.to(xq_ptr.dtype.element_ty), mask=mt[None, :])
    tl.store(logits_ptr + pid_k * SPLIT_STRIDE + offs_t.to(tl.int64)[None, :] * stride_l + offs_e[:, None], acc,
             mask=me[:, None] & mt[None, :])


# -- 2. scores, top-k, weights ----------------------------------------------------------------------------------------
@triton.jit
def _select_topk(s, bias_ptr, offs_t, cols, kcol, mt, mc, stride_bias, TOPK: tl.constexpr, NB_E: tl.constexpr,
                 BLOCK_T: tl.constexpr, KP: tl.constexpr):
    """ids int32 [BLOCK_T, KP]: the top-k of s + bias per token (ties: the lowest index), in order of selection."""
    # bias: one row for every token (stride 0), or a row per token (V4.1: `bias_vl` on image tokens)
    bias = tl.load(bias_ptr + offs_t.to(tl.int64)[:, None] * stride_bias + cols[None, :],
                   mask=mt[:, None] & mc[None, :], other=0.0)
    sel = tl.where(mc[None, :], s + bias, float("-inf"))
    # (score, lowest index) as one int64 key, so each of the k passes is a single max reduction: the float's bits
    # made order-preserving as a signed int in the high word, NB_E - 1 - index in the low word
    bits = sel.to(tl.int32, bitcast=True)
    key = ((bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64) << 32) | (NB_E - 1 - cols)[None, :].to(tl.int64)
    ids = tl.zeros([BLOCK_T, KP], dtype=tl.int32)
    for j in tl.static_range(TOPK):     # k passes of (max, lowest index at the max); picked entries drop out
        idx = NB_E - 1 - tl.max(key, axis=1).to(tl.int32)     # the low word (truncation)
        key = tl.where(cols[None, :] == idx[:, None], -9223372036854775807, key)
        ids = tl.where(kcol[None, :] == j, idx[:, None], ids)
    return ids


@triton.jit
def _router_topk_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, T, E, stride_l, stride_bias, SPLIT_STRIDE,
                        gate_temp, route_scale, eps, expert_start, n_local, list_ptr, count_ptr,
                        hash_ptr, SPLIT: tl.constexpr, TOPK: tl.constexpr, KP: tl.constexpr, NORM: tl.constexpr,
                        NB_E: tl.constexpr, BLOCK_T: tl.constexpr, COMPACT: tl.constexpr, HASH: tl.constexpr):
    """Scores, top-k and weights of BLOCK_T tokens from the SPLIT K-slice logits partials. The ids written are
    local to the experts [expert_start, expert_start + n_local) (one EP rank's; all experts: 0, E): a pick outside
    them is written as n_local, which the expert kernels skip (`refs.local_expert_ids`). COMPACT: the pairs
    p = t·k + j picked here are also appended to list_ptr as p << 16 | local expert (`pair_entry`; count_ptr: how
    many, zeroed by the logits kernel), so the decode GEMVs can run this rank's pairs only (order: atomic arrival).
    HASH (V4's hash-routed layers): the picks are given, hash_ptr int32 [T, TOPK] (`tid2eid` of the tokens), and no
    bias is read."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, NB_E)
    kcol = tl.arange(0, KP)
    mt = offs_t < T
    mc = cols < E
    lp = logits_ptr + offs_t.to(tl.int64)[:, None] * stride_l + cols[None, :]
    z = tl.load(lp, mask=mt[:, None] & mc[None, :], other=0.0)
    for sk in tl.static_range(1, SPLIT):      # K-slice partials, all loads in flight at once, summed in slice order
        z += tl.load(lp + sk * SPLIT_STRIDE, mask=mt[:, None] & mc[None, :], other=0.0)
    z = tl.math.div_rn(z, tl.full(z.shape, gate_temp, tl.float32))
    sp = tl.where(z > 20.0, z, libdevice.log1p(tl.exp(z)))               # torch softplus (beta 1, threshold 20)
    s = tl.math.sqrt_rn(sp)
    if HASH:
        ids = tl.load(hash_ptr + offs_t.to(tl.int64)[:, None] * TOPK + kcol[None, :],
                      mask=mt[:, None] & (kcol < TOPK)[None, :], other=-1)
    else:
        ids = _select_topk(s, bias_ptr, offs_t, cols, kcol, mt, mc, stride_bias, TOPK, NB_E, BLOCK_T, KP)
    # weights = the scores at the picked ids, gathered for all k at once: s [BT, 1, NB_E] at ids [BT, KP, 1]
    hit3 = tl.expand_dims(cols, 0)[:, None, :] == ids[:, :, None]
    wts = tl.where(kcol[None, :] < TOPK, tl.sum(tl.where(hit3, s[:, None, :], 0.0), axis=2), 0.0)
    if NORM:
        den = tl.sum(wts, axis=1) + eps
        wts = tl.math.div_rn(wts, tl.broadcast_to(den[:, None], (BLOCK_T, KP)))
    wts = wts * route_scale
    out = offs_t[:, None] * TOPK + kcol[None, :]
    m2 = mt[:, None] & (kcol < TOPK)[None, :]
    local = ids - expert_start
    ids = tl.where((local >= 0) & (local < n_local), local, n_local)
    tl.store(ids_ptr + out, ids, mask=m2)
    if COMPACT:
        mine = tl.reshape((m2 & (ids < n_local)).to(tl.int32), [BLOCK_T * KP])
        base = tl.atomic_add(count_ptr, tl.sum(mine, axis=0))
        entry = tl.reshape(out * PAIR_SHIFT + ids, [BLOCK_T * KP])
        tl.store(list_ptr + base + tl.cumsum(mine, 0) - mine, entry, mask=mine > 0)
    tl.store(w_ptr + out, wts, mask=m2)


# -- 3. expert-sorted layout ------------------------------------------------------------------------------------------
@triton.jit
def _moe_align_kernel(ids_ptr, sorted_ptr, off_ptr, cnt_ptr, P, E, MAX_SLOTS,
                      BLOCK_M: tl.constexpr, NB_E: tl.constexpr, BLOCK: tl.constexpr):
    """One program. sorted[off[e] .. off[e] + count_e) = the pair indices p = t·k + j routed to expert e (order
    within an expert: atomic arrival), the rest of each BLOCK_M-padded run = P (sentinel); off [E + 1]. Pairs with
    id E (routed to another EP rank) are left out."""
    cols = tl.arange(0, NB_E)
    r = tl.arange(0, BLOCK)
    counts = tl.zeros([NB_E], dtype=tl.int32)
    for c0 in range(0, P, BLOCK):
        m = c0 + r < P
        ids = tl.load(ids_ptr + c0 + r, mask=m, other=NB_E - 1)          # masked lanes land in an unused bin
        counts += tl.histogram(ids, NB_E)
    counts = tl.where(cols < E, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    excl = tl.cumsum(padded, 0) - padded
    tl.store(off_ptr + cols, excl, mask=cols <= E)
    tl.store(cnt_ptr + cols, excl)
    for s0 in range(0, MAX_SLOTS, BLOCK):
        tl.store(sorted_ptr + s0 + r, P, mask=s0 + r < MAX_SLOTS)
    tl.debug_barrier()
    for c0 in range(0, P, BLOCK):
        ids = tl.load(ids_ptr + c0 + r, mask=c0 + r < P, other=E)
        m = ids < E                                                      # E: an expert of another EP rank
        pos = tl.atomic_add(cnt_ptr + ids, 1, mask=m)
        tl.store(sorted_ptr + pos, c0 + r, mask=m)


@triton.jit
def _block_expert(off_ptr, E, start, NB_E: tl.constexpr):
    """The expert whose padded run holds slot `start` (off non-decreasing, off[0] = 0 <= start < off[E])."""
    cols = tl.arange(0, NB_E)
    off = tl.load(off_ptr + cols, mask=cols <= E, other=2147483647)
    return tl.sum((off <= start).to(tl.int32), axis=0) - 1


@triton.jit
def _sorted_tile(sorted_ptr, off_ptr, start, pid_n, N, E, P, TOPK, stride_we, stride_wn, stride_se, stride_sn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NB_E: tl.constexpr):
    """The sorted path's tile (slots start.. of one expert's padded run, N tile pid_n): its slots, pairs, validity,
    tokens, output columns (and their mask), K offsets, and the weight-word [BN, BK/2] and scale [BN, BK/32] offsets
    within the expert's rows (to which each K step adds k0 // 2 and k0 // 32)."""
    e = _block_expert(off_ptr, E, start, NB_E).to(tl.int64)
    slots = start + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + slots)
    valid = pair < P
    tok = tl.where(valid, pair // TOPK, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    wrow = e * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn + tl.arange(0, BLOCK_K // 2)[None, :]
    srow = e * stride_se + offs_n.to(tl.int64)[:, None] * stride_sn + tl.arange(0, BLOCK_K // 32)[None, :]
    return slots, pair, valid, tok, offs_n, mn, offs_k, wrow, srow


# -- 4. w1/w3 + clipped SwiGLU + routing weight + BF16 + FP8 fake quant ----------------------------------------------
@triton.jit
def _moe_w13_kernel(xq_ptr, w13_ptr, s13_ptr, h_ptr, sorted_ptr, off_ptr, topw_ptr,
                    N, N_VALID, K, E, P, TOPK,
                    stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_h,
                    limit,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NB_E: tl.constexpr,
                    NUM_STAGES: tl.constexpr, QB: tl.constexpr):
    pid_n = tl.program_id(1)
    start = tl.program_id(0) * BLOCK_M
    if start >= tl.load(off_ptr + E):
        return
    slots, pair, valid, tok, offs_n, mn, offs_k, wrow, srow = _sorted_tile(
        sorted_ptr, off_ptr, start, pid_n, N, E, P, TOPK, stride_we, stride_wn, stride_se, stride_sn,
        BLOCK_M, BLOCK_N, BLOCK_K, NB_E)
    x_ptrs = xq_ptr + tok[None, :] * stride_x + offs_k[:, None]                          # [BK, BM]
    acc_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    # a tile wholly past the logical width (a TP rank's zero padding) reads no weights and stores h = 0
    k_end = tl.where(pid_n * BLOCK_N >= N_VALID, 0, K)
    for k0 in tl.range(0, k_end, BLOCK_K, num_stages=NUM_STAGES):
        xt = tl.load(x_ptrs + k0, mask=valid[None, :], other=0.0)
        w1 = tl.load(w13_ptr + wrow + k0 // 2, mask=mn[:, None], other=0)
        s1 = tl.load(s13_ptr + srow + k0 // 32, mask=mn[:, None], other=127)
        w3 = tl.load(w13_ptr + (wrow + N * stride_wn) + k0 // 2, mask=mn[:, None], other=0)
        s3 = tl.load(s13_ptr + (srow + N * stride_sn) + k0 // 32, mask=mn[:, None], other=127)
        acc_g = tl.dot_scaled(w1, s1, "e2m1", xt, None, "bf16", acc_g)
        acc_u = tl.dot_scaled(w3, s3, "e2m1", xt, None, "bf16", acc_u)
    if limit > 0:
        acc_u = tl.minimum(tl.maximum(acc_u, -limit), limit)
        acc_g = tl.minimum(acc_g, limit)
    h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    rw = tl.load(topw_ptr + tl.where(valid, pair, 0), mask=valid, other=0.0)
    h = h * rw[None, :]
    h = tl.where((offs_n < N_VALID)[:, None], h, 0.0)
    h = _fake_quant_cols(h.to(tl.bfloat16).to(tl.float32), BLOCK_N, BLOCK_M, QB)
    tl.store(h_ptr + slots.to(tl.int64)[None, :] * stride_h + offs_n[:, None], h.to(h_ptr.dtype.element_ty),
             mask=mn[:, None] & valid[None, :])


# -- 5. w2 + weighted reduction into the shared-expert output ----------------------------------------------------------
@triton.jit
def _moe_w2_kernel(h_ptr, w2_ptr, s2_ptr, out_ptr, sorted_ptr, off_ptr,
                   N, K, E, P, TOPK,
                   stride_h, stride_we, stride_wn, stride_se, stride_sn, stride_o,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NB_E: tl.constexpr,
                   NUM_STAGES: tl.constexpr):
    pid_n = tl.program_id(1)
    start = tl.program_id(0) * BLOCK_M
    if start >= tl.load(off_ptr + E):
        return
    slots, pair, valid, tok, offs_n, mn, offs_k, wrow, srow = _sorted_tile(
        sorted_ptr, off_ptr, start, pid_n, N, E, P, TOPK, stride_we, stride_wn, stride_se, stride_sn,
        BLOCK_M, BLOCK_N, BLOCK_K, NB_E)
    h_ptrs = h_ptr + slots.to(tl.int64)[None, :] * stride_h + offs_k[:, None]           # [BK, BM]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        ht = tl.load(h_ptrs + k0, mask=valid[None, :], other=0.0)
        w2 = tl.load(w2_ptr + wrow + k0 // 2, mask=mn[:, None], other=0)
        s2 = tl.load(s2_ptr + srow + k0 // 32, mask=mn[:, None], other=127)
        acc = tl.dot_scaled(w2, s2, "e2m1", ht, None, "bf16", acc)
    tl.atomic_add(out_ptr + tok[None, :] * stride_o + offs_n[:, None], acc, mask=mn[:, None] & valid[None, :],
                  sem="relaxed")



# -- 6. deterministic mode: the pairs' rows summed in slot order --------------------------------------------------------
@triton.jit
def _moe_pair_sum_kernel(rows_ptr, sh_ptr, out_ptr, D, stride_r, stride_sh, stride_o, TOPK: tl.constexpr,
                         SHARED: tl.constexpr, BLOCK: tl.constexpr):
    """out[t, cols] = sh[t] + rows[t·k] + … + rows[t·k + k - 1] (fp32, in slot order), columns of program 1's block."""
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = d < D
    parts = ()
    for j in tl.static_range(TOPK):   # every row's load in flight before the first add
        parts = parts + (tl.load(rows_ptr + (t * TOPK + j) * stride_r + d, mask=m, other=0.0), )
    if SHARED:
        acc = tl.load(sh_ptr + t * stride_sh + d, mask=m, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(TOPK):
        acc = acc + parts[j]
    tl.store(out_ptr + t * stride_o + d, acc, mask=m)


# -- 4'/5'. decode path: one (token, expert) pair per program, CUDA-core GEMV ------------------------------------------
# MXFP4 word -> 8 fp32 values, fused with the dot against 8 activations. Per int32 word (8 e2m1 codes, code i =
# element 8j + i, low nibble of byte b = element 2b): the codes are re-biased into FP8 e4m3 bytes in place (e2m1
# [s e1 e0 m] -> e4m3 with the same exponent/mantissa bits, i.e. value·2^-6; the e2m1 subnormal 0.5 becomes the e4m3
# subnormal 2^-7, so every code is exact) with 3-input logic ops on all 4 bytes at once, converted two at a time by
# the FP8->f16x2 unit, widened to fp32 and multiply-added with the activations; the e8m0 scale (times 2^6) multiplies
# the word's partial dot once (the activations are stored ×2^6, so the scale is the e8m0 exponent bits as an fp32,
# 2^(e - 127)). $0 = acc out; $1..$4 = activation pairs (e0,e1) (e2,e3) (e4,e5) (e6,e7) as b64;
# $5 = acc in; $6 = the word; $7 = the scale 2^(e - 127).
_MX_DOT8_ASM = tl.constexpr("""
{
.reg .b32 t, lo, hi, h0, h1, h2, h3, x0, x1, x2, x3, x4, x5, x6, x7;
.reg .b16 b0, b1, b2, b3, f0, f1;
.reg .f32 v, a;
shl.b32 t, $6, 4;
and.b32 t, t, 0x80808080;
shl.b32 lo, $6, 2;
and.b32 lo, lo, 0x1C1C1C1C;
or.b32 lo, lo, t;
shr.b32 t, $6, 2;
and.b32 t, t, 0x1C1C1C1C;
and.b32 hi, $6, 0x80808080;
or.b32 hi, hi, t;
mov.b32 {b0, b1}, lo;
mov.b32 {b2, b3}, hi;
cvt.rn.f16x2.e4m3x2 h0, b0;
cvt.rn.f16x2.e4m3x2 h1, b1;
cvt.rn.f16x2.e4m3x2 h2, b2;
cvt.rn.f16x2.e4m3x2 h3, b3;
mov.b64 {x0, x1}, $1;
mov.b64 {x2, x3}, $2;
mov.b64 {x4, x5}, $3;
mov.b64 {x6, x7}, $4;
mov.b32 {f0, f1}, h0;
cvt.f32.f16 v, f0;
mul.rn.f32 a, v, x0;
cvt.f32.f16 v, f1;
fma.rn.f32 a, v, x2, a;
mov.b32 {f0, f1}, h2;
cvt.f32.f16 v, f0;
fma.rn.f32 a, v, x1, a;
cvt.f32.f16 v, f1;
fma.rn.f32 a, v, x3, a;
mov.b32 {f0, f1}, h1;
cvt.f32.f16 v, f0;
fma.rn.f32 a, v, x4, a;
cvt.f32.f16 v, f1;
fma.rn.f32 a, v, x6, a;
mov.b32 {f0, f1}, h3;
cvt.f32.f16 v, f0;
fma.rn.f32 a, v, x5, a;
cvt.f32.f16 v, f1;
fma.rn.f32 a, v, x7, a;
fma.rn.f32 $0, a, $7, $5;
}
""")


@triton.jit
def _mx_dot8(acc, w, sc, xa, xb, xc, xd):
    return tl.inline_asm_elementwise(_MX_DOT8_ASM, "=f,l,l,l,l,f,r,f", [xa, xb, xc, xd, acc, w, sc],
                                     dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _mx_load_x(x_ptrs, K8, mw, EVEN: tl.constexpr):
    """The activations of BW words in the pair-permuted layout (int64 view [4, K/8]: entry q of word j holds the
    fp32 pair 2^6·(x[8j + 2q], x[8j + 2q + 1])) -> 4 int64 tensors [1, BW]."""
    if EVEN:
        xa = tl.load(x_ptrs)
        xb = tl.load(x_ptrs + K8)
        xc = tl.load(x_ptrs + 2 * K8)
        xd = tl.load(x_ptrs + 3 * K8)
    else:
        xa = tl.load(x_ptrs, mask=mw, other=0)
        xb = tl.load(x_ptrs + K8, mask=mw, other=0)
        xc = tl.load(x_ptrs + 2 * K8, mask=mw, other=0)
        xd = tl.load(x_ptrs + 3 * K8, mask=mw, other=0)
    return xa[None, :], xb[None, :], xc[None, :], xd[None, :]


@triton.jit
def _mx_gemv_step(acc, w_ptrs, s, xa, xb, xc, xd, mw, mn, EVEN: tl.constexpr):
    """acc [BN, BW] += the dot of BW int32 words (8 codes each) per row with the activations (s: the words' e8m0
    scales, loaded by the caller). EVEN: no masks."""
    if EVEN:
        w = tl.load(w_ptrs)
    else:
        w = tl.load(w_ptrs, mask=mn[:, None] & mw[None, :], other=0)
    return _mx_dot8(acc, w, e8m0_to_f32(s), xa, xb, xc, xd)


def _mx_dot32h_asm() -> str:
    """PTX for one 32-block of 4 words: f16 accumulation of the 32 exact products, then fp32 promotion.
    $0 = acc out; $1..$4 = the words; $5..$8 / $9..$12 = the words' activation planes 0 / 1 as b64 (f16 codes
    (x0, x2, x4, x6) / (x1, x3, x5, x7)); $13 = the block's fp32 scale; $14 = acc in."""
    body = []
    for i in range(4):
        w, xl, xh = f"${1 + i}", f"${5 + i}", f"${9 + i}"
        first = i == 0
        body += [f"shl.b32 t, {w}, 4;", "and.b32 t, t, 0x80808080;", f"shl.b32 lo, {w}, 2;",
                 "and.b32 lo, lo, 0x1C1C1C1C;", "or.b32 lo, lo, t;", f"shr.b32 t, {w}, 2;",
                 "and.b32 t, t, 0x1C1C1C1C;", f"and.b32 hi, {w}, 0x80808080;", "or.b32 hi, hi, t;",
                 "mov.b32 {b0, b1}, lo;", "mov.b32 {b2, b3}, hi;",
                 "cvt.rn.f16x2.e4m3x2 h0, b0;", "cvt.rn.f16x2.e4m3x2 h1, b1;",
                 "cvt.rn.f16x2.e4m3x2 h2, b2;", "cvt.rn.f16x2.e4m3x2 h3, b3;",
                 f"mov.b64 {{a0, a1}}, {xl};", f"mov.b64 {{a2, a3}}, {xh};",
                 "mul.rn.f16x2 c0, h0, a0;" if first else "fma.rn.f16x2 c0, h0, a0, c0;",
                 "mul.rn.f16x2 c1, h1, a1;" if first else "fma.rn.f16x2 c1, h1, a1, c1;",
                 "fma.rn.f16x2 c0, h2, a2, c0;", "fma.rn.f16x2 c1, h3, a3, c1;"]
    body += ["add.rn.f16x2 c0, c0, c1;", "mov.b32 {f0, f1}, c0;", "cvt.f32.f16 v0, f0;", "cvt.f32.f16 v1, f1;",
             "add.rn.f32 v0, v0, v1;", "fma.rn.f32 $0, v0, $13, $14;"]
    return ("{\n.reg .b32 t, lo, hi, h0, h1, h2, h3, a0, a1, a2, a3, c0, c1;\n.reg .b16 b0, b1, b2, b3, f0, f1;\n"
            ".reg .f32 v0, v1;\n" + "\n".join(body) + "\n}")


# The f16-accumulating variant (MoeConfig.acc16): per 32-block (4 words) the codes go e2m1 -> e4m3 bytes (as
# above) -> f16x2 and multiply-add packed against f16 activation codes (a_q·2^-4, exact), two f16x2 chains; the
# block's sum is widened to fp32 and scaled once (2^(e - 127) · the activation block's 2^(s + 10)). Every product
# is exact in f16 (at most 6 significant bits, |sum| <= 32·(6/64)·28 = 84), so the only difference from the fp32
# path is the f16 rounding of the running in-block sums (relative ~1e-4 of a block, well inside BF16 output
# rounding), and the instruction count per weight element drops from ~4.7 to ~2.4 (no per-element fp32 widening).
_MX_DOT32H_ASM = tl.constexpr(_mx_dot32h_asm())


@triton.jit
def _mx_dot32h(acc, w0, w1, w2, w3, l0, l1, l2, l3, h0, h1, h2, h3, sc):
    return tl.inline_asm_elementwise(_MX_DOT32H_ASM, "=f,r,r,r,r,l,l,l,l,l,l,l,l,f,f",
                                     [w0, w1, w2, w3, l0, l1, l2, l3, h0, h1, h2, h3, sc, acc],
                                     dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _mx_gemv16_load(w_ptrs, x_ptrs, K8, xs_ptrs, mw, mb, mn, EVEN: tl.constexpr):
    """One K step's operands of `_mx_gemv16_dot`: the weight words [ROWS, BW] at w_ptrs, the f16 activation code
    planes 0 and 1 (int64 [1, BW] at x_ptrs and x_ptrs + K8) and the activation block scales at xs_ptrs. EVEN: no
    masks."""
    if EVEN:
        w = tl.load(w_ptrs)
        xl = tl.load(x_ptrs[None, :])
        xh = tl.load(x_ptrs[None, :] + K8)
        xs = tl.load(xs_ptrs[None, :])
    else:
        w = tl.load(w_ptrs, mask=mn[:, None] & mw[None, :], other=0)
        xl = tl.load(x_ptrs[None, :], mask=mw[None, :], other=0)
        xh = tl.load(x_ptrs[None, :] + K8, mask=mw[None, :], other=0)
        xs = tl.load(xs_ptrs[None, :], mask=mb[None, :], other=0.0)
    return w, xl, xh, xs


@triton.jit
def _mx_gemv16_dot(acc, w, s, xl, xh, xs, ROWS: tl.constexpr, BW: tl.constexpr):
    """acc [ROWS, BW/4] += the scaled dot of each row's BW words (BW/4 32-blocks, e8m0 scales s) with the
    activation codes (`_mx_gemv16_load`)."""
    # the activation rows are loaded 2-D [1, BW] and split like the weight tile, so they land in its layout
    w0, w1, w2, w3 = split4(tl.reshape(w, (ROWS, BW // 4, 2, 2)))
    l0, l1, l2, l3 = split4(tl.reshape(xl, (1, BW // 4, 2, 2)))
    h0, h1, h2, h3 = split4(tl.reshape(xh, (1, BW // 4, 2, 2)))
    sc = e8m0_to_f32(s) * xs
    return _mx_dot32h(acc, w0, w1, w2, w3, l0, l1, l2, l3, h0, h1, h2, h3, sc)


@triton.jit
def _mx_gemv16_step(acc, w_ptrs, s, x_ptrs, K8, xs_ptrs, mw, mb, mn,
                    ROWS: tl.constexpr, BW: tl.constexpr, EVEN: tl.constexpr):
    """acc [ROWS, BW/4] += one K step (`_mx_gemv16_load`, then `_mx_gemv16_dot`; e8m0 scales s loaded by the
    caller)."""
    w, xl, xh, xs = _mx_gemv16_load(w_ptrs, x_ptrs, K8, xs_ptrs, mw, mb, mn, EVEN)
    return _mx_gemv16_dot(acc, w, s, xl, xh, xs, ROWS, BW)


@triton.jit
def _mx_row_dots(w_e, s_e, rows, mn, x_ptr, xs_ptr, xi, K, K8, pid_k, SPLIT: tl.constexpr, ROWS: tl.constexpr,
                 BW: tl.constexpr, NUM_STAGES: tl.constexpr, EVEN: tl.constexpr, ACC16: tl.constexpr,
                 UNROLL: tl.constexpr = 0):
    """The decode GEMVs' K loop: [ROWS] fp32 dots of weight rows `rows` of one expert (words at w_e, e8m0 scales at
    s_e) with activation row xi, over K slice pid_k of SPLIT; the activation in the fp32 GEMV layout at x_ptr, or
    (ACC16) as f16 codes at x_ptr with block scales at xs_ptr."""
    ow = tl.arange(0, BW)
    wrow = rows[:, None] * K8 + ow[None, :]                  # int32 words [ROWS, BW] within the expert
    per = tl.cdiv(tl.cdiv(K8, BW), SPLIT) * BW
    k_lo = pid_k * per
    k_hi = tl.minimum(k_lo + per, K8)
    # The e8m0 scales are 1-byte loads Triton cannot stream by cp.async: each iteration loads the next one's while
    # its own dots run, so no iteration waits on a global load (on one TP8 rank few programs share an SM to hide it).
    if ACC16:
        ob = tl.arange(0, BW // 4)
        srow = s_e + rows[:, None] * (K // 32) + ob[None, :]   # one e8m0 per 32-block
        xrow = x_ptr + xi * (K // 4) + ow                    # int64 view of the f16 codes [2, K/8, 4]
        xsrow = xs_ptr + xi * (K // 32) + ob
        acc = tl.zeros([ROWS, BW // 4], dtype=tl.float32)
        if UNROLL > 0:
            # (MoeConfig.unroll13) the slice's UNROLL steps unrolled, each step's operands (weights, scales,
            # activations) loaded into registers NUM_STAGES steps ahead: no shared-memory staging, no barrier
            ops = ()
            for j in tl.static_range(UNROLL + NUM_STAGES):   # load step j, then run step j - NUM_STAGES
                if j < UNROLL:
                    k8 = k_lo + j * BW
                    ops = ops + (_mx_gemv16_load(w_e + wrow + k8, xrow + k8, K8, xsrow + k8 // 4, k8 + ow < k_hi,
                                                 k8 // 4 + ob < k_hi // 4, mn, EVEN)
                                 + (_mx_scales(srow, k8, k_hi, ob * 4, K8, mn), ), )
                if j >= NUM_STAGES:
                    w, xl, xh, xs, s = ops[j - NUM_STAGES]
                    acc = _mx_gemv16_dot(acc, w, s, xl, xh, xs, ROWS, BW)
            return tl.sum(acc, axis=1)
        s = _mx_scales(srow, k_lo, k_hi, ob * 4, K8, mn)
        for k8 in tl.range(k_lo, k_hi, BW, num_stages=NUM_STAGES):
            s_next = _mx_scales(srow, k8 + BW, k_hi, ob * 4, K8, mn)
            acc = _mx_gemv16_step(acc, w_e + wrow + k8, s, xrow + k8, K8, xsrow + k8 // 4,
                                  k8 + ow < K8, k8 // 4 + ob < K // 32, mn, ROWS, BW, EVEN)
            s = s_next
    else:
        srow = s_e + rows[:, None] * (K // 32) + (ow // 4)[None, :]   # one e8m0 per 4 words
        xrow = x_ptr + xi * (K // 2) + ow                    # int64 view of the pair-permuted fp32 row
        acc = tl.zeros([ROWS, BW], dtype=tl.float32)
        s = _mx_scales(srow, k_lo, k_hi, ow, K8, mn)
        for k8 in tl.range(k_lo, k_hi, BW, num_stages=NUM_STAGES):
            s_next = _mx_scales(srow, k8 + BW, k_hi, ow, K8, mn)
            mw = k8 + ow < K8
            xa, xb, xc, xd = _mx_load_x(xrow + k8, K8, mw, EVEN)
            acc = _mx_gemv_step(acc, w_e + wrow + k8, s, xa, xb, xc, xd, mw, mn, EVEN)
            s = s_next
    return tl.sum(acc, axis=1)


@triton.jit
def _mx_scales(srow, k8, k_hi, word, K8, mn):
    """The e8m0 scales of the words k8 + word of each row (srow: the rows' scale pointers at word 0, one scale per
    4 words); 0 at or past k_hi (the slice's end) or K8, and for masked rows."""
    w = k8 + word
    return tl.load(srow + k8 // 4, mask=mn[:, None] & ((w < k_hi) & (w < K8))[None, :], other=0)


@triton.jit
def _pair_perm(n, N):
    """Index of element n of a row of N in the pair-permuted fp32 layout [4, N/8, 2]."""
    return ((n % 8) // 2) * (N // 4) + (n // 8) * 2 + n % 2


@triton.jit
def _pair_perm16(n, N):
    """Index of element n of a row of N in the f16-code layout [2, N/8, 4] (`gemv16_act`)."""
    return (n % 2) * (N // 2) + (n // 8) * 4 + (n % 8) // 2


@triton.jit
def _listed_pair(list_ptr, s, n):
    """Entry s of a rank's pair list (`router` with pairs): (pair index t·k + j, local expert as int64). The entry is
    loaded whether or not s < count (masked only past the list's n = T·k), so that load and the count's are one round
    trip, not three dependent ones (count, pair, then the pair's id)."""
    v = tl.load(list_ptr + s, mask=s < n, other=0)
    return v >> PAIR_BITS, (v & (PAIR_SHIFT - 1)).to(tl.int64)


@triton.jit
def _gemv_pids(COMPACT: tl.constexpr):
    """A decode GEMV program's (pair row, N tile, K slice) and the grid's row and tile counts. Grid (rows, tiles,
    slices); with a pair list (COMPACT) (tiles, slices, rows): CTAs are dispatched in pair-row order, so the programs
    of the listed pairs (the first rows) all start before any spare row's empty ones, which otherwise take dispatch
    slots among them (an EP8 rank at M = 3: 27.7 -> 22.1 µs; benchmarks/README.md, session 14)."""
    if COMPACT:
        return tl.program_id(2), tl.program_id(0), tl.program_id(1), tl.num_programs(2), tl.num_programs(0)
    return tl.program_id(0), tl.program_id(1), tl.program_id(2), tl.num_programs(0), tl.num_programs(1)


@triton.jit
def _moe_w13_gemv_kernel(xp_ptr, xs_ptr, w13_ptr, s13_ptr, hp_ptr, hs_ptr, ids_ptr, topw_ptr, ws_ptr, cnt_ptr,
                         out_ptr, sh_ptr, D_OUT, stride_o, stride_sh,
                         N, N_VALID, K, TOPK, E, limit, list_ptr, count_ptr, T, SPLIT: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, EVEN: tl.constexpr,
                         ACC16: tl.constexpr, INIT_OUT: tl.constexpr, COMPACT: tl.constexpr, PASSES: tl.constexpr,
                         QB: tl.constexpr, UNROLL: tl.constexpr):
    """Pair p = t·k + j, intermediate rows [pid_n·BN, +BN) of w1 and the same rows of w3 (one [2·BN, BK] tile of
    the stacked w13 [E, 2N, K/2]), K slice pid_k of SPLIT: g, u, then the w13 epilogue; h is written in the
    pair-permuted fp32 layout the w2 GEMV reads. With SPLIT > 1 the slices' g|u partials go to an fp32 workspace
    and the last program of the tile to arrive (acq_rel counter, reset by it) sums them in slice order and runs
    the epilogue. ACC16: the activation is in the f16-code layout (xp codes, xs block scales) and so is h (hp, hs),
    the f16-accumulating GEMV (`_mx_gemv16_step`). INIT_OUT (1: zeros, 2: the shared expert's output sh): the
    programs of each token's first pair also write out [T, D_OUT] fp32, the buffer the w2 GEMV adds into, so the
    MoE needs no separate launch for it; 3 (deterministic mode): out is [T·k, D_OUT] and every pair's programs zero
    its row. A pair routed to another EP rank (id E) does nothing else.
    COMPACT (expert parallelism): program row pid_0 runs the pairs list[pid_0 + i·rows], i < PASSES, of the
    count_ptr pairs this rank holds (`router` with a pair list; rows·PASSES >= T·k), so the grid is sized for this
    rank's share of the pairs, not all T·k; every program then writes a share of out's starting value."""
    pid0, pid_n, pid_k, n_rows, n_tiles = _gemv_pids(COMPACT)
    gdc_wait()                  # launched with PDL (MoeConfig.pdl): the previous kernel's outputs are ready from here
    gdc_launch_dependents()
    if COMPACT:
        if INIT_OUT > 0:
            _init_out_listed(out_ptr, sh_ptr, T, TOPK, D_OUT, stride_o, stride_sh,
                             (pid0 * n_tiles + pid_n) * SPLIT + pid_k, n_rows * n_tiles * SPLIT, INIT_OUT,
                             _init_out_share)
        count = tl.load(count_ptr)
        for i in tl.static_range(PASSES):   # (unrolled: a loop around the pipelined K loop doubles the registers)
            s = pid0 + i * n_rows
            p, e = _listed_pair(list_ptr, s, T * TOPK)
            if s < count:
                _w13_pair(xp_ptr, xs_ptr, w13_ptr, s13_ptr, hp_ptr, hs_ptr, topw_ptr, ws_ptr, cnt_ptr, p, e, pid_n,
                          pid_k, n_tiles, N, N_VALID, K, TOPK, limit, SPLIT, BLOCK_N, BLOCK_K, NUM_STAGES, EVEN, ACC16,
                          QB, UNROLL)
    else:
        p = pid0
        e = tl.load(ids_ptr + p).to(tl.int64)
        if INIT_OUT > 0:
            _init_out_pair(out_ptr, sh_ptr, p, TOPK, D_OUT, stride_o, stride_sh, pid_n * SPLIT + pid_k,
                           n_tiles * SPLIT, INIT_OUT, _init_out_share)
        if e < E:
            _w13_pair(xp_ptr, xs_ptr, w13_ptr, s13_ptr, hp_ptr, hs_ptr, topw_ptr, ws_ptr, cnt_ptr, p, e, pid_n, pid_k,
                      n_tiles, N, N_VALID, K, TOPK, limit, SPLIT, BLOCK_N, BLOCK_K, NUM_STAGES, EVEN, ACC16, QB,
                      UNROLL)


@triton.jit
def _w13_pair(xp_ptr, xs_ptr, w13_ptr, s13_ptr, hp_ptr, hs_ptr, topw_ptr, ws_ptr, cnt_ptr, p, e, pid_n, pid_k,
              n_tiles, N, N_VALID, K, TOPK, limit, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              NUM_STAGES: tl.constexpr, EVEN: tl.constexpr, ACC16: tl.constexpr, QB: tl.constexpr,
              UNROLL: tl.constexpr):
    """`_moe_w13_gemv_kernel`'s work for pair p on (local) expert e. A tile wholly past the logical width N_VALID
    (the zero rows the converter pads a TP rank's slice with: one 32-row tile of 320 on a TP8 rank) reads no
    weights: its first K slice writes h = 0 there (w2 reads h's padded columns), the other slices do nothing."""
    t = p // TOPK
    BW: tl.constexpr = BLOCK_K // 8
    K8 = tl.multiple_of(K // 8, 4)        # K % 32 == 0: rows of words start 16-byte aligned
    r = tl.arange(0, 2 * BLOCK_N)
    if pid_n * BLOCK_N >= N_VALID:
        if pid_k == 0:
            _w13_epilogue(tl.zeros([2 * BLOCK_N], tl.float32), hp_ptr, hs_ptr, topw_ptr, p, pid_n, N, N_VALID, limit,
                          BLOCK_N, ACC16, QB)
    else:
        rows = (r // BLOCK_N) * N + pid_n * BLOCK_N + r % BLOCK_N          # w1 rows, then the same w3 rows
        mn = pid_n * BLOCK_N + r % BLOCK_N < N
        w_e = w13_ptr + e * 2 * N * K8
        s_e = s13_ptr + e * 2 * N * (K // 32)
        gu = _mx_row_dots(w_e, s_e, rows, mn, xp_ptr, xs_ptr, t.to(tl.int64), K, K8, pid_k, SPLIT, 2 * BLOCK_N, BW,
                          NUM_STAGES, EVEN, ACC16, UNROLL)
        if SPLIT == 1:
            _w13_epilogue(gu, hp_ptr, hs_ptr, topw_ptr, p, pid_n, N, N_VALID, limit, BLOCK_N, ACC16, QB)
        else:
            tile = p * n_tiles + pid_n
            wsp = ws_ptr + tile.to(tl.int64) * SPLIT * 2 * BLOCK_N
            if splitk_arrive(gu, wsp, r, r >= 0, cnt_ptr, tile, pid_k, SPLIT, 2 * BLOCK_N):
                tot = splitk_total(wsp, r, r >= 0, cnt_ptr, tile, SPLIT, 2 * BLOCK_N, SPLIT)
                _w13_epilogue(tot, hp_ptr, hs_ptr, topw_ptr, p, pid_n, N, N_VALID, limit, BLOCK_N, ACC16, QB)


@triton.jit
def _init_out_listed(out_ptr, sh_ptr, T, TOPK, D, stride_o, stride_sh, i, n, MODE: tl.constexpr,
                     SHARE: tl.constexpr):
    """A decode w13's output start on an EP rank's pair-list grid (INIT_OUT = MODE, 1-3): program i of n writes its
    share of all T rows of out, or (3) of all T·k pair rows. (Scalar-only, so the Gluon w13 calls it with its SHARE.)"""
    if MODE == 3:
        _init_out_rows(out_ptr, sh_ptr, T * TOPK, D, stride_o, stride_sh, i, n, False, SHARE)
    else:
        _init_out_rows(out_ptr, sh_ptr, T, D, stride_o, stride_sh, i, n, MODE == 2, SHARE)


@triton.jit
def _init_out_pair(out_ptr, sh_ptr, p, TOPK, D, stride_o, stride_sh, i, n, MODE: tl.constexpr, SHARE: tl.constexpr):
    """A decode w13's output start on the full grid (INIT_OUT = MODE, 1-3), share i of n by pair p's programs: the
    row of p's token if p is its first pair, or (3) p's own row, another EP rank's pair included."""
    if MODE == 3:
        SHARE(out_ptr, sh_ptr, p.to(tl.int64), D, stride_o, stride_sh, i, n, False)
    elif p % TOPK == 0:
        SHARE(out_ptr, sh_ptr, (p // TOPK).to(tl.int64), D, stride_o, stride_sh, i, n, MODE == 2)


@triton.jit
def _init_out_rows(out_ptr, sh_ptr, T, D, stride_o, stride_sh, i, n, COPY: tl.constexpr, SHARE: tl.constexpr):
    """Program i of n writes its share of all T rows of out (SHARE: `_init_out_share`, or the Gluon kernels' own,
    which has layouts): n // T programs per row, or whole rows i, i + n, ... when there are fewer programs than rows."""
    if n >= T:
        per_row = n // T
        t = i // per_row
        if t < T:
            SHARE(out_ptr, sh_ptr, t.to(tl.int64), D, stride_o, stride_sh, i % per_row, per_row, COPY)
    else:
        for t in range(i, T, n):
            SHARE(out_ptr, sh_ptr, t.to(tl.int64), D, stride_o, stride_sh, 0, 1, COPY)


@triton.jit
def _init_out_share(out_ptr, sh_ptr, t, D, stride_o, stride_sh, i, n, COPY: tl.constexpr):
    """Share i of n of row t of out: out[t] = sh[t] as fp32 (COPY), else 0."""
    BLOCK: tl.constexpr = 256
    per = tl.cdiv(tl.cdiv(D, n), BLOCK) * BLOCK
    lo = i * per
    hi = tl.minimum(lo + per, D)
    for c in tl.range(lo, hi, BLOCK):
        o = c + tl.arange(0, BLOCK)
        if COPY:
            v = tl.load(sh_ptr + t * stride_sh + o, mask=o < hi, other=0.0).to(tl.float32)
        else:
            v = tl.zeros([BLOCK], dtype=tl.float32)
        tl.store(out_ptr + t * stride_o + o, v, mask=o < hi)


@triton.jit
def _w13_epilogue(gu, hp_ptr, hs_ptr, topw_ptr, p, pid_n, N, N_VALID, limit, BLOCK_N: tl.constexpr,
                  ACC16: tl.constexpr, QB: tl.constexpr):
    """g|u [2·BN] -> clipped SwiGLU × routing weight -> BF16 -> FP8 1×QB fake quant -> h: pair-permuted fp32 ×2^6,
    or (ACC16) f16 codes ×2^-4 [2, N/8, 4] + block scales ×2^10 (`gemv16_act`)."""
    g, u = tl.split(tl.trans(tl.reshape(gu, (2, BLOCK_N))))
    if limit > 0:
        u = tl.minimum(tl.maximum(u, -limit), limit)
        g = tl.minimum(g, limit)
    h = g / (1.0 + tl.exp(-g)) * u * tl.load(topw_ptr + p)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    h = tl.where(offs_n < N_VALID, h, 0.0)
    h = tl.reshape(h.to(tl.bfloat16).to(tl.float32), (BLOCK_N, 1))
    if ACC16:
        q, sc = _quant_cols(h, BLOCK_N, 1, QB)
        tl.store(hp_ptr + p.to(tl.int64) * N + _pair_perm16(offs_n, N), tl.reshape(q, (BLOCK_N,)) * 0.0625,
                 mask=offs_n < N)
        offs_b = pid_n * (BLOCK_N // 32) + tl.arange(0, BLOCK_N // 32)
        tl.store(hs_ptr + p.to(tl.int64) * (N // 32) + offs_b, tl.reshape(sc, (BLOCK_N // 32,)) * 1024.0,
                 mask=offs_b < N // 32)
    else:
        h = tl.reshape(_fake_quant_cols(h, BLOCK_N, 1, QB), (BLOCK_N,))
        tl.store(hp_ptr + p.to(tl.int64) * N + _pair_perm(offs_n, N), h * 64.0, mask=offs_n < N)


@triton.jit
def _moe_w2_gemv_kernel(hp_ptr, hs_ptr, w2_ptr, s2_ptr, out_ptr, ids_ptr, N, K, TOPK, E, stride_o, list_ptr, count_ptr,
                        T, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                        EVEN: tl.constexpr, ACC16: tl.constexpr, COMPACT: tl.constexpr, PASSES: tl.constexpr):
    """Pair p, output features [pid_n·BN, +BN), K slice pid_k of SPLIT: y = h_p·W2[e]ᵀ, atomically added (fp32)
    into out[t] (the reduction over slots, slices and the shared expert's output is the same atomic sum).
    ACC16: h in the f16-code layout (hp codes, hs block scales), the f16-accumulating GEMV. A pair routed to
    another EP rank (id E) is skipped; COMPACT: program row pid_0 runs the listed pairs as `_moe_w13_gemv_kernel`."""
    pid0, pid_n, pid_k, n_rows, n_tiles = _gemv_pids(COMPACT)
    gdc_wait()                  # launched with PDL (MoeConfig.pdl, pdl2): the previous kernel's outputs are ready here
    gdc_launch_dependents()
    if COMPACT:
        count = tl.load(count_ptr)
        for i in tl.static_range(PASSES):   # (unrolled: see `_moe_w13_gemv_kernel`)
            s = pid0 + i * n_rows
            p, e = _listed_pair(list_ptr, s, T * TOPK)
            if s < count:
                _w2_pair(hp_ptr, hs_ptr, w2_ptr, s2_ptr, out_ptr, p, e, pid_n, pid_k, N, K, TOPK, stride_o, SPLIT,
                         BLOCK_N, BLOCK_K, NUM_STAGES, EVEN, ACC16)
    else:
        e = tl.load(ids_ptr + pid0).to(tl.int64)
        if e < E:
            _w2_pair(hp_ptr, hs_ptr, w2_ptr, s2_ptr, out_ptr, pid0, e, pid_n, pid_k, N, K, TOPK, stride_o, SPLIT,
                     BLOCK_N, BLOCK_K, NUM_STAGES, EVEN, ACC16)


@triton.jit
def _w2_pair(hp_ptr, hs_ptr, w2_ptr, s2_ptr, out_ptr, p, e, pid_n, pid_k, N, K, TOPK, stride_o, SPLIT: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, EVEN: tl.constexpr,
             ACC16: tl.constexpr):
    """`_moe_w2_gemv_kernel`'s work for pair p on (local) expert e."""
    t = p // TOPK
    BW: tl.constexpr = BLOCK_K // 8
    K8 = tl.multiple_of(K // 8, 4)        # K % 32 == 0: rows of words start 16-byte aligned
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = offs_n < N
    w2_e = w2_ptr + e * N * K8
    s2_e = s2_ptr + e * N * (K // 32)
    y = _mx_row_dots(w2_e, s2_e, offs_n, mn, hp_ptr, hs_ptr, p.to(tl.int64), K, K8, pid_k, SPLIT, BLOCK_N, BW,
                     NUM_STAGES, EVEN, ACC16)
    tl.atomic_add(out_ptr + t.to(tl.int64) * stride_o + offs_n, y, mask=mn, sem="relaxed")


# -- wrappers ---------------------------------------------------------------------------------------------------------
def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def gemv_act(xq: torch.Tensor) -> torch.Tensor:
    """Natural [T, D] fake-quantized activation -> the fp32 decode GEMV's layout: fp32 [T, 4, D/4], entry
    (q, 2j + l) = 2^6·x[8j + 2q + l] (exact)."""
    t, d = xq.shape
    return (xq.float() * 64.0).view(t, d // 8, 4, 2).permute(0, 2, 1, 3).reshape(t, 4, d // 4).contiguous()


def gemv16_act(xq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Natural [T, D] FP8 1×32 fake-quantized activation -> the f16-accumulating GEMV's layout: (codes f16
    [T, 2, D/8, 4], entry (p, j, i) = c[8j + 2i + p]·2^-4, and block scales fp32 [T, D/32] = 2^(e + 10)), where
    x = c·2^e per 32-block with |c| <= 448 (the e4m3 codes, recovered exactly from the pow2 block scale)."""
    t, d = xq.shape
    v = xq.float().view(t, d // QBLOCK, QBLOCK)
    e = torch.ceil(torch.log2(v.abs().amax(-1).clamp_min(1e-30) / 448.0))
    codes = (v * torch.exp2(-e)[..., None] * 0.0625).view(t, d // 8, 4, 2).permute(0, 3, 1, 2)
    return codes.to(torch.float16).contiguous(), torch.exp2(e + 10.0).contiguous()


def natural_act(xq) -> torch.Tensor:
    """Any of the expert GEMMs' activation layouts (BF16 [T, D], `gemv_act`'s, `gemv16_act`'s) -> BF16 [T, D]."""
    if isinstance(xq, tuple):
        codes, sc = xq
        t, d = codes.shape[0], codes.shape[2] * 8
        v = codes.float().permute(0, 2, 3, 1).reshape(t, d // QBLOCK, QBLOCK) * (sc / 64.0)[..., None]
        return v.reshape(t, d).to(torch.bfloat16)
    if xq.dim() == 3:
        t, d = xq.shape[0], xq.shape[1] * xq.shape[2]
        return (xq / 64.0).view(t, 4, d // 8, 2).permute(0, 2, 1, 3).reshape(t, d).to(torch.bfloat16)
    return xq


def as_layout(xq, layout: str):
    """The activation in `layout` ("bf16", "gemv", "gemv16"), converted only when it is in another one."""
    have = "gemv16" if isinstance(xq, tuple) else ("gemv" if xq.dim() == 3 else "bf16")
    if have == layout:
        return xq
    nat = natural_act(xq)
    if layout == "gemv":
        return gemv_act(nat)
    return gemv16_act(nat) if layout == "gemv16" else nat


class LocalPairs(NamedTuple):
    """This EP rank's (token, expert) pairs as the router lists them: index int32 [T·k] (the first count are entries
    `pair_entry(t·k + j, local expert)`, in no particular order), count int32 [1]."""
    index: torch.Tensor
    count: torch.Tensor


def pair_entry(pair, expert):
    """A pair-list entry: pair index t·k + j (< 2^15) in the high half, the local expert (< 2^16) in the low half."""
    return pair * PAIR_SHIFT.value + expert


def local_pairs(t: int, topk: int, device) -> LocalPairs:
    """Buffers for `router(..., pairs=)` (filled on the device: no host sync)."""
    return LocalPairs(torch.empty(t * topk, dtype=torch.int32, device=device),
                      torch.empty(1, dtype=torch.int32, device=device))


@dataclasses.dataclass(frozen=True)
class RouterTiles:
    """Launch shape of the two router kernels: logits tiles (block_t tokens × block_e experts × block_k, `split` K
    slices, `warps`) and the top-k kernel's tokens per program and warps."""
    block_t: int
    block_e: int
    block_k: int
    split: int
    warps: int
    topk_t: int
    topk_warps: int


def router_tiles(t: int, e: int, d: int, qblock: int = QBLOCK) -> RouterTiles:
    """The router's launch shape for T tokens, E experts, hidden D (H200 sweep, benchmarks/router_sweep_h200.json):
    64-expert × 128-K logits tiles on 8 warps, K split for ~2 programs per SM (at most 20 slices), and one token per
    top-k program (its k selection passes are latency-bound: more tokens per program only serialise them). Above
    64 tokens (not swept): 32-expert × 64-K tiles on 4 warps, 4 tokens per top-k program. A K tile holds whole
    quantization blocks of the activation the logits kernel also writes (qblock: 32, or V4's 128)."""
    if t > 64:
        tiles = triton.cdiv(e, 32) * triton.cdiv(t, 64)
        bk = max(_div(d, 64, 32), qblock)
        split = max(1, min(-(-2 * 132 // tiles), d // bk // 2, 16))
        return RouterTiles(64, 32, bk, split, 4, max(1, min(16, 2048 // triton.next_power_of_2(e))), 4)
    bt = 16 if t <= 16 else 64
    bk = max(_div(d, 128, 32), qblock)
    tiles = triton.cdiv(e, 64) * triton.cdiv(t, bt)
    split = max(1, min(-(-2 * 132 // tiles), d // bk, 20))
    return RouterTiles(bt, 64, bk, split, 8, 1, 4)


def router(x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor | None, topk: int, route_scale: float,
           gate_temp: float = 1.0, norm: bool = True, eps: float = ROUTER_NORM_EPS, xq_layout: str | None = "bf16",
           expert_start: int = 0, local_experts: int | None = None, pairs: LocalPairs | None = None,
           qblock: int = QBLOCK, hash_ids: torch.Tensor | None = None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None]:
    """x [T, D] BF16, gate_w [E, D] BF16, bias fp32 [E] or [T, E] (a row per token: V4.1 selects with `bias_vl` on
    image tokens) -> (weights fp32 [T, k], ids int32 [T, k], xq): xq = the FP8
    1×32 fake-quantized activation the expert GEMMs read, BF16 [T, D] (xq_layout "bf16"), or in a decode GEMV's
    layout: fp32 [T, 4, D/4] ("gemv", see `gemv_act`) or (f16 codes, block scales) ("gemv16", see `gemv16_act`);
    or None. Expert parallelism: with local_experts = L the ids are local to the experts [expert_start,
    expert_start + L) of this rank, and a pick of another rank's expert is L (`refs.local_expert_ids`); the weights
    stay normalised over all k picks. pairs (`local_pairs`): also list the pairs t·k + j picked on this rank there,
    for the decode GEMVs to run only those. qblock: the activation's quantization block (32; V4: 128, D % 128 == 0).
    hash_ids (V4's hash-routed layers): the picks, int32 [T, k] (`tid2eid` of the tokens); bias is then unused (may
    be None)."""
    assert x.dim() == 2 and x.dtype == torch.bfloat16 and x.stride(1) == 1, (tuple(x.shape), x.dtype)
    assert gate_w.dtype == torch.bfloat16 and gate_w.is_contiguous() and gate_w.shape[1] == x.shape[1]
    assert xq_layout in (None, "bf16", "gemv", "gemv16"), xq_layout
    t, d = x.shape
    e = gate_w.shape[0]
    assert (bias is None and hash_ids is not None) or (
        bias is not None and bias.shape in ((e,), (t, e)) and bias.dtype == torch.float32 and bias.is_contiguous()), \
        f"router bias must be fp32 [{e}] or [{t}, {e}], contiguous (None only with hash_ids), got " \
        f"{None if bias is None else (bias.dtype, tuple(bias.shape))}"
    assert d % QBLOCK == 0 and 1 <= topk <= e
    assert qblock in (32, 128) and d % qblock == 0, f"router: D={d} is not whole {qblock}-wide quantization blocks"
    if hash_ids is not None:
        assert hash_ids.shape == (t, topk) and hash_ids.dtype == torch.int32 and hash_ids.is_contiguous(), \
            f"hash_ids must be int32 [{t}, {topk}] contiguous, got {hash_ids.dtype} {tuple(hash_ids.shape)}"
    local_experts = e if local_experts is None else local_experts
    assert 0 <= expert_start and 1 <= local_experts and expert_start + local_experts <= e, \
        f"EP expert range [{expert_start}, {expert_start} + {local_experts}) is not inside the router's {e} experts"
    dev = x.device
    ids = torch.empty((t, topk), dtype=torch.int32, device=dev)
    w = torch.empty((t, topk), dtype=torch.float32, device=dev)
    xq = None
    if xq_layout == "bf16":
        xq = torch.empty((t, d), dtype=torch.bfloat16, device=dev)
    elif xq_layout == "gemv":
        xq = torch.empty((t, 4, d // 4), dtype=torch.float32, device=dev)
    elif xq_layout == "gemv16":
        xq = (torch.empty((t, 2, d // 8, 4), dtype=torch.float16, device=dev),
              torch.empty((t, d // QBLOCK), dtype=torch.float32, device=dev))
    if t == 0:
        return w, ids, xq
    rt = router_tiles(t, e, d, qblock)
    logits = torch.empty((rt.split, t, e), dtype=torch.float32, device=dev)
    xq_out, xs_out = xq if isinstance(xq, tuple) else (x if xq is None else xq, logits)   # (unused ones: any)
    if pairs is not None:
        assert pairs.index.shape == (t * topk,) and pairs.index.dtype == torch.int32 and pairs.count.numel() == 1, \
            f"pairs must list up to T·k = {t * topk} int32 pair indices (`local_pairs`)"
        assert t * topk < 1 << 15 and local_experts < PAIR_SHIFT.value, \
            f"a pair list holds pair << 16 | expert: T·k = {t * topk} must be < 32768 (a decode batch)"
    plist, pcount = (ids, ids) if pairs is None else (pairs.index, pairs.count)   # (unused ones: any)
    _router_logits_kernel[(triton.cdiv(e, rt.block_e), triton.cdiv(t, rt.block_t), rt.split)](
        x, gate_w, logits, xq_out, xs_out, pcount, t, e, d,
        x.stride(0), gate_w.stride(0), e, d, rt.split, t * e, BLOCK_E=rt.block_e, BLOCK_T=rt.block_t,
        BLOCK_K=rt.block_k, NUM_STAGES=3, WRITE_XQ=xq is not None, XQ_MODE={"gemv": 1, "gemv16": 2}.get(xq_layout, 0),
        ZERO_COUNT=pairs is not None, QB=qblock, num_warps=rt.warps)
    _router_topk_kernel[(triton.cdiv(t, rt.topk_t),)](
        logits, w if bias is None else bias, ids, w, t, e, e, 0 if bias is None or bias.dim() == 1 else e, t * e,
        float(gate_temp), float(route_scale),
        float(eps), expert_start, local_experts, plist, pcount, ids if hash_ids is None else hash_ids,
        SPLIT=rt.split, TOPK=topk, KP=triton.next_power_of_2(topk), NORM=bool(norm and topk > 1),
        COMPACT=pairs is not None, NB_E=triton.next_power_of_2(e), BLOCK_T=rt.topk_t, HASH=hash_ids is not None,
        num_warps=rt.topk_warps)
    return w, ids, xq


def max_blocks(pairs: int, n_experts: int, block_m: int) -> int:
    """Worst-case number of BLOCK_M-padded expert blocks for `pairs` (token, slot) pairs (shape-only: no sync)."""
    return triton.cdiv(pairs, block_m) + min(n_experts, pairs)


def moe_align(ids: torch.Tensor, n_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids int32 [T, k] -> (sorted pair ids int32 [max_blocks·BM] (sentinel T·k), offsets int32 [E + 1])."""
    assert ids.dtype == torch.int32 and ids.is_contiguous()
    p = ids.numel()
    nb = triton.next_power_of_2(n_experts + 1)
    slots = max_blocks(p, n_experts, block_m) * block_m
    sorted_ids = torch.empty(slots, dtype=torch.int32, device=ids.device)
    off = torch.empty(n_experts + 1, dtype=torch.int32, device=ids.device)
    cnt = torch.empty(nb, dtype=torch.int32, device=ids.device)
    _moe_align_kernel[(1,)](ids, sorted_ids, off, cnt, p, n_experts, slots, BLOCK_M=block_m, NB_E=nb,
                            BLOCK=1024, num_warps=8)
    return sorted_ids, off


def stack_w13(w1: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """[E, I, ...] w1 and w3 (packed codes or scales) -> the stacked [E, 2I, ...] the kernels read (w1 rows first)."""
    return torch.cat([w1, w3], dim=1).contiguous()


def _check_mx(q: torch.Tensor, s: torch.Tensor, e: int, n: int, k: int, name: str) -> None:
    assert q.shape == (e, n, k // 2) and q.dtype in (torch.int8, torch.uint8) and q.is_contiguous(), \
        f"{name}: packed weight must be int8 [E={e}, N={n}, K/2={k // 2}] contiguous, got {tuple(q.shape)} {q.dtype}"
    assert s.shape == (e, n, k // QBLOCK) and s.element_size() == 1 and s.is_contiguous(), \
        f"{name}: scales must be e8m0 [E, N, K/32] contiguous, got {tuple(s.shape)} {s.dtype}"


def gemv_w13(xp, weights: torch.Tensor, ids: torch.Tensor, w13_q: torch.Tensor, w13_s: torch.Tensor,
             inter: int, swiglu_limit: float, cfg: MoeConfig, out: torch.Tensor | None = None,
             shared: torch.Tensor | None = None, pairs: LocalPairs | None = None, slots: int = 0,
             qblock: int = QBLOCK, pair_rows: bool = False):
    """Decode path, first GEMM: h for every (token, slot) pair, in the layout the config's w2 GEMV reads: fp32
    [T·k, I_pad] (pair-permuted ×2^6), or (acc16) f16 codes [T·k, 2, I_pad/8, 4] + block scales [T·k, I_pad/32].
    xp: the activation in `cfg.xq_layout`. With out (fp32 [T, D]) the same launch also sets out to the shared
    expert's output `shared` ([T, D], any float dtype), or to 0 without it; pair_rows (deterministic mode): out is
    [T·k, D] and set to 0, the rows `gemv_w2(pair_rows=True)` adds each pair's output into. pairs (EP, from
    `router`): run only the listed pairs, on `slots` rows of programs (each runs every slots-th listed pair). qblock:
    h's quantization block (32; V4: 128, which a tile of bn13 rows must hold whole). cfg.tc13: the tensor-core w13
    (`moe_tc`, same contract; opt-in, measured slower on the H200)."""
    if cfg.tc13:   # the tensor-core w13 (Gluon): same contract
        from dsflash.plugins.moe_tc import gemv_w13_tc
        assert qblock == QBLOCK, f"{cfg.tag()}: the tensor-core w13 takes 1×32 blocks of h, not {qblock}"
        return gemv_w13_tc(xp, weights, ids, w13_q, w13_s, inter, swiglu_limit, cfg, out, shared, pairs, slots,
                           pair_rows)
    codes, xs = xp if cfg.acc16 else (xp, xp)
    p, d = ids.numel(), codes[0].numel()
    ipad = w13_q.shape[1] // 2
    assert cfg.gemv and ipad % 8 == 0 and cfg.bn13 % qblock == 0 and cfg.bk13 % 32 == 0, (cfg, qblock)
    assert codes.dtype == (torch.float16 if cfg.acc16 else torch.float32) and codes.is_contiguous(), \
        f"activation layout {codes.dtype} does not match the config's {cfg.xq_layout}"
    if cfg.acc16:
        hp = (torch.empty((p, 2, ipad // 8, 4), dtype=torch.float16, device=codes.device),
              torch.empty((p, ipad // QBLOCK), dtype=torch.float32, device=codes.device))
    else:
        hp = torch.empty((p, ipad), dtype=torch.float32, device=codes.device)
    hq, hs = hp if cfg.acc16 else (hp, hp)
    even = ipad % cfg.bn13 == 0 and d % cfg.bk13 == 0
    n_tiles = triton.cdiv(ipad, cfg.bn13)
    split = k_slices(triton.cdiv(d, cfg.bk13), cfg.split13)   # (no slice left empty)
    ws = torch.empty((p * n_tiles * split * 2 * cfg.bn13,), dtype=torch.float32, device=codes.device) \
        if split > 1 else hq
    cnt = split_counter(codes.device, p * n_tiles, "moe_w13") if split > 1 else ids
    init, o, sh = out_init(out, shared, ids, d, pair_rows, hq)
    grid, plist, pcount, passes = _pair_grid(ids, pairs, slots, n_tiles, split)
    _moe_w13_gemv_kernel[grid](
        codes.view(torch.int64), xs, w13_q.view(torch.int32), _u8(w13_s), hq, hs, ids, weights, ws, cnt,
        o, sh, d, o.stride(0), sh.stride(0),
        ipad, inter, d, ids.shape[1], w13_q.shape[0], float(swiglu_limit), plist, pcount, ids.shape[0], SPLIT=split,
        BLOCK_N=cfg.bn13, BLOCK_K=cfg.bk13, NUM_STAGES=cfg.stages, EVEN=even, ACC16=cfg.acc16, INIT_OUT=init,
        COMPACT=pairs is not None, PASSES=passes, QB=qblock, UNROLL=unrolled_steps(cfg, d, ipad),
        num_warps=cfg.warps, launch_pdl=cfg.pdl)
    return hp


def out_init(out: torch.Tensor | None, shared: torch.Tensor | None, ids: torch.Tensor, d: int, pair_rows: bool,
             spare: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
    """A decode w13's INIT_OUT mode and its out / shared arguments (spare: any tensor for the unused ones): none; out
    [T, D] fp32 set to 0 (1) or to `shared` [T, D] (2); pair_rows: out [T·k, D] fp32, each pair's row set to 0 (3)."""
    if out is None:
        assert not pair_rows and shared is None, "the w13 initialises no output without `out`"
        return 0, spare, spare
    rows = ids.numel() if pair_rows else ids.shape[0]
    assert out.dtype == torch.float32 and out.shape == (rows, d) and out.stride(1) == 1, \
        (out.dtype, tuple(out.shape), rows, d)
    if pair_rows:
        assert shared is None, "deterministic mode adds the shared expert in `pair_sum`, not in the w13"
        return 3, out, out
    if shared is None:
        return 1, out, out
    assert shared.shape == (rows, d) and shared.stride(1) == 1, tuple(shared.shape)
    return 2, out, shared


def _pair_grid(ids: torch.Tensor, pairs: LocalPairs | None, slots: int, tiles: int, split: int):
    """A decode GEMV's grid, pair list and count, and passes: one program row per pair, grid (rows, tiles, split);
    or `slots` rows over the listed pairs (each row every slots-th of them, at most T·k / slots passes), grid
    (tiles, split, rows): the rows last, as `_gemv_pids` reads them."""
    if pairs is None:
        return (ids.numel(), tiles, split), ids, ids, 1   # (the list arguments unused: any tensor)
    assert 1 <= slots <= ids.numel(), slots
    return (tiles, split, slots), pairs.index, pairs.count, triton.cdiv(ids.numel(), slots)


def gemv_w2(hp, ids: torch.Tensor, w2_q: torch.Tensor, w2_s: torch.Tensor, out: torch.Tensor,
            cfg: MoeConfig, pairs: LocalPairs | None = None, slots: int = 0, pair_rows: bool = False) -> torch.Tensor:
    """Decode path, second GEMM: out [T, D] fp32 += Σ_pairs h·W2ᵀ (atomic fp32 adds); hp as `gemv_w13` returns it;
    pairs, slots: as `gemv_w13` (the row-per-thread w2 skips another rank's pairs on the full grid instead).
    pair_rows (deterministic mode): out is [T·k, D] and pair p adds into row p, its only writer (one K slice)."""
    hq, hs = hp if cfg.acc16 else (hp, hp)
    ipad = hq[0].numel()
    d = w2_q.shape[1]
    assert cfg.gemv and cfg.bk2 % 32 == 0 and out.dtype == torch.float32 and out.is_contiguous(), cfg
    per_row = 1 if pair_rows else ids.shape[1]          # pairs per output row: the kernels' k
    assert out.shape == (ids.numel() // per_row, d), (tuple(out.shape), tuple(ids.shape), pair_rows)
    pdl = cfg.pdl or cfg.pdl2
    if cfg.rows2:
        assert cfg.acc16, f"the row-per-thread w2 GEMV reads h as f16 codes (acc16), not {cfg.tag()}"
        from dsflash.plugins.moe_gluon import gemv_w2_rows
        return gemv_w2_rows(hq, hs, ids, w2_q, w2_s, out, cfg.warps2, pdl, per_row)
    even = d % cfg.bn2 == 0 and ipad % cfg.bk2 == 0
    split = k_slices(triton.cdiv(ipad, cfg.bk2), cfg.split2)
    assert split == 1 or not pair_rows, f"{cfg.tag()}: a pair's row takes one K slice in deterministic mode"
    grid, plist, pcount, passes = _pair_grid(ids, pairs, slots, triton.cdiv(d, cfg.bn2), split)
    _moe_w2_gemv_kernel[grid](
        hq.view(torch.int64), hs, w2_q.view(torch.int32), _u8(w2_s), out, ids, d, ipad, per_row, w2_q.shape[0],
        out.stride(0), plist, pcount, ids.numel() // per_row,
        SPLIT=split, BLOCK_N=cfg.bn2, BLOCK_K=cfg.bk2, NUM_STAGES=cfg.stages2 or cfg.stages, EVEN=even,
        ACC16=cfg.acc16, COMPACT=pairs is not None, PASSES=passes, num_warps=cfg.warps2, launch_pdl=pdl)
    return out


def _arch(device: torch.device) -> str | None:
    """The GPU's arch ('sm90'; `moe_config.default_moe_config` picks by it), None off CUDA (the interpreter)."""
    if device.type != "cuda":
        return None
    from dsflash.plugins.registry import device_arch
    return device_arch(device)


def moe_experts(xq, weights: torch.Tensor, ids: torch.Tensor,
                w13_q: torch.Tensor, w13_s: torch.Tensor, w2_q: torch.Tensor, w2_s: torch.Tensor,
                swiglu_limit: float, inter: int | None = None, shared: torch.Tensor | None = None,
                config: MoeConfig | None = None, ep: int = 1, pairs: LocalPairs | None = None,
                qblock: int = QBLOCK, ordered: bool | None = None) -> torch.Tensor:
    """Routed MXFP4 experts + the shared expert's output -> fp32 [T, D] (before the TP all-reduce).

    xq: the fake-quantized activation from `router`, BF16 [T, D] or a decode GEMV's layout (`gemv_act`,
    `gemv16_act`; converted when the chosen config reads another one); weights fp32 / ids int32 [T, k] in [0, E]
    (E: an expert of another EP rank, skipped; `router` with local_experts), ep: the EP ranks the experts are
    spread over (picks the tuned config of this share of the routing), pairs: this rank's pairs as `router` lists
    them (the decode GEMVs then launch for about T·k/ep pairs, not T·k); w13_q int8
    [E, 2·I_pad, D/2] (w1 rows, then w3 rows: `stack_w13`), w13_s e8m0 [E, 2·I_pad, D/32], w2_q int8
    [E, D, I_pad/2], w2_s [E, D, I_pad/32] (plain MXFP4: low nibble = even k); inter = the logical intermediate
    width (<= I_pad: padded columns contribute nothing); shared: [T, D] any float dtype, or None; qblock: the
    quantization block of h (32; V4: 128), as the activation's from `router`; ordered: the deterministic expert
    reduction (each pair's output in a row of its own, `pair_sum`; None: on a GPU when `moe_config.deterministic()`).
    No host sync; the work buffers are the only allocations."""
    if isinstance(xq, tuple):
        codes, sc = xq
        t, d = codes.shape[0], codes.shape[2] * 8
        assert codes.dtype == torch.float16 and codes.shape == (t, 2, d // 8, 4) and sc.shape == (t, d // QBLOCK) \
            and sc.dtype == torch.float32, (tuple(codes.shape), codes.dtype, tuple(sc.shape), sc.dtype)
        dev = codes.device
    elif xq.dim() == 3:
        t, d = xq.shape[0], xq.shape[1] * xq.shape[2]
        assert xq.dtype == torch.float32 and xq.shape[1] == 4 and xq.is_contiguous(), (tuple(xq.shape), xq.dtype)
        dev = xq.device
    else:
        assert xq.dim() == 2 and xq.dtype == torch.bfloat16 and xq.stride(1) == 1, (tuple(xq.shape), xq.dtype)
        t, d = xq.shape
        dev = xq.device
    e, ipad = w13_q.shape[0], w13_q.shape[1] // 2
    inter = ipad if inter is None else inter
    assert 0 < inter <= ipad and ipad % QBLOCK == 0 and d % QBLOCK == 0, (inter, ipad, d)
    _check_mx(w13_q, w13_s, e, 2 * ipad, d, "w13")
    _check_mx(w2_q, w2_s, e, d, ipad, "w2")
    assert ids.shape == weights.shape and ids.shape[0] == t and ids.dtype == torch.int32 and ids.is_contiguous()
    assert weights.dtype == torch.float32 and weights.is_contiguous()
    topk = ids.shape[1]
    cfg = config or lookup(t, topk, e, ipad, d, ep, qblock, _arch(dev))
    assert cfg.bn13 % qblock == 0, \
        f"{cfg.tag()}: a w13 tile of {cfg.bn13} rows does not hold whole {qblock}-blocks of h"
    if shared is not None:
        assert shared.shape == (t, d), (tuple(shared.shape), t, d)
    ordered = (dev.type == "cuda" and deterministic()) if ordered is None else ordered
    if t > 0 and cfg.gemv:   # the w13 GEMV also writes the output's starting value: no launch of its own
        sh = None if shared is None else (shared if shared.stride(1) == 1 else shared.contiguous())
        slots = local_pair_slots(ids.numel(), ep)
        if ordered:          # the pairs' rows (zeroed by the w13), then their sum in slot order
            cfg = dataclasses.replace(cfg, split2=1)
        out = torch.empty((ids.numel() if ordered else t, d), dtype=torch.float32, device=dev)
        hp = gemv_w13(as_layout(xq, cfg.xq_layout), weights, ids, w13_q, w13_s, inter, swiglu_limit, cfg, out,
                      None if ordered else sh, pairs, slots, qblock, pair_rows=ordered)
        out = gemv_w2(hp, ids, w2_q, w2_s, out, cfg, pairs, slots, pair_rows=ordered)
        return pair_sum(out, topk, sh) if ordered else out
    if ordered and t > 0:
        out = torch.zeros((t * topk, d), dtype=torch.float32, device=dev)
    elif shared is not None:
        out = shared.to(torch.float32, copy=True).contiguous()
    else:
        out = torch.zeros((t, d), dtype=torch.float32, device=dev)
    if t == 0:
        return out
    p = t * topk
    xq = as_layout(xq, cfg.xq_layout)
    if cfg.f8:
        from dsflash.plugins.moe_f8 import sorted_experts_f8
        out = sorted_experts_f8(xq, weights, ids, w13_q, w13_s, w2_q, w2_s, out, swiglu_limit, inter, cfg, qblock,
                                pair_rows=ordered)
        return pair_sum(out, topk, shared) if ordered else out
    assert d % cfg.bk13 == 0 and ipad % cfg.bk2 == 0 and cfg.bn13 % 32 == 0, (cfg, d, ipad)
    sorted_ids, off = moe_align(ids, e, cfg.block_m)
    nblk = sorted_ids.numel() // cfg.block_m
    nb = triton.next_power_of_2(e + 1)
    h = torch.empty((sorted_ids.numel(), ipad), dtype=torch.bfloat16, device=dev)
    _moe_w13_kernel[(nblk, triton.cdiv(ipad, cfg.bn13))](
        xq, _u8(w13_q), _u8(w13_s), h, sorted_ids, off, weights,
        ipad, inter, d, e, p, topk,
        xq.stride(0), 2 * ipad * d // 2, d // 2, 2 * ipad * d // QBLOCK, d // QBLOCK, ipad,
        float(swiglu_limit),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.bn13, BLOCK_K=cfg.bk13, NB_E=nb, NUM_STAGES=cfg.stages, QB=qblock,
        num_warps=cfg.warps)
    _moe_w2_kernel[(nblk, triton.cdiv(d, cfg.bn2))](
        h, _u8(w2_q), _u8(w2_s), out, sorted_ids, off,
        d, ipad, e, p, 1 if ordered else topk,      # (k = 1: pair p's output goes to row p)
        ipad, d * ipad // 2, ipad // 2, d * ipad // QBLOCK, ipad // QBLOCK, d,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.bn2, BLOCK_K=cfg.bk2, NB_E=nb, NUM_STAGES=cfg.stages,
        num_warps=cfg.warps2)
    return pair_sum(out, topk, shared) if ordered else out


def pair_sum(rows: torch.Tensor, topk: int, shared: torch.Tensor | None = None) -> torch.Tensor:
    """Deterministic mode's expert reduction: rows fp32 [T·k, D] (pair t·k + j's weighted expert output, zeros for a
    pair of another EP rank), shared [T, D] (any float dtype) or None -> fp32 [T, D] = shared + Σ_j rows[t·k + j],
    added in slot order (`pair_sum_ref`, bit for bit)."""
    p, d = rows.shape
    assert rows.dtype == torch.float32 and rows.stride(1) == 1 and topk >= 1 and p % topk == 0, \
        (rows.dtype, tuple(rows.shape), topk)
    t = p // topk
    assert shared is None or shared.shape == (t, d), (tuple(shared.shape), t, d)
    if shared is not None and shared.stride(1) != 1:
        shared = shared.contiguous()
    out = torch.empty((t, d), dtype=torch.float32, device=rows.device)
    if t == 0:
        return out
    block = min(1024, triton.next_power_of_2(d))
    sh = rows if shared is None else shared
    _moe_pair_sum_kernel[(t, triton.cdiv(d, block))](rows, sh, out, d, rows.stride(0), sh.stride(0), out.stride(0),
                                                     TOPK=topk, SHARED=shared is not None, BLOCK=block, num_warps=4)
    return out


def moe(x: torch.Tensor, gate_w: torch.Tensor, gate_bias: torch.Tensor | None, topk: int, route_scale: float,
        w13_q, w13_s, w2_q, w2_s, swiglu_limit: float, inter: int | None = None,
        shared: torch.Tensor | None = None, gate_temp: float = 1.0, config: MoeConfig | None = None,
        expert_start: int = 0, qblock: int = QBLOCK, hash_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Router + routed experts + shared-expert add: x [T, D] BF16 -> fp32 [T, D] (`moe_ref` with w13 stacked). Under
    expert parallelism gate_w routes over all experts and w13/w2 hold this rank's block of them, expert_start..;
    the output is this rank's share (the TP all-reduce sums the ranks'). V4: qblock 128 (x and h quantized per
    1×128) and, on its hash-routed layers, hash_ids int32 [T, k] (the picks; gate_bias unused, may be None)."""
    e, ipad = w13_q.shape[0], w13_q.shape[1] // 2
    ep = gate_w.shape[0] // e
    assert ep * e == gate_w.shape[0], f"{gate_w.shape[0]} routed experts do not split into EP blocks of {e}"
    cfg = config or lookup(x.shape[0], topk, e, ipad, x.shape[1], ep, qblock, _arch(x.device))
    pairs = local_pairs(x.shape[0], topk, x.device) if ep > 1 and cfg.gemv and x.shape[0] > 0 else None
    w, ids, xq = router(x, gate_w, gate_bias, topk, route_scale, gate_temp, xq_layout=cfg.xq_layout,
                        expert_start=expert_start, local_experts=e, pairs=pairs, qblock=qblock, hash_ids=hash_ids)
    return moe_experts(xq, w, ids, w13_q, w13_s, w2_q, w2_s, swiglu_limit, inter, shared, cfg, ep, pairs, qblock)
