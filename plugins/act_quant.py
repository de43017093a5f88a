"""Fused per-1×32 (V4.1) or per-1×128 (V4) FP8 activation quantization (pow2 scales), optionally with the
preceding RMSNorm (norm -> quant). Scales come one per 32 columns either way (a 128-group's scale repeated).

One program per row; the row is walked in chunks of CHUNK_G×32 elements. With a norm, pass 1 sums squares and pass 2
re-reads the (L1/L2-resident) row, normalises, rounds to the activation dtype as the reference does, and quantizes.
Scale exponent e = ceil(log2(max(amax, 1e-4)/448)) is taken from the fp32 bit pattern with integer ops only
(448 = 1.75·2^8, so e = exponent(amax) - 8 + [mantissa(amax) > 1.75]), which equals the reference's
fp32-division-then-bits result for every fp32 amax >= 1e-4 (tests/kernels/test_refs.py checks the identity).
Imports Triton: load this module lazily (CPU CI has no Triton).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsflash.plugins.refs import (  # noqa: F401  (re-exported: name_ref lives beside name)
    ACT_BLOCKS, act_quant_dequant_ref, act_quant_ref, rmsnorm_act_quant_ref, rmsnorm_pair_ref, rmsnorm_ref, E4M3, E8M0,
    QBLOCK)
from dsflash.plugins.tl_helpers import exp2i, scale_exp


@triton.jit
def _quant_g32(v, G: tl.constexpr = 1, GB: tl.constexpr = 1):
    """v [G, 32] fp32 -> (q e4m3 [G, 32], scale exponent e int32 [G]); scale = 2^e. GB > 1: one scale per GB
    consecutive 32-blocks (the 1×128 groups of V4: G a multiple of GB, groups aligned to the chunk)."""
    amax = tl.max(tl.abs(v), axis=1)
    if GB > 1:
        grp = tl.max(tl.reshape(amax, (G // GB, GB)), axis=1)
        amax = tl.reshape(tl.broadcast_to(grp[:, None], (G // GB, GB)), (G,))
    e = scale_exp(amax)
    q = tl.minimum(tl.maximum(v * exp2i(-e)[:, None], -448.0), 448.0).to(tl.float8e4nv)
    return q, e


@triton.jit
def _store_q_scale(q, e, q_ptrs, s_ptrs, mask, gmask, SCALE_E8M0: tl.constexpr):
    tl.store(q_ptrs, q, mask=mask)
    if SCALE_E8M0:
        tl.store(s_ptrs, (e + 127).to(tl.uint8), mask=gmask)
    else:
        tl.store(s_ptrs, exp2i(e), mask=gmask)


@triton.jit
def _div(a, b):
    """IEEE-rounded a / b (Triton's `/` on fp32 is an approximate division; tl.math.div_rn does not broadcast)."""
    a, b = tl.broadcast(a, b)
    return tl.math.div_rn(a, b)


@triton.jit
def _rsqrt_mean(ss, n, eps):
    """1/sqrt(ss/n + eps) with IEEE-rounded division and sqrt (ss: scalar or block, n: int)."""
    den = tl.math.sqrt_rn(_div(ss, n.to(tl.float32)) + eps)
    return _div(tl.full([], 1.0, tl.float32), den)


@triton.jit
def _row_rsqrt_mean(x_row, K, eps, CHUNK_G: tl.constexpr):
    """RMSNorm's 1/sqrt(mean(x²) + eps) of a row of K, in [CHUNK_G, 32] chunks (fp32 squares)."""
    g = tl.arange(0, CHUNK_G)
    j = tl.arange(0, 32)
    acc = tl.zeros([CHUNK_G, 32], dtype=tl.float32)
    for k0 in range(0, K, CHUNK_G * 32):
        offs = k0 + g[:, None] * 32 + j[None, :]
        xv = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        acc += xv * xv
    return _rsqrt_mean(tl.sum(tl.sum(acc, axis=1), axis=0), K, eps)


@triton.jit
def _rmsnorm_row(x_row, w_ptr, y_row, K, eps, CHUNK_G: tl.constexpr):
    """y_row = RMSNorm(x_row) · w rounded to x's dtype, as `_act_quant_kernel` computes its norm output."""
    r = _row_rsqrt_mean(x_row, K, eps, CHUNK_G)
    g = tl.arange(0, CHUNK_G)
    j = tl.arange(0, 32)
    for k0 in range(0, K, CHUNK_G * 32):
        offs = k0 + g[:, None] * 32 + j[None, :]
        mask = offs < K
        v = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        wv = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_row + offs, ((v * r) * wv).to(y_row.dtype.element_ty), mask=mask)


