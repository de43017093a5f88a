"""Per-pair cost of the decode MoE GEMVs at fixed (token, expert) pairs: the same six experts run as one token's
picks (M = 1, one program row per pair), as six tokens' picks among M = 8 (full grid: one row per pair slot, the
other 42 rows empty; or an EP8 rank's pair list), with two pairs on one expert, and on random EP8 routings.

    python3 benchmarks/moe_ep_diag.py --out moe_ep_diag.json

V4.1 TP1-wide experts (5120 × 2304, 48 of them: one EP8 rank's block), one fixed decode config, 8 input sets with
disjoint experts (weights from HBM), CUDA-graph replay (`plugins.timing`). GPU only.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from dsflash.plugins import moe as M
from dsflash.plugins import refs
from dsflash.plugins.bench import measure_ceilings
from dsflash.plugins.moe_config import MoeConfig, local_pair_slots
from dsflash.plugins.timing import graph_time_us

DEV = "cuda"
D, INTER, TOPK, LOCAL, LIMIT, SETS = 5120, 2304, 6, 48, 10.0, 8
CFG = MoeConfig(True, 32, 256, 64, 256, 4, 3, 16, 4, 2, 1, True)   # the tuned TP1 / EP8 decode config (session 11)


def _pairs(m: int, picks: list[tuple[int, int]]) -> torch.Tensor:
    """ids int32 [m, k]: the listed (token, local expert) picks, every other pick another rank's (LOCAL)."""
    ids = torch.full((m, TOPK), LOCAL, dtype=torch.int32)
    used = [0] * m
    for t, e in picks:
        ids[t, used[t]] = e
        used[t] += 1
    return ids.to(DEV)


def _case(name: str, m: int, sets: list[torch.Tensor], ep: int, listed: bool, weights, gen, copy_gbps: float
          ) -> dict:
    w13_q, w13_s, w2_q, w2_s = weights
    expert_bytes = 3 * INTER * D // 2 + 3 * INTER * D // 32
    xs = [M.gemv16_act(refs.fp8_fake_quant_ref((torch.randn(m, D, device=DEV, generator=gen) * 2)))
          for _ in sets]
    topw = [torch.rand(m, TOPK, device=DEV, generator=gen) for _ in sets]
    lists = []
    for ids in sets:
        local = (ids.flatten() < LOCAL).nonzero().flatten().to(torch.int32)
        index = torch.zeros(m * TOPK, dtype=torch.int32, device=DEV)
        index[:local.numel()] = M.pair_entry(local, ids.flatten()[local])
        lists.append(M.LocalPairs(index, torch.tensor([local.numel()], dtype=torch.int32, device=DEV))
                     if listed else None)
    shared = [torch.randn(m, D, device=DEV, generator=gen) for _ in sets]
    distinct = statistics.mean(len(torch.unique(i[i < LOCAL])) for i in sets)
    pairs = statistics.mean(int((i < LOCAL).sum()) for i in sets)
    slots = local_pair_slots(m * TOPK, ep)
    us, _ = graph_time_us([lambda i=i: M.moe_experts(xs[i], topw[i], sets[i], w13_q, w13_s, w2_q, w2_s, LIMIT, INTER,
                                                      shared[i], CFG, ep, lists[i]) for i in range(len(sets))])
    hps = [M.gemv_w13(xs[i], topw[i], sets[i], w13_q, w13_s, INTER, LIMIT, CFG, None, None, lists[i], slots)
           for i in range(len(sets))]
    outs = [torch.zeros(m, D, device=DEV) for _ in sets]
    us13, _ = graph_time_us([lambda i=i: M.gemv_w13(xs[i], topw[i], sets[i], w13_q, w13_s, INTER, LIMIT, CFG, None,
                                                     None, lists[i], slots) for i in range(len(sets))])
    us2, _ = graph_time_us([lambda i=i: M.gemv_w2(hps[i], sets[i], w2_q, w2_s, outs[i], CFG, lists[i], slots)
                            for i in range(len(sets))])
    pct = 100 * distinct * expert_bytes / us / 1e3 / copy_gbps
    print(f"{name:38s} pairs {pairs:5.2f} distinct {distinct:5.2f}  experts {us:6.1f} us ({pct:4.1f} %)  "
          f"w13 {us13:6.1f}  w2 {us2:6.1f}", flush=True)
    return {"case": name, "M": m, "pairs": pairs, "distinct_experts": distinct, "us": us, "w13_us": us13,
            "w2_us": us2, "pct_copy_bw": pct, "ep": ep, "pair_list": listed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    ceil = measure_ceilings()
    gen = torch.Generator(device=DEV).manual_seed(1)
    weights = refs.random_mxfp4_experts(LOCAL, D, INTER, INTER, gen)
    six = range(SETS)
    cases = [
        ("m1 six experts, full grid", 1, [_pairs(1, [(0, 6 * s + j) for j in range(6)]) for s in six], 1, False),
        ("m8 six pairs of token 0, full grid", 8, [_pairs(8, [(0, 6 * s + j) for j in range(6)]) for s in six], 1,
         False),
        ("m8 six pairs of 6 tokens, full grid", 8, [_pairs(8, [(j, 6 * s + j) for j in range(6)]) for s in six], 1,
         False),
        ("m8 six pairs of 6 tokens, ep8 list", 8, [_pairs(8, [(j, 6 * s + j) for j in range(6)]) for s in six], 8,
         True),
        ("m8 six pairs on 5 experts, ep8 list", 8,
         [_pairs(8, [(j, 6 * s + min(j, 4)) for j in range(6)]) for s in six], 8, True),
        ("m2 six pairs of 2 tokens, full grid", 2, [_pairs(2, [(j % 2, 6 * s + j) for j in range(6)]) for s in six],
         1, False),
    ]
    for m in (3, 8, 16):   # one EP8 rank (experts 0..47) of random top-6 routings over 384 experts
        sets = []
        for _ in six:
            g = torch.stack([torch.randperm(8 * LOCAL, generator=gen, device=DEV)[:TOPK] for _ in range(m)])
            sets.append(torch.where(g < LOCAL, g, LOCAL).to(torch.int32))
        cases.append((f"ep8 m{m} random routing, ep8 list", m, sets, 8, True))
    rows = [_case(*c, weights, gen, ceil["copy_GBps"]) for c in cases]
    with open(args.out, "w") as f:
        json.dump({"ceilings": ceil, "config": CFG.tag(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
