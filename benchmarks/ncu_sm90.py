"""One launch per variant of the CUDA group-32 GEMM (`plugins/fp8_gemm_sm90.py`) at wo_b TP1 (M = 4096, N = 5120,
K = 8192), for Nsight Compute:

    ncu --section WarpStateStats --section SchedulerStats -k regex:fp8_g32 \\
        python3 benchmarks/ncu_sm90.py --variants 2x5,2x5t

(`benchmarks/ncu_sm90_s23_h200.txt` holds the session 23 profiles; variant syntax as in gemm_sm90.py.)
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gemm_sm90 import parse_variants, weight  # noqa: E402

from dsflash.plugins.act_quant import act_quant  # noqa: E402
from dsflash.plugins.fp8_gemm_sm90 import fp8_gemm_sm90, weight_scales_f32  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="2x5,2x5t")
    ap.add_argument("--shape", default="4096,5120,8192", help="M,N,K")
    args = ap.parse_args()
    m, n, k = (int(v) for v in args.shape.split(","))
    gen = torch.Generator(device="cuda").manual_seed(0)
    w, ws = weight(n, k, gen)
    a_q, a_s = act_quant(torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen), "fp32")
    for v in parse_variants(args.variants):
        fp8_gemm_sm90(a_q, a_s, w, weight_scales_f32(ws, v["tma"]), **v)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
