"""The decode MoE's split-K counts and pipelining depths at the rows short of 60 % of copy bandwidth (GPU).

Until session 19 `moe_candidates` never offered the Triton w2 GEMV more than one K slice with its default tile
(64 rows × 256 K), so on an EP8 rank (a few pairs of TP1-wide experts: 80 tiles per pair) w2 ran ~500 programs of
nine K steps at M = 8 and ~180 at M = 3. This times the whole `moe_experts` op on the bench's own draws (same seeds
and shape order as `bench_moe`, so the figures compare with kernels_h200.json) for:
- w2 K slices 1, 2, 3, 5, 9 (and 32-row w2 tiles at 1 / 2 / 3 slices) on the EP8 rank and TP1;
- w13 pipelining depth 2-5 and K slices 1-4 on one TP8 rank at M = 3 (its w2 is the Gluon row kernel).
Parity of every config against `moe_experts_ref` on the first routing. Writes `--out` JSON, prints a table.

    python3 benchmarks/moe_split_sweep.py --out moe_split_sweep.json [--shapes ep8,tp1,tp8] [--ms 1,3,8]
        [--variants default]   # only the default config (and its w2 in one K slice): an A/B of two kernel versions
        [--variants near]      # the default and its neighbours (one more K slice or pipeline stage)
        [--variants tc]        # the default and the tensor-core w13 (`moe_tc`) at K slices 2-8, ring depths 2-6
        [--variants unroll]    # the default and its w13 K slices unrolled with register prefetch (`unroll13`)
        [--variants pdl2]      # the default and the unrolled w13, each with and without w2 launched by PDL (`pdl2`)
        [--variants ordered]   # the default with and without the deterministic expert sum (`moe_experts(ordered)`)
"""
import argparse
import dataclasses
import json

import torch

from dsflash.plugins import bench as B
from dsflash.plugins import moe as M
from dsflash.plugins import refs
from dsflash.plugins.moe_config import gemv_warps
from dsflash.plugins.timing import graph_time_us


