"""Small Triton device functions the kernels share: power-of-two scales (the 1×32 activation scale exponent, 2^e,
e8m0 bytes as fp32) and the split of 16-byte in-thread chunks into their four entries.
Triton inlines them, so a kernel compiles as if it spelled them out. Imports Triton: load lazily."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def scale_exp(amax):
    """The exponent e of the 1×32 FP8 scale 2^e for a block absmax: ceil(log2(max(amax, 1e-4) / 448)), from the
    bit pattern (448 = 1.75·2^8: the mantissa decides whether to round up)."""
    bits = tl.maximum(amax, 1e-4).to(tl.int32, bitcast=True)
    return ((bits >> 23) & 0xFF) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)


@triton.jit
def exp2i(e):
    """2^e as fp32 for int32 e in [-126, 127] (exact)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def e8m0_to_f32(s):
    """e8m0 scale bytes (biased exponents) -> fp32 2^(s - 127); a 0 byte (masked out) gives 0.0."""
    return (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def split4(t):
    """[..., 2, 2] (a [..., 4] chunk reshaped) -> its 4 entries, in order."""
    a, b = tl.split(t)
    a0, a2 = tl.split(a)
    b1, b3 = tl.split(b)
    return a0, b1, a2, b3


@triton.jit
def grouped_tile(pid, num_p, num_q, GROUP: tl.constexpr):
    """Program id -> (row tile, column tile) in grouped order: GROUP row tiles run together and share their column
    tiles (the weight tiles) in L2."""
    in_group = GROUP * num_q
    first_p = (pid // in_group) * GROUP
    gsize = tl.minimum(num_p - first_p, GROUP)
    return first_p + (pid % in_group) % gsize, (pid % in_group) // gsize
