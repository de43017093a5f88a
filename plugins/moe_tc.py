"""The MoE decode w13 on tensor cores, in Gluon: MXFP4 codes turned into e4m3 in registers, one m64n8k32 wgmma per
32-block, fp32 promotion per block. A measured alternative to the CUDA-core GEMV, not a default nor a build
candidate: on one TP8 rank at M = 3 it only matches the GEMV, and it is 1.10x slower at M = 8 (H100,
benchmarks/README.md, "Session 46").

Why it was tried: the CUDA-core w13 GEMV (`moe._moe_w13_gemv_kernel`, f16 in-block sums) issues ~3.2 instructions
per MXFP4 weight element and reaches half the SM's issue rate on one TP8 rank at M = 3 (ncu_moe_s19_h200.json).
Here the products and sums run on the tensor cores: a weight word costs 7 integer instructions for its 8 codes, a
share of an MMA and of the per-block fold. Session 20's version loaded the words into registers (16 bytes per
thread, transposed inside the warp through shared memory): 1.05-1.3x slower than the GEMV on the H200, its SMs
waiting on memory (8 long-scoreboard stalls per issued instruction against the GEMV's 1.2,
benchmarks/ncu_moe_tc_s20_h200.json). Since session 46 the words come by TMA through a ring of `stages` 128-K chunks
(`_w13_tc_dots`), read from shared memory straight into the A-operand layout (`_slot_words`, as the sorted path
`moe_f8` reads them): no register staging, no transpose, one CTA barrier per chunk before its slot is refilled,
182 warp instructions per chunk (SASS for sm_90). That is 1.08-1.27x faster than session 20's version, and it
matches the GEMV (TP8 M = 3: 24.50 against 24.61 µs) or is 2.8 % faster (one EP8 rank, M = 3). Shallow rings (2
chunks) with 4-5 K slices are the fastest: many small CTAs resident, not deep rings. The TMA ring's pieces
(`_weight_ring`, `_issue_words`, `_slot_words`, `_blocks_mma`) live here and `moe_f8` imports them.

A program is one (token, expert) pair × 32 intermediate rows × a K slice: an MMA tile of 64 weight rows (per warp,
8 rows of w1 and the same 8 rows of w3, so a thread holds g and u of one row) × 8 token columns (only column 0, the
pair's token, is used), K in chunks of four 32-blocks:
- A (weights). In the wgmma register-operand layout a thread holds, per row and 32-K step, the positions
  4c..4c+3 and 16+4c..16+4c+3 (c = lane % 4). The dot product does not care about the order of K within a block as
  long as both operands agree, so position 4c + j holds code 8c + 2j of the block and 16 + 4c + j code 8c + 2j + 1:
  a thread's 8 codes are its block word c, each half one 32-bit word of 4 e4m3 bytes (`_E4M3_ASM`: the e2m1 value
  ×2^-6). The words reach that layout from the TMA ring's 64-byte-swizzled boxes (w1's 32 rows and w3's).
- B (the token): `gemv16_act`'s f16-code layout already holds each block's codes in that order (plane 0: the even
  codes by word, plane 1: the odd ones); the program stages its K slice once in shared memory as e4m3 (×16, exact).
- Each block's MMA starts from zero; a chunk's 4 MMAs run two per wait (`_blocks_mma`), each folded into the fp32
  total with the block's scale 2^(e_w - 127)·2^e_x (the per-block promotion `moe._mx_dot32h` also does).
The epilogue, the split-K reduction, the output's initial value and the EP pair list are those of the CUDA-core
kernel, and h is written in the same f16-code layout for the w2 GEMVs (`MoeConfig.tc13` selects it in
`moe.gemv_w13`). Numerics: e2m1 × e4m3 products are exact; what differs from the reference is the order of the fp32
block sums and the tensor core's in-block accumulation (3.4e-4-2.7e-3 ‖Δ‖/‖ref‖ of the MoE output at TP8 M = 3 / 8
and one EP8 rank's M = 3, against 4.3e-3-5.5e-3 for the f16 GEMV). V4.1 only (1×32 blocks of h); D % 128 == 0,
I_pad % 32 == 0; sm_90 (wgmma). Imports Triton's Gluon: load this module lazily.
"""
from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from dsflash.plugins.fp8_gemm_gluon import _grid_dependency_wait
from dsflash.plugins.moe import (_gemv_pids, _init_out_listed, _init_out_pair, _listed_pair, _pair_grid,
                                 _pair_perm16, LocalPairs, out_init)
