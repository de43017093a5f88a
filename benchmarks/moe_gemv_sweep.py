"""Tile sweep of the MoE decode GEMVs (H200): w13 (+ SwiGLU epilogue) and w2 (+ weighted reduction) timed on their
own, over row tile, K step, split-K, pipelining depth and in-block accumulation (fp32 / f16), at V4.1-Flash shapes
(384 experts, top-6, hidden 5120; TP1 and one TP8 rank) and decode M. Prints the best configs per GEMM with % of the
measured copy bandwidth on the distinct routed experts' bytes and writes every timing as JSON.

    python3 benchmarks/moe_gemv_sweep.py --out moe_gemv_sweep.json [--ms 1,3,8] [--budget-s 300]

GPU only; what `default_moe_config` picks comes from this file's output (`benchmarks/moe_gemv_sweep_h200.json`).
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import time

import torch

from dsflash.plugins import refs
from dsflash.plugins.bench import HIDDEN, MOE_E, MOE_LIMIT, MOE_SCALE, MOE_SHAPES, MOE_TOPK, measure_ceilings
from dsflash.plugins.timing import graph_time_us

DEV = "cuda"


def _grid13(inter: int, dim: int) -> list[tuple]:
    out = []
    for bn, bk, split, stages, acc16 in itertools.product((32, 64), (128, 256, 512), (1, 2, 3, 4, 6), (1, 3),
                                                           (True, False)):
        if inter % bn or dim % bk or (not acc16 and (stages == 1 or bk != 128 or bn != 64)):   # fp32: baseline only
            continue
        out.append((bn, bk, split, stages, acc16))
    return out


def _grid2(ipad: int, dim: int) -> list[tuple]:
    out = []
    for bn, bk, split, stages, acc16 in itertools.product((64, 128, 256), (64, 128, 256), (1, 2, 4), (1, 3),
                                                           (True, False)):
        if dim % bn or bk > ipad or (not acc16 and (stages == 1 or bk != 128 or bn != 128)):
            continue
        out.append((bn, bk, split, stages, acc16))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="1,3,8")
    ap.add_argument("--budget-s", type=float, default=300.0)
    args = ap.parse_args()
    from dsflash.plugins import moe as M
    t_end = time.time() + args.budget_s
    ceil = measure_ceilings()
    bw = ceil["copy_GBps"] * 1e3          # bytes per µs
    d, e, k = HIDDEN, MOE_E, MOE_TOPK
    gen = torch.Generator(device=DEV).manual_seed(5)
    gw = (torch.randn(e, d, device=DEV, generator=gen) * 0.02).to(torch.bfloat16)
    bias = torch.randn(e, device=DEV, generator=gen) * 0.05
    rows, summary = [], []
    for tp, inter, ipad, ep in MOE_SHAPES:
        if ep > 1:   # (the sweep predates the EP rank's shape: all experts on one device)
            continue
        w13_q = torch.randint(-128, 128, (e, 2 * ipad, d // 2), dtype=torch.int8, device=DEV, generator=gen)
        w13_s = torch.randint(117, 124, (e, 2 * ipad, d // 32), dtype=torch.uint8, device=DEV, generator=gen)
        w2_q = torch.randint(-128, 128, (e, d, ipad // 2), dtype=torch.int8, device=DEV, generator=gen)
        w2_s = torch.randint(117, 124, (e, d, ipad // 32), dtype=torch.uint8, device=DEV, generator=gen)
        b13 = 2 * ipad * d // 2 + 2 * ipad * d // 32
        b2 = d * ipad // 2 + d * ipad // 32
        for m in [int(v) for v in args.ms.split(",")]:
            xs = [(torch.randn(m, d, device=DEV, generator=gen) * 2).to(torch.bfloat16) for _ in range(8)]
            routed = [M.router(x, gw, bias, k, MOE_SCALE, xq_layout=None)[:2] for x in xs]
            n_act = statistics.mean(len(torch.unique(r[1])) for r in routed)
            nat = [refs.fp8_fake_quant_ref(x).to(torch.bfloat16) for x in xs]
            lay = {"gemv": [M.gemv_act(v) for v in nat], "gemv16": [M.gemv16_act(v) for v in nat]}
            base = M.default_moe_config(m, k, e, ipad, d)
            hs = {}
            for name, grid, nbytes in (("w13", _grid13(ipad, d), n_act * b13), ("w2", _grid2(ipad, d), n_act * b2)):
                best = None
                for bn, bk, split, stages, acc16 in grid:
                    if time.time() > t_end:
                        break
                    if name == "w13":
                        cfg = dataclasses.replace(base, bn13=bn, bk13=bk, split13=split, stages=stages, acc16=acc16,
                                                  warps=M.gemv_warps(2 * bn, bk))
                    else:
                        cfg = dataclasses.replace(base, bn2=bn, bk2=bk, split2=split, stages=stages, acc16=acc16,
                                                  warps2=M.gemv_warps(bn, bk))
                    x_in = lay[cfg.xq_layout]
                    try:
                        if name == "w13":
                            calls = [lambda i=i, c=cfg: M.gemv_w13(x_in[i], routed[i][0], routed[i][1], w13_q, w13_s,
                                                                   inter, MOE_LIMIT, c) for i in range(len(xs))]
                        else:
                            key = cfg.xq_layout
                            if key not in hs:   # w2's input: h from a fixed w13 config of the same layout
                                c13 = dataclasses.replace(base, acc16=cfg.acc16)
                                hs[key] = [M.gemv_w13(x_in[i], routed[i][0], routed[i][1], w13_q, w13_s, inter,
                                                      MOE_LIMIT, c13) for i in range(len(xs))]
                            outs = [torch.zeros(m, d, device=DEV) for _ in xs]
                            calls = [lambda i=i, c=cfg: M.gemv_w2(hs[key][i], routed[i][1], w2_q, w2_s, outs[i], c)
                                     for i in range(len(xs))]
                        us, _ = graph_time_us(calls)
                    except Exception as ex:   # a config the compiler refuses (shared memory, registers)
                        rows.append({"tp": tp, "M": m, "gemm": name, "config": cfg.tag(),
                                     "error": f"{type(ex).__name__}: {str(ex)[:200]}"})
                        continue
                    pct = 100 * nbytes / bw / us
                    rows.append({"tp": tp, "M": m, "gemm": name, "config": cfg.tag(), "us": us, "pct_copy_bw": pct,
                                 "weight_MB": nbytes / 1e6})
                    if best is None or us < best["us"]:
                        best = rows[-1]
                if best:
                    summary.append(best)
                    print(f"{tp} M={m} {name}: {best['us']:.1f} us {best['pct_copy_bw']:.0f}% "
                          f"({best['weight_MB']:.0f} MB) {best['config']}", flush=True)
            del xs, routed, nat, lay, hs
            torch.cuda.empty_cache()
        del w13_q, w13_s, w2_q, w2_s
        torch.cuda.empty_cache()
    json.dump({"ceilings": ceil, "best": summary, "rows": rows}, open(args.out, "w"), indent=1)
    print(f"{'shape':6} {'M':>2} {'gemm':4} {'us':>7} {'%bw':>4} {'MB':>5}  config")
    for r in summary:
        print(f"{r['tp']:6} {r['M']:>2} {r['gemm']:4} {r['us']:7.1f} {r['pct_copy_bw']:4.0f} {r['weight_MB']:5.0f}  "
              f"{r['config']}")


if __name__ == "__main__":
    main()
