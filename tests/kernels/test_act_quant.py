"""GPU parity of the fused activation quantization kernels against their plain-PyTorch references."""
from __future__ import annotations

import pytest
import torch

from dsflash.plugins import refs

pytestmark = pytest.mark.gpu
INTERPRET = pytest.mark.interpret
DEV = "cuda" if torch.cuda.is_available() else "cpu"   # "cpu": under TRITON_INTERPRET=1 (conftest)
# The kernels run one program per row, all rows alike: past a few rows more of them only cost the interpreter time
# (257 rows: ~25 s a case on the CPU), so there the many-rows case is 33 rows.
MANY = 257 if DEV == "cuda" else 33


def _x(m: int, k: int, stride_pad: int = 0) -> torch.Tensor:
    """Fresh random bf16 rows spanning ~9 decades of magnitude (never zeros); optionally a strided row view."""
    rows = torch.randn(m, k + stride_pad, device=DEV) * torch.logspace(-5, 4, m, device=DEV).unsqueeze(-1)
    x = rows.to(torch.bfloat16)
    return x[:, :k] if stride_pad else x


def _mismatch(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() != b.float()).float().mean())


@INTERPRET
@pytest.mark.parametrize("m", [1, 3, 8, MANY])
@pytest.mark.parametrize("k", [96, 1280, 5120])
@pytest.mark.parametrize("fmt", ["fp32", "e8m0"])
def test_act_quant_bit_exact(m, k, fmt):
    from dsflash.plugins.act_quant import act_quant
    x = _x(m, k)
    q, s = act_quant(x, fmt)
    qr, sr = refs.act_quant_ref(x, fmt)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == sr.dtype and s.shape == sr.shape
    assert torch.equal(s.view(torch.uint8) if fmt == "e8m0" else s, sr.view(torch.uint8) if fmt == "e8m0" else sr)
    assert _mismatch(q, qr) == 0.0


@INTERPRET
def test_act_quant_strided_and_3d():
    from dsflash.plugins.act_quant import act_quant, act_quant_dequant
    x = _x(5, 1280, stride_pad=64)
    q, s = act_quant(x)
    qr, sr = refs.act_quant_ref(x)
    assert torch.equal(s, sr) and _mismatch(q, qr) == 0.0
    x3 = _x(6, 256).reshape(2, 3, 256)
    q3, s3 = act_quant(x3)
    assert q3.shape == (2, 3, 256) and s3.shape == (2, 3, 8)
    assert torch.equal(act_quant_dequant(x3), refs.act_fake_quant_ref(x3))


@INTERPRET
@pytest.mark.parametrize("m", [1, 3, 8, MANY])
@pytest.mark.parametrize("k", [1280, 5120])
def test_rmsnorm_act_quant(m, k):
    from dsflash.plugins.act_quant import act_quant_dequant, rmsnorm_act_quant
    x = _x(m, k)
    w = torch.rand(k, device=DEV) + 0.5
    y, q, s = rmsnorm_act_quant(x, w, 1e-6)
    yr, qr, sr = refs.rmsnorm_act_quant_ref(x, w, 1e-6)
    # rsqrt / summation order may flip the last BF16 bit of a few elements, which can move an FP8 code
    assert refs.rel_err(y, yr) < 1e-2 and _mismatch(y, yr) < 1e-2
    assert refs.rel_err(refs.act_dequant_ref(q, s), refs.act_dequant_ref(qr, sr)) < 1e-2
    assert _mismatch(s, sr) < 1e-2
    dq = act_quant_dequant(x, w, 1e-6)
    assert refs.rel_err(dq, refs.act_quant_dequant_ref(x, w, 1e-6)) < 1e-2


@INTERPRET
@pytest.mark.parametrize("m", [1, 3, 8, MANY])
@pytest.mark.parametrize("k", [64, 512, 1280, 5120])
def test_rmsnorm(m, k):
    """dsflash::rmsnorm (the norm plugin): the fused kernel's norm without the quantization, close to rmsnorm_ref and
    to rmsnorm_act_quant's norm output, for BF16 and fp32 activations, a leading batch dim and strided rows (a
    stacked GEMM's column slice, which the norm plugin passes in place). (Not bit-equal to the latter: with the
    quantization compiled out the sum of squares may be reduced in another order, H200: last-bit differences at 4
    of 16 shapes.)"""
    from dsflash.plugins import registry  # noqa: F401  (torch.ops.dsflash)
    from dsflash.plugins.act_quant import rmsnorm_act_quant
    w = torch.rand(k, device=DEV) + 0.5
    for x in (_x(m, k), _x(m, k).float(), _x(2 * m, k).view(2, m, k), _x(m, k, stride_pad=96)):
        y = torch.ops.dsflash.rmsnorm(x, w, 1e-6)
        assert y.dtype == x.dtype and y.shape == x.shape
        for yr in (refs.rmsnorm_ref(x, w, 1e-6), rmsnorm_act_quant(x, w, 1e-6)[0]):
            assert refs.rel_err(y, yr) < 1e-5 if x.dtype == torch.float32 else _mismatch(y, yr) < 1e-2   # last bits


