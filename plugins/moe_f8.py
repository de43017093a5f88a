"""The sorted (prefill) MoE path on FP8 tensor cores, in Gluon: MXFP4 codes turned into e4m3 in registers, one
m64nBMk32 wgmma per 32-block against the e4m3 codes of a block of BM tokens of one expert, fp32 promotion per block.

Why: `moe._moe_w13_kernel` (`tl.dot_scaled`: e2m1 -> BF16 in registers, BF16 MMA) is issue-bound on its upcast. On
one TP8 rank at M = 1024 its w13 runs at 66 % issue activity with 40 % of its samples on PRMT and 15 % on SEL, and
the path reaches 18-27 % of copy bandwidth (H100, benchmarks/README.md, "Session 44"). Plain Triton did not give a
cheaper loop: an FP8 `tl.dot` fed by the same re-bias compiled to ~10 instructions per weight element (byte loads
and repacking around the layout conversions). Here the layouts are chosen: the weight words reach the A-operand
layout straight from shared memory (ldmatrix) and cost one 3-op re-bias per word (`moe_tc._a_operand`, the decode
experiment of session 20, whose structure was latency-bound at one token and is not at a block of tokens). This
path is 2.0-2.4x the BF16-MMA one's default at one TP8 rank and TP1, M = 257 / 1024 / 4096 (H100).

A program: BM slots of one expert's padded run (`moe.moe_align`) × 64 MMA rows, K in chunks of 4 blocks. The weight
words come by TMA through a ring of STAGES slots (refilled as soon as every warp has read its slot); the rows'
scales and the tokens' codes are loaded a chunk ahead into registers, the tokens' block scales at the chunk's start
(a chunk ahead they cost 16 registers and the occupancy). Each chunk's activation tile is stored to one of two
shared buffers; its 4 MMAs run two at a time (two partials live: 122 registers, 4 CTAs per SM), and each block's
product is folded into the fp32 total with 2^(e_w - 127)·2^6 (the re-bias) × the token's block scale.
- w13: 32 rows of w1 and the same 32 of w3, two TMA boxes, interleaved on reading (MMA row 16w + 8h + q is row
  8w + q of w1 (h = 0) or w3 (h = 1), so that a thread holds g and u of one row); epilogue: clipped SwiGLU,
  × routing weight, BF16, FP8 1×32 quant (the tile's 32 rows are one block) -> h as e4m3 codes [slots, I_pad] and
  block scales [slots, I_pad/32].
- w2: TILES 64-row tiles of the output per program in one ring (the block's setup and h read once per program; on
  one TP8 rank a tile is only 3 chunks), each tile fp32 atomically added into the output (which holds the shared
  expert's output); the blocks past the logical intermediate are not read.
The activations' codes are read in `_a_operand`'s order within each 32-block: its 16 even codes, then its 16 odd
ones (`even_odd`; w13 writes h so).

Numerics: e2m1 × e4m3 products are exact (the e2m1 code as e4m3 is its value × 2^-6; the activations are the deploy
FP8 1×32 codes, x = c·2^e exactly); the tensor core sums a block's 32 products, and the blocks are summed in fp32:
only the order of the sums differs from the reference's BF16 dequantization with fp32 accumulation. V4.1 (1×32
blocks of h); D % 128 == 0, I_pad % 32 == 0; sm_90 (wgmma). Imports Triton's Gluon: load this module lazily.
"""
from __future__ import annotations

import math

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from dsflash.plugins.act_quant import act_quant
from dsflash.plugins.moe import moe_align
from dsflash.plugins.moe_config import MoeConfig, f8_fits
from dsflash.plugins.moe_tc import (_THREAD_BARRIER, _ROW4, _blocks_mma, _issue_words, _slot_words, _weight_ring,
                                     words_desc)
from dsflash.plugins.tl_helpers import exp2i, scale_exp

_FLAT = gl.constexpr(gl.BlockedLayout([1], [32], [4], [0]))
# the epilogue's [32 rows, BM] tile: a warp's lanes along the rows (one block's amax per column is a warp reduction)
_EPI = gl.constexpr(gl.BlockedLayout([1, 1], [32, 1], [1, 4], [0, 1]))


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
def _load_act(s_at, sc, x_at, xk, xrow, kbv, ch, SW_WORDS: gl.constexpr):
    """Chunk ch (128 K) of the first kbv blocks, what is loaded a chunk ahead besides the weight words: the rows' 4
    block scales (one int32 word per row [64] when SW_WORDS, else e8m0 bytes [64, 4], _ROW4) and the tokens' codes
    [BM, 128] (X_REG, rows xrow); what lies past block kbv reads as 0."""
    if SW_WORDS:
        sw = gl.load((s_at + ch * 4).to(gl.pointer_type(gl.int32)), mask=ch * 4 < kbv, other=0)
    else:
        sw = gl.load(s_at + ch * 4, mask=ch * 4 + sc < kbv, other=0)
    xr = gl.load(x_at + ch * 128, mask=xrow & (ch * 128 + xk < kbv * 32), other=0.0)
    return sw, xr