from dsflash.plugins.moe_config import MoeConfig
from dsflash.plugins.splitk import split_counter, splitk_arrive, splitk_total
from dsflash.plugins.tl_helpers import e8m0_to_f32, exp2i, scale_exp, split4
from dsflash.plugins.tuning import k_slices

BN = gl.constexpr(32)       # intermediate rows per program: 32 of w1 + the same 32 of w3 = one 64-row MMA tile
CHUNK = gl.constexpr(128)   # K per step: 4 blocks, one 32-bit word of e8m0 scales per row

_MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 8, 32]))
_A_OP = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_MMA.value, k_width=4))
# The A operand of one block as [row, half, word c, j] (k = 16·half + 4c + j): the register-operand layout above with
# k split, so that a thread's words ([row, c], the two dims sliced off) load once and broadcast over half and j
# in registers (a load in the operand layout itself requested each word twice)
_A_WORDS4 = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 0, 1], [0, 0, 0, 2], [8, 0, 0, 0], [0, 1, 0, 0]],
    lane_bases=[[0, 0, 1, 0], [0, 0, 2, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
    warp_bases=[[16, 0, 0, 0], [32, 0, 0, 0]], block_bases=[], shape=[64, 2, 4, 4]))
_A_WORDS3 = gl.constexpr(gl.SliceLayout(3, _A_WORDS4.value))
_A_WORDS = gl.constexpr(gl.SliceLayout(1, _A_WORDS3.value))
# a chunk's words [64 rows, 16 words] as the A operand takes them: word c of each block (lane bits: c, then row),
# the blocks in registers (read so from the TMA ring's 64-byte-swizzled boxes by `_slot_words`)
_W_T = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 4], [0, 8], [8, 0]], lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 16]))
# one 32-row box of weight words [32, 16] read as half of `_W_T` (its row bit 8 is the box: w1 or w3)
_HALF_T = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 4], [0, 8]], lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]], warp_bases=[[8, 0], [16, 0]],
    block_bases=[], shape=[32, 16]))
# per-row × per-block values [64, 4] (the rows' block scales): MMA rows as SliceLayout(1, MMA), the 4 in registers
_ROW4 = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [8, 0]], lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 4]))
_FLAT = gl.constexpr(gl.BlockedLayout([4], [32], [4], [0]))
# the token tile [8 MMA columns, 128 K] as loaded and staged: 8 consecutive codes of one row per thread
_X_TILE = gl.constexpr(gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0]))
_B_SMEM = gl.constexpr(gl.NVMMASharedLayout.get_default_for([8, CHUNK.value], gl.float8e4nv))
_THREAD_BARRIER = getattr(gl, "thread_barrier", None) or gl.barrier   # the name Triton 3.6 / 3.8 gives it

# 4 MXFP4 codes in the high nibbles of a word's bytes -> their e4m3 bytes (value × 2^-6: sign bit 7 stays, magnitude
# bits 4-6 go to 2-4). The 4 operands are the same word (the 4 positions of a pack share it); only $4 is read.
_E4M3_ASM = gl.constexpr("{\n.reg .b32 t, u;\nand.b32 t, $4, 0x80808080;\nshr.b32 u, $4, 2;\n"
                         "and.b32 u, u, 0x1C1C1C1C;\nor.b32 $0, t, u;\n}")


# 4 f16 codes ×2^-4 (two f16x2 registers) -> their e4m3 bytes (×16: exact, |c| <= 448)
_F16_TO_E4M3_ASM = gl.constexpr("{\n.reg .b32 a, b, k;\n.reg .b16 lo, hi;\nmov.b32 k, 0x4C004C00;\n"
                                "mul.rn.f16x2 a, $1, k;\nmul.rn.f16x2 b, $2, k;\ncvt.rn.satfinite.e4m3x2.f16x2 lo, a;\n"
                                "cvt.rn.satfinite.e4m3x2.f16x2 hi, b;\nmov.b32 $0, {lo, hi};\n}")


