"""RoPE, then (optionally) fake quantization of the rotated rows, in one kernel (plugin op `rope`).

A V4.1 decode step rotates five kinds of rows per layer: the queries, the window K = V row (then FP8 1×32), and on
index / KV-source layers the index queries and keys (then FP4 with pow2 scales per 32) and the compressed entries
(then FP4 with e4m3 scales per 16). As torch ops each is ~10 launches for the rotation and ~20 for the quantization;
at one token per request every launch costs about as much as it would on a full tile. This kernel does one row
block per program. Numerics are the model's (`refs.rope_quant_ref`, bit for bit): the rotation's products and sums
rounded separately in fp32 (no FMA contraction), the rotated row rounded to x.dtype before it is quantized, IEEE
divisions, round-to-nearest-even FP8 / FP4 codes. Imports Triton: load lazily.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from dsflash.plugins.act_quant import _div
from dsflash.plugins.kernel_device import on_kernel_device
from dsflash.plugins.refs import FP4_E4M3_MIN_AMAX, FP4_POW2_MIN_AMAX, FP8_MIN_AMAX, ROPE_QUANTS
from dsflash.plugins.tl_helpers import exp2i

_QUANT_IDS = {q: i for i, q in enumerate(ROPE_QUANTS)}   # none, fp8, fp4_pow2, fp4_e4m3
_FP8_MIN = tl.constexpr(FP8_MIN_AMAX)
_FP4_POW2_MIN = tl.constexpr(FP4_POW2_MIN_AMAX)
_FP4_E4M3_MIN = tl.constexpr(FP4_E4M3_MIN_AMAX)


@triton.jit
def _mul_rn(a, b):
    """a · b rounded once, never contracted into an FMA with a following add (as torch's separate ops)."""
    a, b = tl.broadcast(a, b)
    return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def _pow2_ceil(t):
    """2^ceil(log2(t)) for positive normal fp32 t, from the bit pattern."""
    bits = t.to(tl.int32, bitcast=True)
    return exp2i(((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32))


@triton.jit
def _round_e2m1(v):
    """Nearest FP4 e2m1 value (ties to the even code), saturating at ±6; +0 for a zero code."""
    a = tl.minimum(tl.abs(v), 6.0)
    r = tl.where(a < 2.0, libdevice.rint(a * 2.0) * 0.5, tl.where(a < 4.0, libdevice.rint(a),
                                                                     libdevice.rint(a * 0.5) * 2.0))
    return tl.where((v < 0.0) & (r > 0.0), -r, r)


@triton.jit
def _fake_quant(v, QUANT: tl.constexpr, ROWS: tl.constexpr, HALF: tl.constexpr,
                HB: tl.constexpr):
    """v [ROWS, HALF, 2] fp32 (a row's channel pairs) -> quantized and dequantized, per block of 2·HB channels."""
    vb = tl.reshape(v, (ROWS, HALF // HB, 2 * HB))
    amax = tl.max(tl.abs(vb), axis=2)                                          # [ROWS, NB]
    fp8_max, fp4_max = tl.full([], 448.0, tl.float32), tl.full([], 6.0, tl.float32)
    if QUANT == 1:     # FP8 e4m3, pow2 scale
        s = _pow2_ceil(_div(tl.maximum(amax, _FP8_MIN), fp8_max))
        q = tl.minimum(tl.maximum(_div(vb, s[:, :, None]), -448.0), 448.0).to(tl.float8e4nv).to(tl.float32)
    elif QUANT == 2:   # FP4 e2m1, pow2 scale
        s = _pow2_ceil(_div(tl.maximum(amax, _FP4_POW2_MIN), fp4_max))
        q = _round_e2m1(_div(vb, s[:, :, None]))
    else:              # FP4 e2m1, e4m3 scale
        s = tl.minimum(_div(tl.maximum(amax, _FP4_E4M3_MIN), fp4_max), 448.0).to(tl.float8e4nv).to(tl.float32)
        q = _round_e2m1(_div(vb, s[:, :, None]))
    return tl.reshape(q * s[:, :, None], (ROWS, HALF, 2))


@triton.jit
def _rope_quant_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, R, HEADS, C,
                       D: tl.constexpr, HALF: tl.constexpr, RD2: tl.constexpr, INVERSE: tl.constexpr,
                       QUANT: tl.constexpr, HB: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = rows < R
    i = tl.arange(0, HALF)                                                     # channel pair
    offs = rows.to(tl.int64)[:, None, None] * D + (2 * i)[None, :, None] + tl.arange(0, 2)[None, None, :]
    x = tl.load(x_ptr + offs, mask=rmask[:, None, None], other=0.0).to(tl.float32)
    a, b = tl.split(x)                                                         # even, odd channels [ROWS, HALF]
    j = i - (HALF - RD2)                                                       # rotary pair (the last RD2 pairs)
    rot = j >= 0
    crow = (rows // HEADS) % C
    cmask = rmask[:, None] & rot[None, :]
    cs = crow[:, None] * RD2 + j[None, :]
    c = tl.load(cos_ptr + cs, mask=cmask, other=1.0)
    s = tl.load(sin_ptr + cs, mask=cmask, other=0.0)
    if INVERSE:
        s = -s
    ra = tl.where(rot[None, :], _mul_rn(a, c) - _mul_rn(b, s), a)
    rb = tl.where(rot[None, :], _mul_rn(a, s) + _mul_rn(b, c), b)
    # the model rounds the rotated row to its dtype before quantizing it
    y = tl.join(ra, rb).to(y_ptr.dtype.element_ty)
    if QUANT != 0:
        y = _fake_quant(y.to(tl.float32), QUANT, ROWS, HALF, HB).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + offs, y, mask=rmask[:, None, None])


def rope_quant(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False, quant: str = "none",
               block: int = 32) -> torch.Tensor:
    """RoPE on the last 2·cos.shape[-1] channels of x (interleaved pairs), then `quant` per `block` channels of the
    whole row (`refs.rope_quant_ref`). x [..., d] or [..., H, d] (bf16 / fp32, d/2 a power of two); cos / sin fp32
    [..., rd/2], the positions' shape (x's dims before d, or before H and d, end in it; leading dims broadcast)."""
    assert on_kernel_device(x, cos, sin), "rope_quant runs on CUDA tensors (or CPU ones under TRITON_INTERPRET=1)"
    assert x.dtype in (torch.bfloat16, torch.float16, torch.float32), x.dtype
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == sin.shape, (cos.dtype, sin.dtype)
    assert quant in _QUANT_IDS, f"quant {quant!r}: one of {ROPE_QUANTS}"
    d, rd2 = x.shape[-1], cos.shape[-1]
    assert d >= 2 and d & (d - 1) == 0 and 2 * rd2 <= d, f"row width {d} (a power of two >= rotary {2 * rd2})"
    heads_axis = x.dim() == cos.dim() + 1          # as `layers.apply_rope`: positions [..., S], x [..., S, H, d]
    heads = x.shape[-2] if heads_axis else 1
    row_shape = tuple(x.shape[:-2] if heads_axis else x.shape[:-1])
    pos_shape = tuple(cos.shape[:-1])
    if len(pos_shape) > len(row_shape) or row_shape[len(row_shape) - len(pos_shape):] != pos_shape:
        cos, sin = (t.expand(*row_shape, rd2).contiguous() for t in (cos, sin))   # broadcast positions
    c = cos.numel() // rd2
    r = x.numel() // d
    if quant != "none":
        assert d % block == 0 and block % 2 == 0 and (block // 2) & (block // 2 - 1) == 0, (d, block)
    x2 = x.contiguous()
    y = torch.empty_like(x2)
    rows = max(1, min(16, 2048 // d))
    if r:
        _rope_quant_kernel[(triton.cdiv(r, rows),)](
            x2, cos.contiguous(), sin.contiguous(), y, r, heads, c, D=d, HALF=d // 2, RD2=rd2, INVERSE=inverse,
            QUANT=_QUANT_IDS[quant], HB=max(block // 2, 1), ROWS=rows, num_warps=4)
    return y
