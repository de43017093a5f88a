"""Config sweep of the Gluon decode FP8 GEMM (H200): boxes per stage × ring depth × split-K at the V4.1-Flash dense
decode shapes whose weights are >= 16 MB, against a copy moving the same bytes (the practical floor at that size)
and against what `tuning.gluon_decode_candidates` offers the build. Prints the best configs per (shape, M) with %
of the measured copy bandwidth and writes every timing as JSON.

    python3 benchmarks/gemm_decode_sweep.py --out gemm_decode_sweep.json [--ms 4,8] [--space grid|offered]

GPU only; the candidate space in `plugins/tuning.py` follows from this file's output.
"""
from __future__ import annotations

import argparse
import itertools
import json
import time

import torch

from dsflash.plugins import refs, tuning
from dsflash.plugins.bench import GEMM_SHAPES, measure_ceilings
from dsflash.plugins.fp8_gemm import fp8_gemm
from dsflash.plugins.tuning import k_slices
from dsflash.plugins.timing import graph_time_us, input_sets

DEV = "cuda"
BIG = 16e6


def _grid(n: int, k: int, space: str) -> list[tuning.GemmConfig]:
    if space == "offered":
        return [c for c in tuning.gluon_decode_candidates(n, k) if not c.quant_in_kernel]   # GEMM alone here
    out = []
    for boxes, stages, split in itertools.product((1, 2, 4), (2, 3, 4, 5, 6, 8), (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)):
        n_st = -(-k // (tuning.GLUON_BLOCK_K * boxes))
        if tuning.gluon_decode_smem(boxes, stages) > tuning.SMEM_PER_CTA or k_slices(n_st, split) != split:
            continue
        if -(-n_st // split) < stages // 2:      # a ring much deeper than the slice: same as a shallower one
            continue
        out.append(tuning.GemmConfig(64, 8, split, 4, stages, swap_ab=True, kgroups=boxes, gluon=True))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="4,8")
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--space", choices=("grid", "offered"), default="grid",
                    help="grid: rings × splits (no PDL); offered: what the build times (with and without PDL)")
    args = ap.parse_args()
    t_end = time.time() + args.budget_s
    ceil = measure_ceilings()
    bw = ceil["copy_GBps"] * 1e3          # bytes per µs
    rows, summary = [], []
    for name, n, k, tp in GEMM_SHAPES:
        nb_w = n * k + (n // 32) * (k // 32)
        if nb_w < BIG:
            continue
        n_sets = input_sets(nb_w)
        ws = [refs.quant_weight_fp8_ref(torch.randn(n, k, device=DEV) * 0.02) for _ in range(n_sets)]
        # floor: a device copy moving the weight's bytes (nb_w / 2 read + nb_w / 2 written)
        src = [torch.empty(nb_w // 2, dtype=torch.uint8, device=DEV) for _ in range(n_sets)]
        dst = [torch.empty_like(s) for s in src]
        floor_us, _ = graph_time_us([lambda i=i: dst[i].copy_(src[i]) for i in range(n_sets)])
        offered = {c.tag() for c in tuning.gluon_decode_candidates(n, k)}
        for m in [int(v) for v in args.ms.split(",")]:
            if time.time() > t_end:
                break
            acts = [refs.act_quant_ref((torch.randn(m, k, device=DEV) * 2).to(torch.bfloat16)) for _ in range(n_sets)]
            ref = refs.fp8_gemm_ref(*acts[0], *ws[0], torch.float32)
            timed = []
            for cfg in _grid(n, k, args.space):
                if time.time() > t_end:
                    break
                try:
                    err = refs.rel_err(fp8_gemm(*acts[0], *ws[0], cfg), ref)
                    us, _ = graph_time_us([lambda i=i, c=cfg: fp8_gemm(*acts[i], *ws[i], c) for i in range(n_sets)])
                except Exception as e:  # reported, not fatal
                    rows.append({"shape": f"{name}[{tp}] {n}x{k}", "M": m, "config": cfg.tag(), "error": str(e)[:200]})
                    continue
                r = {"shape": f"{name}[{tp}] {n}x{k}", "M": m, "config": cfg.tag(), "us": us, "err": err,
                     "pct_copy_bw": 100 * nb_w / bw / us, "offered": cfg.tag() in offered}
                rows.append(r)
                timed.append(r)
            if not timed:
                continue
            timed.sort(key=lambda r: r["us"])
            best_offered = next((r for r in timed if r["offered"]), None)
            summary.append({"shape": f"{name}[{tp}] {n}x{k}", "M": m, "weight_MB": nb_w / 1e6,
                            "floor_copy_us": floor_us, "floor_pct_copy_bw": 100 * nb_w / bw / floor_us,
                            "best": timed[0]["config"], "best_us": timed[0]["us"],
                            "best_pct_copy_bw": timed[0]["pct_copy_bw"], "max_err": max(r["err"] for r in timed),
                            "best_offered": best_offered and best_offered["config"],
                            "best_offered_pct": best_offered and best_offered["pct_copy_bw"],
                            "top5": [[r["config"], round(r["us"], 2)] for r in timed[:5]]})
    print(f"copy BW {ceil['copy_GBps']:.0f} GB/s")
    print(f"{'shape':<28} {'M':>2} {'MB':>5} {'floor µs':>8} {'floor %':>7} {'best µs':>7} {'best %':>6} "
          f"{'offered %':>9} {'max err':>8}  best / top 5")
    for s in summary:
        print(f"{s['shape']:<28} {s['M']:>2} {s['weight_MB']:>5.1f} {s['floor_copy_us']:>8.2f} "
              f"{s['floor_pct_copy_bw']:>7.1f} {s['best_us']:>7.2f} {s['best_pct_copy_bw']:>6.1f} "
              f"{s['best_offered_pct'] or 0:>9.1f} {s['max_err']:>8.1e}  {s['top5']}")
    with open(args.out, "w") as f:
        json.dump({"machine": torch.cuda.get_device_name(), "ceilings": ceil, "summary": summary, "rows": rows}, f,
                  indent=1)


if __name__ == "__main__":
    main()