@gluon.jit
def _load_xs(xs_at, vc, kbv, ch):
    """The tokens' 4 block scales of chunk ch ([BM] each, the MMA's columns vc; stored × 2^6, the re-bias of the
    weight codes), 0 past block kbv. Loaded at the chunk's start, used after its MMAs: a chunk ahead they would hold
    16 more registers per thread (each thread's 4 columns × 4 blocks) and cost the kernel occupancy."""
    x0 = gl.load(xs_at + ch * 4, mask=vc & (ch * 4 < kbv), other=0.0)
    x1 = gl.load(xs_at + ch * 4 + 1, mask=vc & (ch * 4 + 1 < kbv), other=0.0)
    x2 = gl.load(xs_at + ch * 4 + 2, mask=vc & (ch * 4 + 2 < kbv), other=0.0)
    x3 = gl.load(xs_at + ch * 4 + 3, mask=vc & (ch * 4 + 3 < kbv), other=0.0)
    return x0, x1, x2, x3


@gluon.jit
def _step(w_bufs, ready, x_s, j, act, STAGES: gl.constexpr, HALVES: gl.constexpr):
    """Step j of a program's ring up to its MMAs: wait for slot j % STAGES, read its words, stage the activation
    tile in buffer j % 2 (then a barrier, after which every warp is past step j - 1's MMAs and has read slot j's
    words, so the caller may refill the slot, and the proxy fence). Returns (words, buffer, slot)."""
    slot = j % STAGES
    mbarrier.wait(ready.index(slot), (j // STAGES) & 1)
    wt = _slot_words(w_bufs, slot, HALVES)
    buf = x_s.index(j % 2)
    buf.store(act[1])
    _THREAD_BARRIER()
    fence_async_shared()
    return wt, buf, slot


@gluon.jit
def _slot_tokens(sorted_ptr, start, P, TOPK, BM: gl.constexpr, layout: gl.constexpr):
    """The block's slots start.. in `layout` (1-D): (slots, pairs, validity, tokens int64)."""
    slots = start + gl.arange(0, BM, layout=layout)
    pair = gl.load(sorted_ptr + slots)
    valid = pair < P
    return slots, pair, valid, gl.where(valid, pair // TOPK, 0).to(gl.int64)


@gluon.jit
def _ring(w_desc, BROWS: gl.constexpr, HALVES: gl.constexpr, STAGES: gl.constexpr, BM: gl.constexpr,
          X_SMEM: gl.constexpr):
    """The program's shared memory: the weight ring (`moe_tc._weight_ring`) and two activation buffers [BM, 128]
    e4m3."""
    w_bufs, ready = _weight_ring(w_desc, BROWS, HALVES, STAGES)
    x_s = gl.allocate_shared_memory(gl.float8e4nv, [2, BM, 128], X_SMEM)
    return w_bufs, ready, x_s


# -- w1/w3 + clipped SwiGLU + routing weight + BF16 + FP8 quant -> h as codes and block scales ------------------------
@gluon.jit
def _moe_w13_f8_kernel(w_desc, xc_ptr, xs_ptr, s13_ptr, hc_ptr, hs_ptr, sorted_ptr, off_ptr, topw_ptr,
                       N, N_VALID, K, E, P, TOPK, limit,
                       BM: gl.constexpr, STAGES: gl.constexpr, NB_E: gl.constexpr,
                       MMA: gl.constexpr, X_REG: gl.constexpr, X_SMEM: gl.constexpr):
    pid_n = gl.program_id(1)
    start = gl.program_id(0) * BM
    if start >= gl.load(off_ptr + E):
        return
    e = _block_expert(off_ptr, E, start, NB_E)
    KB = K // 32
    # a tile wholly past the logical width (a TP rank's zero padding) reads no weights and stores h = 0
    n_ch = gl.where(pid_n * 32 >= N_VALID, 0, K // 128)
    row_a = e * 2 * N + pid_n * 32
    w_bufs, ready, x_s = _ring(w_desc, 32, 2, STAGES, BM, X_SMEM)
    for s in gl.static_range(STAGES):
        _issue_words(w_desc, w_bufs, ready, s, row_a, row_a + N, s, s < n_ch, 2)
    rs = gl.arange(0, 64, layout=gl.SliceLayout(1, _ROW4))
    qs = rs % 16
    srow = (qs // 8) * N + pid_n * 32 + (rs // 16) * 8 + qs % 8      # the MMA rows' w1 / w3 rows
    s_at = s13_ptr + e.to(gl.int64) * 2 * N * KB + srow * KB
    _, _, vr, tr = _slot_tokens(sorted_ptr, start, P, TOPK, BM, gl.SliceLayout(1, X_REG))
    xk = gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, X_REG)), 0) + gl.expand_dims(tr * 0, 1)
    x_at = xc_ptr + gl.expand_dims(tr * K, 1) + xk
    xrow = gl.expand_dims(vr, 1) & (xk >= 0)
    slots, pair, vc, tc = _slot_tokens(sorted_ptr, start, P, TOPK, BM, gl.SliceLayout(0, MMA))
    xs_at = xs_ptr + tc * KB
    zero = gl.zeros([64, BM], gl.float32, MMA)
    tot = zero
    nxt = _load_act(s_at, rs, x_at, xk, xrow, KB, 0, True)
    for j in range(n_ch):
        act = nxt
        xs = _load_xs(xs_at, vc, KB, j)
        nxt = _load_act(s_at, rs, x_at, xk, xrow, KB, gl.minimum(j + 1, n_ch - 1), True)
        wt, buf, slot = _step(w_bufs, ready, x_s, j, act, STAGES, 2)
        _issue_words(w_desc, w_bufs, ready, slot, row_a, row_a + N, j + STAGES, j + STAGES < n_ch, 2)
        tot = _blocks_mma(wt, act[0], xs, buf, tot, zero, MMA, True)
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
def _moe_w2_f8_kernel(w_desc, hc_ptr, hs_ptr, s2_ptr, out_ptr, sorted_ptr, off_ptr,
                      D, K, KB_VALID, E, P, TOPK,
                      BM: gl.constexpr, STAGES: gl.constexpr, TILES: gl.constexpr, NB_E: gl.constexpr,
                      SW_WORDS: gl.constexpr, MMA: gl.constexpr, X_REG: gl.constexpr, X_SMEM: gl.constexpr):
    """TILES consecutive 64-row tiles of the output per program, one ring over all their chunks (the block's
    slots, tokens and h read once per program; its h chunks again per tile, from cache)."""
    pid_n = gl.program_id(1)
    start = gl.program_id(0) * BM
    if start >= gl.load(off_ptr + E):
        return
    e = _block_expert(off_ptr, E, start, NB_E)
    KB = K // 32
    n_ch = (KB_VALID + 3) // 4    # the blocks past the logical intermediate hold h = 0: not read (tail masked)
    n_steps = TILES * n_ch
    row0 = e * D + pid_n * TILES * 64
    w_bufs, ready, x_s = _ring(w_desc, 64, 1, STAGES, BM, X_SMEM)
    for s in gl.static_range(STAGES):
        ts = s // n_ch
        _issue_words(w_desc, w_bufs, ready, s, row0 + ts * 64, 0, s - ts * n_ch, s < n_steps, 1)
    rs = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(1, _ROW4)), 1)
    sc = gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, _ROW4)), 0) + rs * 0              # [64, 4]
    if SW_WORDS:
        s_at = s2_ptr + e.to(gl.int64) * D * KB + (pid_n * TILES * 64 + gl.arange(0, 64, layout=gl.SliceLayout(
            1, _ROW4))) * KB
    else:
        s_at = s2_ptr + e.to(gl.int64) * D * KB + (pid_n * TILES * 64 + rs) * KB + sc
    slots_r, _, vr, _ = _slot_tokens(sorted_ptr, start, P, TOPK, BM, gl.SliceLayout(1, X_REG))
    xk = gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, X_REG)), 0) + gl.expand_dims(slots_r * 0, 1)
    x_at = hc_ptr + gl.expand_dims(slots_r.to(gl.int64) * K, 1) + xk
    xrow = gl.expand_dims(vr, 1) & (xk >= 0)
    slots, pair, vc, tc = _slot_tokens(sorted_ptr, start, P, TOPK, BM, gl.SliceLayout(0, MMA))
    xs_at = hs_ptr + slots.to(gl.int64) * KB
    rows = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(1, MMA)), 1)
    o_at = out_ptr + gl.expand_dims(tc * D, 0) + pid_n * TILES * 64 + rows
    omask = gl.expand_dims(vc, 0) & (rows >= 0)
    zero = gl.zeros([64, BM], gl.float32, MMA)
    tot = zero
    nxt = _load_act(s_at, sc, x_at, xk, xrow, KB_VALID, 0, SW_WORDS)
    t = 0           # the step's tile and chunk (counters: a division per step costs more than the bookkeeping)
    ch = 0
    t1 = 0          # the next step's, whose scales and h chunk are loaded a step ahead
    ch1 = 0
    t2 = STAGES // n_ch        # the step STAGES ahead, whose words the freed slot receives
    ch2 = STAGES - t2 * n_ch
    for j in range(n_steps):
        act = nxt
        xs = _load_xs(xs_at, vc, KB_VALID, ch)
        if j + 1 < n_steps:
            ch1 += 1
            if ch1 == n_ch:
                ch1 = 0
                t1 += 1
        nxt = _load_act(s_at + t1 * 64 * KB, sc, x_at, xk, xrow, KB_VALID, ch1, SW_WORDS)
        wt, buf, slot = _step(w_bufs, ready, x_s, j, act, STAGES, 1)
        _issue_words(w_desc, w_bufs, ready, slot, row0 + t2 * 64, 0, ch2, j + STAGES < n_steps, 1)
        ch2 += 1
        if ch2 == n_ch:
            ch2 = 0
            t2 += 1
        tot = _blocks_mma(wt, act[0], xs, buf, tot, zero, MMA, SW_WORDS)
        if ch == n_ch - 1:   # the tile's last chunk: add it into the output, start the next tile
            gl.atomic_add(o_at + t * 64, tot, mask=omask, sem="relaxed")
            tot = zero
        ch += 1
        if ch == n_ch:
            ch = 0
            t += 1


