"""GPU parity of the MoE plugins (router, expert-sorted layout, MXFP4 expert GEMMs) against the deploy references.

V4.1-Flash shapes: hidden 5120, 384 experts, top-6; intermediate 2304 (TP1) and 288 padded to 320 (one TP8 rank).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from dsflash.plugins import refs

pytestmark = pytest.mark.gpu
DEV = "cuda" if torch.cuda.is_available() else "cpu"   # "cpu": under TRITON_INTERPRET=1 (conftest)
# cases that also run on the CPU under Triton's interpreter (`make test`; inline PTX on tests/kernels/ptx_emulator.py)
INTERPRET = pytest.mark.interpret
D, E, TOPK, LIMIT, SCALE = 5120, 384, 6, 10.0, 1.5
MS = [1, 3, 8, 64, 257]
# token counts whose cases also run under the interpreter (64 and 257 take 6-35 s each there: GPU only)
MS_INTERPRET = [pytest.param(m, marks=INTERPRET) if m <= 8 else m for m in MS]


def _mx(e: int, n: int, k: int, gen: torch.Generator):
    q = torch.randint(-128, 128, (e, n, k // 2), dtype=torch.int8, device=DEV, generator=gen)
    s = torch.randint(117, 124, (e, n, k // 32), dtype=torch.uint8, device=DEV, generator=gen)
    return q, s


@pytest.fixture(scope="module", params=["tp1", "tp8"])
def experts(request):
    """(inter, ipad, w13_q, w13_s, w2_q, w2_s): stacked w1|w3 rows, padding (rows/columns past inter) zero."""
    inter, ipad = (2304, 2304) if request.param == "tp1" else (288, 320)
    gen = torch.Generator(device=DEV).manual_seed(1)
    w13_q, w13_s = _mx(E, 2 * ipad, D, gen)
    w2_q, w2_s = _mx(E, D, ipad, gen)
    if ipad != inter:
        for half in (0, ipad):
            w13_q[:, half + inter:half + ipad] = 0
            w13_s[:, half + inter:half + ipad] = 127
        w2_q[:, :, inter // 2:] = 0
        w2_s[:, :, inter // 32:] = 127
    yield request.param, inter, ipad, w13_q, w13_s.view(refs.E8M0), w2_q, w2_s.view(refs.E8M0)
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def gate():
    gen = torch.Generator(device=DEV).manual_seed(2)
    gw = (torch.randn(E, D, device=DEV, generator=gen) * 0.02).to(torch.bfloat16)
    bias = torch.randn(E, device=DEV, generator=gen) * 0.05
    return gw, bias


def _x(m: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(m, D, device=DEV, generator=g) * (1 + 3 * torch.rand(m, 1, device=DEV, generator=g))
            ).to(torch.bfloat16)


def _split(w13_q, w13_s, ipad):
    return w13_q[:, :ipad], w13_s[:, :ipad], w13_q[:, ipad:], w13_s[:, ipad:]


@pytest.mark.parametrize("m", MS_INTERPRET)
def test_router(m, gate):
    from dsflash.plugins.moe import gemv_act, natural_act, router
    gw, bias = gate
    x = _x(m, 10 + m)
    w, ids, xq = router(x, gw, bias, TOPK, SCALE)
    _, _, xp = router(x, gw, bias, TOPK, SCALE, xq_layout="gemv")
    _, _, (codes, sc) = router(x, gw, bias, TOPK, SCALE, xq_layout="gemv16")
    xq_ref = refs.fp8_fake_quant_ref(x)
    assert torch.equal(xq, xq_ref) and torch.equal(xp, gemv_act(xq_ref))
    # the f16-code layout: e4m3 codes (×2^-4) and pow2 block scales that multiply back to the same activation
    assert torch.equal(natural_act((codes, sc)), xq_ref) and float(codes.abs().max()) <= 448 / 16
    assert torch.equal(torch.exp2(torch.log2(sc).round()), sc)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    _check_routing(x, gw, bias, w, ids)


def _check_routing(x, gw, bias, w, ids):
    """The kernel's selection and weights against router_ref (bias [E] or [T, E])."""
    w_ref, ids_ref = refs.router_ref(x, gw, bias, TOPK, SCALE)
    same = (ids.long().sort(1).values == ids_ref.sort(1).values).all(1)
    if not bool(same.all()):   # only near-ties of the biased score may select differently
        s = refs.sqrtsoftplus_ref(x.float() @ gw.float().t()) + bias
        top = s.topk(TOPK + 1, dim=1).values
        gap = (top[:, TOPK - 1] - top[:, TOPK]).abs()
        assert bool((gap[~same] < 1e-5).all()), gap[~same]
    wk = w.gather(1, ids.long().argsort(1))[same]
    wr = w_ref.gather(1, ids_ref.argsort(1))[same]
    assert refs.rel_err(wk, wr) < 1e-5
    assert torch.allclose(w.sum(1), torch.full((x.shape[0],), SCALE, device=DEV), rtol=1e-5)


@INTERPRET
@pytest.mark.parametrize("m", [1, 5, 40])
def test_router_takes_a_bias_row_per_token(m, gate):
    """bias [T, E] (V4.1's `bias_vl` rows for image tokens): each token selects with its own row, as router_ref."""
    from dsflash.plugins.moe import router
    gw, bias = gate
    x = _x(m, 30 + m)
    rows = bias.repeat(m, 1)
    rows[1::2] += torch.randn(E, device=DEV) * 3        # every other token: another bias, far from near-ties
    w, ids, _ = router(x, gw, rows.contiguous(), TOPK, SCALE)
    _check_routing(x, gw, rows, w, ids)
    if m > 1:   # the per-token rows changed some selection against the shared bias
        assert not torch.equal(ids, router(x, gw, bias, TOPK, SCALE)[1])
    with pytest.raises(AssertionError, match="router bias must be fp32"):
        router(x, gw, rows[:, :-1].contiguous(), TOPK, SCALE)


