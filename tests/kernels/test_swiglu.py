"""GPU parity of the shared expert's fused clipped SwiGLU against `clipped_swiglu_ref` rounded to BF16."""
from __future__ import annotations

import pytest
import torch

from dsflash.plugins import refs

pytestmark = pytest.mark.gpu
DEV = "cuda" if torch.cuda.is_available() else "cpu"   # "cpu": under TRITON_INTERPRET=1 (conftest)


@pytest.mark.interpret
@pytest.mark.parametrize("t", [1, 3, 257])
@pytest.mark.parametrize("inter", [288, 1000, 2304])
@pytest.mark.parametrize("limit", [10.0, 0.0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_clipped_swiglu(t, inter, limit, dtype):
    from dsflash.plugins.swiglu import clipped_swiglu
    gen = torch.Generator(device=DEV).manual_seed(t * inter)
    # rows of a wider buffer (strided), values past the clip on both sides
    gu = (torch.randn(t, 2 * inter + 32, device=DEV, generator=gen) * 8).to(dtype)
    g, u = gu[:, :inter], gu[:, inter + 32:]
    got = clipped_swiglu(g, u, limit)
    want = refs.clipped_swiglu_ref(g, u, limit).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (t, inter)
    diff = got.float() - want.float()
    # the same fp32 formula, rounded once: at most a last-bit difference where exp's ulp decides a BF16 tie
    assert float((diff != 0).float().mean()) < 1e-3
    assert torch.all(diff.abs() <= want.float().abs() * 2 ** -7)
    if limit > 0:
        assert float(got.float().abs().max()) <= limit * limit * 1.01


def test_clipped_swiglu_op_in_a_graph():
    from dsflash.plugins import registry  # noqa: F401
    g = torch.randn(4, 3, 288, device=DEV).to(torch.bfloat16)
    u = torch.randn(4, 3, 288, device=DEV).to(torch.bfloat16)
    out = torch.ops.dsflash.clipped_swiglu(g, u, 10.0)
    assert out.shape == g.shape
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.dsflash.clipped_swiglu(g, u, 10.0)
    g.copy_(torch.randn_like(g))
    graph.replay()
    torch.cuda.synchronize()
    assert float((out != refs.clipped_swiglu_ref(g, u, 10.0).to(torch.bfloat16)).float().mean()) < 1e-3
