"""The decode linear chain on the H200, as `dsflash::fp8_linear` runs it: a producer writes the activation, then
the FP8 1×32 quantization and the Gluon decode GEMM (two launches), or the GEMM quantizing in-kernel (one launch).

Each chain starts with a plain (non-PDL) producer, as attention or mHC does in the engine. Cases:
  off   - quantization, then the GEMM without PDL;
  gemm  - quantization, then the GEMM with PDL (its weight ring is requested before it waits for the quantization);
  fused - the GEMM quantizes the activation itself (`quant_in_kernel` configs, with or without PDL, whichever is
          faster): one launch.
Each case takes the fastest Gluon decode candidate of the rings in RINGS, run as `dsflash::fp8_linear` runs it
(`registry.fp8_linear_config`). Prints a table, writes JSON.
(`decode_chain_pdl_s6_h200.json` holds an earlier run with a third case, "both", from a variant that launched the
quantization with PDL too; it gained nothing and was not kept.)

    python3 benchmarks/decode_chain.py --out decode_chain.json [--ms 1,4,8]
"""
from __future__ import annotations

import argparse
import json

import torch

from dsflash.plugins import refs, tuning
from dsflash.plugins.registry import fp8_linear_config
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
            for case in ("off", "gemm", "fused"):
                best = None
                for cfg in tuning.gluon_decode_candidates(n, k):
                    if (cfg.quant_in_kernel != (case == "fused") or (case != "fused" and cfg.pdl != (case == "gemm"))
                            or (cfg.kgroups, cfg.num_stages) not in RINGS):
                        continue

                    def chain(i, c=cfg):
                        xs[i].copy_(src[i])                                    # the producer: no PDL
                        return fp8_linear_config(xs[i], *ws[i], c)
                    err = refs.rel_err(chain(0), ref)
                    us, _ = graph_time_us([lambda i=i, f=chain: f(i) for i in range(n_sets)])
                    if best is None or us < best[0]:
                        best = (us, cfg.tag(), err)
                row[case] = {"us": best[0], "config": best[1], "err": best[2]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"{'shape':<26} {'M':>2} {'off µs':>7} {'gemm µs':>8} {'fused µs':>9} {'fused vs off':>12}")
    for r in rows:
        print(f"{r['shape']:<26} {r['M']:>2} {r['off']['us']:>7.2f} {r['gemm']['us']:>8.2f} "
              f"{r['fused']['us']:>9.2f} {r['off']['us'] / r['fused']['us']:>11.2f}×")
    with open(args.out, "w") as f:
        json.dump({"machine": torch.cuda.get_device_name(), "rows": rows,
                   "cases": {"off": "quantization + GEMM, no PDL", "gemm": "quantization + GEMM with PDL",
                             "fused": "GEMM quantizing in-kernel"}},
                  f, indent=1)


if __name__ == "__main__":
    main()
