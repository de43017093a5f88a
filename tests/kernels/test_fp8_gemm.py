"""GPU parity of the group-32 FP8 GEMM (every tuning candidate) and the BF16-cache path against fp8_gemm_ref."""
from __future__ import annotations

import pytest
import torch

from dsflash.plugins import refs, tuning

pytestmark = pytest.mark.gpu
DEV = "cuda" if torch.cuda.is_available() else "cpu"   # "cpu": under TRITON_INTERPRET=1 (conftest)


def _operands(m: int, n: int, k: int, a_fmt: str = "fp32"):
    w = torch.randn(n, k, device=DEV) * 0.02 * torch.logspace(-2, 2, k // 32, device=DEV).repeat_interleave(32)
    w_q, w_s = refs.quant_weight_fp8_ref(w)
    x = (torch.randn(m, k, device=DEV) * torch.logspace(-3, 3, m, device=DEV).unsqueeze(-1)).to(torch.bfloat16)
    a_q, a_s = refs.act_quant_ref(x, a_fmt)
    return x, a_q, a_s, w_q, w_s


def _mnk_cases(ns_ks: list[tuple[int, int]], interpret: set[tuple[int, int, int]]) -> list:
    """(m, n, k) for M = 1, 3, 8, 64, 257 and each (n, k); those in `interpret` also run on the CPU under Triton's
    interpreter (`make test`), their Triton candidates only."""
    return [pytest.param(m, n, k, marks=pytest.mark.interpret) if (m, n, k) in interpret else (m, n, k)
            for m in [1, 3, 8, 64, 257] for n, k in ns_ks]


@pytest.mark.parametrize("m,n,k", _mnk_cases([(256, 512), (4096, 1280), (5120, 288), (576, 5120)],
                                              {(3, 256, 512), (64, 256, 512)}))
def test_fp8_gemm_all_candidates(m, n, k):
    from dsflash.plugins.fp8_gemm import fp8_gemm, tile_weight
    from dsflash.plugins.kernel_device import interpreting
    _, a_q, a_s, w_q, w_s = _operands(m, n, k)
    ref = refs.fp8_gemm_ref(a_q, a_s, w_q, w_s, torch.float32)
    for cfg in tuning.candidates(n, k, m):
        if interpreting() and (cfg.gluon or cfg.sm90):   # Gluon and the sm90 CUDA kernel need the GPU
            continue
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEV)   # poisoned
        a_in = refs.codes16_ref(a_q) if cfg.acc16 else a_q   # acc16 GEMVs read f16 codes
        fp8_gemm(a_in, a_s, w_q, w_s, cfg, out=out, w_tiled=tile_weight(w_q, cfg) if cfg.tiled_w else None)
        err = refs.rel_err(out, ref)
        assert err < 1e-2, (cfg.tag(), err)