def variants(shape: str, m: int, base: M.MoeConfig, which: str, ipad: int,
             cands: list[M.MoeConfig] = ()) -> list[M.MoeConfig]:
    """The configs a mode times at one shape and M, the default first; cands: the bucket's build candidates."""
    out = [base]
    if which == "tc":        # the tensor-core w13 (`moe_tc`) at K slices and TMA ring depths, against the default
        from dsflash.plugins.moe_tc import tc_fits
        if base.acc16 and tc_fits(ipad, B.HIDDEN):
            out += [dataclasses.replace(base, tc13=True, split13=s, stages=st) for s in (2, 3, 4, 5, 8)
                    for st in (2, 3, 4, 6)]
        return out
    if which == "unroll":    # the default and its w13 K slices unrolled with register prefetch (`unroll13`)
        if base.acc16:
            out += [dataclasses.replace(base, unroll13=True, stages=st) for st in (2, 3, 4)]
            out += [dataclasses.replace(base, unroll13=True, split13=s) for s in (2, 4) if s != base.split13]
        return out
    if which == "pdl2":      # w2 launched with PDL, starting in w13's tail (`pdl2`): the default and the unrolled-w13
        # candidates, each without and with it
        out += [c for c in cands if c.unroll13 and not c.pdl2]
        return out + [dataclasses.replace(c, pdl2=True) for c in out]
    if which == "default":   # the default and, for the Triton w2, its one-slice form (the A/B of kernel changes)
        return out if base.rows2 else list(dict.fromkeys(out + [dataclasses.replace(base, split2=1)]))
    if which == "near":      # the default's neighbours: one more K slice in either GEMV, one more pipeline stage
        for s13 in (base.split13, base.split13 + 1):
            for st in (base.stages, base.stages + 1):
                for s2 in (base.split2, base.split2 + 1):
                    out.append(dataclasses.replace(base, split13=s13, stages=st, stages2=base.stages2 and st,
                                                   split2=s2 if not base.rows2 else base.split2))
        return list(dict.fromkeys(out))
    if not base.rows2:
        out += [dataclasses.replace(base, split2=s) for s in (2, 3, 5, 9)]
        out += [dataclasses.replace(base, bn2=32, warps2=gemv_warps(32, base.bk2), split2=s) for s in (1, 2, 3)]
    if shape == "tp8":
        out += [dataclasses.replace(base, stages=s) for s in (2, 4, 5)]
        out += [dataclasses.replace(base, split13=s) for s in (1, 3, 4)]
    return list(dict.fromkeys(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="ep8,tp1,tp8")
    ap.add_argument("--ms", default="1,3,8")
    ap.add_argument("--variants", default="all",
                    choices=["all", "default", "near", "tc", "unroll", "pdl2", "ordered"])
    a = ap.parse_args()
    only, ms = set(a.shapes.split(",")), [int(x) for x in a.ms.split(",")]
    dev = "cuda"
    copy_gbps = B.measure_ceilings()["copy_GBps"]
    d, e, k = B.HIDDEN, B.MOE_E, B.MOE_TOPK
    gen = torch.Generator(device=dev).manual_seed(3)
    gw = (torch.randn(e, d, device=dev, generator=gen) * 0.02).to(torch.bfloat16)
    bias = torch.randn(e, device=dev, generator=gen) * 0.05
    rows = []
    for i_shape, (tp, inter, ipad, ep) in enumerate(B.MOE_SHAPES):
        if tp not in only:
            continue
        gen.manual_seed(4 + i_shape)   # bench_moe's draws for this shape
        el = e // ep
        w13_q, w13_s, w2_q, w2_s = refs.random_mxfp4_experts(el, d, inter, ipad, gen)
        w1 = (w13_q[:, :ipad], w13_s[:, :ipad], w13_q[:, ipad:], w13_s[:, ipad:])
        # an expert's bytes the op must read (w13's padded rows are skipped; w2's padded columns share sectors),
        # and the padded count the figures before session 21 used
        b_exp = 2 * inter * d // 2 + 2 * inter * d // 32 + d * ipad // 2 + d * ipad // 32
        b_pad = 2 * ipad * d // 2 + 2 * ipad * d // 32 + d * ipad // 2 + d * ipad // 32
        for m in ms:
            base = M.default_moe_config(m, k, el, ipad, d, ep)
            xs, shared, lists, routed, n_act = B.routed_decode_batches(m, gw, bias, el, ep, base.xq_layout, gen, 8)
            ref = refs.moe_experts_ref(xs[0], routed[0][0], routed[0][1].long(), *w1, w2_q, w2_s, B.MOE_LIMIT, inter,
                                       shared[0])
            nbytes = n_act * b_exp + m * d * 2 + 2 * m * d * 4
            runs = [(base, False), (base, True)] if a.variants == "ordered" else \
                [(c, False) for c in variants(tp, m, base, a.variants, ipad, M.moe_candidates(m, k, el, ipad, d, ep))]
            for c, ordered in runs:
                def run(i, c=c, ordered=ordered):
                    return M.moe_experts(routed[i][2], routed[i][0], routed[i][1], w13_q, w13_s, w2_q, w2_s,
                                         B.MOE_LIMIT, inter, shared[i], c, ep, lists[i], ordered=ordered)
                err = refs.rel_err(run(0), ref)
                us, how = graph_time_us([lambda i=i: run(i) for i in range(len(routed))])
                row = dict(shape=tp, M=m, config=c.tag() + ("_ordered" if ordered else ""),
                           default=c == base and not ordered, us=round(us, 2),
                           pct_copy_bw=round(100 * nbytes / us / 1e3 / copy_gbps, 1),
                           pct_copy_bw_padded=round(100 * (nbytes + n_act * (b_pad - b_exp)) / us / 1e3 / copy_gbps,
                                                    1),
                           err=err, timing=how,
                           weight_MB=round(n_act * b_exp / 1e6, 1), active_experts=n_act)
                rows.append(row)
                print(json.dumps(row), flush=True)
            del xs, shared, routed
        del w13_q, w13_s, w2_q, w2_s, w1
        torch.cuda.empty_cache()
    with open(a.out, "w") as f:
        json.dump({"copy_GBps": copy_gbps, "rows": rows}, f, indent=1)
    print(f"\ncopy BW {copy_gbps:.0f} GB/s")
    print(f"{'shape':5} {'M':>2} {'config':58} {'us':>7} {'%copy':>6} {'vs default':>10}")
    for r in rows:
        b = next(x for x in rows if x["shape"] == r["shape"] and x["M"] == r["M"] and x["default"])
        print(f"{r['shape']:5} {r['M']:>2} {r['config']:58} {r['us']:7.2f} {r['pct_copy_bw']:6.1f} "
              f"{r['us'] / b['us']:10.3f}")


if __name__ == "__main__":
    main()
