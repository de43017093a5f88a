"""The sorted (prefill) MoE path on FP8 tensor cores, in Gluon: MXFP4 codes turned into e4m3 in registers, one
m64nBMk32 wgmma per 32-block against the e4m3 codes of a block of BM tokens of one expert, fp32 promotion per block.

Why: `moe._moe_w13_kernel` (`tl.dot_scaled`: e2m1 -> BF16 in registers, BF16 MMA) is issue-bound on its upcast. On
one TP8 rank at M = 1024 its w13 runs at 66 % issue activity with 40 % of its samples on PRMT and 15 % on SEL, and
the path reaches 18-27 % of copy bandwidth (H100, benchmarks/README.md, "Session 44"). Plain Triton did not give a
cheaper loop: an FP8 `tl.dot` fed by the same re-bias compiled to ~10 instructions per weight element (byte loads
and repacking around the layout conversions). Here the layouts are chosen: the weight words go to the A-operand
layout by one in-warp transpose per 128-K chunk and one 3-op re-bias per word (`moe_tc._a_operand`, the decode
experiment of session 20, whose structure was latency-bound at one token and is not at a block of tokens).

A program: BM slots of one expert's padded run (`moe.moe_align`) × 64 MMA rows, K in chunks of 4 blocks, DEPTH
chunks of weights, scales and activations in registers ahead of the MMAs; each chunk's activation tile is stored to
one of two shared buffers, the 4 MMAs are issued before one wait, and each block's product is folded into the fp32
total with 2^(e_w - 127)·2^6 (the re-bias) × the token's block scale.
- w13: 32 rows of w1 and the same 32 of w3 (tile row 16w + q: w1 row 8w + q for q < 8, else w3 row 8w + q - 8, so
  that a thread holds g and u of one row); epilogue: clipped SwiGLU, × routing weight, BF16, FP8 1×32 quant (the
  tile's 32 rows are one block) -> h as e4m3 codes [slots, I_pad] and block scales [slots, I_pad/32].
- w2: 64 output rows over the logical intermediate's blocks, fp32 atomically added into the output (which holds the
  shared expert's output).
The activations' codes are read in `_a_operand`'s order within each 32-block: its 16 even codes, then its 16 odd
ones (`even_odd`; w13 writes h so).

Numerics: e2m1 × e4m3 products are exact (the e2m1 code as e4m3 is its value × 2^-6; the activations are the deploy
FP8 1×32 codes, x = c·2^e exactly); the tensor core sums a block's 32 products, and the blocks are summed in fp32:
only the order of the sums differs from the reference's BF16 dequantization with fp32 accumulation. V4.1 (1×32
blocks of h); D % 128 == 0, I_pad % 32 == 0; sm_90 (wgmma). Imports Triton's Gluon: load this module lazily.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from dsflash.plugins.act_quant import act_quant
from dsflash.plugins.moe import moe_align
from dsflash.plugins.moe_config import MoeConfig, f8_fits
from dsflash.plugins.moe_tc import _A_WORDS, _ROW4, _W_NAT, _W_T, _a_operand
from dsflash.plugins.tl_helpers import e8m0_to_f32, exp2i, scale_exp, split4

_FLAT = gl.constexpr(gl.BlockedLayout([1], [32], [4], [0]))
# the epilogue's [32 rows, BM] tile: a warp's lanes along the rows (one block's amax per column is a warp reduction)
_EPI = gl.constexpr(gl.BlockedLayout([1, 1], [32, 1], [1, 4], [0, 1]))
_THREAD_BARRIER = getattr(gl, "thread_barrier", None) or gl.barrier   # the name Triton 3.6 / 3.8 gives it


def _layouts(bm: int) -> dict:
    """The BM-dependent layouts, passed to the kernels as constexprs: the accumulator of m64nBMk32 wgmmas, the
    activation tile [BM, 128] e4m3 as loaded (16 bytes per thread) and as staged for the MMA's B operand."""
    return {"MMA": gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, bm, 32]),
            "X_REG": gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0]),
            "X_SMEM": gl.NVMMASharedLayout.get_default_for([bm, 128], gl.float8e4nv)}