@pytest.mark.parametrize("m", [1, 8, 257])
def test_fp8_gemm_e8m0_and_strided_activations(m):
    from dsflash.plugins.fp8_gemm import fp8_gemm
    n, k = 1024, 1280
    x, a_q, a_s, w_q, w_s = _operands(m, n, k, "e8m0")
    ref = refs.fp8_gemm_ref(a_q, a_s, w_q, w_s, torch.float32)
    assert refs.rel_err(fp8_gemm(a_q, a_s, w_q, w_s), ref) < 1e-2
    big = torch.empty(m, k + 64, dtype=torch.float8_e4m3fn, device=DEV)
    big[:, :k] = a_q
    assert refs.rel_err(fp8_gemm(big[:, :k], a_s, w_q, w_s), ref) < 1e-2
    # e8m0 scales in rows that are not 4-byte aligned: the decode kernel reads them byte by byte, not as words
    odd_s = torch.empty(m, k // 32 + 1, dtype=a_s.dtype, device=DEV)[:, 1:]
    odd_s.copy_(a_s)
    # the Gluon kernels' e8m0-activation and strided-A paths
    for cfg in tuning.GLUON_SPACE if m > 64 else tuning.gluon_decode_candidates(n, k) if m <= 8 else ():
        out = fp8_gemm(big[:, :k], a_s, w_q, w_s, cfg)
        assert refs.rel_err(out, ref) < 1e-2, cfg.tag()
        if m <= 8:
            assert torch.equal(fp8_gemm(a_q, odd_s, w_q, w_s, cfg), out), cfg.tag()


@pytest.mark.parametrize("m,n", [(4096, 1056), (130, 4096), (65, 288), (1, 1056), (2, 4096), (3, 4096),
                                 (8, 288)])
def test_fp8_gemm_gluon_tails(m, n):
    """Row and column tails of the Gluon kernels: N not a multiple of the tile, M one past a tile (or fewer tokens
    than the decode tile's 8: split-K workspaces of 1, 2, 4 and 8 token columns), K = 2304 (a partial last stage)."""
    from dsflash.plugins.fp8_gemm import fp8_gemm
    _, a_q, a_s, w_q, w_s = _operands(m, n, 2304)
    ref = refs.fp8_gemm_ref(a_q, a_s, w_q, w_s, torch.float32)
    cfgs = tuning.GLUON_SPACE if m > 8 else tuning.gluon_decode_candidates(n, 2304) + [
        tuning.GemmConfig(64, 8, 3, 4, 2, swap_ab=True, kgroups=1, gluon=True)]
    for cfg in cfgs:
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEV)
        fp8_gemm(a_q, a_s, w_q, w_s, cfg, out=out)
        assert refs.rel_err(out, ref) < 1e-2, cfg.tag()


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("n,k", [(1056, 2304), (4096, 1280), (576, 5120)])
def test_gluon_decode_quantizes_in_kernel_as_act_quant(m, n, k):
    """fp8_linear_gluon_decode(x) (the activation quantized per 1×32 inside the decode kernel) equals act_quant then
    the same kernel, for every decode candidate and on a strided x; fp8_linear takes that path for a tuned
    quant_in_kernel config (and the two-launch path for a misaligned x)."""
    from dsflash.plugins import registry  # noqa: F401  (torch.ops.dsflash)
    from dsflash.plugins.act_quant import act_quant
    from dsflash.plugins.fp8_gemm import fp8_gemm
    from dsflash.plugins.fp8_gemm_gluon import fp8_linear_gluon_decode
    x, _, _, w_q, w_s = _operands(m, n, k)
    big = torch.empty(m, k + 64, dtype=torch.bfloat16, device=DEV)
    big[:, :k] = x
    ref = refs.fp8_gemm_ref(*refs.act_quant_ref(x), w_q, w_s, torch.float32)
    cands = [c for c in tuning.gluon_decode_candidates(n, k) if c.quant_in_kernel]
    for cfg in cands:
        two = fp8_gemm(*act_quant(x, "e8m0"), w_q, w_s, cfg)
        for xin in (x, big[:, :k]):
            out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEV)
            fp8_linear_gluon_decode(xin, w_q, w_s, cfg, out=out)
            assert refs.rel_err(out, ref) < 1e-2, cfg.tag()
            assert refs.rel_err(out, two) <= 1e-6, cfg.tag()     # same codes and scales: one rounding at most
    key = tuning.key_str(n, k, tuning.m_bucket(m))
    tuning.set_table({key: {"path": "fp8", "config": cands[0].to_dict()}})
    try:
        via_op = torch.ops.dsflash.fp8_linear(x, w_q, w_s)
        assert refs.rel_err(via_op, fp8_linear_gluon_decode(x, w_q, w_s, cands[0])) <= 1e-6
        odd = torch.empty(m * k + 1, dtype=torch.bfloat16, device=DEV)[1:].view(m, k)   # 2-byte aligned: no TMA
        odd.copy_(x)
        assert refs.rel_err(torch.ops.dsflash.fp8_linear(odd, w_q, w_s), via_op) <= 1e-6
    finally:
        tuning.set_table(None)


@pytest.mark.parametrize("m", [1, 3, 257])
def test_bf16_cache_gemm(m):
    from dsflash.plugins.act_quant import act_quant
    from dsflash.plugins.fp8_gemm import bf16_cache_gemm, bf16_cache_weight
    n, k = 768, 1280
    x, _, _, w_q, w_s = _operands(m, n, k)
    a_q, a_s = act_quant(x)
    ref = refs.fp8_gemm_ref(a_q, a_s, w_q, w_s, torch.float32)
    w16 = bf16_cache_weight(w_q, w_s)
    assert refs.rel_err(bf16_cache_gemm(x, w16), ref) < 1e-2
    assert refs.rel_err(bf16_cache_gemm(x, w16), refs.bf16_cache_gemm_ref(x, w16)) < 1e-2


def test_registry_ops_on_gpu():
    from dsflash.plugins import registry  # noqa: F401
    x, a_q, a_s, w_q, w_s = _operands(3, 256, 512)
    out = torch.ops.dsflash.fp8_gemm(a_q, a_s, w_q, w_s)
    assert refs.rel_err(out, refs.fp8_gemm_ref(a_q, a_s, w_q, w_s, torch.float32)) < 1e-2
    q, s = torch.ops.dsflash.act_quant(x)
    assert torch.equal(s, a_s)


