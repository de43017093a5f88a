"""Group-32 FP8 GEMMs on explicit Hopper wgmma, written in Gluon: one for large M (prefill), one for decode.

y[m, n] = Σ_kb (A_q[m, kb]·W_q[n, kb]ᵀ)·sa[m, kb]·sw[n/32, kb], fp32 promotion every 32 K: the contract and numerics
of `fp8_gemm._fp8_gemm_g32_kernel`.

Decode (M <= 8, `_fp8_gemm_g32_gluon_decode_kernel`, swap-AB: 64 weight rows × 8 tokens): each TMA stage brings
1-4 boxes of 128 K; every slot of the ring is requested up front and refilled as soon as its own MMAs are done;
all of a stage's m64n8k32 MMAs are issued before one wait (a partial is 4 registers), so the weight stream never
stalls on an MMA round trip; split-K slices are reduced in the same launch (`splitk`). With PDL the weight ring is
requested before the kernel waits for its predecessor. Shallow rings on many resident programs win
(`tuning.gluon_decode_candidates`). `fp8_linear_gluon_decode` takes the bf16 activation and quantizes it per 1×32
inside the kernel (bit-identical to `act_quant`), so a decode linear is one launch.

Large M (`_fp8_gemm_g32_gluon_kernel`, normal orientation, A rows on the tile's M side). What differs from the
Triton kernel:
- the promotion is one FFMA per accumulator element. The per-column W scale is built from the tile's BN/32 block
  scales by a select on the column's block index, which is a compile-time constant per register, so the scale
  product costs one FMUL per (row, block) a thread holds instead of one per element;
- the K loop issues fewer non-FFMA instructions (4 K blocks per TMA stage, W scales read as one 32-bit word per
  block row and stage), and a 64-row tile capped at 168 registers lets three CTAs share an SM, so one CTA's
  promotion runs while another's MMA does (benchmarks/README.md, session 5: 2× the Triton kernel at M = 4096).
- with V4's 128-groups (`group=128`: scales constant over each 128 K) the large-M kernel runs each stage as one
  128-deep MMA and promotes once, the V4 reference's per-128-K promotion (a quarter of the folds). (Two partials,
  one stage's MMA running while the other is folded, made ptxas serialise every wgmma of the kernel, C7514: the
  overlap comes from the 2-3 CTAs per SM instead.)
Both need K % 128 == 0. Imports Triton's Gluon: load this module lazily.
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

from dsflash.plugins.tuning import GLUON_BLOCK_K as BLOCK_K   # K per TMA stage: 4 scale blocks
from dsflash.plugins.fp8_gemm import _scale_arg
from dsflash.plugins.splitk import decode_ws_tokens, split_counter, splitk_store_rows_tokens
from dsflash.plugins.tl_helpers import e8m0_to_f32, exp2i, grouped_tile, scale_exp
from dsflash.plugins.tuning import GemmConfig, gluon_fits, k_slices

_KB = gl.constexpr(BLOCK_K // 32)


@gluon.jit
def _fold(acc, p, sa, sw_col):
    """acc + p·(sa ⊗ sw_col), one FFMA per element. Volatile asm keeps each fold next to its MMA: LLVM would
    otherwise sink all of a stage's folds below its last MMA and hold every partial live at once."""
    s = gl.expand_dims(sa, 1) * gl.expand_dims(sw_col, 0)
    return gl.inline_asm_elementwise("fma.rn.f32 $0, $1, $2, $3;", "=r,r,r,r", [p, s, acc], dtype=gl.float32,
                                     is_pure=False, pack=1)