@INTERPRET
@pytest.mark.parametrize("m", [1, 3, 16, 40])
def test_router_launch_shapes_agree(m, gate, monkeypatch):
    """Router launch shapes (1-4 tokens per top-k program, 2-4 warps) select the same experts at the same K split,
    with weights equal up to the order of the k-sum in the normalisation."""
    from dsflash.plugins import moe
    gw, bias = gate
    x = _x(m, 50 + m)
    base = moe.router_tiles(m, E, D)
    want = None
    for tt, tw in ((1, 4), (2, 2), (4, 4)):
        rt = dataclasses.replace(base, topk_t=tt, topk_warps=tw)
        monkeypatch.setattr(moe, "router_tiles", lambda t, e, d, qblock=32, rt=rt: rt)
        w, ids, _ = moe.router(x, gw, bias, TOPK, SCALE)
        if want is None:
            want = (w, ids)
            _check_routing(x, gw, bias, w, ids)
        assert torch.equal(ids, want[1]) and refs.rel_err(w, want[0]) <= 1e-6, rt


@INTERPRET
def test_align_layout():
    from dsflash.plugins.moe import max_blocks, moe_align
    for m, bm in ((1, 16), (257, 16), (4096, 64)):
        ids = torch.stack([torch.randperm(E, device=DEV)[:TOPK] for _ in range(m)]).to(torch.int32)
        srt, off = moe_align(ids, E, bm)
        p = m * TOPK
        cnt = torch.bincount(ids.flatten().long(), minlength=E)
        off_ref = torch.zeros(E + 1, dtype=torch.long, device=DEV)
        off_ref[1:] = torch.cumsum((cnt + bm - 1) // bm * bm, 0)
        assert torch.equal(off.long(), off_ref) and off_ref[-1] <= max_blocks(p, E, bm) * bm
        valid = srt[:off_ref[-1]] < p
        assert int(valid.sum()) == p and bool((srt[off_ref[-1]:] == p).all())
        exp_of_slot = torch.repeat_interleave(torch.arange(E, device=DEV), off_ref[1:] - off_ref[:-1])
        assert torch.equal(ids.flatten()[srt[:off_ref[-1]][valid].long()].long(), exp_of_slot[valid])
        assert torch.equal(srt[srt < p].sort().values.long(), torch.arange(p, device=DEV))


@pytest.mark.parametrize("m", MS)
def test_moe_experts(m, experts, gate):
    from dsflash.plugins.moe import MoeConfig, moe_candidates, moe_experts
    from dsflash.plugins.moe_config import rows_fit, unrolled_steps
    tp, inter, ipad, w13_q, w13_s, w2_q, w2_s = experts
    gw, bias = gate
    x = _x(m, 100 + m)
    w, ids = refs.router_ref(x, gw, bias, TOPK, SCALE)
    shared = torch.randn(m, D, device=DEV)
    ref = refs.moe_experts_ref(x, w, ids, *_split(w13_q, w13_s, ipad), w2_q, w2_s, LIMIT, inter, shared)
    xq = refs.fp8_fake_quant_ref(x)
    cfgs = moe_candidates(m, TOPK, E, ipad, D)[:1]   # (the bench checks every candidate's error)
    # both paths at every M: the decode GEMV and the sorted BF16-MMA path
    cfgs += [MoeConfig(False, 32, 128, 64, 64, 4, 3, 16, 4)] if cfgs[0].gemv else [MoeConfig(True, 32, 128, 128, 64,
                                                                                             2, 4, 16, 2)]
    # the sorted path on FP8 tensor cores (`moe_f8`): its default, and 2 stages with one 64-row tile per w2 program
    from dsflash.plugins.moe_config import F8_SORTED
    cfgs += [F8_SORTED, dataclasses.replace(F8_SORTED, stages=2, bn2=64)]
    # both decode GEMV accumulations (fp32 and f16 in-block), split-K and not, with the Triton w2
    gemv = dataclasses.replace(next(c for c in cfgs if c.gemv), rows2=False, pdl=False)
    cfgs += [dataclasses.replace(gemv, acc16=not gemv.acc16), dataclasses.replace(gemv, acc16=True, split13=3, split2=2)]
    if rows_fit(ipad):   # one TP8 rank: w2 with a row per thread pair (Gluon; the default there), with and without PDL
        cfgs += [dataclasses.replace(gemv, acc16=True, rows2=True, warps2=w, split2=1, pdl=pdl)
                 for w, pdl in ((4, True), (2, False))]
    # w2 alone launched with PDL (`pdl2`) after a split w13: the Triton w2, and the row-per-thread one where it fits
    cfgs += [dataclasses.replace(gemv, acc16=True, split13=3, split2=2, pdl2=True)]
    if rows_fit(ipad):
        cfgs += [dataclasses.replace(gemv, acc16=True, split13=3, rows2=True, warps2=4, split2=1, pdl2=True)]
    # the tensor-core w13 (`moe_tc`, its weights through a TMA ring): rings of 1 / 5 / 2 chunks at 1 / 1 / 3 K slices
    cfgs += [dataclasses.replace(gemv, acc16=True, tc13=True, split13=s, stages=st)
             for s, st in ((1, 1), (1, 5), (3, 2))]
    # the w13 slices unrolled with register prefetch (`unroll13`): prefetch depth below and at the slice's steps
    unrolled = [dataclasses.replace(gemv, acc16=True, unroll13=True, split13=s, stages=st)
                for s, st in ((4, 2), (5, 3))]
    assert any(unrolled_steps(c, D, ipad) for c in unrolled)
    cfgs += unrolled
    ids32 = ids.to(torch.int32)
    for cfg in cfgs:
        out = moe_experts(xq, w, ids32, w13_q, w13_s, w2_q, w2_s, LIMIT, inter, shared, cfg)
        err = refs.rel_err(out, ref)
        assert out.dtype == torch.float32 and err < 1e-2, (tp, m, cfg.tag(), err)


@pytest.mark.parametrize("m", [1, 8, 257])
def test_moe_pipeline(m, experts, gate):
    """router kernel -> experts, against the reference experts on the kernel's own routing (no tie flakiness)."""
    from dsflash.plugins.moe import moe, router
    tp, inter, ipad, w13_q, w13_s, w2_q, w2_s = experts
    gw, bias = gate
    x = _x(m, 200 + m)
    shared = torch.randn(m, D, device=DEV).to(torch.bfloat16)
    out = moe(x, gw, bias, TOPK, SCALE, w13_q, w13_s, w2_q, w2_s, LIMIT, inter, shared)
    w, ids, _ = router(x, gw, bias, TOPK, SCALE)
    ref = refs.moe_experts_ref(x, w, ids.long(), *_split(w13_q, w13_s, ipad), w2_q, w2_s, LIMIT, inter, shared)
    assert refs.rel_err(out, ref) < 1e-2


def test_moe_cuda_graph_and_registry(experts, gate):
    from dsflash.plugins import registry  # noqa: F401
    from dsflash.plugins.moe import moe
    tp, inter, ipad, w13_q, w13_s, w2_q, w2_s = experts
    gw, bias = gate
    x = _x(1, 300)
    shared = torch.randn(1, D, device=DEV)
    args = (gw, bias, TOPK, SCALE, w13_q, w13_s, w2_q, w2_s, LIMIT, inter)
    want = moe(x, *args, shared)
    torch.cuda.synchronize()
    static_x = x.clone()
    moe(static_x, *args, shared)   # warm up (compile) outside capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = moe(static_x, *args, shared)
    static_x.copy_(x)
    g.replay()
    torch.cuda.synchronize()
    assert refs.rel_err(out, want) < 1e-6
    x2 = _x(1, 301)
    static_x.copy_(x2)
    g.replay()
    torch.cuda.synchronize()
    assert refs.rel_err(out, moe(x2, *args, shared)) < 1e-6
    # w2 alone launched with PDL (`pdl2`) after a split w13, captured and replayed on new inputs
    from dsflash.plugins.moe import default_moe_config
    cfg = dataclasses.replace(default_moe_config(1, TOPK, E, ipad, D), split13=4, pdl2=True)
    want2 = moe(x, *args, shared, config=cfg)
    assert refs.rel_err(want2, want) < 1e-2
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g2):
        out2 = moe(static_x, *args, shared, config=cfg)
    static_x.copy_(x)
    g2.replay()
    torch.cuda.synchronize()
    assert refs.rel_err(out2, want2) < 1e-6
    y = torch.ops.dsflash.moe(x, gw, bias, TOPK, SCALE, w13_q, w13_s, w2_q, w2_s, LIMIT, inter, shared)
    assert refs.rel_err(y, want) < 1e-6
    w, ids = torch.ops.dsflash.moe_router(x, gw, bias, TOPK, SCALE)
    assert ids.shape == (1, TOPK) and ids.dtype == torch.int32


