"""Where a kernel's warps stall, per SASS opcode and per instruction, from an Nsight Compute source-page export:

    ncu --clock-control none --section WarpStateStats --section SourceCounters --page source --print-source sass \\
        --csv -k regex:fp8_g32 python3 benchmarks/ncu_sm90.py --variants 1x4d4c2h2tw > sass.csv
    python3 benchmarks/ncu_sass_stalls.py sass.csv --out ncu_sass_stalls_h200.json

Prints each opcode's share of the warp-state samples (all warps: the producer's waits count too) with its largest stall
reasons, then the instructions that hold the most samples; writes the same as JSON (the export is ~0.8 MB).
"""
from __future__ import annotations

import argparse
import collections
import csv
import json

SAMPLES = "Warp Stall Sampling (All Samples)"


def summarize(path: str, top: int = 20) -> dict:
    with open(path) as f:
        rows = list(csv.reader(f))
    start = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    hdr = rows[start]
    data = [dict(zip(hdr, r)) for r in rows[start + 1:] if len(r) == len(hdr)]
    num = lambda r, k: float(r.get(k) or 0)   # noqa: E731
    reasons = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    total = sum(num(r, SAMPLES) for r in data)
    share = lambda v: round(100 * v / total, 2)   # noqa: E731

    def opcode(r: dict) -> str:
        words = r["Source"].split()
        return (words[1] if words[0].startswith("@") else words[0]).split(".")[0]

    per_op: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in data:
        c = per_op[opcode(r)]
        c["samples"] += num(r, SAMPLES)
        c["executed"] += num(r, "Instructions Executed")
        for s in reasons:
            c[s[6:]] += num(r, s)
    by_reason = {s[6:]: share(sum(num(r, s) for r in data)) for s in reasons}
    return {
        "samples": total,
        "reasons_pct": dict(sorted(((k, v) for k, v in by_reason.items() if v >= 0.5), key=lambda kv: -kv[1])),
        "opcodes": [{"opcode": op, "samples_pct": share(c["samples"]), "executed": int(c["executed"]),
                     "reasons_pct": {k: share(v) for k, v in c.most_common()
                                     if k not in ("samples", "executed") and share(v) >= 0.3}}
                    for op, c in sorted(per_op.items(), key=lambda kv: -kv[1]["samples"])
                    if share(c["samples"]) >= 0.3],
        "instructions": [{"sass": r["Source"].strip(), "samples_pct": share(num(r, SAMPLES)),
                          "reasons_pct": {s[6:]: share(num(r, s)) for s in reasons
                                          if num(r, s) >= 0.15 * num(r, SAMPLES)}}
                         for r in sorted(data, key=lambda r: -num(r, SAMPLES))[:top]],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--out", default="ncu_sass_stalls_h200.json")
    args = ap.parse_args()
    out = summarize(args.csv, args.top)
    print(f"{out['samples']:.0f} samples; by reason (%): {out['reasons_pct']}")
    for o in out["opcodes"]:
        print(f"{o['opcode']:12s} {o['samples_pct']:5.1f} % of samples, {o['executed'] / 1e6:7.1f} M executed  "
              f"{o['reasons_pct']}")
    for i in out["instructions"]:
        print(f"{i['samples_pct']:5.2f} %  {i['sass'][:60]:60s} {i['reasons_pct']}")
    with open(args.out, "w") as f:
        json.dump({"source": args.csv.rsplit("/", 1)[-1]} | out, f, indent=1)


if __name__ == "__main__":
    main()