@gluon.jit
def _a_operand(words, A_OP: gl.constexpr = _A_OP):
    """A block's words [64 rows, 4] (layout _A_WORDS) -> its e4m3 A operand [64, 32] (in A_OP: the A operand of an
    m64nNk32 MMA, any N; `moe_f8` runs N = its token block): position 4c + j holds the e4m3
    of code 8c + 2j (low nibble of byte j of word c, moved up), 16 + 4c + j that of code 8c + 2j + 1 (the high
    nibble)."""
    half = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, _A_WORDS3)))
    w3 = gl.expand_dims(words, 1)                                                     # [64, 1, 4]
    w3 = gl.where(gl.expand_dims(gl.expand_dims(half, 0), 2) == 0, w3 << 4, w3)       # [64, 2, 4]
    w4 = gl.expand_dims(w3, 3) + gl.zeros([64, 2, 4, 4], gl.int32, _A_WORDS4)         # [64, 2, 4, 4]
    w = gl.convert_layout(gl.reshape(w4, [64, 32]), A_OP, assert_trivial=True)
    q = gl.inline_asm_elementwise(_E4M3_ASM, "=r,r,r,r,r", [w], dtype=gl.int8, is_pure=True, pack=4)
    return q.to(gl.float8e4nv, bitcast=True)


@gluon.jit
def _weight_ring(w_desc, BROWS: gl.constexpr, HALVES: gl.constexpr, STAGES: gl.constexpr):
    """A TMA ring of weight words: STAGES slots of HALVES boxes [BROWS, 16 words] and their barriers."""
    w_bufs = gl.allocate_shared_memory(gl.int32, [STAGES * HALVES, BROWS, 16], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
    return w_bufs, ready


@gluon.jit
def _issue_words(w_desc, w_bufs, ready, slot, row_a, row_b, ch, ok, HALVES: gl.constexpr):
    """TMA of chunk ch's weight words into ring slot `slot` (signalling ready[slot]): one box of 64 rows from row_a,
    or (HALVES 2: w13) two boxes of 32 rows, from row_a (w1) and row_b (w3); nothing when not ok."""
    bar = ready.index(slot)
    mbarrier.expect(bar, HALVES * w_desc.block_type.nbytes, pred=ok)
    tma.async_copy_global_to_shared(w_desc, [row_a, ch * 16], bar, w_bufs.index(slot * HALVES), pred=ok)
    if HALVES == 2:
        tma.async_copy_global_to_shared(w_desc, [row_b, ch * 16], bar, w_bufs.index(slot * 2 + 1), pred=ok)


@gluon.jit
def _slot_words(w_bufs, slot, HALVES: gl.constexpr):
    """Ring slot `slot`'s words as [64 MMA rows, 16] in _W_T (word c of each block per lane: `_a_operand`'s input).
    w13's two 32-row boxes interleave: MMA row 16w + 8h + q is row 8w + q of box h (w1: h = 0, w3: h = 1)."""
    if HALVES == 2:
        h0 = w_bufs.index(slot * 2).load(_HALF_T)
        h1 = w_bufs.index(slot * 2 + 1).load(_HALF_T)
        w = gl.reshape(gl.permute(gl.reshape(gl.join(h0, h1), [4, 8, 16, 2]), [0, 3, 1, 2]), [64, 16])
        return gl.convert_layout(w, _W_T, assert_trivial=True)
    else:
        return w_bufs.index(slot).load(_W_T)


@gluon.jit
def _blocks_mma(wt, sw, xs, buf, tot, zero, MMA: gl.constexpr, SW_WORDS: gl.constexpr):
    """tot [64, BM] + the 4 blocks of one chunk (its activation tile already in `buf`): one MMA per block with the
    words re-biased into the A operand (`_a_operand`), two in flight per wait, each folded with its row scale
    × column scale. (All four before one wait held four partials: 145 registers, 3 CTAs per SM instead of 4.)"""
    A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)
    b0, b1, b2, b3 = split4(gl.reshape(gl.permute(gl.reshape(wt, [64, 4, 4]), [0, 2, 1]), [64, 4, 2, 2]))
    blocks = (b0, b1, b2, b3)
    if SW_WORDS:
        scs = (e8m0_to_f32(sw & 255), e8m0_to_f32((sw >> 8) & 255), e8m0_to_f32((sw >> 16) & 255),
               e8m0_to_f32((sw >> 24) & 255))
    else:
        s0, s1, s2, s3 = split4(gl.reshape(e8m0_to_f32(sw), [64, 2, 2]))
        scs = (s0, s1, s2, s3)
    for h in gl.static_range(0, 4, 2):
        parts = ()
        for kk in gl.static_range(h, h + 2):
            a = _a_operand(gl.convert_layout(blocks[kk], _A_WORDS, assert_trivial=True), A_OP)
            b = buf.slice(kk * 32, 32, dim=1).permute((1, 0))
            parts = parts + (warpgroup_mma(a, b, zero, use_acc=False, is_async=True), )
        parts = warpgroup_mma_wait(0, deps=parts)
        for kk in gl.static_range(h, h + 2):
            s_kk = gl.convert_layout(scs[kk], gl.SliceLayout(1, MMA), assert_trivial=True)
            tot = tot + parts[kk - h] * (gl.expand_dims(s_kk, 1) * gl.expand_dims(xs[kk], 0))
    return tot


