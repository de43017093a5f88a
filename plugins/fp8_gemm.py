"""Group-32 FP8 dense GEMM (V4.1 dense linears; V4's 128-groups too) and the BF16-cache alternative.

y[m, n] = Σ_kb (A_q[m, kb]·W_q[n, kb]ᵀ) · sa[m, kb] · sb[n/32, kb], fp32 promotion every 32 K, output BF16.
A: e4m3 [M, K] with 1×32 pow2 scales (fp32 or e8m0), W: e4m3 [N, K] with 32×32 e8m0 block scales.
V4 (1×128 activation groups, 128×128 weight blocks) comes in the same scale format, each scale repeated over its
32-blocks (`refs.expand_weight_scales`, `act_quant(block=128)`); with `group=128` the FP8-MMA paths may then promote
once per 128 K (a config's kgroups 32-blocks per iteration, as the V4 reference promotes), not every 32 K.
The kernel is written over a generic (P, Q) pair so one body serves both orientations: normal (P = A, Q = W) for
prefill and swap-AB (P = W, Q = A, output written transposed) for decode, where the weight rows fill the MMA's
M = 64/128 side and the few tokens the N = 16..64 side. Operand tiles come by TMA (host tensor descriptors: no
per-element pointers in registers); split-K slices write fp32 partials that the last slice of each tile to arrive sums
in a fixed order, in the same launch (`splitk`).
`gemv` configs (M <= 8) dispatch to the CUDA-core GEMV of fp8_gemv.py instead.
Imports Triton: load this module lazily.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from dsflash.plugins import tuning
from dsflash.plugins.act_quant import act_quant_dequant
from dsflash.plugins.refs import (  # noqa: F401  (re-exported)
    ACT_BLOCKS, E4M3, E8M0, QBLOCK, bf16_cache_gemm_ref, dequant_weight_ref, fp8_gemm_ref)
from dsflash.plugins.splitk import split_counter, splitk_store
from dsflash.plugins.tl_helpers import e8m0_to_f32, grouped_tile
from dsflash.plugins.tuning import GemmConfig, k_slices


@triton.jit
def _scale_col(base, kb, n_kb, mask, E8M0: tl.constexpr):
    """[B] fp32 scales of K block kb (0 past K or mask)."""
    s = tl.load(base + kb, mask=mask & (kb < n_kb), other=0)
    if E8M0:
        s = e8m0_to_f32(s)
    return s


@triton.jit
def _scale_tile(base, kb, n_kb, mask, KG: tl.constexpr, E8M0: tl.constexpr):
    """[B, KG] fp32 scales of K blocks kb .. kb + KG - 1 (0 past K or mask)."""
    g = kb + tl.arange(0, KG)
    s = tl.load(base[:, None] + g[None, :], mask=mask[:, None] & (g < n_kb)[None, :], other=0)
    if E8M0:
        s = e8m0_to_f32(s)
    return s


@triton.jit
def _fp8_gemm_g32_kernel(
    p_desc, q_desc, ps_ptr, qs_ptr, out_ptr, ws_ptr, cnt_ptr,
    P, Q, K,
    stride_ps, stride_qs, stride_op, stride_oq, stride_os,
    SPLIT_K,
    P_SDIV: tl.constexpr, Q_SDIV: tl.constexpr, PS_E8M0: tl.constexpr, QS_E8M0: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, GROUP_P: tl.constexpr, KG: tl.constexpr,
    NUM_STAGES: tl.constexpr, DEQUANT_BF16: tl.constexpr, P_TILED: tl.constexpr,
):
    """acc[p, q] = Σ_kb (P_q[p, kb]·Q_q[q, kb]ᵀ)·ps[p/P_SDIV, kb]·qs[q/Q_SDIV, kb]; operand tiles arrive by TMA
    (out-of-range rows and columns zero-filled), KG 32-wide K blocks per pipelined iteration. With DEQUANT_BF16 each
    operand is scaled per 32-block in registers before one BF16 MMA; otherwise one FP8 MMA over the KG blocks is
    promoted once with the first block's scales (the caller guarantees they hold for all KG: KG == 1, or V4 groups)."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_p, pid_q = grouped_tile(pid, tl.cdiv(P, BLOCK_P), tl.cdiv(Q, BLOCK_Q), GROUP_P)

    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_q = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    mask_p = offs_p < P
    mask_q = offs_q < Q
    ps_base = ps_ptr + (offs_p // P_SDIV) * stride_ps
    qs_base = qs_ptr + (offs_q // Q_SDIV) * stride_qs

    n_kb = K // 32
    n_it = tl.cdiv(n_kb, KG)
    per = tl.cdiv(n_it, SPLIT_K)
    it0 = pid_k * per
    it1 = tl.minimum(it0 + per, n_it)
    acc = tl.zeros([BLOCK_P, BLOCK_Q], dtype=tl.float32)
    # e8m0 scales are 1-byte loads Triton cannot stream by cp.async: every iteration loads the next one's scales
    # while its own MMAs run, so none waits on a global load
    if DEQUANT_BF16:
        cur_p = _scale_tile(ps_base, it0 * KG, n_kb, mask_p & (it0 < it1), KG, PS_E8M0)
        cur_q = _scale_tile(qs_base, it0 * KG, n_kb, mask_q & (it0 < it1), KG, QS_E8M0)
    else:
        cur_p = _scale_col(ps_base, it0 * KG, n_kb, mask_p & (it0 < it1), PS_E8M0)
        cur_q = _scale_col(qs_base, it0 * KG, n_kb, mask_q & (it0 < it1), QS_E8M0)
    for it in tl.range(it0, it1, num_stages=NUM_STAGES):
        kb = it * KG
        if P_TILED:   # P pre-tiled [P/BP, K/(32·KG), BP, 32·KG]: one contiguous box per iteration
            a = p_desc.load([(pid_p * n_it + it) * BLOCK_P, 0])
        else:
            a = p_desc.load([pid_p * BLOCK_P, kb * 32])    # [BP, 32·KG] e4m3 (zero-filled past K)
        b = q_desc.load([pid_q * BLOCK_Q, kb * 32])        # [BQ, 32·KG] e4m3
        if DEQUANT_BF16:
            nxt_p = _scale_tile(ps_base, (it + 1) * KG, n_kb, mask_p & (it + 1 < it1), KG, PS_E8M0)
            nxt_q = _scale_tile(qs_base, (it + 1) * KG, n_kb, mask_q & (it + 1 < it1), KG, QS_E8M0)
            # e4m3·2^e is exact in BF16: the same products, accumulated in fp32 on BF16 tensor cores
            a16 = (a.to(tl.float32).reshape(BLOCK_P, KG, 32) * cur_p[:, :, None]).reshape(BLOCK_P, KG * 32)
            b16 = (b.to(tl.float32).reshape(BLOCK_Q, KG, 32) * cur_q[:, :, None]).reshape(BLOCK_Q, KG * 32)
            acc = tl.dot(a16.to(tl.bfloat16), b16.to(tl.bfloat16).T, acc)
        else:
            nxt_p = _scale_col(ps_base, (it + 1) * KG, n_kb, mask_p & (it + 1 < it1), PS_E8M0)
            nxt_q = _scale_col(qs_base, (it + 1) * KG, n_kb, mask_q & (it + 1 < it1), QS_E8M0)
            acc += tl.dot(a, b.T) * (cur_p[:, None] * cur_q[None, :])   # fp32 promotion every 32·KG K
        cur_p = nxt_p
        cur_q = nxt_q
    o_off = offs_p.to(tl.int64)[:, None] * stride_op + offs_q.to(tl.int64)[None, :] * stride_oq
    o_mask = mask_p[:, None] & mask_q[None, :]
    splitk_store(out_ptr, acc, o_off, o_mask, ws_ptr, cnt_ptr, pid, pid_k, SPLIT_K, stride_os)


def _scale_arg(s: torch.Tensor) -> tuple[torch.Tensor, bool]:
    if s.dtype == torch.float32:
        return s, False
    assert s.dtype in (E8M0, torch.uint8), f"scales must be fp32 or e8m0, got {s.dtype}"
    return s.view(torch.uint8), True


def tile_weight(w_q: torch.Tensor, cfg: GemmConfig) -> torch.Tensor:
    """Re-lay an e4m3 [N, K] weight for a `tiled_w` (swap-AB) config: [N/BP, K/BK, BP, BK] (zero-padded), viewed 2-D,
    so every TMA box the kernel loads is one contiguous BP·BK-byte block (DRAM-friendly decode streaming).
    Done once at build time; the kernel reads it instead of w_q."""
    assert cfg.swap_ab and cfg.tiled_w, cfg
    n, k = w_q.shape
    bp, bk = cfg.block_p, QBLOCK * cfg.kgroups
    nt, kt = -(-n // bp), -(-k // bk)
    pad = torch.zeros((nt * bp, kt * bk), dtype=torch.uint8, device=w_q.device)
    pad[:n, :k] = w_q.view(torch.uint8)
    return pad.view(nt, bp, kt, bk).permute(0, 2, 1, 3).contiguous().view(nt * kt * bp, bk).view(E4M3)


def gemm_operands(a_q: torch.Tensor, a_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor,
                  out: torch.Tensor | None) -> torch.Tensor:
    """The shape/stride/device contract every group-32 GEMM path shares (`fp8_gemm`, `fp8_gemv`; dtypes and
    alignment are each path's own) -> the BF16 [M, N] output (allocated when `out` is None)."""
    assert a_q.dim() == 2 and w_q.dim() == 2, (a_q.shape, w_q.shape)
    m, k = a_q.shape
    n, kw = w_q.shape
    assert k == kw and k % QBLOCK == 0, f"K mismatch or not a multiple of 32: A {tuple(a_q.shape)}, W {tuple(w_q.shape)}"
    assert a_q.stride(1) == 1 and w_q.is_contiguous(), "A needs contiguous K, W must be contiguous"
    assert tuple(a_s.shape) == (m, k // QBLOCK) and a_s.stride(1) == 1, (tuple(a_s.shape), m, k)
    assert tuple(w_s.shape) == (-(-n // QBLOCK), k // QBLOCK) and w_s.is_contiguous(), (tuple(w_s.shape), n, k)
    assert a_q.device == w_q.device == a_s.device == w_s.device
    if out is None:
        out = torch.empty((m, n), dtype=torch.bfloat16, device=a_q.device)
    assert out.shape == (m, n) and out.is_contiguous() and out.dtype == torch.bfloat16
    return out


def fp8_gemm(a_q: torch.Tensor, a_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor,
             config: GemmConfig | None = None, out: torch.Tensor | None = None,
             w_tiled: torch.Tensor | None = None, group: int = QBLOCK, w_s_t: torch.Tensor | None = None
             ) -> torch.Tensor:
    """Group-32 FP8 GEMM -> BF16 [M, N].

    a_q e4m3 [M, K] (row stride free, K contiguous), a_s [M, K/32] fp32|e8m0 (K/32 contiguous),
    w_q e4m3 [N, K] contiguous, w_s [ceil(N/32), K/32] e8m0|fp32 contiguous; K % 32 == 0.
    (Measured on the H200: fp32 weight scales, which Triton streams by cp.async, did not speed up decode and made
    the large-M FP8-MMA configs 1.4-1.9× slower than the 1-byte e8m0 scales; keep e8m0.)
    config: tiles (default: tuning.get_config(N, K, M)); a `gemv` config (M <= 8) runs `fp8_gemv.fp8_gemv` instead,
    a `gluon` config (K % 128 == 0; large M, or M <= 8 with swap_ab) `fp8_gemm_gluon.fp8_gemm_gluon`, an `sm90`
    config (large M, N % 8 == 0) `fp8_gemm_sm90.fp8_gemm_sm90_config`;
    out: optional BF16 [M, N] contiguous; w_tiled: tile_weight(w_q, config), required by (and only used with) a
    `tiled_w` config; w_s_t: weight_scales_f32(w_s, tma=True), what an sm90 config reads (derived per call without
    it). group: the K extent over which the scales are constant (32: V4.1; 128: V4's 1×128 activation
    groups and 128×128 weight blocks, stored as repeated 32-block scales), which lets FP8-MMA configs promote once
    per `kgroups`·32 K (`GemmConfig.promotes_every`) and the Gluon large-M kernel once per 128 K.
    """
    assert a_q.dim() == 2 and w_q.dim() == 2, (a_q.shape, w_q.shape)
    m, k = a_q.shape
    n, kw = w_q.shape
    cfg = config or tuning.get_config(n, k, m, group=group)
    assert group in ACT_BLOCKS and group % cfg.promotes_every == 0, \
        f"config {cfg.tag()} promotes every {cfg.promotes_every} K, but the scales are constant over {group} only"
    if cfg.gemv:   # CUDA-core split-K GEMV for M <= 8 (fp8_gemv.py; it checks its operands); w_tiled is not used
        from dsflash.plugins.fp8_gemv import fp8_gemv
        return fp8_gemv(a_q, a_s, w_q, w_s, cfg, out=out)
    assert a_q.dtype == E4M3 and w_q.dtype == E4M3, (a_q.dtype, w_q.dtype)
    assert a_q.stride(0) % 16 == 0 and a_q.data_ptr() % 16 == 0 and w_q.data_ptr() % 16 == 0, \
        "TMA needs 16-byte aligned bases and row strides"
    out = gemm_operands(a_q, a_s, w_q, w_s, out)
    if m == 0 or n == 0:
        return out
    if cfg.gluon:   # explicit-wgmma kernels (fp8_gemm_gluon.py)
        from dsflash.plugins.fp8_gemm_gluon import fp8_gemm_gluon
        return fp8_gemm_gluon(a_q, a_s, w_q, w_s, cfg, out, group)
    if cfg.sm90:   # the CUDA large-M kernel (fp8_gemm_sm90.py)
        from dsflash.plugins.fp8_gemm_sm90 import fp8_gemm_sm90_config
        return fp8_gemm_sm90_config(a_q, a_s, w_q, w_s, cfg, out, w_s_t)
    sa, sa_e8 = _scale_arg(a_s)
    sb, sb_e8 = _scale_arg(w_s)
    if cfg.swap_ab:   # P = W rows (n), Q = tokens (m); out[m, n] = acc[p=n, q=m]
        P, Q, pp, qq, ps, qs = n, m, w_q, a_q, sb, sa
        p_div, q_div, ps_e8, qs_e8 = QBLOCK, 1, sb_e8, sa_e8
        stride_op, stride_oq = 1, n
    else:
        P, Q, pp, qq, ps, qs = m, n, a_q, w_q, sa, sb
        p_div, q_div, ps_e8, qs_e8 = 1, QBLOCK, sa_e8, sb_e8
        stride_op, stride_oq = n, 1
    tiles = triton.cdiv(P, cfg.block_p) * triton.cdiv(Q, cfg.block_q)
    n_it = triton.cdiv(k, QBLOCK * cfg.kgroups)
    split = k_slices(n_it, cfg.split_k)
    ws = torch.empty((split, m, n), dtype=torch.float32, device=out.device) if split > 1 else out
    cnt = split_counter(out.device, tiles, "fp8_gemm") if split > 1 else out
    grid = (tiles, split)
    if cfg.tiled_w:
        bk = QBLOCK * cfg.kgroups
        rows = triton.cdiv(n, cfg.block_p) * triton.cdiv(k, bk) * cfg.block_p
        assert w_tiled is not None and w_tiled.shape == (rows, bk) and w_tiled.dtype == E4M3, \
            "a tiled_w config needs w_tiled = tile_weight(w_q, config)"
        p_desc = TensorDescriptor(w_tiled, [rows, bk], [bk, 1], [cfg.block_p, bk])
    else:
        p_desc = TensorDescriptor(pp, [P, k], [pp.stride(0), 1], [cfg.block_p, QBLOCK * cfg.kgroups])
    q_desc = TensorDescriptor(qq, [Q, k], [qq.stride(0), 1], [cfg.block_q, QBLOCK * cfg.kgroups])
    _fp8_gemm_g32_kernel[grid](
        p_desc, q_desc, ps, qs, out, ws, cnt,
        P, Q, k,
        ps.stride(0), qs.stride(0), stride_op, stride_oq, m * n,
        split,
        P_SDIV=p_div, Q_SDIV=q_div, PS_E8M0=ps_e8, QS_E8M0=qs_e8,
        BLOCK_P=cfg.block_p, BLOCK_Q=cfg.block_q, GROUP_P=cfg.group_p, KG=cfg.kgroups,
        NUM_STAGES=cfg.num_stages, DEQUANT_BF16=cfg.dequant_bf16, P_TILED=cfg.tiled_w, num_warps=cfg.num_warps)
    return out


def bf16_cache_gemm(x: torch.Tensor, w_bf16: torch.Tensor, norm_weight: torch.Tensor | None = None,
                    eps: float = 0.0, act_block: int = QBLOCK) -> torch.Tensor:
    """BF16-cache path: x [M, K] bf16 (optionally RMSNorm'd first) through the FP8 1×act_block quantize step,
    dequantized to BF16 in the same kernel, times the cached BF16 weight [N, K] on BF16 tensor cores (cuBLAS) ->
    [M, N] bf16. Numerics equal deploy mode (the dequantized activation and weight are exact in BF16; fp32
    accumulation)."""
    assert x.dtype == torch.bfloat16 and w_bf16.dtype == torch.bfloat16, (x.dtype, w_bf16.dtype)
    assert x.shape[-1] == w_bf16.shape[1], (tuple(x.shape), tuple(w_bf16.shape))
    return torch.matmul(act_quant_dequant(x, norm_weight, eps, act_block), w_bf16.t())


def bf16_cache_weight(w_q: torch.Tensor, w_s: torch.Tensor) -> torch.Tensor:
    """The cached BF16 copy of an FP8 32×32-block weight (exact)."""
    return dequant_weight_ref(w_q, w_s, torch.bfloat16)
