"""Group-32 FP8 dense GEMM for decode (M <= 8 tokens) on CUDA cores: a split-K GEMV with the reduction fused.

Why: at M <= 8 the MMA path (`fp8_gemm._fp8_gemm_g32_kernel`, swap-AB wgmma) is latency/occupancy-bound (one TMA
round trip per 32-wide K block, ~2 CTAs per SM) and its split-K reduce is a second launch. Here the weight simply
streams: each program owns BLOCK_N weight rows and one K slice and loads [BLOCK_N, BLOCK_K] e4m3 tiles with plain
16-byte vector loads; the M multiply-adds per weight byte run on CUDA cores. Same numerics as the MMA path: every
e4m3×e4m3 product is exact in fp32; each thread sums 16 consecutive products (inside one 32-block), scales that
partial by sa[m, kb]·sw[n/32, kb] and accumulates in fp32. Split-K partials go to an fp32 workspace; the last
program of an N tile to arrive (acq_rel counter, reset by that program: no memset per call, CUDA-graph replayable)
sums them in slice order and writes BF16: one launch, deterministic. Calls on one stream at a time (the counters
are shared per device).

Layout: Triton gives the weight tile 16 consecutive bytes of a row per thread, threads then warps along K first.
With BLOCK_K = 512·num_warps (or a multiple) every warp lies along K and each thread holds all BLOCK_N rows of its
16-byte chunk, so a token's activation chunk, loaded 1-D, lands in exactly the registers that need it (no shared
memory round trip) and is converted once for BLOCK_N rows. Configs with warps along N (e.g. 32 rows × 256 K) move
the activation through shared memory per token: fine at M = 1, slow beyond.
Measured on the H200 (CUDA graphs, rotating weights, % of the 4198 GB/s copy bandwidth on the weight bytes):
M = 1: 32768×1280 12.3 µs (81 %, MMA default 20.3), 5120×8192 12.7 µs (79 %, 22.0), 4608×5120 8.9 µs (64 %, 15.6);
M = 2: 15.5 / 14.2 / 9.8 µs; M = 4: 21.3 / 20.1 / 13.8 µs (MMA 21.5 / 22.1 / 15.8); M = 8: 38 / 33 / 22 µs, slower
than MMA (the FFMAs, M per weight byte, saturate the FP32 pipe), so the tuner keeps MMA there.
`GemmConfig.acc16` selects `_fp8_gemv16_kernel`: packed f16 FMAs per 32-block, activation as f16 codes from
`act_quant(..., codes16=True)`. Offline SASS: 4.0 / 7.3 instructions per weight element at M = 4 / 8, against 7.2 /
12.7. On the H200 it wins M = 2-8 on most small shapes (e.g. TP8 wq_b M = 8: 7.6 µs vs 8.5 MMA) and wo_b TP1 M = 2
(13.4 µs, 76 %). It loses on the 42 MB TP1 shapes at M >= 4, where it is no longer instruction-bound: the 160-230
registers it needs at 4 rows per thread cap occupancy. Parity 1.7e-3, the same as the fp32 path (BF16 output).
Imports Triton: load this module lazily.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsflash.plugins.fp8_gemm import gemm_operands
from dsflash.plugins.refs import E4M3, E8M0
from dsflash.plugins.splitk import split_counter, splitk_store
from dsflash.plugins.tl_helpers import e8m0_to_f32, split4
from dsflash.plugins.tuning import GemmConfig, k_slices

MAX_M = 8   # tokens; beyond that the MMA path is the one to use


@triton.jit
def _tok_step(acc, wf, swf, a_row, sa_row, m, M, k0, K, kk, kb, KB,
              AS_E8M0: tl.constexpr, CH: tl.constexpr, VEC: tl.constexpr, EVEN_K: tl.constexpr):
    """acc [BN, CH] += (Σ_16 wf·a[m])·sa[m, kb]·sw[kb] for token m (all-zero past M); wf [BN, CH, VEC] fp32,
    swf [CH] fp32 (the tile's rows share one 32-row scale block)."""
    mm = m < M
    # loaded 1-D like a weight row (so its layout is the weight tile's, broadcast over rows), then split in chunks
    if EVEN_K:
        a = tl.load(a_row + k0 + kk, mask=mm, other=0.0)                        # [BK] e4m3
        sa = tl.load(sa_row + kb, mask=mm, other=0)                              # [CH]
    else:
        a = tl.load(a_row + k0 + kk, mask=mm & (k0 + kk < K), other=0.0)
        sa = tl.load(sa_row + kb, mask=mm & (kb < KB), other=0)
    if AS_E8M0:
        sa = e8m0_to_f32(sa)
    af = tl.reshape(a.to(tl.float32), (CH, VEC))
    part = tl.sum(wf * af[None, :, :], axis=2)                                   # [BN, CH]: 16 exact products each
    return acc + part * (swf * sa)[None, :]


@triton.jit
def _fp8_gemv_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, part_ptr, cnt_ptr,
                     M, N, K, stride_am, stride_asm, SPLIT,
                     AS_E8M0: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     NUM_STAGES: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
    """Program (pid_n, pid_k): rows [pid_n·BN, +BN) of W, K tiles [pid_k·per, +per) of the cdiv(K, BK) tiles.
    acc_m[n, c] (c: 16-wide chunk of the tile) += (Σ_16 a_q[m]·w_q[n])·sa[m, kb]·sw[n/32, kb]; y[m] = Σ_c acc_m.
    One accumulator per token (M_PAD <= 8, unrolled), so the weight tile keeps its load layout (16 consecutive
    bytes of a row per thread, threads then warps along K) and VEC = 16 products are summed in-thread before the
    scale is applied."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    VEC: tl.constexpr = 16
    CH: tl.constexpr = BLOCK_K // VEC
    KB = K // 32
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    kk = tl.arange(0, BLOCK_K)
    cb = tl.arange(0, CH) * VEC // 32                          # [CH]: 32-block of each 16-wide chunk, within the tile
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * K          # [BN, 1]
    sw_row = ws_ptr + (pid_n * BLOCK_N // 32) * KB             # BN divides 32: one e8m0 row of scales per tile
    it0, it1 = _k_slice(K, BLOCK_K, SPLIT, pid_k)
    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _zeros8(BLOCK_N, CH)
    for it in tl.range(it0, it1, num_stages=NUM_STAGES):
        k0 = it * BLOCK_K
        kb = k0 // 32 + cb                                     # [CH]
        if EVEN_N & EVEN_K:
            w = tl.load(w_rows + k0 + kk[None, :])                                               # [BN, BK] e4m3
        else:
            w = tl.load(w_rows + k0 + kk[None, :], mask=mask_n[:, None] & (k0 + kk < K)[None, :], other=0.0)
        if EVEN_K:
            sw = tl.load(sw_row + kb)                                                            # [CH] u8
        else:
            sw = tl.load(sw_row + kb, mask=kb < KB, other=0)
        wf = tl.reshape(w.to(tl.float32), (BLOCK_N, CH, VEC))
        swf = e8m0_to_f32(sw)
        acc0 = _tok_step(acc0, wf, swf, a_ptr, as_ptr, 0, M, k0, K, kk, kb, KB, AS_E8M0, CH, VEC, EVEN_K)
        if M_PAD > 1:
            acc1 = _tok_step(acc1, wf, swf, a_ptr + stride_am, as_ptr + stride_asm, 1, M, k0, K, kk, kb, KB,
                             AS_E8M0, CH, VEC, EVEN_K)
        if M_PAD > 2:
            acc2 = _tok_step(acc2, wf, swf, a_ptr + 2 * stride_am, as_ptr + 2 * stride_asm, 2, M, k0, K, kk, kb, KB,
                             AS_E8M0, CH, VEC, EVEN_K)
            acc3 = _tok_step(acc3, wf, swf, a_ptr + 3 * stride_am, as_ptr + 3 * stride_asm, 3, M, k0, K, kk, kb, KB,
                             AS_E8M0, CH, VEC, EVEN_K)
        if M_PAD > 4:
            acc4 = _tok_step(acc4, wf, swf, a_ptr + 4 * stride_am, as_ptr + 4 * stride_asm, 4, M, k0, K, kk, kb, KB,
                             AS_E8M0, CH, VEC, EVEN_K)
            acc5 = _tok_step(acc5, wf, swf, a_ptr + 5 * stride_am, as_ptr + 5 * stride_asm, 5, M, k0, K, kk, kb, KB,
                             AS_E8M0, CH, VEC, EVEN_K)
            acc6 = _tok_step(acc6, wf, swf, a_ptr + 6 * stride_am, as_ptr + 6 * stride_asm, 6, M, k0, K, kk, kb, KB,
                             AS_E8M0, CH, VEC, EVEN_K)
            acc7 = _tok_step(acc7, wf, swf, a_ptr + 7 * stride_am, as_ptr + 7 * stride_asm, 7, M, k0, K, kk, kb, KB,
                             AS_E8M0, CH, VEC, EVEN_K)
    y = _rows_of(acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, M_PAD)
    _store_or_reduce(y, out_ptr, part_ptr, cnt_ptr, pid_n, pid_k, M, N, offs_n, mask_n, SPLIT, M_PAD, BLOCK_N)


# -- f16 in-block accumulation (GemmConfig.acc16) ----------------------------------------------------------------------
# The activation comes as f16 codes (its e4m3 values × 2^-8, exact; `act_quant(..., codes16=True)`), the weight as
# int32 words of 4 e4m3 bytes widened pairwise by the FP8->f16x2 unit (exact). Each thread owns whole 32-blocks of a
# row, and a block's 32 products are summed as packed f16x2 FMAs in two chains, widened to fp32 once and multiply-
# added with sa·sw. Every product is exact in f16 (<= 8 significant bits, |product| <= 448·1.75, a chain <= 8·784), so
# the only difference from the fp32 path is the f16 rounding of the running in-block sums.
_E4M3X4_F16_ASM = tl.constexpr("{\n.reg .b16 l, h;\nmov.b32 {l, h}, $2;\ncvt.rn.f16x2.e4m3x2 $0, l;\n"
                                "cvt.rn.f16x2.e4m3x2 $1, h;\n}")


def _dot32_f16_asm() -> str:
    """$0 = fp32 sum of one block's 32 products: $1..$16 = W as f16x2 pairs, $17..$32 = the activation's."""
    body = [f"mul.rn.f16x2 c{i}, ${1 + i}, ${17 + i};" if i < 2 else
            f"fma.rn.f16x2 c{i % 2}, ${1 + i}, ${17 + i}, c{i % 2};" for i in range(16)]
    body += ["add.rn.f16x2 c0, c0, c1;", "mov.b32 {f0, f1}, c0;", "cvt.f32.f16 v0, f0;", "cvt.f32.f16 v1, f1;",
             "add.rn.f32 $0, v0, v1;"]
    return "{\n.reg .b32 c0, c1;\n.reg .b16 f0, f1;\n.reg .f32 v0, v1;\n" + "\n".join(body) + "\n}"


_DOT32_F16_ASM = tl.constexpr(_dot32_f16_asm())
_DOT32_CONSTRAINTS = tl.constexpr("=f" + ",r" * 32)


@triton.jit
def _cvt4(w):
    return tl.inline_asm_elementwise(_E4M3X4_F16_ASM, "=r,=r,r", [w], dtype=(tl.int32, tl.int32), is_pure=True,
                                     pack=1)


@triton.jit
def _tok_step16(acc, w, a_row, sa_row, m, M, k0p, KP, op, kb, KB, swf,
                AS_E8M0: tl.constexpr, CB: tl.constexpr, EVEN_K: tl.constexpr):
    """acc [BN, CB] += (Σ_32 w·a[m], f16)·sa[m, kb]·sw[kb] for token m (zero past M); w: the tile's 16 f16x2
    tensors [BN, CB]; a_row: token m's f16x2 pairs (int32)."""
    mm = m < M
    if EVEN_K:
        sa = tl.load(sa_row + kb[None, :], mask=mm, other=0)                        # [1, CB]
    else:
        sa = tl.load(sa_row + kb[None, :], mask=mm & (kb < KB)[None, :], other=0)
    if AS_E8M0:
        sa = e8m0_to_f32(sa)
    # the block's 16 f16x2 pairs as 4 loads of 4 consecutive pairs (16 bytes each: in-thread, like the weight words)
    base = a_row + k0p + op[None, :]                                                 # [1, 4·CB]
    msk = mm if EVEN_K else mm & (k0p + op < KP)
    x0, x1, x2, x3 = _split4(tl.load(base, mask=msk, other=0), CB)
    x4, x5, x6, x7 = _split4(tl.load(base + 4, mask=msk, other=0), CB)
    x8, x9, x10, x11 = _split4(tl.load(base + 8, mask=msk, other=0), CB)
    x12, x13, x14, x15 = _split4(tl.load(base + 12, mask=msk, other=0), CB)
    x = (x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15)
    part = tl.inline_asm_elementwise(
        _DOT32_F16_ASM, _DOT32_CONSTRAINTS,
        [w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7], w[8], w[9], w[10], w[11], w[12], w[13], w[14], w[15],
         x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7], x[8], x[9], x[10], x[11], x[12], x[13], x[14], x[15]],
        dtype=tl.float32, is_pure=True, pack=1)
    return acc + part * (swf * sa * 256.0)     # the codes carry 2^-8