@gluon.jit
def _stage_scales(sa_base, sw_base, stride_sw, kb0, n_kb, row_ok, cols_blk, nb0, n_nb,
                  NB: gl.constexpr, AS_E8M0: gl.constexpr, NKB: gl.constexpr = _KB):
    """Scales of the stage's first NKB (4, or 1 with 128-groups) K blocks from kb0 (0 past K or out of range): a
    tuple of NKB sa [BM] and a tuple of NKB per-column W scales [BN]. Each W-scale row is read as one 32-bit word
    (4 consecutive K blocks)."""
    k_ok = kb0 < n_kb
    words = ()
    for j in gl.static_range(NB):
        wp = (sw_base + j * stride_sw + kb0).to(gl.pointer_type(gl.int32))
        words = words + (gl.load(wp, mask=(nb0 + j < n_nb) & k_ok, other=0), )
    sa = ()
    sw = ()
    for kk in gl.static_range(NKB):
        s = gl.load(sa_base + kb0 + kk, mask=row_ok & k_ok, other=0)
        if AS_E8M0:
            s = e8m0_to_f32(s)
        sa = sa + (s, )
        col = e8m0_to_f32((words[0] >> (8 * kk)) & 255)
        for j in gl.static_range(1, NB):
            w = e8m0_to_f32((words[j] >> (8 * kk)) & 255)
            col = gl.where(cols_blk == j, w, col)
        sw = sw + (col, )
    return sa, sw


@gluon.jit
def _load_boxes(desc, bufs, bar, slot, off, k0, ok, BOXES: gl.constexpr):
    """TMA of BOXES boxes of 128 K from k0 of the rows from `off` into buffers slot·BOXES + b, on barrier `bar`."""
    BK: gl.constexpr = desc.block_type.shape[1]
    for b in gl.static_range(BOXES):
        tma.async_copy_global_to_shared(desc, [off, k0 + b * BK], bar, bufs.index(slot * BOXES + b), pred=ok)


@gluon.jit
def _load_stage(p_desc, q_desc, p_bufs, q_bufs, ready, slot, off_p, off_q, k0, ok, BOXES: gl.constexpr):
    """TMA of one pipeline stage into ring slot `slot`, signalling ready[slot]: BOXES boxes of 128 K from k0 of the
    P rows from off_p and the Q rows from off_q (buffers slot·BOXES + b); nothing when not ok."""
    bar = ready.index(slot)
    mbarrier.expect(bar, BOXES * (p_desc.block_type.nbytes + q_desc.block_type.nbytes), pred=ok)
    _load_boxes(p_desc, p_bufs, bar, slot, off_p, k0, ok, BOXES)
    _load_boxes(q_desc, q_bufs, bar, slot, off_q, k0, ok, BOXES)


