"""Where the decode MoE GEMVs' time goes, and what overlapping w13 with w2 could at most save (GPU).

Per shape (V4.1-Flash: one TP8 rank, one EP8 rank, TP1) and token count, with the default decode config:
- `w13`, `w2`: each GEMV alone, 8 input sets with disjoint routings (weights from HBM), and `*_warm`: the same call
  repeated on one set, so that its weights sit in the 60 MB L2 where they fit (TP8 M = 1 / 3);
- `serial`: w13 then w2 (without PDL), `serial_pdl`: the two with programmatic dependent launch (w2's weights are
  requested before it waits for w13);
- `concurrent`: w13 on the current stream and w2 on a second one at the same time, w2 reading the h of an earlier
  call: no dependency between them, so this is a lower bound for any kernel that overlaps the two GEMMs;
- `full`: the `moe_experts` op (w13 also writes the output's starting value, the shared expert's output).
CUDA-graph replay (`plugins.timing`). Prints one line per case, writes `--out` JSON.

    python3 benchmarks/moe_decode_bounds.py --out moe_decode_bounds_h200.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from dsflash.plugins import moe as M
from dsflash.plugins import refs
from dsflash.plugins.bench import MOE_TOPK as TOPK
from dsflash.plugins.bench import measure_ceilings, routed_decode_batches
from dsflash.plugins.timing import graph_time_us

DEV = "cuda"
D, E, LIMIT, SETS = 5120, 384, 10.0, 8
CASES = [("tp8", 288, 320, 1, (1, 3, 8)), ("ep8", 2304, 2304, 8, (3, 8)), ("tp1", 2304, 2304, 1, (1,))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    copy_gbps = measure_ceilings()["copy_GBps"]
    gen = torch.Generator(device=DEV).manual_seed(3)
    gw = (torch.randn(E, D, device=DEV, generator=gen) * 0.02).to(torch.bfloat16)
    bias = torch.randn(E, device=DEV, generator=gen) * 0.05
    side = torch.cuda.Stream()
    rows = []
    for tp, inter, ipad, ep, ms in CASES:
        el = E // ep
        w13_q, w13_s, w2_q, w2_s = refs.random_mxfp4_experts(el, D, inter, ipad, gen)
        expert_bytes = 3 * ipad * D // 2 + 3 * ipad * D // 32
        for m in ms:
            cfg = dataclasses.replace(M.default_moe_config(m, TOPK, el, ipad, D, ep), pdl=False)
            _, shared, lists, routed, distinct = routed_decode_batches(m, gw, bias, el, ep, cfg.xq_layout, gen, SETS)
            slots = M.local_pair_slots(m * TOPK, ep)
            hps = [M.gemv_w13(r[2], r[0], r[1], w13_q, w13_s, inter, LIMIT, cfg, None, None, lists[i], slots)
                   for i, r in enumerate(routed)]
            outs = [torch.zeros(m, D, device=DEV) for _ in range(SETS)]

            def w13(i, c=cfg):
                return M.gemv_w13(routed[i][2], routed[i][0], routed[i][1], w13_q, w13_s, inter, LIMIT, c, None,
                                  None, lists[i], slots)

            def w2(i, c=cfg):
                return M.gemv_w2(hps[i], routed[i][1], w2_q, w2_s, outs[i], c, lists[i], slots)

            def chain(c):
                def run(i):
                    out = torch.empty(m, D, device=DEV)
                    hp = M.gemv_w13(routed[i][2], routed[i][0], routed[i][1], w13_q, w13_s, inter, LIMIT, c, out,
                                    shared[i], lists[i], slots)
                    return M.gemv_w2(hp, routed[i][1], w2_q, w2_s, out, c, lists[i], slots)
                return run

            def concurrent(i):
                cur = torch.cuda.current_stream()
                side.wait_stream(cur)
                w13(i)
                with torch.cuda.stream(side):
                    w2(i)
                cur.wait_stream(side)

            def full(i):
                return M.moe_experts(routed[i][2], routed[i][0], routed[i][1], w13_q, w13_s, w2_q, w2_s, LIMIT,
                                     inter, shared[i], cfg, ep, lists[i])

            def us(fn, n=SETS):
                return round(graph_time_us([lambda i=i: fn(i) for i in range(n)])[0], 2)

            pdl = dataclasses.replace(cfg, pdl=True)
            r = {"shape": tp, "M": m, "config": cfg.tag(), "distinct_experts": distinct,
                 "weight_MB": round(distinct * expert_bytes / 1e6, 2),
                 "w13": us(w13), "w13_warm": us(w13, 1), "w2": us(w2), "w2_warm": us(w2, 1),
                 "serial": us(chain(cfg)), "serial_pdl": us(chain(pdl)), "concurrent": us(concurrent),
                 "full": us(full)}
            for k in ("serial", "concurrent", "full"):
                r[f"{k}_pct_copy_bw"] = round(100 * distinct * expert_bytes / r[k] / 1e3 / copy_gbps, 1)
            rows.append(r)
            print(json.dumps(r), flush=True)
        del w13_q, w13_s, w2_q, w2_s
        torch.cuda.empty_cache()
    with open(a.out, "w") as f:
        json.dump({"copy_GBps": copy_gbps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
