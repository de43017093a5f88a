"""Quantization numerics of the DeepSeek-V4 family, in plain PyTorch and bit-exact.

Formats: FP8 e4m3 (max 448), FP4 e2m1 (grid 0, .5, 1, 1.5, 2, 3, 4, 6), e8m0 scales (pure powers of two, stored as
the biased exponent byte). Power-of-two scales are 2^ceil(log2(amax/qmax)) computed on the fp32 bit pattern, as the
official kernels do. Rounding is round-to-nearest-even everywhere. Kernels in `dsflash.plugins` must match these.
"""
from __future__ import annotations

import functools

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
FP8_MIN_AMAX = 1e-4
FP4_POW2_MIN_AMAX = 6.0 * 2.0 ** -126
FP4_E4M3_MIN_AMAX = 6.0 * 2.0 ** -9
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
E8M0 = torch.float8_e8m0fnu
E4M3 = torch.float8_e4m3fn


# -- scales ---------------------------------------------------------------------------------------------------------
def pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(x)) for positive normal fp32 x, from the bit pattern (exact, no log/exp rounding)."""
    bits = x.float().contiguous().view(torch.int32)
    exp = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), exp)


def pow2_scale(amax: torch.Tensor, qmax: float, min_amax: float) -> torch.Tensor:
    """Power-of-two scale s with amax/s <= qmax (fp32)."""
    return pow2_ceil(torch.clamp(amax.float(), min=min_amax) / qmax)


def e8m0_encode(scale: torch.Tensor) -> torch.Tensor:
    """Pure powers of two (fp32) -> float8_e8m0fnu."""
    bits = scale.float().contiguous().view(torch.int32)
    byte = ((bits >> 23) & 0xFF).to(torch.uint8)
    return byte.view(E8M0)


def e8m0_decode(scale: torch.Tensor) -> torch.Tensor:
    """float8_e8m0fnu (or its uint8 bytes) -> fp32 powers of two."""
    byte = scale.view(torch.uint8) if scale.dtype == E8M0 else scale.to(torch.uint8)
    if bool((byte == 255).any()):
        raise ValueError("e8m0 scale holds the NaN encoding 0xFF")
    return torch.ldexp(torch.ones(byte.shape, dtype=torch.float32, device=byte.device), byte.to(torch.int32) - 127)


# -- element rounding -------------------------------------------------------------------------------------------------
def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest FP4 e2m1 value (ties to the even code), saturating at ±6. Returns fp32."""
    return _e2m1_value(e2m1_code(x))


def e2m1_code(x: torch.Tensor) -> torch.Tensor:
    """4-bit e2m1 codes (bit 3 = sign) of x rounded to nearest-even, saturating at ±6. uint8.

    The magnitude's code is the number of midpoints below it, where the midpoint between codes k and k + 1 counts
    on a tie too when k + 1 is the even code (k odd): two bucketize calls, not a comparison per midpoint."""
    xf = x.float()
    a = xf.abs().clamp(max=FP4_MAX)
    tie_down, tie_up = _e2m1_midpoints(a.device)
    idx = torch.bucketize(a, tie_down, out_int32=True) + torch.bucketize(a, tie_up, out_int32=True, right=True)
    sign = (xf < 0) & (idx > 0)
    return (idx + sign.to(torch.int32) * 8).to(torch.uint8)


