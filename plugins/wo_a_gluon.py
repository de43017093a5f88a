"""WO-A at decode (T <= 8) on explicit Hopper wgmma, written in Gluon: the contract and numerics of `wo_a._wo_a_kernel`.

z[t, g·R + r] = Σ_i W_a[g·R + r, i] · õ[t, g, i], õ = o with the last RD channels of every head rotated back (angle
−θ_t, rounded to BF16 as the reference does). Swap-AB: 64 weight rows of one group × the ≤ 8 tokens per program, over
K slice pid_k of SPLIT. What differs from the Triton kernel, which reloads the activation, its pair-swapped copy and
cos/sin at every K step (24 KB next to 32 KB of weights per step, benchmarks/README.md "Session 10"):
- the program's whole activation slice is brought once, by TMA, into shared memory in the MMA's operand layout; only
  the boxes holding RoPE channels (the last 64-channel box of each head) are then rotated in registers and written
  back, so the K loop streams weights only;
- the weight ring is filled up front and a slot refilled as soon as its MMAs are done; with PDL the ring is requested
  before `griddepcontrol.wait` (the weights do not depend on the previous kernel), the activation after it;
- split-K slices are reduced in the same launch (`splitk`).
Needs K % 64 == 0, rows per group % 64 == 0, and every head's RoPE channels inside its last 64-channel box. Imports
Triton's Gluon: load this module lazily.
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

from dsflash.plugins.fp8_gemm_gluon import _grid_dependency_wait, _load_boxes
from dsflash.plugins.splitk import decode_ws_tokens, split_counter, splitk_store_rows_tokens
from dsflash.plugins.tuning import k_slices

BOX = 64    # K per TMA box: one 128-byte BF16 row, the widest swizzle
TILE_ROWS = 64    # weight rows per program (one wgmma M)
TILE_TOKENS = 8   # tokens per program (the wgmma N): T <= 8
BOX_K, BLOCK_P, BLOCK_Q = gl.constexpr(BOX), gl.constexpr(TILE_ROWS), gl.constexpr(TILE_TOKENS)
ROPE_CHUNK = gl.constexpr(3)  # RoPE boxes rotated per batch of loads (registers: 108 at 3, spills at 9)


@gluon.jit
def _rotate_rope_boxes(a_bufs, o_ptr, cos_ptr, sin_ptr, T, stride_ot, stride_ct, col0, k_lo, k_hi,
                       HEAD_D: gl.constexpr, RD: gl.constexpr, NH: gl.constexpr, num_warps: gl.constexpr):
    """Overwrite the slice's RoPE boxes in a_bufs (box j holds activation columns col0 + k_lo + 64·j, already landed
    by TMA) with their inverse rotation: per pair (a, b) -> (a·cos + b·sin, b·cos − a·sin), rounded to BF16. The
    loads of ROPE_CHUNK candidate heads are issued before the first of their stores."""
    blk: gl.constexpr = gl.BlockedLayout([1, 2], [4, 8], [num_warps, 1], [1, 0])
    tok = gl.arange(0, BLOCK_Q, layout=gl.SliceLayout(1, blk))
    kk = gl.arange(0, BOX_K, layout=gl.SliceLayout(0, blk))
    tok2 = gl.expand_dims(tok, 1)
    kk2 = gl.expand_dims(kk, 0)
    ch = HEAD_D - BOX_K + kk2                               # channel within the head
    rope = ch >= HEAD_D - RD
    pj = gl.where(rope, (ch - (HEAD_D - RD)) // 2, 0)
    sign = gl.where(kk2 % 2 == 0, 1.0, -1.0)
    tok_ok = tok2 < T
    h0 = k_lo // HEAD_D
    for c in gl.static_range(0, NH, ROPE_CHUNK):      # ROPE_CHUNK heads in flight at a time (V4.1: all of them)
        xs = ()
        for i in gl.static_range(c, min(c + ROPE_CHUNK, NH)):
            box_col = (h0 + i) * HEAD_D + HEAD_D - BOX_K      # group column of the head's last box
            ok = (box_col >= k_lo) & (box_col < k_hi)
            base = o_ptr + tok2.to(gl.int64) * stride_ot + col0 + box_col
            m = tok_ok & ok
            x = gl.load(base + kk2, mask=m, other=0.0).to(gl.float32)
            xw = gl.load(base + (kk2 ^ 1), mask=m, other=0.0).to(gl.float32)      # pair-swapped
            cs = gl.load(cos_ptr + tok2 * stride_ct + pj, mask=m & rope, other=1.0)
            sn = gl.load(sin_ptr + tok2 * stride_ct + pj, mask=m & rope, other=0.0)
            xs = xs + ((x * cs + xw * (sn * sign)).to(gl.bfloat16), )
        for i in gl.static_range(c, min(c + ROPE_CHUNK, NH)):
            box_col = (h0 + i) * HEAD_D + HEAD_D - BOX_K
            if (box_col >= k_lo) & (box_col < k_hi):
                a_bufs.index((box_col - k_lo) // BOX_K).store(xs[i - c])


@gluon.jit
def _wo_a_gluon_decode_kernel(w_desc, o_desc, o_ptr, cos_ptr, sin_ptr, out_ptr, part_ptr, cnt_ptr,
                              T, R, KG, ROWS, SPLIT, stride_ot, stride_ct,
                              HEAD_D: gl.constexpr, RD: gl.constexpr, BOXES: gl.constexpr,
                              NUM_STAGES: gl.constexpr, MAX_SLICE_BOXES: gl.constexpr, NH: gl.constexpr,
                              PDL: gl.constexpr, WS_Q: gl.constexpr, num_warps: gl.constexpr):
    """One program: weight rows [64·pid, +64) (inside group g) × the ≤ 8 tokens, K slice pid_k of SPLIT (stages of
    BOXES 64-K boxes). o_desc boxes [8, 64] of o [T, H·d]; w_desc boxes [64, 64] of W_a [G·R, KG]. The split-K
    workspace is [SPLIT, ROWS, WS_Q] (`decode_ws_tokens`)."""
    gl.static_assert(w_desc.block_type.shape[1] == BOX_K)
    pid = gl.program_id(0)
    pid_k = gl.program_id(1)
    row0 = pid * BLOCK_P
    col0 = (row0 // R) * KG                                # the group's first activation column
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BLOCK_Q, 16])
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [NUM_STAGES * BOXES, BLOCK_P, BOX_K], w_desc.layout)
    a_bufs = gl.allocate_shared_memory(o_desc.dtype, [MAX_SLICE_BOXES, BLOCK_Q, BOX_K], o_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    act = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(s), count=1)
    mbarrier.init(act.index(0), count=MAX_SLICE_BOXES)   # one arrival per possible box (expect_tx arrives too)
    n_st = gl.cdiv(KG, BOX_K * BOXES)
    per = gl.cdiv(n_st, SPLIT)
    st0 = pid_k * per
    n_my = gl.minimum(st0 + per, n_st) - st0
    k_lo = st0 * BOXES * BOX_K
    k_hi = gl.minimum(k_lo + n_my * BOXES * BOX_K, KG)
    # the weight ring first (before the dependency wait under PDL: W_a does not depend on the previous kernel)
    for s in gl.static_range(NUM_STAGES):
        bar = ready.index(s)
        mbarrier.expect(bar, BOXES * w_desc.block_type.nbytes, pred=s < n_my)
        _load_boxes(w_desc, w_bufs, bar, s, row0, k_lo + s * BOXES * BOX_K, s < n_my, BOXES)
    if PDL:
        _grid_dependency_wait()
    n_boxes = n_my * BOXES
    for j in gl.static_range(MAX_SLICE_BOXES):
        mbarrier.expect(act.index(0), o_desc.block_type.nbytes, pred=j < n_boxes)
        mbarrier.arrive(act.index(0), pred=j >= n_boxes)
        tma.async_copy_global_to_shared(o_desc, [0, col0 + k_lo + j * BOX_K], act.index(0), a_bufs.index(j),
                                        pred=j < n_boxes)
    mbarrier.wait(act.index(0), 0)
    _rotate_rope_boxes(a_bufs, o_ptr, cos_ptr, sin_ptr, T, stride_ot, stride_ct, col0, k_lo, k_hi, HEAD_D, RD, NH,
                       num_warps)
    fence_async_shared()       # the rotated boxes' generic-proxy stores, before the async proxy (wgmma) reads them
    gl.thread_barrier()
    acc = gl.zeros([BLOCK_P, BLOCK_Q], gl.float32, mma)
    for i in range(n_my):
        st = i % NUM_STAGES
        mbarrier.wait(ready.index(st), (i // NUM_STAGES) & 1)
        for b in gl.static_range(BOXES):
            acc = warpgroup_mma(w_bufs.index(st * BOXES + b), a_bufs.index(i * BOXES + b).permute((1, 0)), acc,
                                is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        # every MMA of this stage is done: refill its slot with the stage NUM_STAGES ahead
        gl.thread_barrier()
        nxt = i + NUM_STAGES
        bar = ready.index(st)
        mbarrier.expect(bar, BOXES * w_desc.block_type.nbytes, pred=nxt < n_my)
        _load_boxes(w_desc, w_bufs, bar, st, row0, k_lo + nxt * BOXES * BOX_K, nxt < n_my, BOXES)
    for s in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(ready.index(s))
    mbarrier.invalidate(act.index(0))
    rows = row0 + gl.arange(0, BLOCK_P, layout=gl.SliceLayout(1, mma))
    toks = gl.arange(0, BLOCK_Q, layout=gl.SliceLayout(0, mma))
    # out[tok, row] = acc[row, tok]
    splitk_store_rows_tokens(out_ptr, acc, gl.expand_dims(rows, 1), gl.expand_dims(rows < ROWS, 1),
                             gl.expand_dims(toks, 0), gl.expand_dims(toks < T, 0), ROWS, part_ptr, WS_Q, cnt_ptr, pid,
                             pid_k, SPLIT)


def fits(t: int, r: int, kg: int, head_d: int, rd: int) -> bool:
    """Whether the Gluon decode kernel takes this call: ≤ 8 tokens, 64-row tiles inside a group, 64-K boxes, every
    head's RoPE channels inside its last box."""
    return (0 < t <= TILE_TOKENS and r % TILE_ROWS == 0 and kg % BOX == 0 and kg % head_d == 0 and head_d % BOX == 0
            and 0 < rd <= BOX)


