"""The hand-scheduled sm_90a group-32 FP8 GEMM (plugins/fp8_gemm_sm90.py): GPU parity against fp8_gemm_ref at awkward
shapes, and, on any machine with the CUDA toolkit, an offline sm_90a build that must neither spill nor let ptxas
serialise its wgmma pipeline (the kernel's structure exists to avoid both)."""
from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from dsflash.plugins import refs
from dsflash.plugins.fp8_gemm_sm90 import cuda_source, smem_bytes

CONFIGS = [dict(wgs=2, stages=5, group_m=8), dict(wgs=1, stages=4, group_m=16),
           dict(wgs=2, stages=5, group_m=8, bn=96, depth=3, body=3), dict(wgs=1, stages=4, group_m=8, bn=64, depth=4),
           dict(wgs=2, stages=4, group_m=8, body=1), dict(wgs=2, stages=5, group_m=8, tma=True),
           dict(wgs=2, stages=5, group_m=8, body=3, tma=True), dict(wgs=1, stages=5, group_m=8, tma=True)]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs the CUDA toolkit's nvcc (no GPU needed)")
@pytest.mark.parametrize("cfg", CONFIGS)
def test_sm90_kernel_builds_without_spills_or_serialised_mma(tmp_path, cfg):
    src = tmp_path / "k.cu"
    src.write_text(cuda_source(**cfg))
    res = subprocess.run(["nvcc", "-cubin", "-arch=sm_90a", "-std=c++17", "-Xptxas", "-v", "-o",
                          str(tmp_path / "k.cubin"), str(src)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    log = res.stdout + res.stderr
    assert "0 bytes spill stores" in log, log
    assert "C7514" not in log and "C7511" not in log, log   # wgmma serialised by ptxas
    assert smem_bytes(cfg["wgs"], cfg["stages"], cfg.get("bn", 128)) <= 227 * 1024


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 136, 160), (77, 200, 288), (130, 264, 416), (257, 520, 1312),
                                   (300, 4096, 1280), (4096, 576, 5120)])
@pytest.mark.parametrize("cfg", CONFIGS)
def test_sm90_gemm_parity(m, n, k, cfg):
    from dsflash.plugins.act_quant import act_quant
    from dsflash.plugins.fp8_gemm_sm90 import fp8_gemm_sm90, weight_scales_f32
    w = torch.randn(n, k, device="cuda") * 0.02 * torch.logspace(-2, 2, k // 32, device="cuda").repeat_interleave(32)
    w_q, w_s = refs.quant_weight_fp8_ref(w)
    x = (torch.randn(m, k, device="cuda") * torch.logspace(-3, 3, m, device="cuda").unsqueeze(-1)).to(torch.bfloat16)
    a_q, a_s = act_quant(x, "fp32")
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")   # poisoned
    fp8_gemm_sm90(a_q, a_s, w_q, weight_scales_f32(w_s, cfg.get("tma", False)), out=out, **cfg)
    assert refs.rel_err(out, refs.fp8_gemm_ref(a_q, a_s, w_q, w_s, torch.float32)) < 1e-2