def _small_experts(e: int, d: int, inter: int, gen: torch.Generator):
    """Stacked w13 [E, 2·I, D/2] and w2 [E, D, I/2] MXFP4 codes with their e8m0 scales."""
    w13_q, w13_s = _mx(e, 2 * inter, d, gen)
    w2_q, w2_s = _mx(e, d, inter, gen)
    return w13_q, w13_s.view(refs.E8M0), w2_q, w2_s.view(refs.E8M0)


@INTERPRET
@pytest.mark.parametrize("acc16", [False, True])
@pytest.mark.parametrize("d,inter,bk13,bn2,bk2", [(352, 96, 128, 128, 64), (640, 384, 256, 256, 256)])
def test_moe_gemv_uneven_tiles(acc16, d, inter, bk13, bn2, bk2):
    """Decode GEMVs whose tiles do not divide the shapes (masked loads), 3 tokens over 8 experts, split-K on:
    D = 352, I = 96 with 64-row / 128-K tiles, and D = 640, I = 384 with 256-K steps (a half last step in both
    GEMVs) and 256-row w2 tiles."""
    from dsflash.plugins.moe import MoeConfig, moe_experts
    e, topk = 8, 3
    gen = torch.Generator(device=DEV).manual_seed(7)
    w13_q, w13_s, w2_q, w2_s = _small_experts(e, d, inter, gen)
    x = _x(3, 400)[:, :d].contiguous()
    ids = torch.stack([torch.randperm(e, device=DEV, generator=gen)[:topk] for _ in range(3)])
    w = torch.rand(3, topk, device=DEV, generator=gen)
    ref = refs.moe_experts_ref(x, w, ids, *_split(w13_q, w13_s, inter), w2_q, w2_s, LIMIT, inter, None)
    cfg = MoeConfig(True, 64, bk13, bn2, bk2, 4, 3, 16, 4, 2, 2, acc16)
    out = moe_experts(refs.fp8_fake_quant_ref(x), w, ids.to(torch.int32), w13_q, w13_s, w2_q, w2_s, LIMIT, inter,
                      None, cfg)
    assert refs.rel_err(out, ref) < 1e-2, (acc16, refs.rel_err(out, ref))


@INTERPRET
@pytest.mark.parametrize("t,k,d", [(1, 1, 96), (3, 6, 352), (5, 3, 1500)])
def test_pair_sum(t, k, d):
    """The deterministic mode's reduction: rows summed in slot order onto the shared expert's output (BF16, strided,
    or none), zero rows (another EP rank's pairs) included: bit for bit `pair_sum_ref`, and the same bits twice."""
    from dsflash.plugins.moe import pair_sum
    g = torch.Generator(device=DEV).manual_seed(t * 100 + k)
    rows = torch.randn(t * k, d, device=DEV, generator=g) * torch.rand(t * k, 1, device=DEV, generator=g) * 1e3
    rows[::4] = 0
    wide = torch.randn(t, 2 * d, device=DEV, generator=g).to(torch.bfloat16)
    for shared in (None, wide[:, :d].contiguous(), wide[:, ::2]):
        out = pair_sum(rows, k, shared)
        assert out.dtype == torch.float32 and torch.equal(out, refs.pair_sum_ref(rows, k, shared))
        assert torch.equal(pair_sum(rows, k, shared), out)
    with pytest.raises(AssertionError):
        pair_sum(torch.zeros(t * k, 2 * d, device=DEV)[:, ::2], k)    # rows with a column stride
    with pytest.raises(AssertionError):
        pair_sum(rows.half(), k)