@functools.lru_cache(maxsize=None)
def _e2m1_midpoints(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The midpoints whose ties round down (k even: to code k) and up (k odd: to code k + 1), on `device`."""
    mids = torch.tensor(_E2M1_MIDPOINTS, dtype=torch.float32)
    return mids[0::2].contiguous().to(device), mids[1::2].contiguous().to(device)


@functools.lru_cache(maxsize=None)
def _e2m1_table(device: torch.device) -> torch.Tensor:
    """The 16 code values on `device`, copied there once (a copy per call would be a host-to-device transfer in
    every forward, which a CUDA graph capture refuses)."""
    return torch.tensor(list(E2M1_VALUES) + [-v for v in E2M1_VALUES], dtype=torch.float32).to(device)


def _e2m1_value(code: torch.Tensor) -> torch.Tensor:
    return _e2m1_table(code.device)[code.long()]


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round to FP8 e4m3 (nearest-even), saturating at ±448. Returns fp32."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(E4M3).float()


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.shape[-1] % block:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of the quantization block {block}")
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)


# -- fake quantization (quantize then dequantize, same shape/dtype) ---------------------------------------------------
def fake_quant_fp8(x: torch.Tensor, block: int, min_amax: float = FP8_MIN_AMAX) -> torch.Tensor:
    """FP8 e4m3 with one pow2 scale per `block` contiguous elements of the last dim (activation quantization).

    A last dim that is not a multiple of `block` ends in a short block (as zero padding would: zeros never raise amax).
    """
    tail = -x.shape[-1] % block
    if tail:
        padded = torch.nn.functional.pad(x, (0, tail))
        return fake_quant_fp8(padded, block, min_amax)[..., :x.shape[-1]]
    xb = _blocks(x, block)
    s = pow2_scale(xb.abs().amax(-1, keepdim=True), FP8_MAX, min_amax)
    return (round_e4m3(xb / s) * s).reshape(x.shape).to(x.dtype)


def fake_quant_fp4_pow2(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP4 e2m1 with one e8m0 (pow2) scale per `block` elements (indexer keys/queries)."""
    xb = _blocks(x, block)
    s = pow2_scale(xb.abs().amax(-1, keepdim=True), FP4_MAX, FP4_POW2_MIN_AMAX)
    return (round_e2m1(xb / s) * s).reshape(x.shape).to(x.dtype)


def fake_quant_fp4_e4m3scale(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """FP4 e2m1 with an e4m3 scale per `block` elements, no global scale (V4.1 compressed KV)."""
    xb = _blocks(x, block)
    amax = torch.clamp(xb.abs().amax(-1, keepdim=True), min=FP4_E4M3_MIN_AMAX)
    s = round_e4m3(amax / FP4_MAX)
    return (round_e2m1(xb / s) * s).reshape(x.shape).to(x.dtype)


@functools.lru_cache(maxsize=None)
def _hadamard_matrix(n: int) -> torch.Tensor:
    if n & (n - 1):
        raise ValueError(f"Hadamard size {n} is not a power of two")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h * n ** -0.5


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard transform of the last dim (Sylvester order, scale n^-0.5)."""
    return (x.float() @ _hadamard_on(x.shape[-1], x.device)).to(x.dtype)


@functools.lru_cache(maxsize=None)
def _hadamard_on(n: int, device: torch.device) -> torch.Tensor:
    return _hadamard_matrix(n).to(device)


# -- weight formats: dequantization -----------------------------------------------------------------------------------
def _expand(scale: torch.Tensor, rows: int, cols: int, br: int, bc: int) -> torch.Tensor:
    return scale.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:rows, :cols]


def dequant_fp8_block(q: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """FP8 e4m3 [out, in] with e8m0 block scales [ceil(out/b), ceil(in/b)] -> fp32 (ragged edges allowed)."""
    out, inp = q.shape
    exp = (-(-out // block), -(-inp // block))
    if tuple(scale.shape) != exp:
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match weight {tuple(q.shape)} with "
                         f"{block}x{block} blocks (expected {exp})")
    return q.float() * _expand(e8m0_decode(scale), out, inp, block, block)


def dequant_fp8_rows32(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP8 e4m3 [rows, d] with e8m0 scales [rows, d/32] (1x32 along the last dim) -> fp32."""
    rows, d = q.shape
    if tuple(scale.shape) != (rows, -(-d // 32)):
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match {tuple(q.shape)} with 1x32 blocks")
    return q.float() * _expand(e8m0_decode(scale), rows, d, 1, 32)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """int8/uint8 [.., n/2] holding two e2m1 codes (low nibble = even index) -> uint8 codes [.., n]."""
    b = packed.view(torch.uint8)
    return torch.stack([b & 0xF, b >> 4], -1).reshape(*b.shape[:-1], b.shape[-1] * 2)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 e2m1 codes [.., n] -> int8 [.., n/2] (low nibble = even index)."""
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (c[..., 0] | (c[..., 1] << 4)).view(torch.int8)


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """MXFP4 [out, in/2] int8 + e8m0 scales [out, in/32] -> fp32 [out, in]."""
    out, half = packed.shape
    if tuple(scale.shape) != (out, -(-(half * 2) // 32)):
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match packed FP4 weight {tuple(packed.shape)} "
                         f"(expected {(out, -(-(half * 2) // 32))}: one e8m0 per 1x32 along K)")
    vals = _e2m1_value(unpack_fp4(packed))
    return vals * _expand(e8m0_decode(scale), out, half * 2, 1, 32)


# -- weight formats: quantization (synthetic checkpoints, layout conversion) -------------------------------------------
def quant_fp8_block(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [out, in] -> (e4m3 [out, in], e8m0 [ceil(out/b), ceil(in/b)]) with pow2 block scales."""
    out, inp = w.shape
    ro, ri = -(-out // block), -(-inp // block)
    pad = torch.zeros(ro * block, ri * block, device=w.device)
    pad[:out, :inp] = w.float()
    amax = pad.reshape(ro, block, ri, block).abs().amax((1, 3))
    s = pow2_scale(amax, FP8_MAX, FP8_MIN_AMAX)
    q = (w.float() / _expand(s, out, inp, block, block)).clamp(-FP8_MAX, FP8_MAX).to(E4M3)
    return q, e8m0_encode(s)


def quant_fp8_rows32(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [rows, d] -> (e4m3 [rows, d], e8m0 [rows, d/32])."""
    wb = _blocks(w, 32)
    s = pow2_scale(wb.abs().amax(-1), FP8_MAX, FP8_MIN_AMAX)
    q = (wb / s.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).reshape(w.shape).to(E4M3)
    return q, e8m0_encode(s)


def quant_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [out, in] -> (int8 [out, in/2], e8m0 [out, in/32]) with pow2 scales per 1x32 along K."""
    wb = _blocks(w, 32)
    s = pow2_scale(wb.abs().amax(-1), FP4_MAX, FP4_POW2_MIN_AMAX)
    codes = e2m1_code(wb / s.unsqueeze(-1)).reshape(w.shape)
    return pack_fp4(codes), e8m0_encode(s)