@gluon.jit
def _x_row0():
    n = gl.arange(0, 8, layout=gl.SliceLayout(1, _X_TILE))
    return gl.expand_dims(n == 0, 1)


@gluon.jit
def _x_pointers(xp_ptr, t, K, ch0):
    """Pointers [8, 128] (layout _X_TILE, row 0 used) to chunk ch0 of the token's f16 codes ×2^-4 [2, K/8, 4]:
    position 32b + 16p + q of a chunk is plane p's entry 64·chunk + 16b + q, i.e. the order `_a_operand` puts the
    weight codes in."""
    k = gl.expand_dims(gl.arange(0, CHUNK, layout=gl.SliceLayout(0, _X_TILE)), 0)
    n = gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(1, _X_TILE)), 1)
    return xp_ptr + t * K + ((k // 16) % 2) * (K // 2) + (k // 32) * 16 + k % 16 + ch0 * 64 + n * 0


@gluon.jit
def _stage_token(x_s, x_at, n_my, MAX_CH: gl.constexpr):
    """The pair's token for the whole K slice into x_s [MAX_CH, 8, 128] as e4m3 (×16, exact) in row 0 of each chunk
    (rows 1-7 zero: MMA columns the program never reads; chunks past n_my zero), 4 chunks' loads in flight at a
    time; then a barrier and the proxy fence before any MMA reads it."""
    for c0 in gl.static_range(0, MAX_CH, 4):
        xs = ()
        for c in gl.static_range(c0, min(c0 + 4, MAX_CH)):
            xs = xs + (gl.load(x_at + c * 64, mask=_x_row0() & (c < n_my), other=0.0), )
        for c in gl.static_range(c0, min(c0 + 4, MAX_CH)):
            x_s.index(c).store(gl.inline_asm_elementwise(_F16_TO_E4M3_ASM, "=r,r,r", [xs[c - c0]], dtype=gl.int8,
                                                         is_pure=True, pack=4).to(gl.float8e4nv, bitcast=True))
    _THREAD_BARRIER()
    fence_async_shared()


@gluon.jit
def _w13_tc_dots(w_desc, xp_ptr, xs_ptr, s13_ptr, t, e, pid_n, pid_k, N, N_VALID, K, KB, pass_i,
                 SPLIT: gl.constexpr, STAGES: gl.constexpr, MAX_CH: gl.constexpr, x_s, w_bufs, ready):
    """g|u partial of pair (token t, local expert e), rows [pid_n·32, +32) of w1 and w3, K slice pid_k (at most
    MAX_CH chunks): [64] fp32 in SliceLayout(1, MMA), tile row 16w + q = w1 row 8w + q (q < 8) or w3 row 8w + q - 8.
    The weight words stream by TMA through a ring of STAGES chunks (`_weight_ring`: w1's and w3's 32-row boxes),
    each slot refilled as soon as every warp has read it; the rows' scale words come a chunk ahead in registers, the
    token's K slice is staged once (`_stage_token`). A tile wholly past N_VALID (a TP rank's zero padding) reads
    nothing. pass_i: the program's pass (an EP pair list's program runs several pairs over one ring, each pass the
    same number of chunks: the ring's barrier phases carry on from the passes before)."""
    n_ch = K // CHUNK
    per = gl.cdiv(n_ch, SPLIT)
    ch0 = pid_k * per
    n_my = gl.where(pid_n * BN >= N_VALID, 0, gl.minimum(ch0 + per, n_ch) - ch0)
    base = pass_i * n_my                   # ring steps taken by earlier passes (their barrier phases)
    row_a = (e * 2 * N + pid_n * BN).to(gl.int32)
    for s in gl.static_range(STAGES):
        _issue_words(w_desc, w_bufs, ready, (base + s) % STAGES, row_a, row_a + N, ch0 + s, s < n_my, 2)
    rs = gl.arange(0, 64, layout=gl.SliceLayout(1, _ROW4))
    qs = rs % 16
    srow = (qs // 8) * N + pid_n * BN + (rs // 16) * 8 + qs % 8
    s_at = (s13_ptr + e * 2 * N * KB + srow * KB + ch0 * 4).to(gl.pointer_type(gl.int32))
    xs_at = xs_ptr + t * KB + ch0 * 4 + gl.arange(0, 8, layout=gl.SliceLayout(0, _MMA)) * 0
    _stage_token(x_s, _x_pointers(xp_ptr, t, K, ch0), n_my, MAX_CH)
    zero = gl.zeros([64, 8], gl.float32, _MMA)
    tot = zero
    sw_next = gl.load(s_at, mask=n_my > 0, other=0)
    for j in range(n_my):
        sw = sw_next
        xs = (gl.load(xs_at + j * 4), gl.load(xs_at + j * 4 + 1), gl.load(xs_at + j * 4 + 2),
              gl.load(xs_at + j * 4 + 3))
        sw_next = gl.load(s_at + gl.minimum(j + 1, n_my - 1))
        step = base + j
        slot = step % STAGES
        mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
        wt = _slot_words(w_bufs, slot, 2)
        _THREAD_BARRIER()        # every warp has read the slot: refill it
        _issue_words(w_desc, w_bufs, ready, slot, row_a, row_a + N, ch0 + j + STAGES, j + STAGES < n_my, 2)
        tot = _blocks_mma(wt, sw, xs, x_s.index(j), tot, zero, _MMA, True)
    cols = gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, _MMA)), 0)
    return gl.sum(gl.where(cols == 0, tot, 0.0), axis=1) * 0.0625


