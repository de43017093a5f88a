"""The decode MoE's w13 and w2 GEMVs in one launch (`plugins/moe_fused.py`, added by `moe_fused_s16.patch`: tried in
session 16 and not kept, benchmarks/README.md) against the two-launch `moe_experts` (GPU).

Per shape (V4.1-Flash: TP1, one EP8 rank, one TP8 rank) and token count: the op with its default decode config
(`two_launch_default`; at TP8 that is the row-per-thread Gluon w2), the same op with the config the fused kernel
takes (`two_launch`: at TP8 the Triton w2 tile), and the fused launch with and without the w2 programs' L2 prefetch
of their weights, and without it, polling their counters every 200 / 1000 ns. Parity: the fused output against the two-launch one with the same config (only the order of the
output's fp32 atomic adds differs), on every input set, twice (the counters reset themselves), and replayed from a
CUDA graph. CUDA-graph replay timing over 8 routings (`plugins.timing`). Prints a line per case, writes `--out` JSON.

    git apply benchmarks/moe_fused_s16.patch && python3 benchmarks/moe_fused.py --out moe_fused_h200.json
"""
from __future__ import annotations

import argparse
import json

import torch

from dsflash.plugins import moe as M
from dsflash.plugins import refs
from dsflash.plugins.bench import MOE_TOPK as TOPK
from dsflash.plugins.bench import measure_ceilings, routed_decode_batches
from dsflash.plugins.moe_config import _triton_gemv_default, default_moe_config
from dsflash.plugins.moe_fused import gemv_fused
from dsflash.plugins.timing import graph_time_us

DEV = "cuda"
D, E, LIMIT, SETS = 5120, 384, 10.0, 8
CASES = [("tp1", 2304, 2304, 1, (1, 3, 8)), ("ep8", 2304, 2304, 8, (1, 3, 8)), ("tp8", 288, 320, 1, (1, 3, 8))]


def fused_config(m: int, el: int, ipad: int, ep: int):
    """The default decode config, with the Triton w2 tile where the default is the row-per-thread Gluon one."""
    cfg = default_moe_config(m, TOPK, el, ipad, D, ep)
    if cfg.rows2:
        t = _triton_gemv_default(-(-m * TOPK // ep), ipad, D)
        cfg = M.MoeConfig(**(cfg.to_dict() | {k: getattr(t, k) for k in ("bn2", "bk2", "warps2", "split2",
                                                                           "stages2")} | {"rows2": False}))
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="tp1,ep8,tp8")
    a = ap.parse_args()
    copy_gbps = measure_ceilings()["copy_GBps"]
    gen = torch.Generator(device=DEV).manual_seed(3)
    gw = (torch.randn(E, D, device=DEV, generator=gen) * 0.02).to(torch.bfloat16)
    bias = torch.randn(E, device=DEV, generator=gen) * 0.05
    rows = []
    for tp, inter, ipad, ep, ms in CASES:
        if tp not in a.shapes.split(","):
            continue
        el = E // ep
        w13_q, w13_s, w2_q, w2_s = refs.random_mxfp4_experts(el, D, inter, ipad, gen)
        expert_bytes = 3 * ipad * D // 2 + 3 * ipad * D // 32
        for m in ms:
            dflt = default_moe_config(m, TOPK, el, ipad, D, ep)
            cfg = fused_config(m, el, ipad, ep)
            _, shared, lists, routed, distinct = routed_decode_batches(m, gw, bias, el, ep, cfg.xq_layout, gen, SETS)
            slots = M.local_pair_slots(m * TOPK, ep)

            def two(i, c=cfg):
                return M.moe_experts(routed[i][2], routed[i][0], routed[i][1], w13_q, w13_s, w2_q, w2_s, LIMIT,
                                     inter, shared[i], c, ep, lists[i])

            def fused(i, prefetch=True, sleep_ns=0):
                out = torch.empty(m, D, device=DEV)
                return gemv_fused(routed[i][2], routed[i][0], routed[i][1], w13_q, w13_s, w2_q, w2_s, inter, LIMIT,
                                  cfg, out, shared[i], lists[i], slots, prefetch=prefetch, sleep_ns=sleep_ns)

            err = 0.0
            for i in range(SETS):
                ref = two(i)
                for _ in range(2):
                    err = max(err, float(refs.rel_err(fused(i), ref)))
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                gout = fused(0)
            for _ in range(3):
                g.replay()
            torch.cuda.synchronize()
            err = max(err, float(refs.rel_err(gout, two(0))))

            def us(fn):
                return round(graph_time_us([lambda i=i: fn(i) for i in range(SETS)])[0], 2)

            r = {"shape": tp, "M": m, "config": cfg.tag(), "default_config": dflt.tag(),
                 "distinct_experts": distinct, "weight_MB": round(distinct * expert_bytes / 1e6, 2),
                 "max_rel_diff_fused_vs_two_launch": err,
                 "two_launch_default": us(lambda i: two(i, dflt)), "two_launch": us(two),
                 "fused": us(fused), "fused_no_prefetch": us(lambda i: fused(i, False))}
            for ns in (200, 1000):
                r[f"fused_no_prefetch_sleep{ns}"] = us(lambda i, ns=ns: fused(i, False, ns))
            for k in ("two_launch_default", "two_launch", "fused", "fused_no_prefetch", "fused_no_prefetch_sleep200",
                      "fused_no_prefetch_sleep1000"):
                r[f"{k}_pct_copy_bw"] = round(100 * distinct * expert_bytes / r[k] / 1e3 / copy_gbps, 1)
            rows.append(r)
            print(json.dumps(r), flush=True)
        del w13_q, w13_s, w2_q, w2_s
        torch.cuda.empty_cache()
    with open(a.out, "w") as f:
        json.dump({"copy_GBps": copy_gbps, "rows": rows}, f, indent=1)
    print(f"{'shape':>5} {'M':>2} {'default':>8} {'2-launch':>8} {'fused':>8} {'no pf':>8} {'sl200':>8} {'sl1000':>8}"
          "  (µs; % copy BW)")
    for r in rows:
        print(f"{r['shape']:>5} {r['M']:>2} " + " ".join(f"{r[k]:>5.1f}/{r[k + '_pct_copy_bw']:>2.0f}" for k in (
            "two_launch_default", "two_launch", "fused", "fused_no_prefetch", "fused_no_prefetch_sleep200",
            "fused_no_prefetch_sleep1000")) + f"  err {r['max_rel_diff_fused_vs_two_launch']:.1e}")


if __name__ == "__main__":
    main()