# -- V4: 1×128 activation groups and 128×128 weight blocks, in the kernels' 32-block scale format -------------------
def _v4_operands(m: int, n: int, k: int):
    w = torch.randn(n, k, device=DEV) * 0.02 * torch.logspace(-2, 2, -(-k // 128), device=DEV).repeat_interleave(128)[:k]
    w_q, w_s = refs.quant_weight_fp8_ref(w, 128)
    x = (torch.randn(m, k, device=DEV) * torch.logspace(-3, 3, m, device=DEV).unsqueeze(-1)).to(torch.bfloat16)
    a_q, a_s = refs.act_quant_ref(x, "e8m0", 128)
    return x, a_q, a_s, w_q, w_s


@pytest.mark.parametrize("m,n,k", _mnk_cases([(4096, 1024), (512, 4096), (4096, 256), (200, 96)],
                                              {(3, 200, 96), (64, 200, 96)}))
def test_fp8_gemm_v4_groups_all_candidates(m, n, k):
    """Every candidate of a V4 shape (TP8 wq_b, TP8 shared w1|w3, TP8 shared w2, a ragged tiny width), among them
    the FP8-MMA tiles promoted once per 64 / 128 K, against the reference on V4 operands (the tiny width's Triton
    candidates also under the interpreter)."""
    from dsflash.plugins.fp8_gemm import fp8_gemm, tile_weight
    from dsflash.plugins.kernel_device import interpreting
    _, a_q, a_s, w_q, w_s = _v4_operands(m, n, k)
    ref = refs.fp8_gemm_ref(a_q, a_s, w_q, w_s, torch.float32)
    cands = tuning.candidates(n, k, m, 128)
    assert any(c.promotes_every == 128 for c in cands)
    for cfg in cands:
        if interpreting() and (cfg.gluon or cfg.sm90):   # Gluon and the sm90 CUDA kernel need the GPU
            continue
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEV)
        a_in = refs.codes16_ref(a_q) if cfg.acc16 else a_q
        fp8_gemm(a_in, a_s, w_q, w_s, cfg, out=out, w_tiled=tile_weight(w_q, cfg) if cfg.tiled_w else None, group=128)
        assert refs.rel_err(out, ref) < 1e-2, (cfg.tag(), refs.rel_err(out, ref))


@pytest.mark.parametrize("m,n,k", [(4096, 4096, 1024), (4096, 1056, 2304), (130, 512, 4096)])
def test_fp8_gemm_gluon_v4_promotes_per_128(m, n, k):
    """The Gluon large-M kernel with group 128 (one 128-deep MMA and one fold per stage) matches the reference, and a
    per-128 config is refused on group-32 scales (it would be silently wrong)."""
    from dsflash.plugins.fp8_gemm import fp8_gemm
    _, a_q, a_s, w_q, w_s = _v4_operands(m, n, k)
    ref = refs.fp8_gemm_ref(a_q, a_s, w_q, w_s, torch.float32)
    for cfg in list(tuning.GLUON_SPACE) + [tuning.default_config(n, k, m, group=128)]:
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEV)
        fp8_gemm(a_q, a_s, w_q, w_s, cfg, out=out, group=128)
        assert refs.rel_err(out, ref) < 1e-2, cfg.tag()
    with pytest.raises(AssertionError, match="promotes every 128"):
        fp8_gemm(a_q, a_s, w_q, w_s, tuning.default_config(n, k, m, group=128))


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("n,k", [(4096, 1024), (512, 4096)])
def test_v4_linear_decode_and_bf16_cache(m, n, k):
    """fp8_linear with act_block 128: the Gluon decode kernel quantizing per 1×128 in the kernel equals act_quant
    (block 128) then the same kernel; the BF16-cache path and the op's default config match the reference."""
    from dsflash.plugins import registry  # noqa: F401
    from dsflash.plugins.act_quant import act_quant
    from dsflash.plugins.fp8_gemm import bf16_cache_gemm, bf16_cache_weight, fp8_gemm
    from dsflash.plugins.fp8_gemm_gluon import fp8_linear_gluon_decode
    x, a_q, a_s, w_q, w_s = _v4_operands(m, n, k)
    ref = refs.fp8_gemm_ref(a_q, a_s, w_q, w_s, torch.float32)
    for cfg in [c for c in tuning.gluon_decode_candidates(n, k) if c.quant_in_kernel][:4]:
        one = fp8_linear_gluon_decode(x, w_q, w_s, cfg, act_block=128)
        two = fp8_gemm(*act_quant(x, "e8m0", block=128), w_q, w_s, cfg, group=128)
        assert refs.rel_err(one, ref) < 1e-2 and refs.rel_err(one, two) <= 1e-6, cfg.tag()
    assert refs.rel_err(bf16_cache_gemm(x, bf16_cache_weight(w_q, w_s), act_block=128), ref) < 1e-2
    assert refs.rel_err(torch.ops.dsflash.fp8_linear(x, w_q, w_s, None, 128), ref) < 1e-2
