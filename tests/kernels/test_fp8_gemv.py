"""GPU parity of the CUDA-core FP8 GEMV (M <= 8, fused split-K) against fp8_gemm_ref: awkward shapes, both
activation-scale formats, strided activations, poisoned outputs, every gemv tuning candidate, graph replays."""
from __future__ import annotations

import pytest
import torch

from dsflash.plugins import refs, tuning

pytestmark = pytest.mark.gpu
DEV = "cuda" if torch.cuda.is_available() else "cpu"   # "cpu": under TRITON_INTERPRET=1 (conftest)


def _operands(m: int, n: int, k: int, a_fmt: str = "fp32"):
    """Random weights quantized over ceil(N/32)·32 rows (so N need not be a multiple of 32), then cut to N."""
    n32 = -(-n // 32) * 32
    w = torch.randn(n32, k, device=DEV) * 0.02 * torch.logspace(-2, 2, k // 32, device=DEV).repeat_interleave(32)
    w_q, w_s = refs.quant_weight_fp8_ref(w)
    x = (torch.randn(m, k, device=DEV) * torch.logspace(-3, 3, m, device=DEV).unsqueeze(-1)).to(torch.bfloat16)
    a_q, a_s = refs.act_quant_ref(x, a_fmt)
    return a_q, a_s, w_q[:n].contiguous(), w_s


def _cfg(bn: int, bk: int, split: int, warps: int = 4, stages: int = 1, acc16: bool = False) -> tuning.GemmConfig:
    return tuning.GemmConfig(bn, 8, split, warps, stages, swap_ab=True, gemv=True, block_k=bk, acc16=acc16)


def _check(a_q, a_s, w_q, w_s, cfg, tol: float = 1e-2) -> None:
    from dsflash.plugins.fp8_gemm import fp8_gemm
    from dsflash.plugins.fp8_gemv import fp8_gemv
    ref = refs.fp8_gemm_ref(a_q, a_s, w_q, w_s, torch.float32)
    a_in = refs.codes16_ref(a_q) if cfg.acc16 else a_q
    for fn in (fp8_gemv, fp8_gemm):
        out = torch.full((a_q.shape[0], w_q.shape[0]), float("nan"), dtype=torch.bfloat16, device=DEV)   # poisoned
        fn(a_in, a_s, w_q, w_s, cfg, out=out)
        err = refs.rel_err(out, ref)
        assert err < tol, (fn.__name__, cfg.tag(), err)


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("n,k", [(4600, 5120), (1000, 1056), (4096, 1280)])
@pytest.mark.parametrize("bn,bk,split,warps", [(32, 256, 1, 4), (32, 512, 4, 8), (16, 1024, 2, 8), (8, 2048, 1, 4),
                                                (8, 2048, 3, 4), (4, 1024, 2, 2), (8, 512, 5, 1)])
def test_fp8_gemv_shapes_and_splits(m, n, k, bn, bk, split, warps):
    """Warps along N (32×256, 32×512, 16×1024) and along K (rows in-thread); K tails; N tails; splits (some leave
    fewer K tiles than slices)."""
    torch.manual_seed(m * 7 + n + k)
    _check(*_operands(m, n, k), _cfg(bn, bk, split, warps))


@pytest.mark.parametrize("m", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("n,k", [(4600, 5120), (1000, 1056), (4096, 1280)])
@pytest.mark.parametrize("bn,bk,split,warps", [(4, 1024, 1, 1), (4, 2048, 3, 2), (8, 1024, 2, 1), (2, 2048, 5, 2),
                                                (16, 512, 1, 1)])
def test_fp8_gemv16_shapes_and_splits(m, n, k, bn, bk, split, warps):
    """f16 in-block accumulation (acc16): the activation as f16 codes; K and N tails, splits."""
    torch.manual_seed(m * 11 + n + k)
    _check(*_operands(m, n, k), _cfg(bn, bk, split, warps, acc16=True))


@pytest.mark.interpret
@pytest.mark.parametrize("acc16", [False, True])
def test_fp8_gemv_small_case(acc16):
    """One small case of each accumulation mode (N, K and split tails), the one that also runs on the CPU under
    Triton's interpreter (its inline PTX on tests/kernels/ptx_emulator.py)."""
    torch.manual_seed(3)
    _check(*_operands(2, 200, 1056), _cfg(8, 512, 3, 1, acc16=acc16))


@pytest.mark.interpret
def test_fp8_gemv16_reads_f16_codes():
    from dsflash.plugins.act_quant import act_quant
    from dsflash.plugins.fp8_gemv import fp8_gemv
    a_q, a_s, w_q, w_s = _operands(3, 256, 1024)
    with pytest.raises(AssertionError, match="codes16"):
        fp8_gemv(a_q, a_s, w_q, w_s, _cfg(4, 1024, 1, 1, acc16=True))
    x = (torch.randn(3, 1024, device=DEV) * 3).to(torch.bfloat16)
    q16, s16 = act_quant(x, "e8m0", codes16=True)
    q, s = refs.act_quant_ref(x, "e8m0")
    assert q16.dtype == torch.float16 and torch.equal(q16, refs.codes16_ref(q)) and torch.equal(s16, s)


@pytest.mark.parametrize("m", [1, 5, 8])
def test_fp8_gemv_e8m0_and_strided_activations(m):
    torch.manual_seed(m)
    n, k = 1000, 1280
    a_q, a_s, w_q, w_s = _operands(m, n, k, "e8m0")
    assert a_s.dtype == torch.float8_e8m0fnu
    big = torch.empty(m, k + 48, dtype=torch.float8_e4m3fn, device=DEV)   # row stride k + 48 (not a multiple of 32)
    big[:, :k] = a_q
    s_big = torch.empty(m, k // 32 + 3, dtype=a_s.dtype, device=DEV)    # strided scale rows too
    s_big[:, :k // 32] = a_s
    for cfg in (_cfg(32, 256, 1), _cfg(8, 1024, 3, warps=2), _cfg(16, 256, 3, warps=8, stages=3)):
        _check(a_q, a_s, w_q, w_s, cfg)
        _check(big[:, :k], s_big[:, :k // 32], w_q, w_s, cfg)


@pytest.mark.parametrize("m", [1, 2, 8])
def test_fp8_gemv_all_tuning_candidates(m):
    torch.manual_seed(100 + m)
    n, k = 4608, 5120
    ops = _operands(m, n, k)
    gemv = [c for c in tuning.candidates(n, k, m) if c.gemv]
    assert gemv and all(c.block_q >= m and c.split_k <= k // 32 for c in gemv)
    assert len({c.tag() for c in gemv}) == len(gemv)
    for cfg in gemv:
        _check(*ops, cfg)


def test_fp8_gemv_graph_replays_on_changed_inputs():
    """The split-K counters are reset by the last program of each tile: replays of one captured graph on new
    inputs (copied into the captured buffers) stay exact, and the result does not depend on the replay."""
    from dsflash.plugins.fp8_gemv import fp8_gemv
    torch.manual_seed(7)
    m, n, k = 4, 2080, 4096
    cfg = _cfg(8, 1024, 4, warps=2)
    a_q, a_s, w_q, w_s = _operands(m, n, k)
    out = torch.empty((m, n), dtype=torch.bfloat16, device=DEV)
    fp8_gemv(a_q, a_s, w_q, w_s, cfg, out=out)     # warm-up: compile, allocate the counters
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fp8_gemv(a_q, a_s, w_q, w_s, cfg, out=out)
    for _ in range(3):
        na_q, na_s, nw_q, nw_s = _operands(m, n, k)
        a_q.copy_(na_q), a_s.copy_(na_s), w_q.copy_(nw_q), w_s.copy_(nw_s)
        out.fill_(float("nan"))
        g.replay()
        ref = refs.fp8_gemm_ref(a_q, a_s, w_q, w_s, torch.float32)
        assert refs.rel_err(out, ref) < 1e-2
        first = out.clone()
        g.replay()
        assert torch.equal(out, first)   # deterministic: fixed-order reduction


def test_fp8_gemv_rejects_large_m_and_non_gemv_configs():
    from dsflash.plugins.fp8_gemv import fp8_gemv
    a_q, a_s, w_q, w_s = _operands(9, 64, 256)
    with pytest.raises(AssertionError):
        fp8_gemv(a_q, a_s, w_q, w_s, _cfg(32, 256, 1))
    with pytest.raises(AssertionError):
        fp8_gemv(a_q[:2], a_s[:2], w_q, w_s, tuning.default_config(64, 256, 2))
