"""One EP8 rank's decode MoE (48 of 384 V4.1 experts) against the program rows of its pair-list grid (GPU).

`moe.local_pair_slots` sizes the grid of the decode GEMVs for the pairs a rank gets on average plus two standard
deviations; a rank with more runs them as second passes. This sweeps that row count (mean, mean + σ, the rule,
the rule + 4, all T·k) with and without PDL and at three w13 split-K counts, the `moe_experts` op timed over 8
routings (CUDA-graph replay), parity against `moe_experts_ref` on the first. Writes `--out` JSON.

    python3 benchmarks/moe_ep_slots.py --out moe_ep_slots.json
"""
import argparse
import dataclasses
import json
import math

import torch

from dsflash.plugins import moe as M
from dsflash.plugins import refs
from dsflash.plugins.bench import routed_decode_batches
from dsflash.plugins.timing import graph_time_us

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--out", required=True)
out_path = ap.parse_args().out
dev = "cuda"
d, e, k, ep = 5120, 384, 6, 8
el = e // ep
gen = torch.Generator(device=dev).manual_seed(3)
gw = (torch.randn(e, d, device=dev, generator=gen) * 0.02).to(torch.bfloat16)
bias = torch.randn(e, device=dev, generator=gen) * 0.05
gen.manual_seed(4 + 2)   # the bench's EP8 weights (its third shape)
W = refs.random_mxfp4_experts(el, d, 2304, 2304, gen)
w13_q, w13_s, w2_q, w2_s = W
b13 = 2 * 2304 * d // 2 + 2 * 2304 * d // 32
b2 = d * 2304 // 2 + d * 2304 // 32
orig = M.local_pair_slots
COPY_GBPS = 4244   # the H200 copy bandwidth of the kernel bench (kernels_h200.json), for the pct column
res = []
for m in (3, 8):
    sets = 8
    cfg0 = M.default_moe_config(m, k, el, 2304, d, ep)
    xs, shared, lists, routed, n_act = routed_decode_batches(m, gw, bias, el, ep, cfg0.xq_layout, gen, sets)
    npairs = [int((r[1] < el).sum()) for r in routed]
    p = m * k
    base = orig(p, ep)
    ref = refs.moe_experts_ref(xs[0], routed[0][0], routed[0][1].long(), w13_q[:, :2304], w13_s[:, :2304],
                               w13_q[:, 2304:], w13_s[:, 2304:], w2_q, w2_s, 10.0, 2304, shared[0])
    for slots in sorted({max(1, math.ceil(p / ep)), math.ceil(p / ep + math.sqrt(p / ep)), base, min(p, base + 4), p}):
        for pdl in (False, True):
            for split13 in sorted({cfg0.split13, max(1, cfg0.split13 // 2), cfg0.split13 * 2}):
                cfg = dataclasses.replace(cfg0, pdl=pdl, split13=split13)
                M.local_pair_slots = lambda pairs, ep_, s=slots: s
                out = M.moe_experts(routed[0][2], routed[0][0], routed[0][1], w13_q, w13_s, w2_q, w2_s, 10.0, 2304,
                                    shared[0], cfg, ep, lists[0])
                err = refs.rel_err(out, ref)
                us, _ = graph_time_us([lambda i=i: M.moe_experts(routed[i][2], routed[i][0], routed[i][1], w13_q, w13_s,
                                                                 w2_q, w2_s, 10.0, 2304, shared[i], cfg, ep, lists[i])
                                       for i in range(sets)])
                row = dict(M=m, slots=slots, base_slots=base, pdl=pdl, split13=split13, us=us, err=err, n_act=n_act,
                           pairs=npairs, pct=100 * n_act * (b13 + b2) / us / 1e3 / COPY_GBPS)
                res.append(row)
                print(json.dumps(row), flush=True)
M.local_pair_slots = orig
with open(out_path, "w") as f:
    json.dump(res, f, indent=1)
