"""Launch-shape sweep of the MoE router (H200): logits tiles (tokens × experts × K step, K slices) and the top-k
kernel's tokens per program and warps, at V4.1-Flash's gate (384 experts × hidden 5120, top-6) and decode / small
prefill T. Every variant's ids and weights are checked against `router_ref`; timed as one router call (both
launches, the deploy activation written in the decode GEMV layout) in a CUDA graph over rotating inputs.
Stage 1 sweeps the logits tiles with the current top-k shape; stage 2 the top-k shape on stage 1's winner.
Prints the current and the best shape per T and writes every timing as JSON.

    python3 benchmarks/router_sweep.py --out router_sweep.json [--ts 1,3,8,64]

GPU only; `moe.router_tiles` comes from this file's output (`benchmarks/router_sweep_h200.json`).
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json

import torch

from dsflash.plugins import moe, refs
from dsflash.plugins.bench import HIDDEN, MOE_E, MOE_SCALE, MOE_TOPK
from dsflash.plugins.timing import graph_time_us, input_sets

DEV = "cuda"
# logits tiles of stage 1: experts per tile, K step, K slices, warps. --wide: the grid of
# router_sweep_grid_h200.json, recorded with an earlier top-k (three reductions per pass) and a variant that ran the
# top-k in the last logits program (rows with "fused": true; 0.2 µs faster at T = 1, slower at T > 1: not kept)
GRID = ((64, 128), (128, 256), (10, 20, 40), (8,))
WIDE_GRID = ((32, 64, 128), (128, 256), (4, 8, 16, 20, 40), (4, 8))


def _check(x, gw, bias, w, ids) -> float:
    """Fraction of tokens whose selection equals router_ref's (near-ties aside, 1.0); raises on wrong weights."""
    w_ref, ids_ref = refs.router_ref(x, gw, bias, MOE_TOPK, MOE_SCALE)
    same = (ids.long().sort(1).values == ids_ref.sort(1).values).all(1)
    wk, wr = w.gather(1, ids.long().argsort(1))[same], w_ref.gather(1, ids_ref.argsort(1))[same]
    if same.any() and refs.rel_err(wk, wr) > 1e-5:
        raise AssertionError(f"router weights off by {refs.rel_err(wk, wr):.2e}")
    return float(same.float().mean())


def _kernel_us(tiles: moe.RouterTiles, x, gw, bias, calls: int = 50) -> dict[str, float]:
    """Mean device time per call of each router kernel (torch.profiler, eager): what the launches themselves take,
    apart from the gaps between them."""
    moe.router_tiles = lambda t, e, d, qblock=32: tiles
    for _ in range(3):
        moe.router(x, gw, bias, MOE_TOPK, MOE_SCALE, xq_layout="gemv16")
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            moe.router(x, gw, bias, MOE_TOPK, MOE_SCALE, xq_layout="gemv16")
        torch.cuda.synchronize()
    out = {}
    for ev in prof.key_averages():
        if "router" in ev.key:
            out[ev.key] = ev.device_time_total / calls
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ts", default="1,3,8,64")
    ap.add_argument("--wide", action="store_true", help="stage 1 over WIDE_GRID")
    args = ap.parse_args()
    global GRID
    if args.wide:
        GRID = WIDE_GRID
    current = moe.router_tiles
    e, d = MOE_E, HIDDEN
    gen = torch.Generator(device=DEV).manual_seed(0)
    n_sets = input_sets(e * d * 2)
    gws = [(torch.randn(e, d, device=DEV, generator=gen) * 0.02).to(torch.bfloat16) for _ in range(n_sets)]
    bias = torch.randn(e, device=DEV, generator=gen) * 0.05
    rows, summary = [], []
    for t in [int(v) for v in args.ts.split(",")]:
        xs = [(torch.randn(t, d, device=DEV, generator=gen) * 2).to(torch.bfloat16) for _ in range(n_sets)]
        # one gate weight per input set as well: the weight read is what a decode router costs
        calls_x = list(zip(xs, gws))

        def timed(tiles):
            moe.router_tiles = lambda t_, e_, d_, qblock_=32: tiles
            w, ids, _ = moe.router(xs[0], gws[0], bias, MOE_TOPK, MOE_SCALE, xq_layout="gemv16")
            agree = _check(xs[0], gws[0], bias, w, ids)
            us, _ = graph_time_us([lambda x=x, g=g: moe.router(x, g, bias, MOE_TOPK, MOE_SCALE, xq_layout="gemv16")
                                   for x, g in calls_x])
            row = {"T": t, "tiles": dataclasses.asdict(tiles), "us": us, "agree": agree}
            rows.append(row)
            return us
        base = current(t, e, d)
        base_us = timed(base)
        best = (base_us, base)
        for be, bk, split, warps in itertools.product(*GRID):
            if d % bk or split > d // bk or (warps == 8 and be < 64):
                continue
            cand = dataclasses.replace(base, block_e=be, block_k=bk, split=split, warps=warps)
            try:
                us = timed(cand)
            except Exception as ex:   # a shape that fails to compile is reported, not fatal
                rows.append({"T": t, "tiles": dataclasses.asdict(cand), "error": f"{type(ex).__name__}: {ex}"[:300]})
                continue
            best = min(best, (us, cand), key=lambda b: b[0])
        for cand in [dataclasses.replace(best[1], topk_t=tt, topk_warps=tw)
                     for tt, tw in itertools.product((1, 2, 4), (1, 2, 4))]:
            us = timed(cand)
            best = min(best, (us, cand), key=lambda b: b[0])
        kernels = {name: _kernel_us(tiles, xs[0], gws[0], bias) for name, tiles in (("current", base),
                                                                                     ("best", best[1]))}
        summary.append({"T": t, "current": dataclasses.asdict(base), "current_us": base_us,
                        "best": dataclasses.asdict(best[1]), "best_us": best[0], "kernel_us": kernels})
        print(json.dumps(summary[-1]), flush=True)
    moe.router_tiles = current
    print(f"{'T':>4} {'current µs':>10} {'best µs':>8}  best tiles")
    for s in summary:
        b = s["best"]
        print(f"{s['T']:>4} {s['current_us']:>10.2f} {s['best_us']:>8.2f}  t{b['block_t']} e{b['block_e']} "
              f"k{b['block_k']} x{b['split']} w{b['warps']} | topk t{b['topk_t']} w{b['topk_warps']} | "
              f"kernels µs: {s['kernel_us']}")
    with open(args.out, "w") as f:
        json.dump({"machine": torch.cuda.get_device_name(), "E": e, "D": d, "topk": MOE_TOPK, "summary": summary,
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
