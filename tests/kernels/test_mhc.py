"""GPU parity of the fused mHC kernels: coefficients against fp32 (≤ 1e-5), row kernels against their refs."""
from __future__ import annotations

import pytest
import torch

from dsflash.plugins import refs

pytestmark = pytest.mark.gpu
DEV = "cuda" if torch.cuda.is_available() else "cpu"   # "cpu": under TRITON_INTERPRET=1 (conftest)
# cases that also run on the CPU under Triton's interpreter (`make test`): few tokens at D = 256, and one token at
# D = 9248 (the two-pass rows)
INTERPRET = pytest.mark.interpret


def _cases(ts, ds, small):
    """(t, d) pairs, those in `small` marked to run under the interpreter too."""
    return [pytest.param(t, d, marks=INTERPRET) if (t, d) in small else (t, d) for t in ts for d in ds]


def _site(t: int, d: int):
    X = (torch.randn(t, 4, d, device=DEV) * (1 + torch.rand(t, 4, 1, device=DEV) * 3)).to(torch.bfloat16)
    fn = torch.randn(24, 4 * d, device=DEV) * (4 * d) ** -0.5
    base = torch.randn(24, device=DEV) * 0.5
    scale = torch.rand(3, device=DEV) + 0.5
    return X, fn, base, scale


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.parametrize("t,d", _cases([1, 3, 8, 64, 257], [256, 5120], {(1, 256), (3, 256), (8, 256), (64, 256)}))
def test_hc_mix(t, d):
    from dsflash.plugins.mhc import hc_mix
    X, fn, base, scale = _site(t, d)
    xflat = X.flatten(1)
    got = hc_mix(xflat, refs.hc_split_weight(fn), base, scale, 20, 1e-6, 1e-20)
    want = refs.hc_mix_ref(xflat, fn, base, scale, 4, 20, 1e-6, 1e-20)
    for name, g, w in zip(("pre", "post", "comb"), got, want):
        assert g.dtype == torch.float32 and g.shape == w.shape, name
        assert refs.rel_err(g, w) < 1e-5, (name, refs.rel_err(g, w))


SMALL_ROWS = {(1, 256), (3, 256), (1, 9248)}


@pytest.mark.parametrize("t,d", _cases([1, 3, 257], [256, 5120, 9248], SMALL_ROWS))   # 9248: past the
@pytest.mark.parametrize("quant", [False, True])                                      # register-resident row
def test_hc_pre(t, d, quant):
    from dsflash.plugins.mhc import hc_pre
    X, *_ = _site(t, d)
    pre = torch.rand(t, 4, device=DEV) + 0.1
    w = torch.rand(d, device=DEV) + 0.5
    got = hc_pre(X, pre, w, 1e-20, quant)
    want = refs.hc_pre_ref(X, pre, w, 1e-20, quant)
    if not quant:
        got, want = (got,), (want,)
    assert refs.rel_err(got[0], want[0]) < 1e-2
    assert float((got[0] != want[0]).float().mean()) < 1e-2
    if quant:
        assert refs.rel_err(refs.act_dequant_ref(got[1], got[2]), refs.act_dequant_ref(want[1], want[2])) < 1e-2


@pytest.mark.parametrize("t,d", _cases([1, 3, 257], [256, 5120, 9248], SMALL_ROWS))
@pytest.mark.parametrize("mode", ["expand", "fused", "fused_quant"])
def test_hc_post(t, d, mode):
    from dsflash.plugins.mhc import hc_post
    X, fn, base, scale = _site(t, d)
    pre, post, comb = refs.hc_mix_ref(X.flatten(1), fn, base, scale)
    fx = torch.randn(t, d, device=DEV).to(torch.bfloat16)
    w = torch.rand(d, device=DEV) + 0.5
    kw = {} if mode == "expand" else dict(next_pre=pre, norm_weight=w, eps=1e-20, quant=mode == "fused_quant")
    got = hc_post(X, fx, post, comb, **kw)
    want = refs.hc_post_ref(X, fx, post, comb, **kw)
    if mode == "expand":
        got, want = (got,), (want,)
    assert refs.rel_err(got[0], want[0]) < 1e-2 and float((got[0] != want[0]).float().mean()) < 1e-2
    if mode != "expand":
        assert refs.rel_err(got[1], want[1]) < 1e-2
    if mode == "fused_quant":
        assert refs.rel_err(refs.act_dequant_ref(got[2], got[3]), refs.act_dequant_ref(want[2], want[3])) < 1e-2