@triton.jit
def _split4(t, B: tl.constexpr):
    """[A, 4·B] loaded in 16-byte chunks (4 consecutive entries in-thread) -> the 4 entries of each chunk, [A, B]
    each, in order."""
    return split4(tl.reshape(t, (t.shape[0], B, 2, 2)))


@triton.jit
def _fp8_gemv16_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, part_ptr, cnt_ptr,
                       M, N, K, stride_am, stride_asm, SPLIT,
                       AS_E8M0: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       NUM_STAGES: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
    """`_fp8_gemv_kernel` with f16 in-block accumulation: W as int32 words (4 e4m3 each), A as f16x2 pairs (int32,
    row stride stride_am pairs), each thread owning whole 32-blocks of a row."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    BW: tl.constexpr = BLOCK_K // 4
    CB: tl.constexpr = BLOCK_K // 32
    KW = tl.multiple_of(K // 4, 8)                             # K % 32 == 0: rows start 32-byte aligned
    KP = tl.multiple_of(K // 2, 16)
    KB = K // 32
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    ob = tl.arange(0, CB)
    # 16-byte chunks, one per block and tile row: the first 4 words (pairs) of each block; the other half (other
    # 3 quarters) are the same offsets + 4 (+ 4, 8, 12): the loads stay 2-D with 4-entry contiguity, so Triton
    # spreads threads along the blocks and keeps all BN rows of a block, and the activation's, in one thread
    c4 = tl.arange(0, 4 * CB)
    ow = (c4 // 4) * 8 + c4 % 4                                # [4·CB] word offsets in a tile row
    op = (c4 // 4) * 16 + c4 % 4                               # [4·CB] f16x2-pair offsets in a token row
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * KW
    sw_row = ws_ptr + (pid_n * BLOCK_N // 32) * KB
    it0, it1 = _k_slice(K, BLOCK_K, SPLIT, pid_k)
    acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _zeros8(BLOCK_N, CB)
    for it in tl.range(it0, it1, num_stages=NUM_STAGES):
        k0w = it * BW
        kb = it * CB + ob
        wb = w_rows + k0w + ow[None, :]                                                # [BN, 4·CB] words
        if EVEN_N & EVEN_K:
            wlo = tl.load(wb)
            whi = tl.load(wb + 4)
        else:
            wm = mask_n[:, None] & (k0w + ow < KW)[None, :]
            wlo = tl.load(wb, mask=wm, other=0)
            whi = tl.load(wb + 4, mask=wm, other=0)
        if EVEN_K:
            sw = tl.load(sw_row + kb[None, :])                                          # [1, CB]
        else:
            sw = tl.load(sw_row + kb[None, :], mask=(kb < KB)[None, :], other=0)
        swf = e8m0_to_f32(sw)
        q0, q1, q2, q3 = _split4(wlo, CB)
        q4, q5, q6, q7 = _split4(whi, CB)
        p0, p1 = _cvt4(q0)
        p2, p3 = _cvt4(q1)
        p4, p5 = _cvt4(q2)
        p6, p7 = _cvt4(q3)
        p8, p9 = _cvt4(q4)
        p10, p11 = _cvt4(q5)
        p12, p13 = _cvt4(q6)
        p14, p15 = _cvt4(q7)
        w = (p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15)
        k0p = 2 * k0w
        acc0 = _tok_step16(acc0, w, a_ptr, as_ptr, 0, M, k0p, KP, op, kb, KB, swf, AS_E8M0, CB, EVEN_K)
        if M_PAD > 1:
            acc1 = _tok_step16(acc1, w, a_ptr + stride_am, as_ptr + stride_asm, 1, M, k0p, KP, op, kb, KB, swf,
                               AS_E8M0, CB, EVEN_K)
        if M_PAD > 2:
            acc2 = _tok_step16(acc2, w, a_ptr + 2 * stride_am, as_ptr + 2 * stride_asm, 2, M, k0p, KP, op, kb, KB,
                               swf, AS_E8M0, CB, EVEN_K)
            acc3 = _tok_step16(acc3, w, a_ptr + 3 * stride_am, as_ptr + 3 * stride_asm, 3, M, k0p, KP, op, kb, KB,
                               swf, AS_E8M0, CB, EVEN_K)
        if M_PAD > 4:
            acc4 = _tok_step16(acc4, w, a_ptr + 4 * stride_am, as_ptr + 4 * stride_asm, 4, M, k0p, KP, op, kb, KB,
                               swf, AS_E8M0, CB, EVEN_K)
            acc5 = _tok_step16(acc5, w, a_ptr + 5 * stride_am, as_ptr + 5 * stride_asm, 5, M, k0p, KP, op, kb, KB,
                               swf, AS_E8M0, CB, EVEN_K)
            acc6 = _tok_step16(acc6, w, a_ptr + 6 * stride_am, as_ptr + 6 * stride_asm, 6, M, k0p, KP, op, kb, KB,
                               swf, AS_E8M0, CB, EVEN_K)
            acc7 = _tok_step16(acc7, w, a_ptr + 7 * stride_am, as_ptr + 7 * stride_asm, 7, M, k0p, KP, op, kb, KB,
                               swf, AS_E8M0, CB, EVEN_K)
    y = _rows_of(acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, M_PAD)
    _store_or_reduce(y, out_ptr, part_ptr, cnt_ptr, pid_n, pid_k, M, N, offs_n, mask_n, SPLIT, M_PAD, BLOCK_N)


@triton.jit
def _k_slice(K, BLOCK_K: tl.constexpr, SPLIT, pid_k):
    """The [it0, it1) of the cdiv(K, BLOCK_K) K tiles that slice pid_k of SPLIT takes."""
    n_it = tl.cdiv(K, BLOCK_K)
    per = tl.cdiv(n_it, SPLIT)
    it0 = pid_k * per
    return it0, tl.minimum(it0 + per, n_it)


@triton.jit
def _zeros8(BN: tl.constexpr, C: tl.constexpr):
    """One fp32 [BN, C] accumulator per token (at most 8)."""
    z = tl.zeros([BN, C], dtype=tl.float32)
    return z, z, z, z, z, z, z, z


@triton.jit
def _rows_of(acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, M_PAD: tl.constexpr):
    """y [M_PAD, BN]: row m = Σ over the chunk axis of acc_m [BN, C]."""
    offs_m = tl.arange(0, M_PAD)
    y = tl.where(offs_m[:, None] == 0, tl.sum(acc0, axis=1)[None, :], 0.0)
    if M_PAD > 1:
        y = tl.where(offs_m[:, None] == 1, tl.sum(acc1, axis=1)[None, :], y)
    if M_PAD > 2:
        y = tl.where(offs_m[:, None] == 2, tl.sum(acc2, axis=1)[None, :], y)
        y = tl.where(offs_m[:, None] == 3, tl.sum(acc3, axis=1)[None, :], y)
    if M_PAD > 4:
        y = tl.where(offs_m[:, None] == 4, tl.sum(acc4, axis=1)[None, :], y)
        y = tl.where(offs_m[:, None] == 5, tl.sum(acc5, axis=1)[None, :], y)
        y = tl.where(offs_m[:, None] == 6, tl.sum(acc6, axis=1)[None, :], y)
        y = tl.where(offs_m[:, None] == 7, tl.sum(acc7, axis=1)[None, :], y)
    return y


@triton.jit
def _store_or_reduce(y, out_ptr, part_ptr, cnt_ptr, pid_n, pid_k, M, N, offs_n, mask_n, SPLIT,
                     M_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    """y [M_PAD, BN] fp32 of K slice pid_k -> BF16 out; with SPLIT > 1 through the fp32 workspace, summed in slice
    order by the last program of the N tile to arrive (which resets its counter)."""
    offs_m = tl.arange(0, M_PAD)
    o_off = offs_m[:, None] * N + offs_n[None, :]
    o_mask = (offs_m < M)[:, None] & mask_n[None, :]
    splitk_store(out_ptr, y, o_off, o_mask, part_ptr, cnt_ptr, pid_n, pid_k, SPLIT, M * N)


def fp8_gemv(a_q: torch.Tensor, a_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, config: GemmConfig,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """Group-32 FP8 GEMM for M <= 8 on CUDA cores -> BF16 [M, N]; the operand contract of `fp8_gemm.fp8_gemm`.

    a_q e4m3 [M, K] (row stride free, K contiguous; f16 codes for an acc16 config), a_s [M, K/32] fp32|e8m0
    (K/32 contiguous), w_q e4m3 [N, K] contiguous, w_s e8m0 [ceil(N/32), K/32] contiguous; K % 32 == 0 (the shared
    checks: `fp8_gemm.gemm_operands`). config: a `gemv` GemmConfig (block_p = BLOCK_N weight rows, block_q >= M,
    block_k, split_k, num_warps, num_stages); out: optional BF16 [M, N] contiguous.
    """
    assert config.gemv, f"not a gemv config: {config}"
    out = gemm_operands(a_q, a_s, w_q, w_s, out)
    assert a_q.shape[0] <= config.block_q, f"M={a_q.shape[0]} exceeds the config's {config.block_q} tokens"
    want = torch.float16 if config.acc16 else E4M3
    assert a_q.dtype == want, (f"config {config.tag()} reads {want} activation codes, got {a_q.dtype}"
                               + (" (act_quant(x, codes16=True))" if config.acc16 else ""))
    assert w_q.dtype == E4M3, w_q.dtype
    m, k = a_q.shape
    n = w_q.shape[0]
    assert m <= MAX_M, f"the GEMV path takes at most {MAX_M} tokens, got M={m}"
    assert a_s.dtype in (torch.float32, E8M0, torch.uint8), f"activation scales must be fp32 or e8m0, got {a_s.dtype}"
    assert w_s.dtype in (E8M0, torch.uint8), f"weight scales must be e8m0, got {w_s.dtype}"
    if m == 0 or n == 0:
        return out
    sa_e8 = a_s.dtype != torch.float32
    sa = a_s.view(torch.uint8) if sa_e8 else a_s
    bn, bk = config.block_p, config.block_k
    n_tiles = triton.cdiv(n, bn)
    n_it = triton.cdiv(k, bk)
    split = k_slices(n_it, config.split_k)
    part = torch.empty((split, m, n), dtype=torch.float32, device=out.device) if split > 1 else out
    cnt = split_counter(out.device, n_tiles, "fp8_gemv") if split > 1 else out
    if config.acc16:
        assert a_q.stride(0) % 2 == 0, "f16 code rows must start 4-byte aligned"
        kern, a_in, w_in = _fp8_gemv16_kernel, a_q.view(torch.int32), w_q.view(torch.int32)
        a_stride = a_q.stride(0) // 2
    else:
        kern, a_in, w_in, a_stride = _fp8_gemv_kernel, a_q, w_q, a_q.stride(0)
    kern[(n_tiles, split)](
        a_in, sa, w_in, w_s.view(torch.uint8), out, part, cnt,
        m, n, k, a_stride, sa.stride(0), split,
        AS_E8M0=sa_e8, M_PAD=max(1, triton.next_power_of_2(m)), BLOCK_N=bn, BLOCK_K=bk,
        NUM_STAGES=config.num_stages, EVEN_N=n % bn == 0, EVEN_K=k % bk == 0, num_warps=config.num_warps)
    return out