@triton.jit
def _rmsnorm_pair_kernel(a_ptr, wa_ptr, ya_ptr, b_ptr, wb_ptr, yb_ptr, KA, KB, stride_a, stride_b, eps,
                         CHUNK_G: tl.constexpr):
    """Program (row, 0) normalizes row `row` of a, (row, 1) the same row of b: two RMSNorms in one launch."""
    row = tl.program_id(0).to(tl.int64)
    if tl.program_id(1) == 0:
        _rmsnorm_row(a_ptr + row * stride_a, wa_ptr, ya_ptr + row * KA, KA, eps, CHUNK_G)
    else:
        _rmsnorm_row(b_ptr + row * stride_b, wb_ptr, yb_ptr + row * KB, KB, eps, CHUNK_G)


@triton.jit
def _act_quant_kernel(
    x_ptr, w_ptr, y_ptr, q_ptr, s_ptr, dq_ptr,
    K,
    stride_x, stride_y, stride_q, stride_s, stride_dq,
    eps,
    HAS_NORM: tl.constexpr, WRITE_Y: tl.constexpr, WRITE_Q: tl.constexpr, WRITE_DQ: tl.constexpr,
    SCALE_E8M0: tl.constexpr, CHUNK_G: tl.constexpr, CODES16: tl.constexpr = False, GB: tl.constexpr = 1,
):
    row = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, CHUNK_G)
    j = tl.arange(0, 32)
    x_row = x_ptr + row * stride_x
    r = 1.0
    if HAS_NORM:
        r = _row_rsqrt_mean(x_row, K, eps, CHUNK_G)
    for k0 in range(0, K, CHUNK_G * 32):
        offs = k0 + g[:, None] * 32 + j[None, :]
        mask = offs < K
        v = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_NORM:
            wv = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            # the reference rounds the norm output to the activation dtype before quantizing
            v = ((v * r) * wv).to(x_ptr.dtype.element_ty).to(tl.float32)
            if WRITE_Y:
                tl.store(y_ptr + row * stride_y + offs, v.to(y_ptr.dtype.element_ty), mask=mask)
        q, e = _quant_g32(v, CHUNK_G, GB)   # (masked columns past K are 0: a short last group, as zero padding)
        kg = k0 // 32 + g
        gmask = kg < K // 32
        if WRITE_Q:
            if CODES16:   # the f16-accumulating GEMV's activation: the e4m3 values × 2^-8 as f16 (exact)
                q = (q.to(tl.float32) * 0.00390625).to(tl.float16)
            _store_q_scale(q, e, q_ptr + row * stride_q + offs, s_ptr + row * stride_s + kg, mask, gmask,
                           SCALE_E8M0)
        if WRITE_DQ:
            sc = exp2i(e)
            tl.store(dq_ptr + row * stride_dq + offs, (q.to(tl.float32) * sc[:, None]).to(dq_ptr.dtype.element_ty),
                     mask=mask)