@gluon.jit
def _block_expert(off_ptr, E, start, NB_E: gl.constexpr):
    """The expert whose padded run holds slot `start` (`moe._block_expert`)."""
    cols = gl.arange(0, NB_E, layout=_FLAT)
    off = gl.load(off_ptr + cols, mask=cols <= E, other=2147483647)
    return gl.sum((off <= start).to(gl.int32), axis=0) - 1


@gluon.jit
def _load_chunk(w_at, wc, s_at, sc, x_at, xk, xrow, xs_at, vc, kbv, ch):
    """Chunk ch (128 K) of the first kbv blocks: the rows' words [64, 16] (_W_NAT), their 4 block scales [64, 4]
    (e8m0 bytes, _ROW4), the tokens' codes [BM, 128] (X_REG, rows xrow) and their 4 block scales ([BM] each, the
    MMA's columns vc; stored × 2^6, the re-bias of the weight codes); what lies past block kbv reads as 0."""
    words = gl.load(w_at + ch * 16, mask=ch * 16 + wc < kbv * 4, other=0)
    sw = gl.load(s_at + ch * 4, mask=ch * 4 + sc < kbv, other=0)
    xr = gl.load(x_at + ch * 128, mask=xrow & (ch * 128 + xk < kbv * 32), other=0.0)
    x0 = gl.load(xs_at + ch * 4, mask=vc & (ch * 4 < kbv), other=0.0)
    x1 = gl.load(xs_at + ch * 4 + 1, mask=vc & (ch * 4 + 1 < kbv), other=0.0)
    x2 = gl.load(xs_at + ch * 4 + 2, mask=vc & (ch * 4 + 2 < kbv), other=0.0)
    x3 = gl.load(xs_at + ch * 4 + 3, mask=vc & (ch * 4 + 3 < kbv), other=0.0)
    return words, sw, xr, (x0, x1, x2, x3)


@gluon.jit
def _chunk_mma(ring, buf, tot, zero, MMA: gl.constexpr):
    """tot [64, BM] + the 4 blocks of one chunk: its activation tile into `buf` (a barrier and the proxy fence before
    the MMAs read it), the words transposed in-warp to the A-operand layout (`moe_tc._chunk_mma`), one MMA per block,
    all issued before one wait, then each folded with its row scale × column scale."""
    words, sw, xr, xs = ring
    buf.store(xr)
    _THREAD_BARRIER()
    fence_async_shared()
    A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)
    wt = gl.convert_layout(words, _W_T)
    b0, b1, b2, b3 = split4(gl.reshape(gl.permute(gl.reshape(wt, [64, 4, 4]), [0, 2, 1]), [64, 4, 2, 2]))
    blocks = (b0, b1, b2, b3)
    parts = ()
    for kk in gl.static_range(4):
        a = _a_operand(gl.convert_layout(blocks[kk], _A_WORDS, assert_trivial=True), A_OP)
        b = buf.slice(kk * 32, 32, dim=1).permute((1, 0))
        parts = parts + (warpgroup_mma(a, b, zero, use_acc=False, is_async=True), )
    s0, s1, s2, s3 = split4(gl.reshape(e8m0_to_f32(sw), [64, 2, 2]))
    scs = (s0, s1, s2, s3)
    parts = warpgroup_mma_wait(0, deps=parts)
    for kk in gl.static_range(4):
        s_kk = gl.convert_layout(scs[kk], gl.SliceLayout(1, MMA), assert_trivial=True)
        tot = tot + parts[kk] * (gl.expand_dims(s_kk, 1) * gl.expand_dims(xs[kk], 0))
    return tot


