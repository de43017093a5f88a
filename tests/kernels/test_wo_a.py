"""GPU parity of the WO-A grouped projection (inverse RoPE fused in front, split-K reduced in the same launch)."""
from __future__ import annotations

import pytest
import torch

from dsflash.plugins import refs

pytestmark = pytest.mark.gpu
DEV = "cuda" if torch.cuda.is_available() else "cpu"   # "cpu": under TRITON_INTERPRET=1 (conftest)
HEAD_D, RD, RANK = 512, 64, 1024


def _inv_freq_of(rd: int) -> torch.Tensor:
    return 1.0 / (10000.0 ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)).float()


def _case(m: int, h: int, g: int, seed: int, head_d: int = HEAD_D, rd: int = RD, rank: int = RANK):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    o = (torch.randn(m, h, head_d, device=DEV, generator=gen) * 2).to(torch.bfloat16)
    pos = torch.randint(0, 1 << 20, (m,), device=DEV, generator=gen)
    cos, sin = refs.rope_cos_sin_ref(pos, _inv_freq_of(rd).to(DEV))
    w = (torch.randn(g * rank, h * head_d // g, device=DEV, generator=gen) * 0.02).to(torch.bfloat16)
    return o, cos, sin, w


@pytest.mark.parametrize("m", [1, 3, 8, 64, 257])
@pytest.mark.parametrize("h,g", [(64, 8), (8, 1)])
def test_wo_a_all_candidates(m, h, g):
    from dsflash.plugins.wo_a import candidates, wo_a
    o, cos, sin, w = _case(m, h, g, 7 * m + h)
    ref = refs.wo_a_ref(o, cos, sin, w, torch.float32)
    cands = candidates(m, w.shape[0], w.shape[1], arch="sm90", head_d=HEAD_D, rd=RD)
    assert any(c.gluon for c in cands) == (m <= 8)
    for cfg in cands:
        out = wo_a(o, cos, sin, w, cfg)
        err = refs.rel_err(out, ref)
        assert out.dtype == torch.bfloat16 and out.shape == (m, g * RANK) and err < 1e-2, (cfg.tag(), err)
        again = wo_a(o, cos, sin, w, cfg)      # split-K counters were reset by the previous call
        assert torch.equal(again, out), cfg.tag()


@pytest.mark.interpret
@pytest.mark.parametrize("m", [1, 5, 40])
def test_wo_a_triton_candidates_small(m):
    """Every Triton WO-A candidate (arch-neutral: no Gluon) at a small shape, also under the interpreter on the CPU:
    groups of 3 heads of 128 with RoPE on 32, rank 128, against the reference; a second call gives the same bits
    (the split-K counters were reset)."""
    from dsflash.plugins.wo_a import candidates, wo_a
    o, cos, sin, w = _case(m, 6, 2, 13 * m, head_d=128, rd=32, rank=128)
    ref = refs.wo_a_ref(o, cos, sin, w, torch.float32)
    cands = candidates(m, w.shape[0], w.shape[1], head_d=128, rd=32)
    assert cands and not any(c.gluon for c in cands)
    for cfg in cands:
        out = wo_a(o, cos, sin, w, cfg)
        assert out.shape == (m, 2 * 128) and refs.rel_err(out, ref) < 1e-2, (cfg.tag(), refs.rel_err(out, ref))
        assert torch.equal(wo_a(o, cos, sin, w, cfg), out), cfg.tag()


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


@pytest.mark.parametrize("m", [1, 2, 5, 8])
@pytest.mark.parametrize("head_d,rd,h,g,rank", [(128, 32, 6, 2, 64), (256, 64, 12, 3, 192), (512, 64, 3, 1, 128)])
def test_wo_a_gluon_awkward_shapes(m, head_d, rd, h, g, rank):
    """The Gluon decode kernel at shapes unlike V4.1's: RoPE narrower than a box, groups of 3-6 heads, slices that
    start inside a head, a slice longer than one ring, split counts that leave a short last slice."""
    from dsflash.plugins.wo_a import WoAConfig, wo_a
    o, cos, sin, w = _case(m, h, g, 11 * m + head_d, head_d, rd, rank)
    ref = refs.wo_a_ref(o, cos, sin, w, torch.float32)
    kg = w.shape[1]
    for boxes, stages, split, pdl in ((1, 2, 1, False), (2, 3, 3, True), (1, 4, 5, False), (2, 2, 64, True)):
        if kg % (64 * boxes):
            continue
        cfg = WoAConfig(64, 8, 64, split, stages, 4, gluon=True, boxes=boxes, pdl=pdl)
        out = wo_a(o, cos, sin, w, cfg)
        err = refs.rel_err(out, ref)
        assert out.shape == (m, g * rank) and err < 1e-2, (cfg.tag(), err)
        assert torch.equal(wo_a(o, cos, sin, w, cfg), out), cfg.tag()   # deterministic; counters reset


def test_wo_a_default_on_sm90_is_the_gluon_kernel():
    from dsflash.plugins import registry  # noqa: F401
    from dsflash.plugins.wo_a import default_config, wo_a
    o, cos, sin, w = _case(4, 8, 1, 9)
    cfg = default_config(4, w.shape[0], w.shape[1], None, "sm90", HEAD_D, RD)
    assert cfg.gluon
    assert torch.equal(torch.ops.dsflash.wo_a(o, cos, sin, w), wo_a(o, cos, sin, w, cfg))
