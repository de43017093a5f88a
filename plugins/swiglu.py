"""The shared expert's clipped SwiGLU in one launch: h = bf16(silu(min(g, L)) · clamp(u, ±L)), fp32 math.

In deploy numerics the reference widens g = w1(x) and u = w3(x) to fp32, clamps both, applies silu, multiplies and
rounds h to BF16 before w2: six to seven elementwise launches at decode (benchmarks/README.md "Session 10"). This
kernel reads g and u once and writes h once. silu(g) = g / (1 + e^-g) with an IEEE division and libdevice's exp, as
PyTorch computes it; the result is rounded once, to BF16. Imports Triton: load this module lazily.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from dsflash.plugins.kernel_device import on_kernel_device
from dsflash.plugins.refs import clipped_swiglu_ref  # noqa: F401  (re-exported: name_ref lives beside name)

BLOCK = 1024


@triton.jit
def _clipped_swiglu_kernel(g_ptr, u_ptr, h_ptr, n_cols, stride_g, stride_u, stride_h, limit,
                           CLIP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < n_cols
    g = tl.load(g_ptr + row * stride_g + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=m, other=0.0).to(tl.float32)
    if CLIP:
        u = tl.minimum(tl.maximum(u, -limit), limit)
        g = tl.minimum(g, limit)
    h = tl.math.div_rn(g, 1.0 + libdevice.exp(-g)) * u
    tl.store(h_ptr + row * stride_h + cols, h.to(tl.bfloat16), mask=m)


def clipped_swiglu(g: torch.Tensor, u: torch.Tensor, limit: float) -> torch.Tensor:
    """g, u [..., I] (BF16 or fp32, last dim contiguous, same shape) -> h [..., I] BF16 (`clipped_swiglu_ref`
    rounded to BF16); limit <= 0: no clipping."""
    assert g.shape == u.shape, (tuple(g.shape), tuple(u.shape))
    assert g.dtype in (torch.bfloat16, torch.float32) and u.dtype == g.dtype, (g.dtype, u.dtype)
    assert on_kernel_device(g, u) and u.device == g.device
    lead, n = g.shape[:-1], g.shape[-1]
    g2, u2 = g.reshape(-1, n), u.reshape(-1, n)
    assert g2.stride(-1) == 1 and u2.stride(-1) == 1, "the last dim must be contiguous"
    h = torch.empty(g2.shape, dtype=torch.bfloat16, device=g.device)
    if h.numel():
        _clipped_swiglu_kernel[(g2.shape[0], triton.cdiv(n, BLOCK))](
            g2, u2, h, n, g2.stride(0), u2.stride(0), h.stride(0), float(limit),
            CLIP=limit > 0, BLOCK=BLOCK, num_warps=4)
    return h.view(*lead, n)