@INTERPRET
def test_moe_deterministic_reduction():
    """`moe_experts(ordered=True)`: every expert path writes each (token, expert) pair's output to a row of its own and
    the rows are summed in slot order, so the output is bit for bit the slot-order sum of the pairs each computed
    alone (whatever order their atomics would have run in), another rank's pair (id E) adding nothing; and it stays
    within 1e-2 of the reference. D = 384, I = 128, 4 tokens × top-3 over 8 experts, one expert shared by two
    pairs: the decode GEMVs (fp32 and f16 sums, a w2 split over K folded to one slice; on the full grid and on an EP
    rank's pair list, listed out of slot order, whose programs zero every pair's row) and the sorted BF16-MMA path
    under the interpreter; on a GPU also the row-per-thread w2, the tensor-core w13 and the FP8 sorted path."""
    from dsflash.plugins.moe import LocalPairs, MoeConfig, moe_experts, pair_entry
    from dsflash.plugins.moe_config import F8_SORTED
    e, d, inter, topk = 8, 384, 128, 3
    gen = torch.Generator(device=DEV).manual_seed(13)
    w13_q, w13_s, w2_q, w2_s = _small_experts(e, d, inter, gen)
    x = refs.fp8_fake_quant_ref(_x(4, 800)[:, :d].contiguous())
    ids = torch.tensor([[0, 5, 7], [5, 1, e], [3, 4, 6], [2, e, 0]], dtype=torch.int32, device=DEV)
    w = torch.rand(4, topk, device=DEV, generator=gen) + 0.1
    shared = torch.randn(4, d, device=DEV, generator=gen).to(torch.bfloat16)
    ref = refs.moe_experts_ref(x, w, ids.long(), *_split(w13_q, w13_s, inter), w2_q, w2_s, LIMIT, inter, shared)
    gemv = MoeConfig(True, 32, 128, 128, 64, 2, 3, 16, 4, 2, 2, False)
    cfgs = [gemv, dataclasses.replace(gemv, acc16=True), MoeConfig(False, 32, 128, 64, 64, 4, 3, 16, 4)]
    if DEV == "cuda":
        cfgs += [dataclasses.replace(gemv, acc16=True, rows2=True, split2=1),
                 dataclasses.replace(gemv, acc16=True, tc13=True, split13=2, stages=2), F8_SORTED]
    args = (w13_q, w13_s, w2_q, w2_s, LIMIT, inter)
    mine = [(p, int(v)) for p, v in enumerate(ids.flatten().tolist()) if v < e][::-1]
    index = torch.zeros(ids.numel(), dtype=torch.int32, device=DEV)
    index[:len(mine)] = torch.tensor([pair_entry(p, v) for p, v in mine], dtype=torch.int32, device=DEV)
    listed = LocalPairs(index, torch.tensor([len(mine)], dtype=torch.int32, device=DEV))
    for cfg in cfgs:
        out = moe_experts(x, w, ids, *args, shared, cfg, ordered=True)
        solo = dataclasses.replace(cfg, split2=1)   # one K slice: a pair's only add lands on zero, exactly
        rows = torch.stack([moe_experts(x[i:i + 1], w[i:i + 1, j:j + 1], ids[i:i + 1, j:j + 1], *args, None, solo,
                                        ordered=False)[0] for i in range(4) for j in range(topk)])
        assert torch.equal(out, refs.pair_sum_ref(rows, topk, shared)), cfg.tag()
        if cfg.gemv:   # the pair list's grid (EP8's 5 program rows for 12 pairs: 10 listed, in 2 passes)
            assert torch.equal(moe_experts(x, w, ids, *args, shared, cfg, 8, listed, ordered=True), out), cfg.tag()
        assert torch.equal(moe_experts(x, w, ids, *args, shared, cfg, ordered=True), out), cfg.tag()
        assert refs.rel_err(out, ref) < 1e-2, (cfg.tag(), refs.rel_err(out, ref))
        if DEV == "cuda":   # serve's switch (batch-invariant mode) selects it on a GPU
            from dsflash.plugins.moe_config import set_deterministic
            set_deterministic(True)
            try:
                assert torch.equal(moe_experts(x, w, ids, *args, shared, cfg), out), cfg.tag()
            finally:
                set_deterministic(False)


@pytest.mark.parametrize("warps,pdl", [(2, False), (8, True)])
def test_moe_w2_rows(warps, pdl):
    """The row-per-thread-pair w2 GEMV (`moe_gluon`) against the Triton f16 GEMV's contract: D = 352 rows (not a
    multiple of the 32/128-row tiles), I = 128 (two 8-word steps), 3 tokens over 8 experts, expert shared by two
    pairs, into a non-zero output."""
    from dsflash.plugins.moe import MoeConfig, as_layout, gemv_w13, gemv_w2
    e, d, inter, topk = 8, 352, 128, 3
    gen = torch.Generator(device=DEV).manual_seed(11)
    w13_q, w13_s, w2_q, w2_s = _small_experts(e, d, inter, gen)
    x = _x(3, 500)[:, :d].contiguous()
    ids = torch.tensor([[0, 5, 7], [5, 1, 2], [3, 4, 6]], dtype=torch.int32, device=DEV)
    w = torch.rand(3, topk, device=DEV, generator=gen)
    shared = torch.randn(3, d, device=DEV, generator=gen)
    ref = refs.moe_experts_ref(x, w, ids.long(), *_split(w13_q, w13_s, inter), w2_q, w2_s, LIMIT, inter, shared)
    base = MoeConfig(True, 32, 64, 64, 64, 4, 3, 16, 4, 1, 1, True)
    cfg = dataclasses.replace(base, rows2=True, warps2=warps, pdl=pdl)
    hp = gemv_w13(as_layout(refs.fp8_fake_quant_ref(x), "gemv16"), w, ids, w13_q, w13_s, inter, LIMIT, cfg)
    out = gemv_w2(hp, ids, w2_q, w2_s, shared.clone(), cfg)
    tri = gemv_w2(hp, ids, w2_q, w2_s, shared.clone(), base)
    assert refs.rel_err(out, tri) < 1e-5, refs.rel_err(out, tri)
    assert refs.rel_err(out, ref) < 1e-2, refs.rel_err(out, ref)