@gluon.jit
def _quantize_tokens(x_bufs, q_bufs, slot, BOXES: gl.constexpr, cols_l: gl.constexpr, num_warps: gl.constexpr,
                     A128: gl.constexpr = False):
    """The stage's token boxes (bf16 [BQ, 128] each, in x_bufs) quantized per 1×32 (A128: per 1×128, a whole box)
    as `act_quant` does (scale 2^e, e = scale_exp(absmax), e4m3 with RTNE and ±448 saturation) into q_bufs, the
    MMA's token operand. Returns the 4·BOXES scale vectors 2^e [BQ] (layout cols_l), in K-block order."""
    BK: gl.constexpr = x_bufs.shape[2]
    # x: [BQ = 8 tokens, 128 K], 8 consecutive K per thread (a quarter of a 32-block)
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    grp = gl.expand_dims(gl.arange(0, BK, layout=gl.SliceLayout(0, blk)) // 32, 0)   # [1, BK]: K block in box
    scales = ()
    for b in gl.static_range(BOXES):
        v = x_bufs.index(slot * BOXES + b).load(blk).to(gl.float32)                  # [BQ, BK]
        mag = gl.abs(v)
        inv = v * 0.0
        if A128:
            e = scale_exp(gl.max(mag, axis=1))                                          # [BQ]
            inv = inv + gl.expand_dims(exp2i(-e), 1)
            for g in gl.static_range(BK // 32):
                scales = scales + (gl.convert_layout(exp2i(e), cols_l), )
        else:
            for g in gl.static_range(BK // 32):
                e = scale_exp(gl.max(gl.where(grp == g, mag, 0.0), axis=1))              # [BQ]
                inv = gl.where(grp == g, gl.expand_dims(exp2i(-e), 1), inv)
                scales = scales + (gl.convert_layout(exp2i(e), cols_l), )
        q = gl.minimum(gl.maximum(v * inv, -448.0), 448.0).to(gl.float8e4nv)
        q_bufs.index(slot * BOXES + b).store(q)
    fence_async_shared()       # the generic-proxy stores, before the async proxy (wgmma) reads them
    gl.thread_barrier()
    return scales


@gluon.jit
def _grid_dependency_wait():
    """griddepcontrol.wait (launched with PDL): the previous kernel's writes are visible from here; then let the next
    kernel launch, so that its own prologue (weight prefetch) overlaps this kernel's stream."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def _fp8_gemm_g32_gluon_kernel(a_desc, b_desc, out_ptr, as_ptr, ws_ptr, M, N, K, stride_om, stride_as, stride_ws,
                               AS_E8M0: gl.constexpr, GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr,
                               G128: gl.constexpr, num_warps: gl.constexpr):
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    NB: gl.constexpr = BN // 32
    gl.static_assert(BK == 32 * _KB, "4 scale blocks per stage")
    NKB: gl.constexpr = 1 if G128 else _KB   # scale blocks read (and promotions) per stage

    pid_m, pid_n = grouped_tile(gl.program_id(0), gl.cdiv(M, BM), gl.cdiv(N, BN), GROUP_M)
    off_m = pid_m * BM
    off_n = pid_n * BN

    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BN, 32])
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    cols_l: gl.constexpr = gl.SliceLayout(0, mma)

    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES, BM, BK], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NUM_STAGES, BN, BK], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(s), count=1)
    n_it = gl.cdiv(K, BK)
    for s in gl.static_range(NUM_STAGES - 1):   # out-of-range rows / K are zero-filled by TMA
        _load_stage(a_desc, b_desc, a_bufs, b_bufs, ready, s, off_m, off_n, s * BK, s < n_it, 1)

    rows = off_m + gl.arange(0, BM, layout=rows_l)
    row_ok = rows < M
    sa_base = as_ptr + rows * stride_as
    cols = off_n + gl.arange(0, BN, layout=cols_l)
    cols_blk = gl.arange(0, BN, layout=cols_l) // 32
    nb0 = off_n // 32
    n_nb = gl.cdiv(N, 32)
    sw_base = ws_ptr + nb0 * stride_ws
    n_kb = K // 32
    sa, sw = _stage_scales(sa_base, sw_base, stride_ws, 0, n_kb, row_ok, cols_blk, nb0, n_nb, NB, AS_E8M0, NKB)

    acc = gl.zeros([BM, BN], gl.float32, mma)
    part = gl.zeros([BM, BN], gl.float32, mma)
    for it in range(n_it):
        st = it % NUM_STAGES
        mbarrier.wait(ready.index(st), (it // NUM_STAGES) & 1)
        a_s = a_bufs.index(st)
        b_s = b_bufs.index(st)
        # the next stage's scales: loaded now, used a stage later
        nxt_sa, nxt_sw = _stage_scales(sa_base, sw_base, stride_ws, (it + 1) * _KB, n_kb, row_ok, cols_blk, nb0,
                                       n_nb, NB, AS_E8M0, NKB)
        if G128:
            # every warp is past the previous stage's MMA (waited there): refill its slot, then one 128-deep MMA
            # promoted once
            gl.thread_barrier()
            nxt = it + NUM_STAGES - 1
            _load_stage(a_desc, b_desc, a_bufs, b_bufs, ready, nxt % NUM_STAGES, off_m, off_n, nxt * BK,
                        nxt < n_it, 1)
            part = warpgroup_mma(a_s, b_s.permute((1, 0)), part, use_acc=False, is_async=True)
            part = warpgroup_mma_wait(0, deps=(part, ))
            acc = _fold(acc, part, sa[0], sw[0])
        else:
            for kk in gl.static_range(_KB):
                # part: [BM, BN] = A[:, 32 K] · W[BN, 32 K]ᵀ (fresh, fp32), folded at once: promotion every 32 K
                part = warpgroup_mma(a_s.slice(kk * 32, 32, dim=1), b_s.slice(kk * 32, 32, dim=1).permute((1, 0)),
                                     part, use_acc=False, is_async=True)
                part = warpgroup_mma_wait(0, deps=(part, ))
                acc = _fold(acc, part, sa[kk], sw[kk])
                if kk == 0:
                    # every warp is past the previous stage's MMAs: refill its slot
                    gl.thread_barrier()
                    nxt = it + NUM_STAGES - 1
                    _load_stage(a_desc, b_desc, a_bufs, b_bufs, ready, nxt % NUM_STAGES, off_m, off_n, nxt * BK,
                                nxt < n_it, 1)
        sa = nxt_sa
        sw = nxt_sw
    for s in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(ready.index(s))

    o_off = gl.expand_dims(rows.to(gl.int64) * stride_om, 1) + gl.expand_dims(cols, 0)
    o_mask = gl.expand_dims(row_ok, 1) & gl.expand_dims(cols < N, 0)
    gl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=o_mask)


@gluon.jit
def _scale_words(base, kb, n_kb, ok, BOXES: gl.constexpr):
    """The e8m0 scales of BOXES 128-K boxes from K block kb (kb % 4 == 0), one 32-bit word (4 K blocks) per box and
    per pointer of `base` (0 past K or where not ok)."""
    words = ()
    for b in gl.static_range(BOXES):
        words = words + (gl.load((base + kb + b * _KB).to(gl.pointer_type(gl.int32)),
                                 mask=ok & (kb + b * _KB < n_kb), other=0), )
    return words


@gluon.jit
def _fp8_gemm_g32_gluon_decode_kernel(w_desc, a_desc, out_ptr, ws_ptr, as_ptr, part_ptr, cnt_ptr, M, N, K,
                                      stride_ws, stride_as, SPLIT, AS_E8M0: gl.constexpr, BOXES: gl.constexpr,
                                      NUM_STAGES: gl.constexpr, PDL: gl.constexpr, QUANT_A: gl.constexpr,
                                      Q_LAYOUT: gl.constexpr, A128: gl.constexpr, A_WORDS: gl.constexpr,
                                      PREFETCH: gl.constexpr, MAX_SPLIT: gl.constexpr, WS_Q: gl.constexpr,
                                      num_warps: gl.constexpr):
    """Decode (M <= 8), swap-AB: 64 weight rows × the 8-token tile per program, over K slice pid_k of SPLIT.
    A stage is BOXES TMA boxes of 128 K (weights [64, 128], tokens [8, 128]); its 4·BOXES m64n8k32 MMAs are all
    issued before one wait (each partial is 4 registers), then folded: the weight stream never waits on an MMA.
    PDL (launched with programmatic dependent launch): the weight boxes of the whole ring are requested before
    `griddepcontrol.wait`, the tokens after it; nothing the previous kernel writes is read or written before.
    QUANT_A: a_desc is the bf16 activation itself; each stage's token boxes are quantized per 1×32 in the kernel
    (`_quantize_tokens`, into e4m3 buffers of layout Q_LAYOUT; A128: per 1×128, V4) and as_ptr is unused: one launch
    per linear.
    Scales: the weight's, and the activation's when e8m0 in 4-byte aligned rows (A_WORDS), come as one 32-bit word
    (4 K blocks) per box and row or token, loaded before the stage's MMAs are issued; with PREFETCH (slices of more
    than one stage) a stage ahead, the first stage's weight words before `griddepcontrol.wait`. (A scale load per
    token and K block in the fold cost M = 8 up to 1.2 µs over M = 1 on the 24 MB shared w13: benchmarks/README.md,
    session 17.)
    MAX_SPLIT (a power of two >= SPLIT): the last slice's sum of the partials is unrolled that far (`splitk_total`);
    unrolled over a constexpr SPLIT it measured 0.1-0.3 µs faster than the runtime loop (gemm_decode_splitk.py).
    WS_Q: token columns of the split-K workspace [SPLIT, N, WS_Q] (`decode_ws_tokens`)."""
    BP: gl.constexpr = w_desc.block_type.shape[0]
    BQ: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = w_desc.block_type.shape[1]
    gl.static_assert(BK == 32 * _KB, "128 K per box")
    pid = gl.program_id(0)
    pid_k = gl.program_id(1)
    off_n = pid * BP

    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BQ, 32])
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    cols_l: gl.constexpr = gl.SliceLayout(0, mma)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [NUM_STAGES * BOXES, BP, BK], w_desc.layout)
    # t_bufs: what the token TMA fills; a_bufs: the MMA's e4m3 token operand (the same buffers unless QUANT_A)
    t_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES * BOXES, BQ, BK], a_desc.layout)
    if QUANT_A:
        a_bufs = gl.allocate_shared_memory(gl.float8e4nv, [NUM_STAGES * BOXES, BQ, BK], Q_LAYOUT)
    else:
        a_bufs = t_bufs
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(s), count=1)
    n_st = gl.cdiv(K, BK * BOXES)
    per = gl.cdiv(n_st, SPLIT)
    st0 = pid_k * per
    n_my = gl.minimum(st0 + per, n_st) - st0
    rows = off_n + gl.arange(0, BP, layout=rows_l)
    rows_ok = rows < N
    toks = gl.arange(0, BQ, layout=cols_l)
    toks_ok = toks < M
    sw_row = ws_ptr + (rows // 32) * stride_ws
    sa_col = as_ptr + toks * stride_as
    n_kb = K // 32
    if PREFETCH:
        w_next = _scale_words(sw_row, st0 * BOXES * _KB, n_kb, rows_ok, BOXES)
    # every slot is filled up front: a slot is refilled only after its own stage's MMAs have completed, so a slice
    # of <= NUM_STAGES stages (the usual decode split) is requested in one go, with no second round trip
    if PDL:   # the weights do not depend on the previous kernel: request them before waiting for it
        for s in gl.static_range(NUM_STAGES):
            bar = ready.index(s)
            mbarrier.expect(bar, BOXES * (w_desc.block_type.nbytes + a_desc.block_type.nbytes), pred=s < n_my)
            _load_boxes(w_desc, w_bufs, bar, s, off_n, (st0 + s) * BOXES * BK, s < n_my, BOXES)
        _grid_dependency_wait()
        for s in gl.static_range(NUM_STAGES):
            _load_boxes(a_desc, t_bufs, ready.index(s), s, 0, (st0 + s) * BOXES * BK, s < n_my, BOXES)
    else:
        for s in gl.static_range(NUM_STAGES):
            _load_stage(w_desc, a_desc, w_bufs, t_bufs, ready, s, off_n, 0, (st0 + s) * BOXES * BK, s < n_my,
                        BOXES)

    if PREFETCH and A_WORDS:
        a_next = _scale_words(sa_col, st0 * BOXES * _KB, n_kb, toks_ok, BOXES)
    zero = gl.zeros([BP, BQ], gl.float32, mma)
    acc = gl.zeros([BP, BQ], gl.float32, mma)
    for i in range(n_my):
        st = i % NUM_STAGES
        mbarrier.wait(ready.index(st), (i // NUM_STAGES) & 1)
        kb0 = (st0 + i) * BOXES * _KB
        if QUANT_A:
            sa_q = _quantize_tokens(t_bufs, a_bufs, st, BOXES, cols_l, num_warps, A128)
        if PREFETCH:   # this stage's words came a stage ago; request the next stage's (none past the slice)
            w_words = w_next
            more = i + 1 < n_my
            w_next = _scale_words(sw_row, kb0 + BOXES * _KB, n_kb, rows_ok & more, BOXES)
            if A_WORDS:
                a_words = a_next
                a_next = _scale_words(sa_col, kb0 + BOXES * _KB, n_kb, toks_ok & more, BOXES)
        else:
            w_words = _scale_words(sw_row, kb0, n_kb, rows_ok, BOXES)
            if A_WORDS:
                a_words = _scale_words(sa_col, kb0, n_kb, toks_ok, BOXES)
        parts = ()
        for b in gl.static_range(BOXES):
            w_s = w_bufs.index(st * BOXES + b)
            a_s = a_bufs.index(st * BOXES + b)
            for kk in gl.static_range(_KB):   # parts[b·4 + kk]: [64 weight rows, 8 tokens] of one 32-K block
                parts = parts + (warpgroup_mma(w_s.slice(kk * 32, 32, dim=1),
                                               a_s.slice(kk * 32, 32, dim=1).permute((1, 0)),
                                               zero, use_acc=False, is_async=True), )
        parts = warpgroup_mma_wait(0, deps=parts)
        for b in gl.static_range(BOXES):
            for kk in gl.static_range(_KB):
                sw = e8m0_to_f32((w_words[b] >> (8 * kk)) & 255)
                if QUANT_A:
                    sa = sa_q[b * _KB + kk]
                elif A_WORDS:
                    sa = e8m0_to_f32((a_words[b] >> (8 * kk)) & 255)
                else:
                    kb = kb0 + b * _KB + kk
                    sa = gl.load(sa_col + kb, mask=toks_ok & (kb < n_kb), other=0)
                    if AS_E8M0:
                        sa = e8m0_to_f32(sa)
                acc = acc + parts[b * _KB + kk] * (gl.expand_dims(sw, 1) * gl.expand_dims(sa, 0))
        # every MMA of this stage is done: refill its slot with the stage NUM_STAGES ahead
        gl.thread_barrier()
        nxt = i + NUM_STAGES
        _load_stage(w_desc, a_desc, w_bufs, t_bufs, ready, st, off_n, 0, (st0 + nxt) * BOXES * BK, nxt < n_my,
                    BOXES)
    for s in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(ready.index(s))

    # out[tok, n] = acc[n, tok]
    splitk_store_rows_tokens(out_ptr, acc, gl.expand_dims(rows, 1), gl.expand_dims(rows_ok, 1),
                             gl.expand_dims(toks, 0), gl.expand_dims(toks_ok, 0), N, part_ptr, WS_Q, cnt_ptr, pid,
                             pid_k, SPLIT, MAX_SPLIT)


@functools.cache
def e4m3_smem_layout(rows: int):
    """The shared-memory layout of a [rows, BLOCK_K] e4m3 TMA box, made once per shape rather than at every launch."""
    return gl.NVMMASharedLayout.get_default_for([rows, BLOCK_K], gl.float8e4nv)


@functools.cache
def _bf16_unswizzled():
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)


def fp8_gemm_gluon(a_q: torch.Tensor, a_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, cfg: GemmConfig,
                   out: torch.Tensor, group: int = 32) -> torch.Tensor:
    """out [M, N] bf16 = group-32 FP8 GEMM; operands already checked by `fp8_gemm.gemm_operands` and `fp8_gemm`
    (group 128: the scales are constant over each 128 K, and the large-M kernel promotes once per stage).
    cfg.gluon: block_p = BM rows (64 with 4 warps, 128 with 8), block_q = BN (64 or 128), num_stages, maxnreg;
    with swap_ab the decode kernel (M <= 8): block_p 64 weight rows, block_q 8 tokens, kgroups 128-K boxes per
    stage, split_k, num_stages, pdl."""
    m, k = a_q.shape
    n = w_q.shape[0]
    assert cfg.gluon, cfg
    assert gluon_fits(k), f"the Gluon FP8 GEMM needs K % {BLOCK_K} == 0, got K={k}"
    sa, as_e8 = _scale_arg(a_s)
    ws8, ws_e8 = _scale_arg(w_s)
    assert ws_e8 and ws8.data_ptr() % 4 == 0 and ws8.stride(0) % 4 == 0, \
        "the Gluon FP8 GEMM reads e8m0 weight scales as 32-bit words"
    if cfg.swap_ab:
        return _decode(a_q, sa, as_e8, w_q, ws8, cfg, out)
    bm, bn = cfg.block_p, cfg.block_q
    a_desc = TensorDescriptor(a_q, [m, k], [a_q.stride(0), 1], [bm, BLOCK_K], e4m3_smem_layout(bm))
    b_desc = TensorDescriptor(w_q, [n, k], [k, 1], [bn, BLOCK_K], e4m3_smem_layout(bn))
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), )
    _fp8_gemm_g32_gluon_kernel[grid](
        a_desc, b_desc, out, sa, ws8, m, n, k, out.stride(0), sa.stride(0), ws8.stride(0),
        AS_E8M0=as_e8, GROUP_M=cfg.group_p, NUM_STAGES=cfg.num_stages, G128=group == 128,
        num_warps=cfg.num_warps,
        **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}))
    return out


def bf16_tma_ready(x: torch.Tensor) -> bool:
    """Whether the decode kernel can read x itself by TMA (quant_in_kernel): bf16 [M, K], contiguous 16-byte aligned
    rows."""
    return (x.dim() == 2 and x.dtype == torch.bfloat16 and x.stride(1) == 1 and x.stride(0) % 8 == 0
            and x.data_ptr() % 16 == 0)


def fp8_linear_gluon_decode(x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, cfg: GemmConfig,
                            out: torch.Tensor | None = None, act_block: int = 32) -> torch.Tensor:
    """out [M, N] bf16 = the group-32 FP8 linear of bf16 x [M <= 8, K] in one launch: the decode kernel quantizes
    the activation per 1×act_block (32, or V4's 128) itself, exactly as `act_quant` then `fp8_gemm` with the same
    config (QUANT_A).
    cfg: a Gluon decode config (gluon, swap_ab; its quant_in_kernel flag is not needed); w_s: e8m0 block scales."""
    assert cfg.gluon and cfg.swap_ab, f"in-kernel quantization is the Gluon decode kernel's, not {cfg.tag()}"
    assert bf16_tma_ready(x), \
        f"x must be bf16 [M, K] with contiguous, 16-byte aligned rows, got {x.dtype} {tuple(x.shape)} {x.stride()}"
    m, k = x.shape
    assert w_q.dtype == torch.float8_e4m3fn and w_q.dim() == 2 and w_q.shape[1] == k, (w_q.dtype, tuple(w_q.shape))
    assert gluon_fits(k), f"the Gluon FP8 GEMM needs K % {BLOCK_K} == 0, got K={k}"
    ws8, ws_e8 = _scale_arg(w_s)
    assert ws_e8 and ws8.data_ptr() % 4 == 0 and ws8.stride(0) % 4 == 0, \
        "the Gluon FP8 GEMM reads e8m0 weight scales as 32-bit words"
    if out is None:
        out = torch.empty((m, w_q.shape[0]), dtype=torch.bfloat16, device=x.device)
    assert act_block in (32, 128), f"activation block {act_block}: 32 (V4.1) or 128 (V4)"
    return _decode(x, None, False, w_q, ws8, cfg, out, act_block == 128)


def _decode(a: torch.Tensor, sa: torch.Tensor | None, as_e8: bool, w_q: torch.Tensor, ws8: torch.Tensor,
            cfg: GemmConfig, out: torch.Tensor, a128: bool = False) -> torch.Tensor:
    """The decode kernel's launch: a = the e4m3 activation with its scales sa (as `_scale_arg` returns them), or,
    with sa None, the bf16 activation the kernel quantizes itself; ws8: e8m0 bytes."""
    m, k = a.shape
    n = w_q.shape[0]
    assert m <= cfg.block_q, f"the Gluon decode GEMM takes M <= {cfg.block_q} tokens, got {m}"
    w_desc = TensorDescriptor(w_q, [n, k], [k, 1], [cfg.block_p, BLOCK_K], e4m3_smem_layout(cfg.block_p))
    # the bf16 activation's 256-byte box rows exceed the 128-byte swizzle span TMA allows; only threads read that
    # buffer, so it is left unswizzled
    a_layout = _bf16_unswizzled() if sa is None else e4m3_smem_layout(cfg.block_q)
    a_desc = TensorDescriptor(a, [m, k], [a.stride(0), 1], [cfg.block_q, BLOCK_K], a_layout)
    tiles = triton.cdiv(n, cfg.block_p)
    n_st = triton.cdiv(k, BLOCK_K * cfg.kgroups)
    split = k_slices(n_st, cfg.split_k)
    ws_q = decode_ws_tokens(m, cfg.block_q)
    part = torch.empty((split, n, ws_q), dtype=torch.float32, device=out.device) if split > 1 else out
    cnt = split_counter(out.device, tiles, "fp8_gemm_gluon") if split > 1 else out
    _fp8_gemm_g32_gluon_decode_kernel[(tiles, split)](
        w_desc, a_desc, out, ws8, ws8 if sa is None else sa, part, cnt, m, n, k, ws8.stride(0),
        0 if sa is None else sa.stride(0), split, AS_E8M0=as_e8, BOXES=cfg.kgroups, NUM_STAGES=cfg.num_stages,
        PDL=cfg.pdl, QUANT_A=sa is None, A128=a128,
        A_WORDS=as_e8 and sa.stride(0) % 4 == 0 and sa.data_ptr() % 4 == 0, PREFETCH=triton.cdiv(n_st, split) > 1,
        MAX_SPLIT=triton.next_power_of_2(split), WS_Q=ws_q,
        Q_LAYOUT=e4m3_smem_layout(cfg.block_q),
        num_warps=4, launch_pdl=cfg.pdl)
    return out
