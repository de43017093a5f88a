"""The MoE decode w2 GEMV for a short intermediate (one TP8 rank: 320), in Gluon: weight rows across threads.

`moe._moe_w2_gemv_kernel` spreads a row's K over the threads of a tile and loops over K steps. With K = 320 a row is
only 40 words (160 bytes + 10 scale bytes), so each program makes three short dependent steps, the last one half
masked, then a cross-thread sum: the TP8 w2 reaches 41-47 % of copy bandwidth where the TP1 one (K = 2304) reaches
77-83 % (benchmarks/README.md). Here a pair of threads owns a row: thread j of the pair holds the 32-blocks of parity
j, the row's words are all requested at the start (K/64 loads of 16 bytes per thread, a 32-byte sector per thread
pair), h and its block scales are staged in shared memory once per program, and the only reduction is one shuffle
between the two. The arithmetic is `moe._mx_dot32h`'s PTX (f16 in-block accumulation, fp32 promotion per block), so
the result equals the f16-accumulating GEMV's up to the fp32 order of the block sums. H200, one TP8 rank: w2 at
M = 8 20.0 -> 14.2 µs (47 -> 68 % of copy BW), at M = 1 4.6 -> 3.4 µs (benchmarks/README.md, "Session 9").

With PDL the weights, which depend only on the router's ids, are requested before `griddepcontrol.wait`: their
stream overlaps the tail of the w13 GEMV that writes h. (The router finished before w13 passed its own wait, and w13
lets this kernel launch only after that.) Imports Triton's Gluon: load this module lazily.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from dsflash.plugins.fp8_gemm_gluon import _grid_dependency_wait
from dsflash.plugins.moe import _MX_DOT32H_ASM
from dsflash.plugins.moe_config import rows_fit
from dsflash.plugins.tl_helpers import e8m0_to_f32, split4

ROWS_PER_WARP = gl.constexpr(16)   # thread pairs of a warp, one row each


@gluon.jit
def _pairs4(t):
    """[ROWS, 8] (each thread of a pair holds 4 consecutive entries) -> its 4 entries, each [ROWS, 2] (the pair)."""
    ROWS: gl.constexpr = t.shape[0]
    return split4(gl.reshape(t, [ROWS, 2, 2, 2]))


@gluon.jit
def _moe_w2_rows_kernel(hp_ptr, hs_ptr, w2_ptr, s2_ptr, out_ptr, ids_ptr, N, TOPK, E, stride_o,
                        K8: gl.constexpr, PDL: gl.constexpr, num_warps: gl.constexpr):
    """Pair p, output features [pid_n·ROWS, +ROWS): out[t] += h_p·W2[e]ᵀ (fp32 atomics), h in the f16-code layout
    (hp: int64 view [P, 2, K/8] of the codes, hs: block scales [P, K/32]), W2 words [E, N, K/8], scales e8m0
    [E, N, K/32]. K8 = K/8 words per row, a multiple of 8. A pair routed to another EP rank (id E) only waits."""
    p = gl.program_id(0)
    e = gl.load(ids_ptr + p).to(gl.int64)
    if e < E:
        _w2_rows_pair(hp_ptr, hs_ptr, w2_ptr, s2_ptr, out_ptr, p, e, N, TOPK, stride_o, K8, PDL, num_warps)
    elif PDL:   # every program waits: this grid must not complete before the one it depends on
        _grid_dependency_wait()


@gluon.jit
def _w2_rows_pair(hp_ptr, hs_ptr, w2_ptr, s2_ptr, out_ptr, p, e, N, TOPK, stride_o,
                  K8: gl.constexpr, PDL: gl.constexpr, num_warps: gl.constexpr):
    """`_moe_w2_rows_kernel`'s work for pair p on (local) expert e."""
    ROWS: gl.constexpr = ROWS_PER_WARP * num_warps
    KB: gl.constexpr = K8 // 4
    # [ROWS, 8 words] per step: thread (r, j) holds words 4j..4j+3 of the step, i.e. 32-block 2·step + j of row r
    lay: gl.constexpr = gl.BlockedLayout([1, 4], [ROWS_PER_WARP, 2], [num_warps, 1], [1, 0])
    rows = gl.program_id(1) * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, lay))
    cols = gl.arange(0, 8, layout=gl.SliceLayout(0, lay))
    row_ok = gl.expand_dims(rows < N, 1)
    grow = gl.expand_dims(e * N + rows, 1)                               # [ROWS, 1] global row
    w_at = w2_ptr + grow * K8 + gl.expand_dims(cols, 0)
    s_at = s2_ptr + grow * KB + gl.expand_dims(cols // 4, 0)
    # a thread's 4 scale entries of a step are one byte (its block's): the compiler keeps one of the 4 loads
    words = ()
    scales = ()
    for c in gl.static_range(K8 // 8):
        words = words + (gl.load(w_at + 8 * c, mask=row_ok, other=0), )
        scales = scales + (gl.load(s_at + 2 * c, mask=row_ok, other=0), )
    if PDL:   # h is the previous kernel's output: wait for it only now
        _grid_dependency_wait()
    # h and its block scales, staged in shared memory once per program: each block then reads them at shared-memory
    # latency instead of making K/64 dependent global round trips
    NX: gl.constexpr = triton.next_power_of_2(2 * K8)
    flat: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    i = gl.arange(0, NX, layout=flat)
    x_s = gl.allocate_shared_memory(gl.int64, [NX], plain)
    x_s.store(gl.load(hp_ptr + p.to(gl.int64) * (2 * K8) + i, mask=i < 2 * K8, other=0))
    # the scales spread to one per word (word 8c + col of step c belongs to block 2c + col // 4)
    xs_s = gl.allocate_shared_memory(gl.float32, [NX], plain)
    xs_s.store(gl.load(hs_ptr + p.to(gl.int64) * KB + i // 4, mask=i < K8, other=0.0))
    gl.thread_barrier()
    step_l: gl.constexpr = gl.SliceLayout(0, lay)
    acc0, _, _, _ = _pairs4(gl.zeros([ROWS, 8], gl.float32, lay))   # zeros in the layout the split gives
    for c in gl.static_range(K8 // 8):
        w = words[c]
        xl, _ = gl.broadcast(gl.expand_dims(x_s.slice(8 * c, 8).load(step_l), 0), w)
        xh, _ = gl.broadcast(gl.expand_dims(x_s.slice(K8 + 8 * c, 8).load(step_l), 0), w)
        xs, _ = gl.broadcast(gl.expand_dims(xs_s.slice(8 * c, 8).load(step_l), 0), w)
        w0, w1, w2, w3 = _pairs4(w)
        l0, l1, l2, l3 = _pairs4(xl)
        h0, h1, h2, h3 = _pairs4(xh)
        sc, _, _, _ = _pairs4(e8m0_to_f32(scales[c]) * xs)
        acc0 = gl.inline_asm_elementwise(_MX_DOT32H_ASM, "=f,r,r,r,r,l,l,l,l,l,l,l,l,f,f",
                                         [w0, w1, w2, w3, l0, l1, l2, l3, h0, h1, h2, h3, sc, acc0],
                                         dtype=gl.float32, is_pure=True, pack=1)
    # the pair's two partial sums (the split's layout is this one: one entry per thread)
    pair: gl.constexpr = gl.BlockedLayout([1, 1], [ROWS_PER_WARP, 2], [num_warps, 1], [1, 0])
    y = gl.sum(gl.convert_layout(acc0, pair), axis=1)
    rows_y = gl.program_id(1) * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, pair))
    t = p // TOPK
    gl.atomic_add(out_ptr + t.to(gl.int64) * stride_o + rows_y, y, mask=rows_y < N, sem="relaxed")


def gemv_w2_rows(hq: torch.Tensor, hs: torch.Tensor, ids: torch.Tensor, w2_q: torch.Tensor, w2_s: torch.Tensor,
                 out: torch.Tensor, warps: int, pdl: bool, per_row: int | None = None) -> torch.Tensor:
    """out [T, D] fp32 += Σ_pairs h·W2ᵀ; hq, hs: h as the f16-accumulating w13 GEMV writes it (codes [P, 2, K/8, 4],
    block scales [P, K/32]); w2 as `moe.gemv_w2` takes it. per_row: pairs per output row (None: k, a token's; 1:
    deterministic mode's row per pair, out [P, D])."""
    p, k = hq.shape[0], hq[0].numel()
    e, d = w2_q.shape[0], w2_q.shape[1]
    assert rows_fit(k), f"the row-per-thread w2 GEMV needs K % 64 == 0 and K <= 512, got {k}"
    assert hq.dtype == torch.float16 and hq.is_contiguous() and hs.shape == (p, k // 32), (hq.dtype, tuple(hs.shape))
    assert w2_q.shape == (e, d, k // 2) and w2_s.shape == (e, d, k // 32), (tuple(w2_q.shape), tuple(w2_s.shape))
    per_row = ids.shape[1] if per_row is None else per_row
    assert out.shape == (p // per_row, d) and out.dtype == torch.float32, (tuple(out.shape), out.dtype, per_row)
    grid = (p, -(-d // (ROWS_PER_WARP.value * warps)))
    _moe_w2_rows_kernel[grid](hq.view(torch.int64), hs, w2_q.view(torch.int32), w2_s.view(torch.uint8), out, ids, d,
                              per_row, e, out.stride(0), K8=k // 8, PDL=pdl, num_warps=warps, launch_pdl=pdl)
    return out