@gluon.jit
def _sorted_dots(w_at, wc, s_at, sc, x_at, xk, xrow, xs_at, vc, kbv, n_ch, x_s, BM: gl.constexpr,
                 DEPTH: gl.constexpr, MMA: gl.constexpr):
    """[64, BM] fp32: the program's n_ch chunks (`_load_chunk`'s operands), DEPTH of them loaded ahead (a load past
    the last chunk re-reads it)."""
    last = gl.maximum(n_ch - 1, 0)
    zero = gl.zeros([64, BM], gl.float32, MMA)
    tot = zero
    ring = ()
    for d in gl.static_range(DEPTH):
        ring = ring + (_load_chunk(w_at, wc, s_at, sc, x_at, xk, xrow, xs_at, vc, kbv, gl.minimum(d, last)), )
    for i0 in range(0, n_ch, DEPTH):
        nring = ()
        for d in gl.static_range(DEPTH):
            i = i0 + d
            if i < n_ch:
                tot = _chunk_mma(ring[d], x_s.index(i % 2), tot, zero, MMA)
            nring = nring + (_load_chunk(w_at, wc, s_at, sc, x_at, xk, xrow, xs_at, vc, kbv,
                                         gl.minimum(i + DEPTH, last)), )
        ring = nring
    return tot


