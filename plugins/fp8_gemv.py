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
Imports Triton: load this module lazily.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsflash.plugins.refs import E4M3, E8M0, QBLOCK
from dsflash.plugins.tuning import GemmConfig

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
        sa = (sa.to(tl.int32) << 23).to(tl.float32, bitcast=True)
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
    n_it = tl.cdiv(K, BLOCK_K)
    per = tl.cdiv(n_it, SPLIT)
    it0 = pid_k * per
    it1 = tl.minimum(it0 + per, n_it)
    acc0 = tl.zeros([BLOCK_N, CH], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, CH], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N, CH], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N, CH], dtype=tl.float32)
    acc4 = tl.zeros([BLOCK_N, CH], dtype=tl.float32)
    acc5 = tl.zeros([BLOCK_N, CH], dtype=tl.float32)
    acc6 = tl.zeros([BLOCK_N, CH], dtype=tl.float32)
    acc7 = tl.zeros([BLOCK_N, CH], dtype=tl.float32)
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
        swf = (sw.to(tl.int32) << 23).to(tl.float32, bitcast=True)
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
    # y [M_PAD, BN]: row m = Σ_c acc_m
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
    o_off = offs_m[:, None] * N + offs_n[None, :]
    o_mask = (offs_m < M)[:, None] & mask_n[None, :]
    if SPLIT == 1:
        tl.store(out_ptr + o_off, y.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        slab = M * N
        tl.store(part_ptr + pid_k * slab + o_off, y, mask=o_mask)
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT - 1:   # the last slice of this N tile to arrive: sum the partials in slice order
            tot = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
            for s in range(0, SPLIT):
                tot += tl.load(part_ptr + s * slab + o_off, mask=o_mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + o_off, tot.to(out_ptr.dtype.element_ty), mask=o_mask)
            tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")


_counters: dict[tuple[str, int], torch.Tensor] = {}


def _counter(device: torch.device, n: int) -> torch.Tensor:
    """Per-device split-K tile counters, zero between calls (the last program of each tile resets its own); grown
    (one allocation) when a larger grid first needs more. (Keyed by device type too: TRITON_INTERPRET runs on CPU.)"""
    idx = device.index if device.index is not None else (torch.cuda.current_device() if device.type == "cuda" else 0)
    c = _counters.get((device.type, idx))
    if c is None or c.numel() < n:
        c = torch.zeros(max(n, 1 << 14), dtype=torch.int32, device=device)
        _counters[(device.type, idx)] = c
    return c


def fp8_gemv(a_q: torch.Tensor, a_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, config: GemmConfig,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """Group-32 FP8 GEMM for M <= 8 on CUDA cores -> BF16 [M, N]; the operand contract of `fp8_gemm.fp8_gemm`.

    a_q e4m3 [M, K] (row stride free, K contiguous), a_s [M, K/32] fp32|e8m0 (K/32 contiguous), w_q e4m3 [N, K]
    contiguous, w_s e8m0 [ceil(N/32), K/32] contiguous; K % 32 == 0. config: a `gemv` GemmConfig (block_p = BLOCK_N
    weight rows, block_q >= M, block_k, split_k, num_warps, num_stages); out: optional BF16 [M, N] contiguous.
    """
    assert config.gemv, f"not a gemv config: {config}"
    assert a_q.shape[0] <= config.block_q, f"M={a_q.shape[0]} exceeds the config's {config.block_q} tokens"
    assert a_q.dim() == 2 and w_q.dim() == 2, (a_q.shape, w_q.shape)
    assert a_q.dtype == E4M3 and w_q.dtype == E4M3, (a_q.dtype, w_q.dtype)
    m, k = a_q.shape
    n, kw = w_q.shape
    assert m <= MAX_M, f"the GEMV path takes at most {MAX_M} tokens, got M={m}"
    assert k == kw and k % QBLOCK == 0, f"K mismatch or not a multiple of 32: A {tuple(a_q.shape)} W {tuple(w_q.shape)}"
    assert a_q.stride(1) == 1 and w_q.is_contiguous(), "A needs contiguous K, W must be contiguous"
    assert tuple(a_s.shape) == (m, k // QBLOCK) and a_s.stride(1) == 1, (tuple(a_s.shape), m, k)
    assert a_s.dtype in (torch.float32, E8M0, torch.uint8), f"activation scales must be fp32 or e8m0, got {a_s.dtype}"
    assert tuple(w_s.shape) == (-(-n // QBLOCK), k // QBLOCK) and w_s.is_contiguous(), (tuple(w_s.shape), n, k)
    assert w_s.dtype in (E8M0, torch.uint8), f"weight scales must be e8m0, got {w_s.dtype}"
    assert a_q.device == w_q.device == a_s.device == w_s.device
    if out is None:
        out = torch.empty((m, n), dtype=torch.bfloat16, device=a_q.device)
    assert out.shape == (m, n) and out.is_contiguous() and out.dtype == torch.bfloat16
    if m == 0 or n == 0:
        return out
    sa_e8 = a_s.dtype != torch.float32
    sa = a_s.view(torch.uint8) if sa_e8 else a_s
    bn, bk = config.block_p, config.block_k
    n_tiles = triton.cdiv(n, bn)
    n_it = triton.cdiv(k, bk)
    split = triton.cdiv(n_it, triton.cdiv(n_it, max(1, min(config.split_k, n_it))))   # no empty K slices
    part = torch.empty((split, m, n), dtype=torch.float32, device=out.device) if split > 1 else out
    cnt = _counter(out.device, n_tiles) if split > 1 else out
    _fp8_gemv_kernel[(n_tiles, split)](
        a_q, sa, w_q, w_s.view(torch.uint8), out, part, cnt,
        m, n, k, a_q.stride(0), sa.stride(0), split,
        AS_E8M0=sa_e8, M_PAD=max(1, triton.next_power_of_2(m)), BLOCK_N=bn, BLOCK_K=bk,
        NUM_STAGES=config.num_stages, EVEN_N=n % bn == 0, EVEN_K=k % bk == 0, num_warps=config.num_warps)
    return out
