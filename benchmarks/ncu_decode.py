"""Driver for Nsight Compute profiles of the decode kernels (issue 6): it launches each kernel twice.

- `moe`: the MXFP4 MoE decode GEMVs (w13 + SwiGLU, w2) on one TP8 rank (I 288 -> 320) at M = 3 and 8, default configs
  (`--tc13 S,D`: then also with the tensor-core w13 at S K slices, D chunks in flight).
- `gemm`: the dense FP8 decode GEMM at M = 8 on the TP1 shapes of >= 16 MB with the swap-AB MMA configs the tuner
  picks there (BF16-dequant, 128 K per iteration), and the plain FP8-MMA config for comparison.
- `prefill`: the Gluon large-M FP8 GEMM (`fp8_gemm_gluon`, the config the tuner picked at M = 4096 in session 5) on
  wo_b TP1 and wq_a (results: benchmarks/ncu_prefill_h200.json).
- `moe_sorted`: the MoE's sorted (prefill) path, align + w13 + w2, on one TP8 rank at M = 257 and 1024: the BF16-MMA
  default (16-27 % of copy bandwidth in session 43; `-k 'regex:_moe_align|_moe_w13_kernel|_moe_w2_kernel'`), then
  the sm90 default on FP8 tensor cores (`moe_f8`; `-k 'regex:_f8_kernel'`).

On the H200 machine, from the repo root (results: benchmarks/ncu_decode_h200.json, section "Session 4" of README.md):
    ncu --clock-control none --metrics <list in ncu_decode_h200.json> \
        -k 'regex:_moe_w13|_moe_w2|_fp8_gemm_g32' --csv python3 benchmarks/ncu_decode.py moe
"""
from __future__ import annotations

import argparse
import dataclasses

import torch

from dsflash.plugins import moe as M
from dsflash.plugins import refs, tuning
from dsflash.plugins.fp8_gemm import fp8_gemm

DEV = "cuda"
D, E, TOPK, INTER, IPAD = 5120, 384, 6, 288, 320          # V4.1-Flash, one TP8 rank's expert slice
GEMM_CASES = [(4608, 5120, tuning.GemmConfig(128, 16, 8, 4, 4, swap_ab=True, dequant_bf16=True, kgroups=4)),
              (5120, 8192, tuning.GemmConfig(128, 16, 7, 4, 4, swap_ab=True, dequant_bf16=True, kgroups=4)),
              (32768, 1280, tuning.GemmConfig(128, 16, 1, 4, 4, swap_ab=True, dequant_bf16=True, kgroups=4)),
              (32768, 1280, tuning.GemmConfig(128, 16, 1, 4, 8, swap_ab=True))]


def run_moe(g: torch.Generator, tc13: tuple[int, int] | None = None) -> None:
    gw = (torch.randn(E, D, device=DEV, generator=g) * 0.02).to(torch.bfloat16)
    bias = torch.randn(E, device=DEV, generator=g) * 0.05
    w13_q = torch.randint(-128, 128, (E, 2 * IPAD, D // 2), dtype=torch.int8, device=DEV, generator=g)
    w13_s = torch.randint(117, 124, (E, 2 * IPAD, D // 32), dtype=torch.uint8, device=DEV, generator=g)
    w2_q = torch.randint(-128, 128, (E, D, IPAD // 2), dtype=torch.int8, device=DEV, generator=g)
    w2_s = torch.randint(117, 124, (E, D, IPAD // 32), dtype=torch.uint8, device=DEV, generator=g)
    w13_s, w2_s = w13_s.view(refs.E8M0), w2_s.view(refs.E8M0)
    for m in (3, 8):
        x = (torch.randn(m, D, device=DEV, generator=g) * 2).to(torch.bfloat16)
        cfg = M.default_moe_config(m, TOPK, E, IPAD, D)
        w, ids, xq = M.router(x, gw, bias, TOPK, 1.5, xq_layout=cfg.xq_layout)
        out = torch.zeros(m, D, device=DEV)
        for c in [cfg] + ([dataclasses.replace(cfg, tc13=True, split13=tc13[0], stages=tc13[1])] if tc13 else []):
            for _ in range(2):
                hp = M.gemv_w13(xq, w, ids, w13_q, w13_s, INTER, 10.0, c)
                M.gemv_w2(hp, ids, w2_q, w2_s, out, c)
        torch.cuda.synchronize()


def run_gemm() -> None:
    for n, k, cfg in GEMM_CASES:
        w_q, w_s = refs.quant_weight_fp8_ref(torch.randn(n, k, device=DEV) * 0.02)
        a_q, a_s = refs.act_quant_ref(torch.randn(8, k, device=DEV).to(torch.bfloat16))
        for _ in range(2):
            fp8_gemm(a_q, a_s, w_q, w_s, cfg)
        torch.cuda.synchronize()


def run_moe_sorted(g: torch.Generator) -> None:
    gw = (torch.randn(E, D, device=DEV, generator=g) * 0.02).to(torch.bfloat16)
    bias = torch.randn(E, device=DEV, generator=g) * 0.05
    w13_q, w13_s, w2_q, w2_s = refs.random_mxfp4_experts(E, D, INTER, IPAD, g)
    for m in (257, 1024):
        x = (torch.randn(m, D, device=DEV, generator=g) * 2).to(torch.bfloat16)
        for cfg in (M.default_moe_config(m, TOPK, E, IPAD, D), M.default_moe_config(m, TOPK, E, IPAD, D, arch="sm90")):
            assert not cfg.gemv, cfg.tag()
            w, ids, xq = M.router(x, gw, bias, TOPK, 1.5, xq_layout=cfg.xq_layout)
            for _ in range(2):
                M.moe_experts(xq, w, ids, w13_q, w13_s, w2_q, w2_s, 10.0, INTER, None, cfg)
            torch.cuda.synchronize()


PREFILL_CASES = [(5120, 8192), (1280, 5120)]


def run_prefill() -> None:
    cfg = tuning.GLUON_SPACE[0]
    for n, k in PREFILL_CASES:
        w_q, w_s = refs.quant_weight_fp8_ref(torch.randn(n, k, device=DEV) * 0.02)
        a_q, a_s = refs.act_quant_ref(torch.randn(4096, k, device=DEV).to(torch.bfloat16))
        for _ in range(2):
            fp8_gemm(a_q, a_s, w_q, w_s, cfg)
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("moe", "gemm", "prefill", "moe_sorted"))
    p.add_argument("--tc13", default="", help="moe: also the tensor-core w13 (`moe_tc`) at 'split,depth'")
    a = p.parse_args()
    if a.what == "moe":
        run_moe(torch.Generator(device=DEV).manual_seed(3),
                tuple(int(v) for v in a.tc13.split(",")) if a.tc13 else None)
    elif a.what == "gemm":
        run_gemm()
    elif a.what == "moe_sorted":
        run_moe_sorted(torch.Generator(device=DEV).manual_seed(3))
    else:
        run_prefill()


if __name__ == "__main__":
    main()