@pytest.mark.parametrize("m", [1, 3, 8, 257])
@pytest.mark.parametrize("ka,kb", [(1280, 512), (64, 128), (96, 4096), (1024, 512)])
def test_rmsnorm_pair(m, ka, kb):
    """dsflash::rmsnorm_pair (an attention's q_norm and kv_norm in one launch) on the two column slices of one
    stacked row, as the wq_a|wkv GEMM writes them: each part as `dsflash::rmsnorm` computes it alone (last bits at
    most) and close to rmsnorm_ref, BF16 and fp32; the same from a CUDA-graph replay."""
    from dsflash.plugins import registry  # noqa: F401  (torch.ops.dsflash)
    wa, wb = torch.rand(ka, device=DEV) + 0.5, torch.rand(kb, device=DEV) + 0.5
    for stacked in (_x(m, ka + kb), _x(m, ka + kb).float()):
        a, b = stacked.split([ka, kb], -1)
        ya, yb = torch.ops.dsflash.rmsnorm_pair(a, wa, b, wb, 1e-6)
        assert ya.shape == a.shape and yb.shape == b.shape and ya.dtype == yb.dtype == a.dtype
        for y, x, w in ((ya, a, wa), (yb, b, wb)):
            for yr in (torch.ops.dsflash.rmsnorm(x, w, 1e-6), refs.rmsnorm_ref(x, w, 1e-6)):
                assert refs.rel_err(y, yr) < 1e-5 if x.dtype == torch.float32 else _mismatch(y, yr) < 1e-2
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ga, gb = torch.ops.dsflash.rmsnorm_pair(a, wa, b, wb, 1e-6)
        stacked.copy_(stacked.flip(0))
        graph.replay()
        torch.cuda.synchronize()
        want = torch.ops.dsflash.rmsnorm_pair(a, wa, b, wb, 1e-6)
        assert torch.equal(ga, want[0]) and torch.equal(gb, want[1])


@INTERPRET
@pytest.mark.parametrize("m", [1, 3, MANY])
@pytest.mark.parametrize("k", [96, 352, 1024, 4096])
@pytest.mark.parametrize("fmt", ["fp32", "e8m0"])
def test_act_quant_128_groups_bit_exact(m, k, fmt):
    """V4's 1×128 groups (96 / 352: a short last group, as the V4 reference pads): codes, scales (one per 32
    columns, a group's repeated), the fused norm, the dequantized and the f16-code forms, bit for bit."""
    from dsflash.plugins.act_quant import act_quant, act_quant_dequant, rmsnorm_act_quant
    x = _x(m, k) * torch.logspace(-2, 2, k, device=DEV).to(torch.bfloat16)
    q, s = act_quant(x, fmt, block=128)
    qr, sr = refs.act_quant_ref(x, fmt, 128)
    assert torch.equal(s.view(torch.uint8) if fmt == "e8m0" else s, sr.view(torch.uint8) if fmt == "e8m0" else sr)
    assert _mismatch(q, qr) == 0.0
    q16, _ = act_quant(x, fmt, codes16=True, block=128)
    assert torch.equal(q16, refs.codes16_ref(qr))
    w = torch.rand(k, device=DEV) + 0.5
    y, q2, s2 = rmsnorm_act_quant(x, w, 1e-6, fmt, block=128)
    # the norm's rsqrt / summation order may flip the last BF16 bit of a few elements (as at 1×32): quantizing the
    # kernel's own norm output is bit-exact, and the dequantized values agree with the reference's
    q2y, s2y = refs.act_quant_ref(y, fmt, 128)
    assert _mismatch(q2, q2y) == 0.0 and torch.equal(s2.view(torch.uint8), s2y.view(torch.uint8))
    yr = refs.rmsnorm_ref(x, w, 1e-6)
    assert _mismatch(y, yr) < 1e-2
    assert refs.rel_err(act_quant_dequant(x, w, 1e-6, block=128), refs.act_quant_dequant_ref(x, w, 1e-6, 128)) < 1e-2
