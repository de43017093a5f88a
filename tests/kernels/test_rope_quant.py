"""GPU parity of the RoPE (+ fake quantization) kernel against its plain-PyTorch reference: bit for bit."""
from __future__ import annotations

import pytest
import torch

from dsflash.plugins import refs

pytestmark = pytest.mark.gpu
DEV = "cuda" if torch.cuda.is_available() else "cpu"   # "cpu": under TRITON_INTERPRET=1 (conftest)
INTERPRET = pytest.mark.interpret


def _angles(positions: torch.Tensor, rd2: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000.0 ** (torch.arange(rd2, device=DEV, dtype=torch.float64) / rd2))
    ang = positions.to(torch.float64).unsqueeze(-1) * inv
    return ang.cos().float(), ang.sin().float()


def _x(shape, dtype, g) -> torch.Tensor:
    """Fresh random rows over ~6 decades (never zeros). Each row's first 16 channels (not rotated) have absmax 6, so
    their FP4 scale is 1 and the rounding midpoints of the FP4 grid planted there are exact ties."""
    scale = torch.logspace(-3, 3, shape[-2] if len(shape) > 1 else 1, device=DEV).unsqueeze(-1)
    x = torch.randn(*shape, device=DEV, generator=g) * scale
    x[..., :16] = torch.randn(*shape[:-1], 16, device=DEV, generator=g).clamp(-5.9, 5.9)
    x[..., :8] = torch.tensor([6.0, 0.25, -0.75, 1.25, -1.75, 2.5, -3.5, 5.0], device=DEV)
    return x.to(dtype)


# (x shape, positions shape): decode rows with heads, a prefill chunk, rows without heads, positions broadcast over
# the batch, V4.1 widths (heads 512-d with 64 rotary channels, index heads 128-d) and tiny ones
CASES = [((1, 1, 8, 512), (1, 1)), ((3, 5, 8, 512), (3, 5)), ((2, 7, 4, 128), (2, 7)), ((64, 512), (64,)),
         ((3, 9, 512), (1, 9)), ((1, 257, 128), (1, 257)), ((5, 1, 3, 64), (5, 1))]


@INTERPRET
@pytest.mark.parametrize("shape,pshape", CASES)
@pytest.mark.parametrize("quant,block", [("none", 32), ("fp8", 32), ("fp4_pow2", 32), ("fp4_e4m3", 16)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_quant_bit_exact(shape, pshape, quant, block, dtype):
    from dsflash.plugins.rope_quant import rope_quant
    g = torch.Generator(device=DEV).manual_seed(hash((shape, quant)) % 2**31)
    x = _x(shape, dtype, g)
    rd2 = 32 if shape[-1] >= 128 else 16
    pos = torch.randint(0, 70000, pshape, device=DEV, generator=g)
    cos, sin = _angles(pos, rd2)
    for inverse in (False, True):
        got = rope_quant(x, cos, sin, inverse, quant, block)
        want = refs.rope_quant_ref(x, cos, sin, inverse, quant, block)
        assert got.dtype == dtype and got.shape == x.shape
        assert torch.equal(got, want), (float((got.float() - want.float()).abs().max()), inverse)
    if quant != "none":
        assert not torch.equal(got, refs.rope_ref(x, cos, sin, True))   # the rows were quantized


def test_rope_quant_op_in_a_cuda_graph():
    """The registered op replays in a CUDA graph (no host sync, no allocation during replay) with new inputs."""
    from dsflash.plugins import registry  # noqa: F401 (registers torch.ops.dsflash.*)
    g = torch.Generator(device=DEV).manual_seed(3)
    x = _x((4, 1, 8, 512), torch.bfloat16, g)
    pos = torch.randint(0, 9000, (4, 1), device=DEV, generator=g)
    cos, sin = _angles(pos, 32)
    op = torch.ops.dsflash.rope_quant
    op(x, cos, sin, False, "fp8", 32)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(x, cos, sin, False, "fp8", 32)
    x.copy_(_x((4, 1, 8, 512), torch.bfloat16, g))
    graph.replay()
    assert torch.equal(out, refs.rope_quant_ref(x, cos, sin, False, "fp8", 32))