@gluon.jit
def _w13_tc_epilogue(gu, hp_ptr, hs_ptr, topw_ptr, p, pid_n, N, N_VALID, limit):
    """g|u [64] (tile rows as `_w13_tc_dots` returns them) -> clipped SwiGLU × routing weight -> BF16 -> FP8 1×32
    (the tile's 32 rows are one block) -> h as f16 codes ×2^-4 [2, N/8, 4] + the block's scale ×2^10
    (`moe._w13_epilogue` with ACC16)."""
    g, u = gl.split(gl.permute(gl.reshape(gu, [4, 2, 8]), [0, 2, 1]))
    g = gl.convert_layout(gl.reshape(g, [BN]), _FLAT)
    u = gl.convert_layout(gl.reshape(u, [BN]), _FLAT)
    if limit > 0:
        u = gl.minimum(gl.maximum(u, -limit), limit)
        g = gl.minimum(g, limit)
    h = g / (1.0 + gl.exp(-g)) * u * gl.load(topw_ptr + p)
    n = pid_n * BN + gl.arange(0, BN, layout=_FLAT)
    h = gl.where(n < N_VALID, h, 0.0).to(gl.bfloat16).to(gl.float32)
    ex = scale_exp(gl.max(gl.abs(h), axis=0))
    c = gl.minimum(gl.maximum(h * exp2i(-ex), -448.0), 448.0).to(gl.float8e4nv).to(gl.float32)
    gl.store(hp_ptr + p.to(gl.int64) * N + _pair_perm16(n, N), (c * 0.0625).to(gl.float16))
    gl.store(hs_ptr + p.to(gl.int64) * (N // 32) + pid_n, exp2i(ex) * 1024.0)


@gluon.jit
def _w13_tc_pair(w_desc, xp_ptr, xs_ptr, s13_ptr, hp_ptr, hs_ptr, topw_ptr, ws_ptr, cnt_ptr, p, e, pid_n, pid_k,
                 n_tiles, N, N_VALID, K, KB, TOPK, limit, pass_i, SPLIT: gl.constexpr, DEPTH: gl.constexpr,
                 MAX_CH: gl.constexpr, x_s, w_bufs, ready):
    """`_moe_w13_tc_kernel`'s work for pair p on (local) expert e."""
    t = (p // TOPK).to(gl.int64)
    gu = _w13_tc_dots(w_desc, xp_ptr, xs_ptr, s13_ptr, t, e, pid_n, pid_k, N, N_VALID, K, KB, pass_i, SPLIT, DEPTH,
                      MAX_CH, x_s, w_bufs, ready)
    if SPLIT == 1:
        _w13_tc_epilogue(gu, hp_ptr, hs_ptr, topw_ptr, p, pid_n, N, N_VALID, limit)
    else:
        off = gl.arange(0, 64, layout=gl.SliceLayout(1, _MMA))
        tile = p * n_tiles + pid_n
        wsp = ws_ptr + tile.to(gl.int64) * SPLIT * 64
        if splitk_arrive(gu, wsp, off, off >= 0, cnt_ptr, tile, pid_k, SPLIT, 64):
            tot = splitk_total(wsp, off, off >= 0, cnt_ptr, tile, SPLIT, 64, SPLIT)
            _w13_tc_epilogue(tot, hp_ptr, hs_ptr, topw_ptr, p, pid_n, N, N_VALID, limit)


@gluon.jit
def _init_out_share(out_ptr, sh_ptr, t, D, stride_o, stride_sh, i, n, COPY: gl.constexpr):
    """Share i of n of row t of out: out[t] = sh[t] as fp32 (COPY), else 0 (`moe._init_out_share`)."""
    BLOCK: gl.constexpr = 512
    per = gl.cdiv(gl.cdiv(D, n), BLOCK) * BLOCK
    lo = i * per
    hi = gl.minimum(lo + per, D)
    for c in range(lo, hi, BLOCK):
        o = c + gl.arange(0, BLOCK, layout=_FLAT)
        if COPY:
            v = gl.load(sh_ptr + t * stride_sh + o, mask=o < hi, other=0.0).to(gl.float32)
        else:
            v = gl.zeros([BLOCK], gl.float32, _FLAT)
        gl.store(out_ptr + t * stride_o + o, v, mask=o < hi)


@gluon.jit
def _moe_w13_tc_kernel(w_desc, xp_ptr, xs_ptr, s13_ptr, hp_ptr, hs_ptr, ids_ptr, topw_ptr, ws_ptr, cnt_ptr,
                       out_ptr, sh_ptr, D_OUT, stride_o, stride_sh, N, N_VALID, K, KB, TOPK, E, limit, list_ptr,
                       count_ptr, T, SPLIT: gl.constexpr, DEPTH: gl.constexpr, MAX_CH: gl.constexpr,
                       INIT_OUT: gl.constexpr, COMPACT: gl.constexpr, PASSES: gl.constexpr, PDL: gl.constexpr):
    """Grid and pair dispatch as `moe._moe_w13_gemv_kernel` (rows of pairs, 32-row tiles, K slices; COMPACT: the EP
    pair list, PASSES per program row; INIT_OUT 1 / 2: also write out's starting value, zeros / the shared expert's
    output; 3: out is [T·k, D], each pair's row zeroed); per pair `_w13_tc_pair`. PDL: launched with programmatic
    dependent launch (waits for the router).
    w_desc: w13's words [E·2·I_pad, D/8] in 32 × 16 boxes, streamed through a ring of DEPTH chunks."""
    pid0, pid_n, pid_k, n_rows, n_tiles = _gemv_pids(COMPACT)
    if PDL:
        _grid_dependency_wait()
    x_s = gl.allocate_shared_memory(gl.float8e4nv, [MAX_CH, 8, CHUNK], _B_SMEM)
    w_bufs, ready = _weight_ring(w_desc, 32, 2, DEPTH)
    if COMPACT:
        if INIT_OUT > 0:
            _init_out_listed(out_ptr, sh_ptr, T, TOPK, D_OUT, stride_o, stride_sh,
                             (pid0 * n_tiles + pid_n) * SPLIT + pid_k, n_rows * n_tiles * SPLIT, INIT_OUT,
                             _init_out_share)
        count = gl.load(count_ptr)
        for i in gl.static_range(PASSES):
            s = pid0 + i * n_rows
            p, e = _listed_pair(list_ptr, s, T * TOPK)
            if s < count:
                _w13_tc_pair(w_desc, xp_ptr, xs_ptr, s13_ptr, hp_ptr, hs_ptr, topw_ptr, ws_ptr, cnt_ptr, p, e, pid_n,
                             pid_k, n_tiles, N, N_VALID, K, KB, TOPK, limit, i, SPLIT, DEPTH, MAX_CH, x_s, w_bufs,
                             ready)
    else:
        p = pid0
        e = gl.load(ids_ptr + p).to(gl.int64)
        if INIT_OUT > 0:
            _init_out_pair(out_ptr, sh_ptr, p, TOPK, D_OUT, stride_o, stride_sh, pid_n * SPLIT + pid_k,
                           n_tiles * SPLIT, INIT_OUT, _init_out_share)
        if e < E:
            _w13_tc_pair(w_desc, xp_ptr, xs_ptr, s13_ptr, hp_ptr, hs_ptr, topw_ptr, ws_ptr, cnt_ptr, p, e, pid_n,
                         pid_k, n_tiles, N, N_VALID, K, KB, TOPK, limit, 0, SPLIT, DEPTH, MAX_CH, x_s, w_bufs, ready)


def tc_fits(inter_pad: int, dim: int, qblock: int = 32) -> bool:
    """Whether the tensor-core w13 takes this expert shape: whole 32-row tiles and 128-K chunks, 1×32 blocks."""
    return inter_pad % BN.value == 0 and dim % CHUNK.value == 0 and qblock == 32


def gemv_w13_tc(xp, weights: torch.Tensor, ids: torch.Tensor, w13_q: torch.Tensor, w13_s: torch.Tensor,
                inter: int, swiglu_limit: float, cfg: MoeConfig, out: torch.Tensor | None = None,
                shared: torch.Tensor | None = None, pairs: LocalPairs | None = None, slots: int = 0,
                pair_rows: bool = False):
    """`moe.gemv_w13` for an acc16 config with tc13: the same activation (f16 codes, block scales), the same h
    ((f16 codes [T·k, 2, I_pad/8, 4], block scales [T·k, I_pad/32])), the same out initialisation and pair list;
    cfg.split13 K slices of 128-K chunks, cfg.stages chunks of weights in flight per program."""
    codes, xs = xp
    p, d = ids.numel(), codes[0].numel()
    ipad = w13_q.shape[1] // 2
    assert cfg.tc13 and cfg.acc16 and tc_fits(ipad, d), f"{cfg.tag()}: I_pad={ipad}, D={d}"
    assert codes.dtype == torch.float16 and codes.is_contiguous() and xs.shape == (ids.shape[0], d // 32), \
        f"the tensor-core w13 reads the f16-code activation (gemv16), got {codes.dtype} {tuple(xs.shape)}"
    hp = (torch.empty((p, 2, ipad // 8, 4), dtype=torch.float16, device=codes.device),
          torch.empty((p, ipad // 32), dtype=torch.float32, device=codes.device))
    n_tiles = ipad // BN.value
    n_ch = d // CHUNK.value
    split = k_slices(n_ch, cfg.split13)
    ws = torch.empty((p * n_tiles * split * 64,), dtype=torch.float32, device=codes.device) if split > 1 else hp[1]
    cnt = split_counter(codes.device, p * n_tiles, "moe_w13_tc") if split > 1 else ids
    init, o, sh = out_init(out, shared, ids, d, pair_rows, hp[1])
    grid, plist, pcount, passes = _pair_grid(ids, pairs, slots, n_tiles, split)
    _moe_w13_tc_kernel[grid](
        words_desc(w13_q, 32), codes, xs, w13_s.view(torch.uint8), hp[0], hp[1], ids, weights, ws, cnt,
        o, sh, d, o.stride(0), sh.stride(0), ipad, inter, d, d // 32, ids.shape[1],
        w13_q.shape[0], float(swiglu_limit),
        plist, pcount, ids.shape[0], SPLIT=split, DEPTH=max(1, cfg.stages), MAX_CH=triton.cdiv(n_ch, split),
        INIT_OUT=init, COMPACT=pairs is not None, PASSES=passes, PDL=cfg.pdl, num_warps=4, launch_pdl=cfg.pdl)
    return hp


def words_desc(q: torch.Tensor, box_rows: int) -> TensorDescriptor:
    """The TMA descriptor of MXFP4 expert weights q (int8 [E, rows, K/2]) as int32 words [E·rows, K/8], in boxes of
    box_rows rows × 16 words (one 128-K chunk) for `_weight_ring`."""
    rows, words = q.shape[0] * q.shape[1], q.shape[2] // 4
    return TensorDescriptor(q.view(torch.int32).view(rows, words), [rows, words], [words, 1], [box_rows, 16],
                            _words_smem())


@functools.cache
def _words_smem():
    """The weight boxes' shared layout: rows of 16 words (64 bytes), 64-byte swizzle (fewer bank conflicts for the
    in-warp word reads of `_slot_words`)."""
    return gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=32, rank=2)
