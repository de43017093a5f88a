"""GPU parity of the WO-A grouped projection (inverse RoPE fused in front, split-K reduced in the same launch)."""
from __future__ import annotations

import pytest
import torch

from dsflash.plugins import refs

pytestmark = pytest.mark.gpu
DEV = "cuda"
HEAD_D, RD, RANK = 512, 64, 1024


def _inv_freq() -> torch.Tensor:
    return 1.0 / (10000.0 ** (torch.arange(0, RD, 2, dtype=torch.float64) / RD)).float()


def _case(m: int, h: int, g: int, seed: int):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    o = (torch.randn(m, h, HEAD_D, device=DEV, generator=gen) * 2).to(torch.bfloat16)
    pos = torch.randint(0, 1 << 20, (m,), device=DEV, generator=gen)
    cos, sin = refs.rope_cos_sin_ref(pos, _inv_freq().to(DEV))
    w = (torch.randn(g * RANK, h * HEAD_D // g, device=DEV, generator=gen) * 0.02).to(torch.bfloat16)
    return o, cos, sin, w


@pytest.mark.parametrize("m", [1, 3, 8, 64, 257])
@pytest.mark.parametrize("h,g", [(64, 8), (8, 1)])
def test_wo_a_all_candidates(m, h, g):
    from dsflash.plugins.wo_a import candidates, wo_a
    o, cos, sin, w = _case(m, h, g, 7 * m + h)
    ref = refs.wo_a_ref(o, cos, sin, w, torch.float32)
    for cfg in candidates(m, w.shape[0], w.shape[1]):
        out = wo_a(o, cos, sin, w, cfg)
        err = refs.rel_err(out, ref)
        assert out.dtype == torch.bfloat16 and out.shape == (m, g * RANK) and err < 1e-2, (cfg.tag(), err)
        again = wo_a(o, cos, sin, w, cfg)      # split-K counters were reset by the previous call
        assert torch.equal(again, out), cfg.tag()


def test_wo_a_rope_matters_and_graph():
    from dsflash.plugins.wo_a import wo_a
    o, cos, sin, w = _case(2, 8, 1, 5)
    ref = refs.wo_a_ref(o, cos, sin, w, torch.float32)
    no_rope = refs.wo_a_ref(o, torch.ones_like(cos), torch.zeros_like(sin), w, torch.float32)
    assert refs.rel_err(no_rope, ref) > 1e-2     # the test would notice a missing rotation
    sx = o.clone()
    wo_a(sx, cos, sin, w)
    gph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gph):
        out = wo_a(sx, cos, sin, w)
    for seed in (6, 7):
        o2 = _case(2, 8, 1, seed)[0]
        sx.copy_(o2)
        gph.replay()
        torch.cuda.synchronize()
        assert refs.rel_err(out, refs.wo_a_ref(o2, cos, sin, w, torch.float32)) < 1e-2
    from dsflash.plugins import registry  # noqa: F401
    assert torch.equal(torch.ops.dsflash.wo_a(o, cos, sin, w), wo_a(o, cos, sin, w))
