"""Programmatic dependent launch in the decode linear chain (H200): producer → FP8 activation quantization → Gluon
decode GEMM, as `dsflash::fp8_linear` runs it, timed per chain with and without PDL on the GEMM.

Each chain starts with a plain (non-PDL) producer writing the activation, as attention or mHC does in the engine,
so the GEMM can overlap only what follows it. Cases: off (GEMM without PDL) and gemm (GEMM with PDL: its weight ring
is requested before it waits for the quantization). Each case takes the fastest Gluon decode candidate of the rings
in RINGS. Prints a table, writes JSON. (`decode_chain_pdl_s6_h200.json` also holds a third case, "both", from a
variant that launched the quantization with PDL too; it gained nothing and was not kept.)

    python3 benchmarks/decode_chain_pdl.py --out decode_chain_pdl.json [--ms 1,4,8]
"""
from __future__ import annotations

import argparse
import json

import torch

from dsflash.plugins import refs, tuning
from dsflash.plugins.act_quant import act_quant
from dsflash.plugins.fp8_gemm import fp8_gemm
from dsflash.plugins.timing import graph_time_us, input_sets

DEV = "cuda"
SHAPES = [("wq_b[tp8]", 4096, 1280), ("wo_b[tp8]", 5120, 1024), ("shexp_w13[tp8]", 576, 5120),
          ("wo_b[tp1]", 5120, 8192)]
RINGS = {(1, 3), (2, 2), (4, 2)}   # the rings the build chose for these shapes (gemm_decode_s6_h200.json)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="4")
    args = ap.parse_args()
    rows = []
    for name, n, k in SHAPES:
        n_sets = input_sets(n * k)
        ws = [refs.quant_weight_fp8_ref(torch.randn(n, k, device=DEV) * 0.02) for _ in range(n_sets)]
        for m in [int(v) for v in args.ms.split(",")]:
            src = [(torch.randn(m, k, device=DEV) * 2).to(torch.bfloat16) for _ in range(n_sets)]
            xs = [torch.empty_like(s) for s in src]
            ref = refs.fp8_gemm_ref(*refs.act_quant_ref(src[0]), *ws[0], torch.float32)
            row = {"shape": f"{name} {n}x{k}", "M": m}
            for case in ("off", "gemm"):
                best = None
                for cfg in tuning.gluon_decode_candidates(n, k):
                    if cfg.pdl != (case != "off") or (cfg.kgroups, cfg.num_stages) not in RINGS:
                        continue

                    def chain(i, c=cfg):
                        xs[i].copy_(src[i])                                    # the producer: no PDL
                        return fp8_gemm(*act_quant(xs[i], "e8m0"), *ws[i], c)
                    err = refs.rel_err(chain(0), ref)
                    us, _ = graph_time_us([lambda i=i, f=chain: f(i) for i in range(n_sets)])
                    if best is None or us < best[0]:
                        best = (us, cfg.tag(), err)
                row[case] = {"us": best[0], "config": best[1], "err": best[2]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"{'shape':<26} {'M':>2} {'off µs':>7} {'gemm µs':>8} {'gemm vs off':>11}")
    for r in rows:
        print(f"{r['shape']:<26} {r['M']:>2} {r['off']['us']:>7.2f} {r['gemm']['us']:>8.2f} "
              f"{r['off']['us'] / r['gemm']['us']:>10.2f}×")
    with open(args.out, "w") as f:
        json.dump({"machine": torch.cuda.get_device_name(), "rows": rows,
                   "cases": {"off": "no PDL", "gemm": "GEMM with PDL"}},
                  f, indent=1)


if __name__ == "__main__":
    main()
