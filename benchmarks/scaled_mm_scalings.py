"""How much cuBLAS's own FP8 GEMM loses to finer scale groups: `torch._scaled_mm` at the V4.1 dense shapes (M = 4096)
with per-tensor scales (issue 6's denominator), row-wise scales (one per row of A and per column of W: no promotion
inside the K loop) and, where this torch and cuBLAS offer it, DeepSeek-style block scales (A 1×128, W 128×128: an
fp32 promotion every 128 K). Our group-32 path (a promotion every 32 K) is timed against the per-tensor call by
`make bench-kernels` (its `fp8_gemm_vs_scaled_mm`, kernels_h200.json); this script asks what the finer scalings cost
cuBLAS itself.

Every variant is first checked against an fp32 reference of the same codes and scales (a scale layout this torch
reads differently fails the check and is reported, not timed); then all variants of a shape are timed together, their
replays interleaved (`graph_time_many`: the card's power limit lowers the clock within ~50 ms, benchmarks/README.md
"Session 27"). Prints one table (µs, TFLOP/s, ratio to per-tensor) and writes the rows as JSON.

    python3 benchmarks/scaled_mm_scalings.py [--m 4096] [--out scaled_mm_scalings_h200.json]
"""
from __future__ import annotations

import argparse
import json

import torch

from dsflash.plugins import refs
from dsflash.plugins.bench import GEMM_SHAPES
from dsflash.plugins.timing import graph_time_many, input_sets

DEV = "cuda"


def _codes(x: torch.Tensor, groups: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] fp32 -> e4m3 codes and fp32 scales per (groups[0] × groups[1]) block (0 = the whole dim):
    x ≈ codes · scale."""
    r, c = x.shape
    gr, gc = groups[0] or r, groups[1] or c
    blocks = x.view(r // gr, gr, c // gc, gc)
    scale = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp_min(1e-12) / refs.FP8_MAX
    q = (blocks / scale).to(torch.float8_e4m3fn).view(r, c)
    return q, scale.view(r // gr, c // gc).float()


def _dequant(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    r, c = q.shape
    return (q.float().view(s.shape[0], r // s.shape[0], s.shape[1], c // s.shape[1])
            * s.view(s.shape[0], 1, s.shape[1], 1)).view(r, c)


def scalings(m: int, n: int):
    """[(name, A groups, W groups, candidate (scale_a, scale_b) layouts as `_scaled_mm` may take them from
    (sa [M/ga, K/gk], sw [N/gn, K/gk]))] for the three cuBLAS scalings. The block layouts differ between torch
    releases; the first candidate whose result checks is used."""
    def mn_major(t):   # same shape, the first dim contiguous
        return t.t().contiguous().t()
    return [
        ("per_tensor", (0, 0), (0, 0), [lambda sa, sw: (sa.reshape(()), sw.reshape(()))]),
        ("rowwise", (1, 0), (1, 0), [lambda sa, sw: (sa.reshape(m, 1), sw.reshape(1, n))]),
        ("block_1x128_128x128", (1, 128), (128, 128),
         [lambda sa, sw: (mn_major(sa), sw.t().contiguous()), lambda sa, sw: (mn_major(sa), sw.t()),
          lambda sa, sw: (mn_major(sa), sw), lambda sa, sw: (sa, sw), lambda sa, sw: (sa, sw.t().contiguous())]),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=4096)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.manual_seed(0)
    m = a.m
    doc = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), "m": m, "rows": []}
    for name, n, k, tps in GEMM_SHAPES:
        shape = f"{name}[{tps}] {n}x{k}"
        sets = input_sets(n * k + m * k)
        xs = [torch.randn(m, k, device=DEV) for _ in range(sets)]
        wts = [torch.randn(n, k, device=DEV) * 0.02 for _ in range(sets)]
        timed, errs = {}, {}
        for sname, ga, gw, layouts in scalings(m, n):
            if k % 16 or n % 16 or (ga[1] and (k % 128 or n % 128)):
                errs[sname] = "shape not a multiple of cuBLAS's 16 / the 128 blocks"
                continue
            coded = [(*_codes(x, ga), *_codes(w, gw)) for x, w in zip(xs, wts)]   # (qa, sa, qw, sw) per set
            qa, sa, qw, sw = coded[0]
            ref = _dequant(qa, sa) @ _dequant(qw, sw).t()
            errs[sname] = "no scale layout this torch accepts"
            for arg in layouts:
                try:
                    out = torch._scaled_mm(qa, qw.t(), *arg(sa, sw), out_dtype=torch.bfloat16)
                except Exception as e:  # this torch / cuBLAS does not take the scaling (in this layout)
                    errs[sname] = f"{type(e).__name__}: {str(e)[:200]}"
                    continue
                err = refs.rel_err(out, ref)
                if err > 1e-2:
                    errs[sname] = f"wrong result (rel. err. {err:.2e}) in every layout tried"
                    continue
                errs[sname] = err
                ops = [(c[0], c[2], *arg(c[1], c[3])) for c in coded]
                timed[sname] = [lambda o=o: torch._scaled_mm(o[0], o[1].t(), o[2], o[3], out_dtype=torch.bfloat16)
                                for o in ops]
                break
        times = dict(zip(timed, graph_time_many(list(timed.values())))) if timed else {}
        base = times.get("per_tensor", (None,))[0]
        for sname, err in errs.items():
            row = {"shape": shape, "n": n, "k": k, "scaling": sname}
            if sname in times:
                us = times[sname][0]
                row |= {"us": us, "TFLOPs": 2 * m * n * k / us / 1e6, "rel_err": err,
                        "vs_per_tensor": base / us if base else None}
            else:
                row["skipped"] = err
            doc["rows"].append(row)
    print(f"torch {doc['torch']}, {doc['gpu']}, M = {m}")
    print(f"{'shape':34} {'scaling':22} {'µs':>9} {'TFLOP/s':>8} {'vs per-tensor':>13}")
    for r in doc["rows"]:
        if "us" in r:
            vs = "" if r["vs_per_tensor"] is None else f"{r['vs_per_tensor']:13.3f}"
            print(f"{r['shape']:34} {r['scaling']:22} {r['us']:9.1f} {r['TFLOPs']:8.0f} {vs:>13}")
        else:
            print(f"{r['shape']:34} {r['scaling']:22} skipped: {r['skipped'][:60]}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
