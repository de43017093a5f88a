"""CPU checks of the plugins' plain-PyTorch references and op registry (no Triton, no GPU needed).

The refs must equal the model's numerics (`model_def.quant`, `model_def.layers`) exactly where those define them.
"""
from __future__ import annotations

import pytest
import torch

from dsflash.model_def import layers, quant
from dsflash.plugins import refs, tuning


def _rand(*shape, dtype=torch.bfloat16, scale=1.0, gen=None):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


@pytest.mark.parametrize("shape", [(1, 64), (3, 1280), (5, 96)])
def test_act_quant_ref_equals_model_fake_quant(seed, shape):
    x = _rand(*shape) * torch.logspace(-6, 3, shape[0]).unsqueeze(-1).to(torch.bfloat16)
    q, s = refs.act_quant_ref(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (shape[0], shape[1] // 32)
    deq = refs.act_dequant_ref(q, s, torch.float32)
    assert torch.equal(deq, quant.fake_quant_fp8(x.float(), 32))
    assert torch.equal(refs.act_fake_quant_ref(x), quant.fake_quant_fp8(x, 32))
    q8, s8 = refs.act_quant_ref(x, "e8m0")
    assert torch.equal(q8.float(), q.float()) and torch.equal(quant.e8m0_decode(s8), s)


@pytest.mark.parametrize("shape", [(1, 128), (3, 1024), (5, 96), (2, 352)])
def test_act_quant_ref_128_groups_equal_v4_fake_quant(seed, shape):
    """V4's 1×128 groups (ragged widths: one short last group, as the V4 model pads) in the kernels' format: one scale
    per 32 columns, a group's scale repeated; different from 1×32 wherever a group's blocks differ."""
    from dsflash.model_def.v4 import _fq_fp8
    x = _rand(*shape) * torch.logspace(-3, 3, shape[1]).to(torch.bfloat16)
    q, s = refs.act_quant_ref(x, block=128)
    assert s.shape == (shape[0], shape[1] // 32)
    assert torch.equal(refs.act_dequant_ref(q, s, torch.float32), _fq_fp8(x.float(), 128))
    assert torch.equal(refs.act_fake_quant_ref(x, 128), _fq_fp8(x, 128))
    assert torch.equal(s.view(shape[0], -1)[:, ::4].repeat_interleave(4, -1)[:, :s.shape[1]], s)
    assert not torch.equal(s, refs.act_quant_ref(x)[1])
    y, q2, s2 = refs.rmsnorm_act_quant_ref(x, torch.ones(shape[1]), 1e-6, "e8m0", 128)
    assert torch.equal(refs.act_dequant_ref(q2, s2, torch.float32), _fq_fp8(y.float(), 128))


@pytest.mark.parametrize("n,k", [(256, 384), (200, 96), (96, 160)])
def test_v4_weight_scales_expand_to_the_32_format(seed, n, k):
    """128×128 scales (ragged edges) expanded to 32×32 dequantize exactly as the V4 checkpoint does, and the FP8
    linear op with act_block 128 equals the V4 deploy linear."""
    from dsflash.model_def.v4 import _RaggedNumerics
    from dsflash.plugins import registry  # noqa: F401
    w = torch.randn(n, k) * 0.05
    q, s128 = quant.quant_fp8_block(w, 128)
    s32 = refs.expand_weight_scales(s128, n, k, 128)
    assert s32.shape == (-(-n // 32), k // 32) and s32.dtype == refs.E8M0
    assert torch.equal(refs.dequant_weight_ref(q, s32), quant.dequant_fp8_block(q, s128, 128))
    rq, rs = refs.quant_weight_fp8_ref(w, 128)
    assert torch.equal(rq.float(), q.float()) and torch.equal(rs.view(torch.uint8), s32.view(torch.uint8))
    x = _rand(3, k) * torch.logspace(-2, 2, k).to(torch.bfloat16)
    lin = layers.Linear(k, n, _RaggedNumerics("deploy", 128), quant="fp8")
    lin.weight.data.copy_(refs.dequant_weight_ref(q, s32))
    with torch.no_grad():
        want = lin(x.float())
    got = torch.ops.dsflash.fp8_linear(x, q, s32, None, 128).float()
    torch.testing.assert_close(got, want.to(torch.bfloat16).float(), rtol=0, atol=0)
    wrong = torch.ops.dsflash.fp8_linear(x, q, s32, None, 32).float()
    assert refs.rel_err(wrong, want) > 1e-3   # the group size is seen at these magnitudes


def test_integer_scale_exponent_matches_division():
    """The kernels' e = exp(amax) - 8 + [mantissa > 1.75] equals pow2_ceil(max(amax,1e-4)/448) (fp32 division)."""
    g = torch.Generator().manual_seed(1)
    bits = torch.randint(0, 2 ** 31 - 1, (200000,), generator=g, dtype=torch.int64).to(torch.int32)
    a = bits.view(torch.float32).abs()
    a = a[torch.isfinite(a)]
    edge = torch.tensor([1e-4, 448.0, 448.0 * 2 ** -20, 7.0, 1.75, 3.5, 1.0, 2.0, 0.0, 3e38], dtype=torch.float32)
    near = torch.cat([torch.nextafter(edge, torch.tensor(float("inf"))), torch.nextafter(edge, torch.tensor(0.0))])
    a = torch.cat([a, edge, near.abs()])
    amax = torch.clamp(a, min=1e-4)
    b = amax.view(torch.int32)
    e = ((b >> 23) & 0xFF) - 135 + ((b & 0x7FFFFF) > 0x600000).to(torch.int32)
    ref = quant.pow2_scale(a, 448.0, 1e-4)
    assert torch.equal(torch.ldexp(torch.ones_like(amax), e), ref)


def test_rmsnorm_act_quant_ref(seed):
    x = _rand(4, 1280)
    w = torch.rand(1280) + 0.5
    y, q, s = refs.rmsnorm_act_quant_ref(x, w, 1e-6)
    norm = layers.RMSNorm(1280, 1e-6)
    norm.weight.data.copy_(w)
    y_model = norm(x)
    assert torch.equal(y, y_model)
    assert torch.equal(refs.act_dequant_ref(q, s, torch.bfloat16), layers.Numerics("deploy").act_in(y_model, True))
    assert torch.equal(refs.act_quant_dequant_ref(x, w, 1e-6), layers.Numerics("deploy").act_in(y_model, True))


def test_fp8_gemm_ref_equals_dequant_linear(seed):
    m, n, k = 3, 96, 160
    w = torch.randn(n, k) * 0.05
    w_q, w_s = refs.quant_weight_fp8_ref(w)
    wq2, ws2 = quant.quant_fp8_block(w, 32)
    assert torch.equal(w_q.float(), wq2.float()) and torch.equal(w_s.view(torch.uint8), ws2.view(torch.uint8))
    w_deq = quant.dequant_fp8_block(w_q, w_s, 32)
    assert torch.equal(refs.dequant_weight_ref(w_q, w_s), w_deq)
    x = _rand(m, k)
    a_q, a_s = refs.act_quant_ref(x)
    y = refs.fp8_gemm_ref(a_q, a_s, w_q, w_s, torch.float32)
    lin = layers.Linear(k, n, layers.Numerics("deploy"), quant="fp8")
    lin.weight.data.copy_(w_deq)
    torch.testing.assert_close(y, lin(x.float()), rtol=1e-5, atol=1e-5)
    y16 = refs.bf16_cache_gemm_ref(x, w_deq.to(torch.bfloat16)).float()
    assert refs.rel_err(y16, y) < 1e-2


def test_hc_refs_equal_model_layers(seed):
    t, d = 3, 64
    X = _rand(t, 4, d)
    fn = torch.randn(24, 4 * d) * 0.1
    base, scale = torch.randn(24) * 0.1, torch.rand(3) + 0.5
    got = refs.hc_mix_ref(X.flatten(1), fn, base, scale, 4, 20, 1e-6, 1e-20)
    want = layers.hc_mix(X.flatten(1), fn, base, scale, 4, 20, 1e-6, 1e-20)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    pre, post, comb = got
    w = torch.rand(d) + 0.5
    norm = layers.RMSNorm(d, 1e-20)
    norm.weight.data.copy_(w)
    y_model = norm(layers.hc_collapse(X, pre))
    assert torch.equal(refs.hc_pre_ref(X, pre, w, 1e-20), y_model)
    y, q, s = refs.hc_pre_ref(X, pre, w, 1e-20, quant=True)
    assert torch.equal(refs.act_dequant_ref(q, s), quant.fake_quant_fp8(y_model, 32))
    fx = _rand(t, d)
    Xn = refs.hc_post_ref(X, fx, post, comb)
    assert torch.equal(Xn, layers.hc_expand(X, fx, post, comb))
    Xn2, y2 = refs.hc_post_ref(X, fx, post, comb, pre, w, 1e-20)
    assert torch.equal(Xn2, Xn) and torch.equal(y2, norm(layers.hc_collapse(Xn, pre)))


def test_hc_split_weight_is_fp32_exact_enough():
    fn = torch.randn(24, 512) * 0.02
    h = refs.hc_split_weight(fn)
    assert h.shape == (3, 32, 512) and h.dtype == torch.bfloat16
    recon = h.float().sum(0)
    assert torch.all(recon[24:] == 0)
    assert (recon[:24] - fn).abs().max() <= fn.abs().max() * 2 ** -22


@pytest.mark.parametrize("n,k", [(5120, 8192), (32768, 1280), (5120, 288), (576, 5120)])
@pytest.mark.parametrize("m", [1, 3, 8, 64, 257, 4096])
@pytest.mark.parametrize("group", [32, 128])
def test_tuning_defaults_are_valid(n, k, m, group):
    cands = tuning.candidates(n, k, m, group)
    assert cands[0] == tuning.default_config(n, k, m, group=group)
    for c in cands:
        assert tuning.GemmConfig.from_dict(c.to_dict()) == c
        assert c.split_k <= k // 32 and group % c.promotes_every == 0
        if m <= 64:
            assert c.swap_ab and c.block_q >= m
    # V4's 128-groups add FP8-MMA tiles promoted once per 64 / 128 K
    assert any(c.promotes_every > 32 for c in cands) == (group == 128)


def test_tuning_table_lookup_and_fallback(caplog):
    cfg = tuning.GemmConfig(64, 16, 2, 4, 10, swap_ab=True)
    tuning.set_table({tuning.key_str(5120, 8192, 1): {"path": "fp8", "config": cfg.to_dict()},
                      tuning.key_str(5120, 8192, 4096): {"path": "bf16cache", "config": {}}})
    try:
        assert tuning.lookup(5120, 8192, 1) == ("fp8", cfg)
        assert tuning.lookup(5120, 8192, 5000)[0] == "bf16cache"
        with caplog.at_level("WARNING"):
            tuning.lookup(5120, 8192, 8)
            tuning.lookup(5120, 8192, 7)   # same bucket: logged once
        assert sum("no tuned entry" in r.message for r in caplog.records) == 1
    finally:
        tuning.set_table(None)


def test_registry_cpu_ops_and_fakes(seed):
    from dsflash.plugins import registry  # noqa: F401
    ops = torch.ops.dsflash
    x = _rand(3, 64)
    w = torch.rand(64) + 0.5
    q, s = ops.act_quant(x)
    assert torch.equal(q.float(), refs.act_quant_ref(x)[0].float())
    y, q2, s2 = ops.rmsnorm_act_quant(x, w, 1e-6, True)
    assert s2.dtype == refs.E8M0
    wq, ws = refs.quant_weight_fp8_ref(torch.randn(32, 64) * 0.1)
    out = ops.fp8_gemm(q, s, wq, ws)
    assert out.shape == (3, 32) and out.dtype == torch.bfloat16
    X = _rand(2, 4, 64)
    fn = torch.randn(24, 256) * 0.1
    pre, post, comb = ops.hc_mix(X.flatten(1), fn, refs.hc_split_weight(fn), torch.zeros(24), torch.ones(3), 20,
                                 1e-6, 1e-20)
    Xn, yy, qq, ss = ops.hc_post_pre_quant(X, _rand(2, 64), post, comb, pre, w, 1e-20)
    assert Xn.shape == X.shape and qq.shape == (2, 64) and ss.shape == (2, 2)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        fx = torch.empty(5, 4, 128, dtype=torch.bfloat16)
        fy, fq, fs = ops.hc_pre_quant(fx, torch.empty(5, 4), torch.empty(128), 1e-20)
        assert fy.shape == (5, 128) and fq.dtype == refs.E4M3 and fs.shape == (5, 4)
        fo = ops.fp8_gemm(torch.empty(5, 128, dtype=refs.E4M3), torch.empty(5, 4), torch.empty(64, 128, dtype=refs.E4M3),
                          torch.empty(2, 4, dtype=refs.E8M0))
        assert fo.shape == (5, 64) and fo.dtype == torch.bfloat16


def test_plugins_package_imports_no_triton_and_no_other_dsflash_package():
    import ast
    import pathlib
    root = pathlib.Path(refs.__file__).parent
    for name in ("refs.py", "tuning.py", "registry.py", "__init__.py"):
        tree = ast.parse((root / name).read_text())
        mods = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.col_offset == 0]
        mods += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) and n.col_offset == 0 for a in n.names]
        assert not any(m and m.startswith("triton") for m in mods), (name, mods)
    for path in root.glob("*.py"):
        tree = ast.parse(path.read_text())
        for n in ast.walk(tree):
            mod = n.module if isinstance(n, ast.ImportFrom) else None
            if mod and mod.startswith("dsflash.") and not mod.startswith("dsflash.plugins"):
                raise AssertionError(f"{path.name} imports {mod}")