@gluon.jit
def _slot_tokens(sorted_ptr, start, P, TOPK, BM: gl.constexpr, layout: gl.constexpr):
    """The block's slots start.. in `layout` (1-D): (slots, pairs, validity, tokens int64)."""
    slots = start + gl.arange(0, BM, layout=layout)
    pair = gl.load(sorted_ptr + slots)
    valid = pair < P
    return slots, pair, valid, gl.where(valid, pair // TOPK, 0).to(gl.int64)


# -- w1/w3 + clipped SwiGLU + routing weight + BF16 + FP8 quant -> h as codes and block scales ------------------------
@gluon.jit
def _moe_w13_f8_kernel(xc_ptr, xs_ptr, w13_ptr, s13_ptr, hc_ptr, hs_ptr, sorted_ptr, off_ptr, topw_ptr,
                       N, N_VALID, K, E, P, TOPK, limit,
                       BM: gl.constexpr, DEPTH: gl.constexpr, NB_E: gl.constexpr,
                       MMA: gl.constexpr, X_REG: gl.constexpr, X_SMEM: gl.constexpr):
    pid_n = gl.program_id(1)
    start = gl.program_id(0) * BM
    if start >= gl.load(off_ptr + E):
        return
    e = _block_expert(off_ptr, E, start, NB_E).to(gl.int64)
    K8 = K // 8
    KB = K // 32
    r = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(1, _W_NAT)), 1)
    q = r % 16
    wrow = (q // 8) * N + pid_n * 32 + (r // 16) * 8 + q % 8
    wc = gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(0, _W_NAT)), 0) + r * 0             # [64, 16]
    w_at = w13_ptr + e * 2 * N * K8 + wrow * K8 + wc
    rs = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(1, _ROW4)), 1)
    qs = rs % 16
    srow = (qs // 8) * N + pid_n * 32 + (rs // 16) * 8 + qs % 8
    sc = gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, _ROW4)), 0) + rs * 0              # [64, 4]
    s_at = s13_ptr + e * 2 * N * KB + srow * KB + sc
    _, _, vr, tr = _slot_tokens(sorted_ptr, start, P, TOPK, BM, gl.SliceLayout(1, X_REG))
    xk = gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, X_REG)), 0) + gl.expand_dims(tr * 0, 1)
    x_at = xc_ptr + gl.expand_dims(tr * K, 1) + xk
    xrow = gl.expand_dims(vr, 1) & (xk >= 0)
    slots, pair, vc, tc = _slot_tokens(sorted_ptr, start, P, TOPK, BM, gl.SliceLayout(0, MMA))
    xs_at = xs_ptr + tc * KB
    x_s = gl.allocate_shared_memory(gl.float8e4nv, [2, BM, 128], X_SMEM)
    # a tile wholly past the logical width (a TP rank's zero padding) reads no weights and stores h = 0
    n_ch = gl.where(pid_n * 32 >= N_VALID, 0, K // 128)
    tot = _sorted_dots(w_at, wc, s_at, sc, x_at, xk, xrow, xs_at, vc, KB, n_ch, x_s, BM, DEPTH, MMA)
    # rows 16w + q: q < 8 -> g of row 8w + q, else u of row 8w + q - 8 (the same thread's register pair)
    g, u = gl.split(gl.permute(gl.reshape(tot, [4, 2, 8, BM]), [0, 2, 3, 1]))
    g = gl.convert_layout(gl.reshape(g, [32, BM]), _EPI)
    u = gl.convert_layout(gl.reshape(u, [32, BM]), _EPI)
    if limit > 0:
        u = gl.minimum(gl.maximum(u, -limit), limit)
        g = gl.minimum(g, limit)
    cols = gl.arange(0, BM, layout=gl.SliceLayout(0, _EPI))
    slots, pair, valid, _ = _slot_tokens(sorted_ptr, start, P, TOPK, BM, gl.SliceLayout(0, _EPI))
    rw = gl.load(topw_ptr + gl.where(valid, pair, 0), mask=valid, other=0.0)
    h = g / (1.0 + gl.exp(-g)) * u * gl.expand_dims(rw, 0)
    n = gl.expand_dims(pid_n * 32 + gl.arange(0, 32, layout=gl.SliceLayout(1, _EPI)), 1)
    h = gl.where(n < N_VALID, h, 0.0).to(gl.bfloat16).to(gl.float32)
    ex = scale_exp(gl.max(gl.abs(h), axis=0))                                               # [BM]
    c = gl.minimum(gl.maximum(h * gl.expand_dims(exp2i(-ex), 0), -448.0), 448.0).to(gl.float8e4nv)
    # within the block: the even rows' codes first, then the odd rows' (`even_odd`, what w2's A operand pairs with)
    nb = n % 32
    pos = pid_n * 32 + (nb % 2) * 16 + nb // 2
    srow64 = gl.expand_dims(slots.to(gl.int64), 0)
    gl.store(hc_ptr + srow64 * N + pos, c, mask=gl.expand_dims(valid, 0) & (pos >= 0))
    gl.store(hs_ptr + slots.to(gl.int64) * (N // 32) + pid_n, exp2i(ex + 6), mask=valid & (cols >= 0))   # × 2^6


# -- w2 + weighted reduction into the shared-expert output ------------------------------------------------------------
@gluon.jit
def _moe_w2_f8_kernel(hc_ptr, hs_ptr, w2_ptr, s2_ptr, out_ptr, sorted_ptr, off_ptr,
                      D, K, KB_VALID, E, P, TOPK,
                      BM: gl.constexpr, DEPTH: gl.constexpr, NB_E: gl.constexpr,
                      MMA: gl.constexpr, X_REG: gl.constexpr, X_SMEM: gl.constexpr):
    pid_n = gl.program_id(1)
    start = gl.program_id(0) * BM
    if start >= gl.load(off_ptr + E):
        return
    e = _block_expert(off_ptr, E, start, NB_E).to(gl.int64)
    K8 = K // 8
    KB = K // 32
    r = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(1, _W_NAT)), 1)
    wc = gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(0, _W_NAT)), 0) + r * 0             # [64, 16]
    w_at = w2_ptr + e * D * K8 + (pid_n * 64 + r) * K8 + wc
    rs = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(1, _ROW4)), 1)
    sc = gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, _ROW4)), 0) + rs * 0              # [64, 4]
    s_at = s2_ptr + e * D * KB + (pid_n * 64 + rs) * KB + sc
    slots_r, _, vr, _ = _slot_tokens(sorted_ptr, start, P, TOPK, BM, gl.SliceLayout(1, X_REG))
    xk = gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, X_REG)), 0) + gl.expand_dims(slots_r * 0, 1)
    x_at = hc_ptr + gl.expand_dims(slots_r.to(gl.int64) * K, 1) + xk
    xrow = gl.expand_dims(vr, 1) & (xk >= 0)
    slots, pair, vc, tc = _slot_tokens(sorted_ptr, start, P, TOPK, BM, gl.SliceLayout(0, MMA))
    xs_at = hs_ptr + slots.to(gl.int64) * KB
    x_s = gl.allocate_shared_memory(gl.float8e4nv, [2, BM, 128], X_SMEM)
    # the blocks past the logical intermediate hold h = 0: not read (the last chunk's tail masked)
    n_ch = (KB_VALID + 3) // 4
    tot = _sorted_dots(w_at, wc, s_at, sc, x_at, xk, xrow, xs_at, vc, KB_VALID, n_ch, x_s, BM, DEPTH, MMA)
    rows = gl.expand_dims(pid_n * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, MMA)), 1)
    gl.atomic_add(out_ptr + gl.expand_dims(tc * D, 0) + rows, tot, mask=gl.expand_dims(vc, 0) & (rows < D),
                  sem="relaxed")