def _chunk(k: int, block: int) -> tuple[int, int]:
    g = max(min(triton.next_power_of_2(k // QBLOCK), 256), block // QBLOCK)
    return g, (4 if g <= 64 else 8)


def _group_blocks(block: int) -> int:
    assert block in ACT_BLOCKS, f"activation block {block}: the kernels quantize per 1x32 (V4.1) or 1x128 (V4)"
    return block // QBLOCK


def _rows(x: torch.Tensor) -> torch.Tensor:
    assert x.dim() >= 1 and x.shape[-1] % QBLOCK == 0, f"last dim {tuple(x.shape)} must be a multiple of {QBLOCK}"
    assert x.stride(-1) == 1, "last dim must be contiguous"
    assert x.dtype in (torch.bfloat16, torch.float16, torch.float32), x.dtype
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    return x2


def _launch(x: torch.Tensor, weight: torch.Tensor | None, eps: float, write_y: bool, write_q: bool,
            write_dq: bool, scale_fmt: str, codes16: bool = False, block: int = QBLOCK):
    assert scale_fmt in ("fp32", "e8m0"), scale_fmt
    gb = _group_blocks(block)
    x2 = _rows(x)
    m, k = x2.shape
    lead = x.shape[:-1]
    dev = x.device
    if weight is not None:
        assert weight.shape == (k,) and weight.is_contiguous(), (tuple(weight.shape), k)
    y = torch.empty((m, k), dtype=x.dtype, device=dev) if write_y else None
    q = torch.empty((m, k), dtype=torch.float16 if codes16 else E4M3, device=dev) if write_q else None
    s = (torch.empty((m, k // QBLOCK), dtype=torch.uint8 if scale_fmt == "e8m0" else torch.float32, device=dev)
         if write_q else None)
    dq = torch.empty((m, k), dtype=x.dtype, device=dev) if write_dq else None
    dummy = x2
    cg, warps = _chunk(k, block)
    if m > 0:
        _act_quant_kernel[(m,)](
            x2, weight if weight is not None else dummy, y if y is not None else dummy,
            q if q is not None else dummy, s if s is not None else dummy, dq if dq is not None else dummy,
            k,
            x2.stride(0), k, k, k // QBLOCK, k,
            float(eps),
            HAS_NORM=weight is not None, WRITE_Y=write_y, WRITE_Q=write_q, WRITE_DQ=write_dq,
            SCALE_E8M0=scale_fmt == "e8m0", CHUNK_G=cg, CODES16=codes16, GB=gb, num_warps=warps)
    if s is not None and scale_fmt == "e8m0":
        s = s.view(E8M0)
    shp = lambda t, last: None if t is None else t.reshape(*lead, last)  # noqa: E731
    return shp(y, k), shp(q, k), shp(s, k // QBLOCK), shp(dq, k)


def act_quant(x: torch.Tensor, scale_fmt: str = "fp32", codes16: bool = False, block: int = QBLOCK
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] bf16/fp16/fp32 (K % 32 == 0, last dim contiguous) -> (e4m3 [..., K], scales [..., K/32] fp32|e8m0),
    one pow2 scale per 1×`block` (32 or 128; a ragged last group as `act_quant_ref`).
    codes16: the codes as f16 values × 2^-8 instead of e4m3 (`codes16_ref`; what `GemmConfig.acc16` GEMVs read)."""
    _, q, s, _ = _launch(x, None, 0.0, False, True, False, scale_fmt, codes16, block)
    return q, s


def rmsnorm_act_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, scale_fmt: str = "fp32",
                      block: int = QBLOCK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RMSNorm (weight [K] fp32|bf16) -> round to x.dtype -> FP8 1×`block`. Returns (y [..., K] x.dtype, q, scales)."""
    y, q, s, _ = _launch(x, weight, eps, True, True, False, scale_fmt, block=block)
    return y, q, s


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (weight [K] fp32|bf16) over the last dim in fp32, rounded to x.dtype: one launch (the reference is
    about six elementwise and reduction kernels)."""
    return _launch(x, weight, eps, True, False, False, "fp32")[0]


def rmsnorm_pair(a: torch.Tensor, wa: torch.Tensor, b: torch.Tensor, wb: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(a)·wa, RMSNorm(b)·wb) in one launch, each as `rmsnorm` computes it (fp32, rounded to the input dtype):
    an attention's q_norm and kv_norm over the two column slices of the stacked wq_a|wkv output. a [..., KA] and
    b [..., KB] share their leading dims and dtype; rows may be strided (last dim contiguous)."""
    a2, b2 = _rows(a), _rows(b)
    (m, ka), kb = a2.shape, b2.shape[1]
    assert a.shape[:-1] == b.shape[:-1] and a.dtype == b.dtype, \
        (tuple(a.shape), tuple(b.shape), a.dtype, b.dtype)
    assert wa.shape == (ka,) and wb.shape == (kb,) and wa.is_contiguous() and wb.is_contiguous(), \
        (tuple(wa.shape), tuple(wb.shape))
    ya = torch.empty((m, ka), dtype=a.dtype, device=a.device)
    yb = torch.empty((m, kb), dtype=b.dtype, device=b.device)
    if m > 0:
        cg, warps = _chunk(max(ka, kb), QBLOCK)
        _rmsnorm_pair_kernel[(m, 2)](a2, wa, ya, b2, wb, yb, ka, kb, a2.stride(0), b2.stride(0), float(eps),
                                     CHUNK_G=cg, num_warps=warps)
    return ya.reshape(a.shape), yb.reshape(b.shape)


def act_quant_dequant(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 0.0,
                      block: int = QBLOCK) -> torch.Tensor:
    """(optional RMSNorm ->) FP8 1×`block` quantize -> dequantize to x.dtype: the BF16-cache GEMM's activation."""
    _, _, _, dq = _launch(x, weight, eps, False, False, True, "fp32", block=block)
    return dq
