"""How close the decode MoE rows can come to the 60 % line at all: the read floors of their bytes (GPU).

The decode MoE is two launches, w13 then w2, and w2 reads h, which w13 writes: however the kernels are written, w2's
weights are read after w13's (prefetching them during w13 measured slower, benchmarks/README.md, session 15). For
each decode row of `kernels_h200.json` (one TP8 rank, one EP8 rank, TP1; M = 1, 3, 8) this times, on the bytes the
row's two GEMVs must read (its `moe_w13_gemv` and `moe_w2_gemv` weight_MB):

- `two_reads`: `copy_floor.read_sum` over w13's bytes, then over w2's, as two launches in stream order: the floor of
  any two-launch implementation, with no arithmetic at all;
- `one_read`: one `read_sum` over both: the floor of a single launch that fused the two GEMVs and their dependency;
- each read alone (the floor of each GEMV).

Each read takes its best of 2 / 4 / 8 / 16 programs per SM, as `copy_floor.py` does, in the same graph-replayed
timing (input sets totalling 3× the L2). Prints a table and writes `--out` JSON; the `moe_experts[tuned]` figures
shown beside are the ones in `--kernels` (another run: compare percentages, not microseconds).

    python3 benchmarks/moe_floor.py --out moe_floor.json [--kernels benchmarks/kernels_h200.json]

GPU only.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from dsflash.plugins.bench import measure_ceilings
from dsflash.plugins.timing import graph_time_us, input_sets

sys.path.insert(0, str(Path(__file__).resolve().parent))
from copy_floor import ReadSets, best_read_us  # noqa: E402

DEV = "cuda"
TARGET_PCT = 60.0


def decode_rows(kernels: dict) -> list[dict]:
    """(shape, M, w13 MB, w2 MB, measured µs and %) of every decode MoE row of a kernels_h200.json."""
    by = {}
    for r in kernels["rows"]:
        if r["op"] in ("moe_experts[tuned]", "moe_w13_gemv", "moe_w2_gemv") and r["M"] <= 8:
            by.setdefault((r["shape"], r["M"]), {})[r["op"]] = r
    out = []
    for (shape, m), ops in sorted(by.items()):
        if len(ops) < 3:
            continue
        op = ops["moe_experts[tuned]"]
        out.append({"shape": shape, "M": m, "w13_MB": ops["moe_w13_gemv"]["weight_MB"],
                    "w2_MB": ops["moe_w2_gemv"]["weight_MB"], "measured_us": op["us"],
                    "measured_pct": op["pct_copy_bw"]})
    return out


def best_graph_us(make_calls) -> tuple[float, int]:
    """`copy_floor.best_read_us`, asserting the graph-replayed timing every kernel row uses."""
    us, per_sm, how = best_read_us(make_calls)
    assert how == "graph", "the floors are graph-replayed timings, like every kernel row"
    return us, per_sm


def floor_row(row: dict, copy_gbps: float, sms: int, gen: torch.Generator) -> dict:
    a_mb, b_mb = row["w13_MB"], row["w2_MB"]
    sets = input_sets(min(a_mb, b_mb) * 1e6)   # enough sets that even the smaller read comes from HBM
    a, b, ab = (ReadSets(mb, sets, sms, gen) for mb in (a_mb, b_mb, a_mb + b_mb))
    t_a, k_a = best_graph_us(lambda k: [lambda i=i: a.call(i, k) for i in range(sets)])
    t_b, k_b = best_graph_us(lambda k: [lambda i=i: b.call(i, k) for i in range(sets)])
    # the two reads back to back, each with its own best grid: w2's launch starts when w13's has finished
    t_two, _ = graph_time_us([lambda i=i: (a.call(i, k_a), b.call(i, k_b)) for i in range(sets)])
    t_one, _ = best_graph_us(lambda k: [lambda i=i: ab.call(i, k) for i in range(sets)])
    total = a.mb + b.mb

    def pct(us: float) -> float:
        return 100 * total * 1e3 / us / copy_gbps

    return {**row, "w13_read_us": t_a, "w2_read_us": t_b, "two_reads_us": t_two, "one_read_us": t_one,
            "w13_read_pct": 100 * a.mb * 1e3 / t_a / copy_gbps, "w2_read_pct": 100 * b.mb * 1e3 / t_b / copy_gbps,
            "two_reads_pct": pct(t_two), "one_read_pct": pct(t_one),
            "measured_of_two_reads": t_two / row["measured_us"],
            "two_launch_can_reach_target": pct(t_two) >= TARGET_PCT}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--kernels", default=str(Path(__file__).resolve().parent / "kernels_h200.json"))
    args = ap.parse_args()
    with open(args.kernels) as f:
        rows = decode_rows(json.load(f))
    ceil = measure_ceilings()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device=DEV).manual_seed(0)
    print(f"copy ceiling {ceil['copy_GBps']:.0f} GB/s; % columns are of it, on the row's w13 + w2 bytes")
    print(f"{'shape':>34} {'M':>2} {'w13+w2 MB':>10} {'w13 read':>9} {'w2 read':>8} {'two reads':>10} "
          f"{'one read':>9} {'measured':>9}")
    out = []
    for row in rows:
        r = floor_row(row, ceil["copy_GBps"], sms, gen)
        out.append(r)
        print(f"{r['shape']:>34} {r['M']:>2} {r['w13_MB'] + r['w2_MB']:10.1f} {r['w13_read_pct']:8.1f}% "
              f"{r['w2_read_pct']:7.1f}% {r['two_reads_pct']:9.1f}% {r['one_read_pct']:8.1f}% "
              f"{r['measured_pct']:8.1f}%")
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"command": "python3 benchmarks/moe_floor.py --out " + Path(args.out).name,
                   "kernels": Path(args.kernels).name, "ceilings": ceil, "target_pct": TARGET_PCT, "rows": out},
                  f, indent=1)


if __name__ == "__main__":
    main()