def even_odd(codes: torch.Tensor) -> torch.Tensor:
    """e4m3 codes [T, K] -> the same with each 32-block's 16 even entries first, then its 16 odd ones (the order
    `moe_tc._a_operand` gives the weight codes)."""
    t, k = codes.shape
    return codes.view(t, k // 32, 16, 2).transpose(2, 3).contiguous().view(t, k)


def sorted_experts_f8(xq: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13_q: torch.Tensor,
                      w13_s: torch.Tensor, w2_q: torch.Tensor, w2_s: torch.Tensor, out: torch.Tensor,
                      swiglu_limit: float, inter: int, cfg: MoeConfig, qblock: int = 32) -> torch.Tensor:
    """`moe.moe_experts`' sorted path on FP8 tensor cores: out (fp32 [T, D], holding the shared expert's output or
    zeros) += Σ_k weight · expert(x). xq: the BF16 fake-quantized activation [T, D] (its e4m3 codes are recovered
    exactly); the weights as `moe_experts` takes them (shapes checked there)."""
    t, d = xq.shape
    e, ipad = w13_q.shape[0], w13_q.shape[1] // 2
    assert cfg.f8 and not cfg.gemv and cfg.block_m in (16, 32, 64), cfg.tag()
    assert f8_fits(ipad, d, qblock), f"moe_f8: D={d} (% 128), I_pad={ipad} (% 32), qblock={qblock} (32)"
    assert xq.dtype == torch.bfloat16 and out.shape == (t, d) and out.dtype == torch.float32 and out.is_contiguous()
    topk, bm = ids.shape[1], cfg.block_m
    xc, xs = act_quant(xq, "fp32")                    # exact: xq holds FP8 1×32 values already
    xc, xs = even_odd(xc), xs * 64.0                  # × 2^6: the re-bias of the weight codes
    sorted_ids, off = moe_align(ids, e, bm)
    nblk = sorted_ids.numel() // bm
    nb = triton.next_power_of_2(e + 1)
    hc = torch.empty((sorted_ids.numel(), ipad), dtype=torch.float8_e4m3fn, device=xq.device)
    hs = torch.empty((sorted_ids.numel(), ipad // 32), dtype=torch.float32, device=xq.device)
    lay = _layouts(bm)
    _moe_w13_f8_kernel[(nblk, ipad // 32)](
        xc, xs, w13_q.view(torch.int32), w13_s.view(torch.uint8), hc, hs, sorted_ids, off, weights,
        ipad, inter, d, e, t * topk, topk, float(swiglu_limit),
        BM=bm, DEPTH=cfg.stages, NB_E=nb, num_warps=4, **lay)
    _moe_w2_f8_kernel[(nblk, triton.cdiv(d, 64))](
        hc, hs, w2_q.view(torch.int32), w2_s.view(torch.uint8), out, sorted_ids, off,
        d, ipad, triton.cdiv(inter, 32), e, t * topk, topk,
        BM=bm, DEPTH=cfg.stages2 or cfg.stages, NB_E=nb, num_warps=4, **lay)
    return out