@pytest.mark.parametrize("stages,stages2,bn2", [(1, 0, 64), (2, 3, 128), (3, 0, 384), (4, 2, 192)])
def test_moe_f8_sorted(stages, stages2, bn2):
    """The sorted path on FP8 tensor cores (`moe_f8`, Gluon: GPU only) against the reference and the BF16 sorted path
    on the same routing, at TMA ring depths 1-4 and 1-6 output tiles per w2 program: D = 384 (3 chunks of 128 K,
    fewer than the deeper rings' stages),
    I = 64 padded to 96 (w13's third tile all padding: h = 0, no weights read; w2 reads 2 of its 4-block chunk's
    blocks), 70 tokens over 8 experts (top-3: runs of 0-60 pairs, so blocks partly filled and experts
    with several blocks), out started from the shared expert's output."""
    from dsflash.plugins.moe import MoeConfig, moe_experts
    e, d, inter, ipad, topk, m = 8, 384, 64, 96, 3, 70
    gen = torch.Generator(device=DEV).manual_seed(17)
    w13_q, w13_s, w2_q, w2_s = _small_experts(e, d, ipad, gen)
    for half in (0, ipad):
        w13_q[:, half + inter:half + ipad] = 0
    w2_q[:, :, inter // 2:] = 0
    x = _x(m, 700)[:, :d].contiguous()
    # a skewed routing: expert 0 in most tokens' picks, expert 7 in none
    ids = torch.stack([torch.randperm(7, device=DEV, generator=gen)[:topk] if t >= m * 3 // 4 else
                       torch.cat([torch.zeros(1, dtype=torch.long, device=DEV),
                                  1 + torch.randperm(6, device=DEV, generator=gen)[:topk - 1]])
                       for t in range(m)]).to(torch.int32)
    w = torch.rand(m, topk, device=DEV, generator=gen)
    shared = torch.randn(m, d, device=DEV, generator=gen)
    ref = refs.moe_experts_ref(x, w, ids.long(), *_split(w13_q, w13_s, ipad), w2_q, w2_s, LIMIT, inter, shared)
    xq = refs.fp8_fake_quant_ref(x)
    bf16 = MoeConfig(False, 32, 128, 64, 32, 4, 3, 16, 4)
    f8 = dataclasses.replace(bf16, f8=True, stages=stages, stages2=stages2, bn2=bn2)
    out = moe_experts(xq, w, ids, w13_q, w13_s, w2_q, w2_s, LIMIT, inter, shared, f8)
    base = moe_experts(xq, w, ids, w13_q, w13_s, w2_q, w2_s, LIMIT, inter, shared, bf16)
    assert refs.rel_err(out, ref) < 1e-2, refs.rel_err(out, ref)
    assert refs.rel_err(out - shared, base - shared) < 1e-2, refs.rel_err(out - shared, base - shared)


@pytest.mark.parametrize("split,depth", [(1, 1), (1, 2), (1, 4), (2, 1), (2, 3), (3, 2)])
def test_moe_w13_tc(split, depth):
    """The tensor-core w13 (`moe_tc`, its weights through a TMA ring of `depth` chunks) against the CUDA-core f16
    GEMV's contract: D = 384 (3 chunks of 128 K: a slice shorter than the ring, slices of 2 and 1 chunks, one slot
    reused), I = 64 padded to 96 (3 tiles of 32 rows, the last one padding), 3 tokens over 8 experts with an expert
    shared by two pairs, out started from the shared expert's output; h matches the CUDA-core kernel's, the whole MoE
    the reference."""
    from dsflash.plugins.moe import MoeConfig, as_layout, gemv_w13, gemv_w2
    e, d, inter, ipad, topk = 8, 384, 64, 96, 3
    gen = torch.Generator(device=DEV).manual_seed(13)
    w13_q, w13_s, w2_q, w2_s = _small_experts(e, d, ipad, gen)
    for half in (0, ipad):
        w13_q[:, half + inter:half + ipad] = 0
    w2_q[:, :, inter // 2:] = 0
    x = _x(3, 600)[:, :d].contiguous()
    ids = torch.tensor([[0, 5, 7], [5, 1, 2], [3, 4, 6]], dtype=torch.int32, device=DEV)
    w = torch.rand(3, topk, device=DEV, generator=gen)
    shared = torch.randn(3, d, device=DEV, generator=gen)
    ref = refs.moe_experts_ref(x, w, ids.long(), *_split(w13_q, w13_s, ipad), w2_q, w2_s, LIMIT, inter, shared)
    xp = as_layout(refs.fp8_fake_quant_ref(x), "gemv16")
    base = MoeConfig(True, 32, 128, 64, 64, 4, 3, 16, 4, 1, 1, True)
    cfg = dataclasses.replace(base, tc13=True, split13=split, stages=depth)
    out = torch.full((3, d), float("nan"), device=DEV)
    hq, hs = gemv_w13(xp, w, ids, w13_q, w13_s, inter, LIMIT, cfg, out, shared)
    assert torch.equal(out, shared)
    cq, cs = gemv_w13(xp, w, ids, w13_q, w13_s, inter, LIMIT, base)
    h_tc = hq.float().permute(0, 2, 3, 1).reshape(-1, ipad // 32, 32) * hs[..., None]
    h_cc = cq.float().permute(0, 2, 3, 1).reshape(-1, ipad // 32, 32) * cs[..., None]
    assert refs.rel_err(h_tc, h_cc) < 1e-2, refs.rel_err(h_tc, h_cc)
    assert not bool(h_tc[:, inter // 32:].any())     # the padded rows of h are zero
    gemv_w2((hq, hs), ids, w2_q, w2_s, out, base)
    assert refs.rel_err(out, ref) < 1e-2, refs.rel_err(out, ref)


# -- expert parallelism: one rank's block of experts, routed over all of them ---------------------------------------
EP = 8
LOCAL = E // EP


def test_router_ids_local_to_an_ep_block(gate):
    """ids local to [start, start + L), another rank's pick = L; the weights are the all-expert router's."""
    from dsflash.plugins.moe import local_pairs, pair_entry, router
    gw, bias = gate
    x = _x(40, 600)
    w, ids, _ = router(x, gw, bias, TOPK, SCALE)
    for start in (0, 5 * LOCAL, E - LOCAL):
        w_l, ids_l, _ = router(x, gw, bias, TOPK, SCALE, expert_start=start, local_experts=LOCAL)
        assert torch.equal(w_l, w) and torch.equal(ids_l, refs.local_expert_ids(ids, start, LOCAL))
        assert bool(((ids_l == LOCAL) | (ids_l < LOCAL)).all()) and bool((ids_l < LOCAL).any())
        # the pair list: exactly this rank's pairs t·k + j with their local experts (`pair_entry`), counted (twice:
        # the counter restarts every call)
        pairs = local_pairs(40, TOPK, DEV)
        for _ in range(2):
            router(x, gw, bias, TOPK, SCALE, expert_start=start, local_experts=LOCAL, pairs=pairs)
            n = int(pairs.count)
            mine = (ids_l.flatten() < LOCAL).nonzero().flatten()
            listed = pairs.index[:n].long().sort().values
            assert n == mine.numel() and torch.equal(listed, pair_entry(mine, ids_l.flatten()[mine].long()))
    with pytest.raises(AssertionError, match="EP expert range"):
        router(x, gw, bias, TOPK, SCALE, expert_start=E - LOCAL + 1, local_experts=LOCAL)


@INTERPRET
def test_align_leaves_out_other_ranks_pairs():
    from dsflash.plugins.moe import moe_align
    ids = torch.randint(0, LOCAL + 1, (257, TOPK), dtype=torch.int32, device=DEV)   # LOCAL: another rank's
    srt, off = moe_align(ids, LOCAL, 16)
    mine = (ids.flatten() < LOCAL).nonzero().flatten()
    assert int(off[-1]) % 16 == 0 and torch.equal(srt[srt < ids.numel()].sort().values.long(), mine)


@pytest.mark.parametrize("m", MS)
def test_moe_expert_parallel(m, experts, gate):
    """EP8: every rank's block of 48 experts with the ids the router makes local to it, on every expert-GEMM path
    (the default, both GEMV accumulations, the Triton and the row-per-thread w2, the sorted MMA path): the ranks'
    outputs sum (the all-reduce) to the single-rank reference within 1e-2, and each rank is near the reference on
    its own block. A rank's share can be a single (token, expert) pair, whose f16 in-block rounding is not averaged
    over the k picks (~1e-2 alone, the documented worst single-token case), hence 2e-2 per rank."""
    from dsflash.plugins.moe import MoeConfig, local_pairs, moe, moe_candidates, moe_experts, router
    from dsflash.plugins.moe_config import rows_fit
    tp, inter, ipad, w13_q, w13_s, w2_q, w2_s = experts
    gw, bias = gate
    x = _x(m, 700 + m)
    shared = torch.randn(m, D, device=DEV)
    xq = refs.fp8_fake_quant_ref(x)
    w, ids_all, _ = router(x, gw, bias, TOPK, SCALE)
    want = refs.moe_experts_ref(x, w, ids_all.long(), *_split(w13_q, w13_s, ipad), w2_q, w2_s, LIMIT, inter, shared)
    gemv = dataclasses.replace(MoeConfig(True, 32, 256, 64, 256, 4, 3, 16, 4, 2, 2, True), pdl=True)
    cfgs = moe_candidates(m, TOPK, LOCAL, ipad, D, EP)[:1] + [
        gemv, dataclasses.replace(gemv, acc16=False, pdl=False), MoeConfig(False, 32, 128, 64, 64, 4, 3, 16, 4)]
    if rows_fit(ipad):
        cfgs.append(dataclasses.replace(gemv, rows2=True, warps2=4, split2=1))
    cfgs.append(dataclasses.replace(gemv, tc13=True, split13=4, stages=2, pdl=False))   # (pair list: passes, one ring)
    cfgs.append(dataclasses.replace(gemv, tc13=True, split13=2, stages=3, pdl=False))
    cfgs.append(dataclasses.replace(gemv, unroll13=True, split13=4, stages=2, pdl=False))   # 5 steps unrolled
    cfgs.append(dataclasses.replace(gemv, pdl=False, pdl2=True))   # w2 alone launched with PDL
    totals = [torch.zeros(m, D, device=DEV) for _ in range(2 * len(cfgs) + 1)]
    for r in range(EP):
        start, sl = r * LOCAL, slice(r * LOCAL, (r + 1) * LOCAL)
        pairs = local_pairs(m, TOPK, DEV)
        ids = router(x, gw, bias, TOPK, SCALE, expert_start=start, local_experts=LOCAL, pairs=pairs)[1]
        assert torch.equal(ids, refs.local_expert_ids(ids_all, start, LOCAL))
        mine = [t[sl] for t in (w13_q, w13_s, w2_q, w2_s)]
        sh = shared if r == 0 else None
        ref = refs.moe_experts_ref(x, w, ids.long(), *_split(mine[0], mine[1], ipad), mine[2], mine[3], LIMIT, inter,
                                   sh)
        # every config on the full grid (another rank's pairs skipped) and, the decode GEMVs, on the rank's pair list
        for i, (cfg, listed) in enumerate([(c, None) for c in cfgs] + [(c, pairs) for c in cfgs]):
            out = moe_experts(xq, w, ids, *mine, LIMIT, inter, sh, cfg, EP, listed)
            if float(ref.norm()) > 0:
                assert refs.rel_err(out, ref) < 2e-2, (tp, m, start, cfg.tag(), refs.rel_err(out, ref))
            else:                       # none of the tokens picked this rank's experts
                assert not bool(out.any()), (tp, m, start, cfg.tag())
            totals[i] += out
        totals[-1] += moe(x, gw, bias, TOPK, SCALE, *mine, LIMIT, inter, sh, expert_start=start)
    for cfg, total in zip(cfgs + cfgs + ["moe()"], totals):
        assert refs.rel_err(total, want) < 1e-2, (tp, m, getattr(cfg, "tag", lambda: cfg)(), refs.rel_err(total, want))


@pytest.mark.parametrize("m", [3, 8])
def test_moe_ep_rank_with_more_pairs_than_slots(m, experts, gate):
    """A hot EP rank (the bias sends every pick to its 48 experts): T·k listed pairs on fewer program rows
    (`local_pair_slots`), so programs run several pairs; the whole op against the reference, in a CUDA graph too."""
    from dsflash.plugins.moe import moe
    from dsflash.plugins.moe_config import local_pair_slots
    tp, inter, ipad, w13_q, w13_s, w2_q, w2_s = experts
    gw, bias = gate
    hot = bias.clone()
    hot[2 * LOCAL:3 * LOCAL] += 100.0
    assert local_pair_slots(m * TOPK, EP) < m * TOPK
    mine = [t[2 * LOCAL:3 * LOCAL] for t in (w13_q, w13_s, w2_q, w2_s)]
    x = _x(m, 800 + m)
    shared = torch.randn(m, D, device=DEV)
    ref = refs.moe_ref(x, gw, hot, TOPK, SCALE, *_split(mine[0], mine[1], ipad), mine[2], mine[3], LIMIT, inter,
                       shared, expert_start=2 * LOCAL)
    out = moe(x, gw, hot, TOPK, SCALE, *mine, LIMIT, inter, shared, expert_start=2 * LOCAL)
    assert refs.rel_err(out, ref) < 1e-2
    static_x = x.clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = moe(static_x, gw, hot, TOPK, SCALE, *mine, LIMIT, inter, shared, expert_start=2 * LOCAL)
    static_x.copy_(_x(m, 900 + m))
    g.replay()
    torch.cuda.synchronize()
    want = moe(static_x, gw, hot, TOPK, SCALE, *mine, LIMIT, inter, shared, expert_start=2 * LOCAL)
    assert refs.rel_err(got, want) < 1e-6


# -- V4-Flash: hidden 4096, 256 experts of 2048 (one TP8 rank: 256), top-6; activations quantized per 1×128 ----------
V4_D, V4_E, V4_QB = 4096, 256, 128


def _x_wide(m: int, d: int, seed: int) -> torch.Tensor:
    """Activations whose 32-blocks differ by up to 2^14 in scale, so a 1×128 block's small members fall into e4m3's
    subnormal range or to 0: 1×32 and 1×128 quantization then differ (they agree almost everywhere on plain randn,
    pow2 scales only moving e4m3's fixed 3-bit mantissa)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(m, d, device=DEV, generator=g)
    blocks = torch.randint(-14, 3, (m, d // 32, 1), device=DEV, generator=g).float()
    return (x.view(m, d // 32, 32) * torch.exp2(blocks)).view(m, d).to(torch.bfloat16)


@pytest.fixture(scope="module")
def v4_gate():
    gen = torch.Generator(device=DEV).manual_seed(3)
    gw = (torch.randn(V4_E, V4_D, device=DEV, generator=gen) * 0.02).to(torch.bfloat16)
    return gw, torch.randn(V4_E, device=DEV, generator=gen) * 0.05


@pytest.mark.parametrize("m", MS_INTERPRET)
def test_v4_router_quantizes_per_128(m, v4_gate):
    """V4's router writes the experts' activation quantized per 1×128 in every layout (bit for bit, on inputs where
    1×32 would differ), and selects as router_ref."""
    from dsflash.plugins.moe import gemv_act, natural_act, router
    gw, bias = v4_gate
    x = _x_wide(m, V4_D, 300 + m)
    w, ids, xq = router(x, gw, bias, TOPK, SCALE, qblock=V4_QB)
    _, _, xp = router(x, gw, bias, TOPK, SCALE, xq_layout="gemv", qblock=V4_QB)
    _, _, xp16 = router(x, gw, bias, TOPK, SCALE, xq_layout="gemv16", qblock=V4_QB)
    want = refs.fp8_fake_quant_ref(x, V4_QB)
    assert not torch.equal(want, refs.fp8_fake_quant_ref(x))      # the inputs tell the two blockings apart
    assert torch.equal(xq, want) and torch.equal(xp, gemv_act(want)) and torch.equal(natural_act(xp16), want)
    w_ref, ids_ref = refs.router_ref(x, gw, bias, TOPK, SCALE)
    same = (ids.long().sort(1).values == ids_ref.sort(1).values).all(1)
    assert float(same.float().mean()) >= 0.9
    assert refs.rel_err(w.gather(1, ids.long().argsort(1))[same], w_ref.gather(1, ids_ref.argsort(1))[same]) < 1e-5


@INTERPRET
@pytest.mark.parametrize("m", [1, 5, 64])
def test_v4_router_takes_hash_picks(m, v4_gate):
    """V4's hash-routed layers: the router keeps the given picks (`tid2eid` of the tokens), weights = the scores at
    them, normalised and scaled (router_ref with hash_ids), with or without a bias (unread), also local to an EP
    rank's block."""
    from dsflash.plugins.moe import router
    gw, bias = v4_gate
    x = _x_wide(m, V4_D, 400 + m)
    picks = torch.stack([torch.randperm(V4_E, device=DEV)[:TOPK] for _ in range(m)]).to(torch.int32)
    w, ids, _ = router(x, gw, bias, TOPK, SCALE, qblock=V4_QB, hash_ids=picks)
    w_ref, _ = refs.router_ref(x, gw, bias, TOPK, SCALE, hash_ids=picks)
    assert torch.equal(ids, picks) and refs.rel_err(w, w_ref) < 1e-5
    w_nb, ids_nb, _ = router(x, gw, None, TOPK, SCALE, qblock=V4_QB, hash_ids=picks)   # (a hash layer has no bias)
    assert torch.equal(ids_nb, picks) and torch.equal(w_nb, w)
    n = V4_E // 8   # EP8 rank 2: picks outside [2n, 3n) become n
    _, ids_ep, _ = router(x, gw, bias, TOPK, SCALE, qblock=V4_QB, hash_ids=picks, expert_start=2 * n, local_experts=n)
    assert torch.equal(ids_ep.long(), refs.local_expert_ids(picks.long(), 2 * n, n))


def _v4_experts(e: int, d: int, inter: int, gen: torch.Generator, wide: bool):
    """Stacked MXFP4 experts; wide: every other 32-row block of w1 and w3 scaled by 2^-8 (so h there is ~2^-16 of
    its 1×128 block: e4m3 subnormals or 0 under a 1×128 quantization, full precision under 1×32) and w2's matching
    K blocks by 2^+16, so those blocks still weigh in the output."""
    w13_q, w13_s = _mx(e, 2 * inter, d, gen)
    w2_q, w2_s = _mx(e, d, inter, gen)
    if wide:
        small = (torch.arange(inter, device=DEV) // 32) % 2 == 1
        w13_s[:, torch.cat([small, small])] -= 8
        w2_s[:, :, small.view(-1, 32)[:, 0]] += 16
    return w13_q, w13_s.view(refs.E8M0), w2_q, w2_s.view(refs.E8M0)


@pytest.mark.parametrize("m", [1, 3, 8, 64, 257])
@pytest.mark.parametrize("inter", [2048, 256])
def test_v4_moe_experts(m, inter):
    """V4 experts (TP1 2048, one TP8 rank 256) against moe_experts_ref with 1×128 x and h. The fp32-accumulating
    paths (decode GEMV, split-K or not; the sorted MMA path) on wide-range inputs, where 1×32 quantization misses by
    far more; the f16 in-block GEMVs (default, split-K) on plain ones (their ~1e-3 rounding of g and u would move
    the subnormal codes of the wide inputs)."""
    from dsflash.plugins.moe import MoeConfig, moe_candidates, moe_experts
    from dsflash.plugins.moe_config import for_qblock
    e = 32   # (the experts the routing below reaches; the shapes are V4's)
    picks = torch.stack([torch.randperm(e, device=DEV)[:TOPK] for _ in range(m)])
    w = torch.rand(m, TOPK, device=DEV) + 0.1
    shared = torch.randn(m, V4_D, device=DEV)
    first = moe_candidates(m, TOPK, e, inter, V4_D, qblock=V4_QB)[0]
    gemv = dataclasses.replace(first if first.gemv else MoeConfig(True, 32, 128, 128, 64, 2, 4, 16, 2), rows2=False,
                               pdl=False)
    fp32 = [dataclasses.replace(gemv, acc16=False), dataclasses.replace(gemv, acc16=False, split13=3, split2=2),
            MoeConfig(False, 32, 128, 64, 64, 4, 3, 16, 4)]
    f16 = [first, dataclasses.replace(gemv, acc16=True, split13=3, split2=2)]
    for wide, cfgs in ((True, fp32), (False, f16)):
        gen = torch.Generator(device=DEV).manual_seed(5)
        w13_q, w13_s, w2_q, w2_s = _v4_experts(e, V4_D, inter, gen, wide)
        x = _x_wide(m, V4_D, 500 + m) if wide else _x(m, 500 + m)[:, :V4_D].contiguous()
        halves = (*_split(w13_q, w13_s, inter), w2_q, w2_s)
        ref = refs.moe_experts_ref(x, w, picks, *halves, LIMIT, inter, shared, V4_QB)
        if wide:
            assert refs.rel_err(refs.moe_experts_ref(x, w, picks, *halves, LIMIT, inter, shared), ref) > 5e-2
        xq = refs.fp8_fake_quant_ref(x, V4_QB)
        for cfg in map(lambda c: for_qblock(c, V4_QB), cfgs):
            assert cfg.bn13 % V4_QB == 0, cfg.tag()
            out = moe_experts(xq, w, picks.to(torch.int32), w13_q, w13_s, w2_q, w2_s, LIMIT, inter, shared, cfg,
                              qblock=V4_QB)
            err = refs.rel_err(out, ref)
            assert err < 1e-2, (inter, m, wide, cfg.tag(), err)


@pytest.mark.parametrize("m", [1, 8, 257])
def test_v4_moe_pipeline(m, v4_gate):
    """router (scored and hash-routed) -> experts with 1×128 activations, against the reference experts on the
    kernel's own routing; and the registry op on the same inputs."""
    from dsflash.plugins import registry  # noqa: F401  (torch.ops.dsflash.moe)
    from dsflash.plugins.moe import moe, router
    gw, bias = v4_gate
    gen = torch.Generator(device=DEV).manual_seed(6)
    w13_q, w13_s, w2_q, w2_s = _v4_experts(V4_E, V4_D, 256, gen, wide=False)
    x = _x_wide(m, V4_D, 600 + m)
    shared = torch.randn(m, V4_D, device=DEV).to(torch.bfloat16)
    picks = torch.stack([torch.randperm(V4_E, device=DEV)[:TOPK] for _ in range(m)]).to(torch.int32)
    for hash_ids in (None, picks):
        out = moe(x, gw, bias, TOPK, SCALE, w13_q, w13_s, w2_q, w2_s, LIMIT, 256, shared, qblock=V4_QB,
                  hash_ids=hash_ids)
        w, ids, _ = router(x, gw, bias, TOPK, SCALE, qblock=V4_QB, hash_ids=hash_ids)
        ref = refs.moe_experts_ref(x, w, ids.long(), *_split(w13_q, w13_s, 256), w2_q, w2_s, LIMIT, 256, shared,
                                   V4_QB)
        assert refs.rel_err(out, ref) < 1e-2, (m, hash_ids is not None)
        op = torch.ops.dsflash.moe(x, gw, bias, TOPK, SCALE, w13_q, w13_s, w2_q, w2_s, LIMIT, 256, shared, 1.0, 0,
                                   V4_QB, hash_ids)
        assert refs.rel_err(op, ref) < 1e-2


@INTERPRET
def test_moe_sorted_tiles():
    """The sorted path (expert blocks of tokens, `tl.dot_scaled`) at the default rule's tile and every tile `build`
    times around it (`moe_config._sorted_candidates`), on a small expert set with a TP rank's zero padding (inter 64
    of 96), against the reference: the path the GPU tests reach only at full width (M = 257) also runs on the CPU."""
    from dsflash.plugins.moe import moe_experts
    from dsflash.plugins.moe_config import default_moe_config, moe_candidates
    d, e, topk, inter, ipad, m = 256, 8, 2, 64, 96, 40
    gen = torch.Generator(device=DEV).manual_seed(5)
    w13_q, w13_s, w2_q, w2_s = refs.random_mxfp4_experts(e, d, inter, ipad, gen)
    x = _x_wide(m, d, 700)
    ids = torch.stack([torch.randperm(e, device=DEV, generator=gen)[:topk] for _ in range(m)]).to(torch.int32)
    w = torch.rand(m, topk, device=DEV, generator=gen)
    shared = torch.randn(m, d, device=DEV, generator=gen)
    ref = refs.moe_experts_ref(x, w, ids.long(), *_split(w13_q, w13_s, ipad), w2_q, w2_s, LIMIT, inter, shared)
    cfgs = moe_candidates(m, topk, e, ipad, d)
    assert cfgs[0] == default_moe_config(m, topk, e, ipad, d) and not any(c.gemv for c in cfgs) and len(cfgs) >= 8
    cfgs = [c for c in cfgs if not c.f8]   # `moe_f8` is Gluon, GPU only (test_moe_f8_sorted)
    xq = refs.fp8_fake_quant_ref(x)
    for cfg in cfgs:
        out = moe_experts(xq, w, ids, w13_q, w13_s, w2_q, w2_s, LIMIT, inter, shared, cfg)
        assert refs.rel_err(out, ref) < 1e-2, (cfg.tag(), refs.rel_err(out, ref))