SLICE_BOX_LIMIT = 16   # a slice's activation stays in shared memory and its RoPE boxes in registers (≤ 3 heads)


def slice_boxes(kg: int, boxes: int, split: int) -> tuple[int, int]:
    """(K slices launched, 64-K boxes of the longest slice) for a ring of `boxes` boxes per stage; at least as many
    slices as keep each within SLICE_BOX_LIMIT."""
    n_st = triton.cdiv(kg, BOX * boxes)
    s = k_slices(n_st, max(split, triton.cdiv(n_st, SLICE_BOX_LIMIT // boxes)))
    return s, triton.cdiv(n_st, s) * boxes


@functools.cache
def _bf16_smem_layout(rows: int):
    """The shared-memory layout of a [rows, BOX] bf16 TMA box, made once per shape rather than at every launch."""
    return gl.NVMMASharedLayout.get_default_for([rows, BOX], gl.bfloat16)


def wo_a_gluon_decode(o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, w: torch.Tensor, r: int, boxes: int,
                      num_stages: int, split: int, pdl: bool) -> torch.Tensor:
    """z [T, G·R] BF16 for o [T, H, d] BF16 contiguous, cos/sin [T, RD/2] fp32, W_a [G·R, KG] BF16 contiguous
    (operands checked by `wo_a.wo_a`). Calls on one stream at a time (the split-K counters are shared per device)."""
    t, h, d = o.shape
    rows, kg = w.shape
    rd = 2 * cos.shape[1]
    assert fits(t, r, kg, d, rd), (t, r, kg, d, rd)
    out = torch.empty((t, rows), dtype=torch.bfloat16, device=o.device)
    split, max_boxes = slice_boxes(kg, boxes, split)
    tiles = rows // TILE_ROWS
    ws_q = decode_ws_tokens(t, TILE_TOKENS)
    part = torch.empty((split, rows, ws_q), dtype=torch.float32, device=o.device) if split > 1 else out
    cnt = split_counter(o.device, tiles, "wo_a_gluon") if split > 1 else out
    w_desc = TensorDescriptor(w, [rows, kg], [kg, 1], [TILE_ROWS, BOX], _bf16_smem_layout(TILE_ROWS))
    ov = o.view(t, h * d)
    o_desc = TensorDescriptor(ov, [t, h * d], [h * d, 1], [TILE_TOKENS, BOX], _bf16_smem_layout(TILE_TOKENS))
    nh = triton.cdiv(max_boxes * BOX, d) + 1        # heads whose last box can fall in one slice
    _wo_a_gluon_decode_kernel[(tiles, split)](
        w_desc, o_desc, ov, cos, sin, out, part, cnt,
        t, r, kg, rows, split, h * d, cos.stride(0),
        HEAD_D=d, RD=rd, BOXES=boxes, NUM_STAGES=num_stages, MAX_SLICE_BOXES=max_boxes, NH=nh, PDL=pdl,
        WS_Q=ws_q, num_warps=4, launch_pdl=pdl)
    return out