def even_odd(codes: torch.Tensor) -> torch.Tensor:
    """e4m3 codes [T, K] -> the same with each 32-block's 16 even entries first, then its 16 odd ones (the order
    `moe_tc._a_operand` gives the weight codes)."""
    t, k = codes.shape
    return codes.view(t, k // 32, 16, 2).transpose(2, 3).contiguous().view(t, k)


def sorted_experts_f8(xq: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13_q: torch.Tensor,
                      w13_s: torch.Tensor, w2_q: torch.Tensor, w2_s: torch.Tensor, out: torch.Tensor,
                      swiglu_limit: float, inter: int, cfg: MoeConfig, qblock: int = 32,
                      pair_rows: bool = False) -> torch.Tensor:
    """`moe.moe_experts`' sorted path on FP8 tensor cores: out (fp32 [T, D], holding the shared expert's output or
    zeros) += Σ_k weight · expert(x). xq: the BF16 fake-quantized activation [T, D] (its e4m3 codes are recovered
    exactly); the weights as `moe_experts` takes them (shapes checked there). pair_rows (deterministic mode): out is
    a zeroed [T·k, D] and pair p's output goes to row p."""
    t, d = xq.shape
    e, ipad = w13_q.shape[0], w13_q.shape[1] // 2
    assert cfg.f8 and not cfg.gemv and cfg.block_m in (16, 32, 64) and cfg.stages >= 1, cfg.tag()
    assert f8_fits(ipad, d, qblock), f"moe_f8: D={d} (% 128), I_pad={ipad} (% 32), qblock={qblock} (32)"
    topk, bm = ids.shape[1], cfg.block_m
    assert xq.dtype == torch.bfloat16 and out.shape == (t * topk if pair_rows else t, d) \
        and out.dtype == torch.float32 and out.is_contiguous(), (tuple(out.shape), out.dtype, pair_rows)
    xc, xs = act_quant(xq, "fp32")                    # exact: xq holds FP8 1×32 values already
    xc, xs = even_odd(xc), xs * 64.0                  # × 2^6: the re-bias of the weight codes
    sorted_ids, off = moe_align(ids, e, bm)
    nblk = sorted_ids.numel() // bm
    nb = triton.next_power_of_2(e + 1)
    hc = torch.empty((sorted_ids.numel(), ipad), dtype=torch.float8_e4m3fn, device=xq.device)
    hs = torch.empty((sorted_ids.numel(), ipad // 32), dtype=torch.float32, device=xq.device)
    lay = _layouts(bm)
    _moe_w13_f8_kernel[(nblk, ipad // 32)](
        words_desc(w13_q, 32), xc, xs, w13_s.view(torch.uint8), hc, hs, sorted_ids, off, weights,
        ipad, inter, d, e, t * topk, topk, float(swiglu_limit),
        BM=bm, STAGES=cfg.stages, NB_E=nb, num_warps=4, **lay)
    tiles = math.gcd(max(1, cfg.bn2 // 64), d // 64)
    _moe_w2_f8_kernel[(nblk, d // (64 * tiles))](
        words_desc(w2_q, 64), hc, hs, w2_s.view(torch.uint8), out, sorted_ids, off,
        d, ipad, triton.cdiv(inter, 32), e, t * topk, 1 if pair_rows else topk,   # (k = 1: pair p -> row p)
        BM=bm, STAGES=cfg.stages2 or cfg.stages, TILES=tiles, NB_E=nb, SW_WORDS=(ipad // 32) % 4 == 0, num_warps=4,
        **lay)
    return out
