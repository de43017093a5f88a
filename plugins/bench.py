"""Kernel benchmark (`make bench-kernels`, GPU): every plugin against its reference path and the measured ceilings.

    python -m dsflash.plugins.bench --out results.json [--sections mhc,act,gemm,moe,wo_a,gemm_v4,moe_v4,slots]
                                    [--ms 1,3,8,64,257,4096]
                                    [--merge]   (replace only the rows of the sections and M run, keep the file's others)
                                    [--gemm-shapes 'wq_b[tp1],...'] [--moe-shapes tp1,tp8,ep8]

One table: op, shape, M, time (µs, CUDA-graph replay over rotating input sets so weights come from HBM, not L2),
GB/s (bytes the op must move), TFLOP/s, % of the measured ceiling (copy bandwidth or matrix rate, whichever bounds
the op), the reference path's time in the same run and the speedup, and ‖Δ‖/‖ref‖ parity. V4.1-Flash shapes for TP1
and one TP8 rank; `slots`: the decode-slot attention kernels (RoPE + quant, attention, index scores) at one TP8
rank against the torch ops they replace; `gemm_v4` / `moe_v4`: the FP8 GEMM and the MoE at V4-Flash shapes with its 1×128 activation
groups (rows "v4_..."). The ceilings (device-to-device copy, `torch._scaled_mm` FP8 and BF16 matmul at 8192³) are
measured in the same run. Also writes the per-shape winners (tile config; FP8 vs BF16-cache) in tuned.json's format.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
import traceback

import torch

from dsflash.plugins import refs, tuning
from dsflash.plugins.timing import graph_time_many, graph_time_us, input_sets

DEV = "cuda"
HIDDEN = 5120
HC_ITERS, HC_EPS, NORM_EPS = 20, 1e-6, 1e-20

# (name, N, K, tp): V4.1-Flash dense FP8 linears; TP8 rows are one rank's shard
GEMM_SHAPES = [
    ("wq_a", 1280, 5120, "tp1/tp8"),
    ("wkv", 512, 5120, "tp1/tp8"),
    ("wq_b", 32768, 1280, "tp1"),
    ("wo_b", 5120, 8192, "tp1"),
    ("shexp_w13", 4608, 5120, "tp1"),
    ("shexp_w2", 5120, 2304, "tp1"),
    ("idx_wq_b", 4096, 1280, "tp1"),
    ("wq_b", 4096, 1280, "tp8"),
    ("wo_b", 5120, 1024, "tp8"),
    ("shexp_w13", 576, 5120, "tp8"),
    ("shexp_w2", 5120, 288, "tp8"),
]
# V4-Flash (1×128 activation groups, 128×128 weight blocks): the `gemm_v4` section, rows prefixed "v4_"
GEMM_V4_SHAPES = [
    ("wq_a", 1024, 4096, "tp1/tp8"),
    ("wq_b", 32768, 1024, "tp1"),
    ("wo_b", 4096, 8192, "tp1"),
    ("shexp_w13", 4096, 4096, "tp1"),
    ("shexp_w2", 4096, 2048, "tp1"),
    ("wq_b", 4096, 1024, "tp8"),
    ("wo_b", 4096, 1024, "tp8"),
    ("shexp_w13", 512, 4096, "tp8"),
    ("shexp_w2", 4096, 256, "tp8"),
]


# op-name prefixes of each section's rows (for --merge)
SECTION_OPS = {"mhc": ("hc_", "mhc_site", "mhc"), "act": ("act_quant", "rmsnorm_act_quant", "rmsnorm", "act"),
               "gemm": ("fp8_gemm", "bf16_cache_gemm", "scaled_mm", "gemm"), "moe": ("moe",), "wo_a": ("wo_a",),
               "gemm_v4": ("v4_fp8_gemm", "v4_bf16_cache_gemm", "v4_scaled_mm"), "moe_v4": ("v4_moe",),
               "slots": ("rope_quant", "slot_attention", "slot_index")}


def replaced_by_run(row: dict, sections: list[str], ms: list[int], moe_only: set[str] | None = None,
                    gemm_only: set[str] | None = None) -> bool:
    """Whether a row of an earlier results file is one a `--merge` run of these sections, token counts and shapes
    replaces: its op belongs to a section run, its M was run, and, with `--moe-shapes`, an MoE row's shape
    ("tp1 ...", "ep8 ...") was among them (the router's row, timed with TP1, counts as TP1); with `--gemm-shapes`, a
    GEMM row's shape ("wq_b[tp1] ...")."""
    if row.get("M") not in ms or not any(row["op"].startswith(p) for sec in sections for p in SECTION_OPS[sec]):
        return False
    name = str(row.get("shape", "")).split(" ")[0]
    op = row["op"].removeprefix("v4_")
    if moe_only and op.startswith("moe"):
        return (name if name in ("tp1", "tp8", "ep8") else "tp1") in moe_only
    if gemm_only and op.startswith(SECTION_OPS["gemm"]):
        return name in gemm_only
    return True


def merged_results(previous: dict, result: dict, sections: list[str], ms: list[int],
                   moe_only: set[str] | None = None, gemm_only: set[str] | None = None) -> dict:
    """An earlier results file with a `--merge` run folded in: the run's rows replace the ones it re-ran
    (`replaced_by_run`), the others and the earlier ceilings are kept, the run is listed in `merged_runs`, and its
    `tuned` entries replace those of the same NxK@bucket key while the other buckets' entries stay."""
    doc = dict(previous)
    doc["rows"] = [r for r in previous["rows"] if not replaced_by_run(r, sections, ms, moe_only, gemm_only)] \
        + result["rows"]
    doc["targets"] = targets(doc["rows"])
    doc["merged_runs"] = previous.get("merged_runs", []) + [
        {k: result[k] for k in ("machine", "command", "ceilings") if k in result} | {"sections": sections}]
    doc["tuned"] = previous.get("tuned", {}) | result.get("tuned", {})
    return doc


def write_results(path: str, doc: dict) -> None:
    """Write a results file whole or not at all: through `<path>.part` and a rename, so a run stopped mid-write
    leaves the earlier file, which the next `--merge` reads, intact."""
    part = f"{path}.part"
    with open(part, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    os.replace(part, path)


# -- timing -----------------------------------------------------------------------------------------------------------
def _event_time_us(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(reps):
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1000)
    return statistics.median(ts)


def measure_ceilings() -> dict:
    """Copy bandwidth (bytes read + written, best of memcpy and an elementwise kernel over 4.3 GB) and the FP8 / BF16
    matrix rates at 8192³ on random data, after a warm-up that brings the clocks up."""
    a16 = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    b16 = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    t_end = time.time() + 1.5
    while time.time() < t_end:  # warm-up
        for _ in range(20):
            a16 @ b16.t()
        torch.cuda.synchronize()
    n = 1 << 31
    src = torch.randn(n // 4, device=DEV).view(torch.bfloat16)   # 2^30 bf16 elements: 4.3 GB moved per copy
    dst = torch.empty_like(src)
    t_copy = _event_time_us(lambda: dst.copy_(src))
    t_neg = _event_time_us(lambda: torch.neg(src, out=dst))
    nbytes = 2 * src.numel() * src.element_size()
    del src, dst
    a = torch.randn(8192, 8192, device=DEV).to(torch.float8_e4m3fn)
    b = torch.randn(8192, 8192, device=DEV).to(torch.float8_e4m3fn)
    one = torch.ones((), device=DEV)
    t_fp8 = _event_time_us(lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16), 20)
    t_bf16 = _event_time_us(lambda: a16 @ b16.t(), 20)
    flops = 2 * 8192 ** 3
    return {"copy_GBps": nbytes / min(t_copy, t_neg) / 1e3, "memcpy_GBps": nbytes / t_copy / 1e3,
            "elementwise_GBps": nbytes / t_neg / 1e3, "fp8_scaled_mm_TFLOPs": flops / t_fp8 / 1e6,
            "bf16_mm_TFLOPs": flops / t_bf16 / 1e6}


def _row(op, shape, m, us, ref_us, nbytes, flops, ceil, err, **extra) -> dict:
    t_bw = nbytes / (ceil["copy_GBps"] * 1e3)
    rate = ceil["fp8_scaled_mm_TFLOPs"] if extra.get("rate") == "fp8" else ceil["bf16_mm_TFLOPs"]
    t_mm = flops / (rate * 1e6) if flops else 0.0
    extra.pop("rate", None)
    return {"op": op, "shape": shape, "M": m, "us": us, "GBps": nbytes / us / 1e3, "TFLOPs": flops / us / 1e6,
            "pct_ceiling": 100 * max(t_bw, t_mm) / us, "bound": "mem" if t_bw >= t_mm else "mma",
            "pct_copy_bw": 100 * t_bw / us, "ref_us": ref_us, "speedup": (ref_us / us) if ref_us else None,
            "err": err, **extra}


# -- sections ---------------------------------------------------------------------------------------------------------
def bench_act(ceil: dict, ms: list[int]) -> list[dict]:
    from dsflash.plugins.act_quant import act_quant, rmsnorm, rmsnorm_act_quant, rmsnorm_pair
    rows = []
    for name, k, norm in (("act_quant", HIDDEN, False), ("act_quant", 8192, False), ("rmsnorm_act_quant", 1280, True)):
        w = torch.rand(k, device=DEV) + 0.5
        for m in ms:
            nbytes = m * k * (2 + 1) + m * (k // 32) * 4 + (m * k * 2 if norm else 0) + (k * 4 if norm else 0)
            xs = [(torch.randn(m, k, device=DEV) * 3).to(torch.bfloat16) for _ in range(input_sets(nbytes, 16))]
            if norm:
                f = [lambda x=x: rmsnorm_act_quant(x, w, 1e-6) for x in xs]
                r = [lambda x=x: refs.rmsnorm_act_quant_ref(x, w, 1e-6) for x in xs]
                got, want = rmsnorm_act_quant(xs[0], w, 1e-6)[1:], refs.rmsnorm_act_quant_ref(xs[0], w, 1e-6)[1:]
            else:
                f = [lambda x=x: act_quant(x) for x in xs]
                r = [lambda x=x: refs.act_quant_ref(x) for x in xs]
                got, want = act_quant(xs[0]), refs.act_quant_ref(xs[0])
            err = refs.rel_err(refs.act_dequant_ref(*got), refs.act_dequant_ref(*want))
            us, how = graph_time_us(f)
            ref_us, _ = graph_time_us(r)
            rows.append(_row(name, f"{m}x{k}", m, us, ref_us, nbytes, 0, ceil, err, timing=how))
    # the norm plugin (q_norm 1280, kv_norm 512, the hidden 5120) against the model's torch RMSNorm
    for k in (512, 1280, HIDDEN):
        w = torch.rand(k, device=DEV) + 0.5
        for m in ms:
            nbytes = 2 * m * k * 2 + k * 4
            xs = [(torch.randn(m, k, device=DEV) * 3).to(torch.bfloat16) for _ in range(input_sets(nbytes, 16))]
            err = refs.rel_err(rmsnorm(xs[0], w, 1e-6), refs.rmsnorm_ref(xs[0], w, 1e-6))
            us, how = graph_time_us([lambda x=x: rmsnorm(x, w, 1e-6) for x in xs])
            ref_us, _ = graph_time_us([lambda x=x: refs.rmsnorm_ref(x, w, 1e-6) for x in xs])
            rows.append(_row("rmsnorm", f"{m}x{k}", m, us, ref_us, nbytes, 0, ceil, err, timing=how))
    # q_norm and kv_norm in one launch, on the two column slices of the stacked wq_a|wkv output, against the two
    # launches of the norm plugin (`two_launches_us`) and the torch reference
    ka, kb = 1280, 512
    wa, wb = torch.rand(ka, device=DEV) + 0.5, torch.rand(kb, device=DEV) + 0.5
    for m in ms:
        nbytes = 2 * m * (ka + kb) * 2 + (ka + kb) * 4
        xs = [(torch.randn(m, ka + kb, device=DEV) * 3).to(torch.bfloat16).split([ka, kb], -1)
              for _ in range(input_sets(nbytes, 16))]
        got = rmsnorm_pair(xs[0][0], wa, xs[0][1], wb, 1e-6)
        want = refs.rmsnorm_pair_ref(xs[0][0], wa, xs[0][1], wb, 1e-6)
        err = max(refs.rel_err(g, w) for g, w in zip(got, want))
        us, how = graph_time_us([lambda a=a, b=b: rmsnorm_pair(a, wa, b, wb, 1e-6) for a, b in xs])
        two_us, _ = graph_time_us([lambda a=a, b=b: (rmsnorm(a, wa, 1e-6), rmsnorm(b, wb, 1e-6)) for a, b in xs])
        ref_us, _ = graph_time_us([lambda a=a, b=b: refs.rmsnorm_pair_ref(a, wa, b, wb, 1e-6) for a, b in xs])
        rows.append(_row("rmsnorm_pair", f"{m}x({ka}+{kb})", m, us, ref_us, nbytes, 0, ceil, err, timing=how,
                         two_launches_us=two_us))
    return rows


def mhc_weights(k: int, gen: torch.Generator | None = None, device=DEV):
    """Random parameters of one mHC site over 4·D = k: fn [24, k] fp32 (mixes of O(1)), base [24], scale [3]."""
    fn = torch.randn(24, k, device=device, generator=gen) * k ** -0.5
    return fn, torch.randn(24, device=device, generator=gen) * 0.5, torch.rand(3, device=device, generator=gen) + 0.5


def randomize_mhc(block, gen: torch.Generator) -> None:
    """Fill the two mHC sites of a V4.1 block (`hc_{attn,ffn}_{fn,base,scale}`) with `mhc_weights`."""
    with torch.no_grad():
        for site in ("attn", "ffn"):
            for name, t in zip(("fn", "base", "scale"), mhc_weights(block.hc_attn_fn.shape[1], gen,
                                                                     block.hc_attn_fn.device)):
                getattr(block, f"hc_{site}_{name}").copy_(t)


def bench_mhc(ceil: dict, ms: list[int]) -> list[dict]:
    from dsflash.plugins.mhc import hc_mix, hc_post, hc_pre
    rows = []
    d = HIDDEN
    k = 4 * d
    fn, base, scale = mhc_weights(k)
    h = refs.hc_split_weight(fn)
    w = torch.rand(d, device=DEV) + 0.5
    for t in ms:
        per_set = t * 4 * d * 2 * 3
        sets = []
        for _ in range(input_sets(per_set, 16)):
            X = (torch.randn(t, 4, d, device=DEV) * 2).to(torch.bfloat16)
            fx = torch.randn(t, d, device=DEV).to(torch.bfloat16)
            pre, post, comb = refs.hc_mix_ref(X.flatten(1), fn, base, scale, 4, HC_ITERS, HC_EPS, NORM_EPS)
            sets.append((X, fx, pre, post, comb))
        X, fx, pre, post, comb = sets[0]
        # (b) coefficients vs fp32
        got = hc_mix(X.flatten(1), h, base, scale, HC_ITERS, HC_EPS, NORM_EPS)
        err = max(refs.rel_err(g, r) for g, r in zip(got, (pre, post, comb)))
        us, how = graph_time_us([lambda s=s: hc_mix(s[0].flatten(1), h, base, scale, HC_ITERS, HC_EPS, NORM_EPS)
                                  for s in sets])
        ref_us, _ = graph_time_us([lambda s=s: refs.hc_mix_ref(s[0].flatten(1), fn, base, scale, 4, HC_ITERS,
                                                                HC_EPS, NORM_EPS) for s in sets])
        nb = t * k * 2 + 3 * 32 * k * 2 + t * 24 * 4
        rows.append(_row("hc_mix", f"{t}x4x{d}", t, us, ref_us, nb, 2 * t * k * 24 * 3, ceil, err, timing=how))
        # (a) collapse + norm + quant
        g = hc_pre(X, pre, w, NORM_EPS, True)
        r = refs.hc_pre_ref(X, pre, w, NORM_EPS, True)
        err = max(refs.rel_err(g[0], r[0]), refs.rel_err(refs.act_dequant_ref(g[1], g[2]), refs.act_dequant_ref(r[1], r[2])))
        us, how = graph_time_us([lambda s=s: hc_pre(s[0], s[2], w, NORM_EPS, True) for s in sets])
        ref_us, _ = graph_time_us([lambda s=s: refs.hc_pre_ref(s[0], s[2], w, NORM_EPS, True) for s in sets])
        nb = t * 4 * d * 2 + t * d * (2 + 1) + t * d // 32 * 4
        rows.append(_row("hc_pre+quant", f"{t}x4x{d}", t, us, ref_us, nb, 0, ceil, err, timing=how))
        # (c) expand, and expand fused with the next collapse + norm + quant
        g = hc_post(X, fx, post, comb)
        err = refs.rel_err(g, refs.hc_post_ref(X, fx, post, comb))
        us, how = graph_time_us([lambda s=s: hc_post(s[0], s[1], s[3], s[4]) for s in sets])
        ref_us, _ = graph_time_us([lambda s=s: refs.hc_post_ref(s[0], s[1], s[3], s[4]) for s in sets])
        nb = t * 4 * d * 2 * 2 + t * d * 2
        rows.append(_row("hc_post", f"{t}x4x{d}", t, us, ref_us, nb, 0, ceil, err, timing=how))
        g = hc_post(X, fx, post, comb, pre, w, NORM_EPS, True)
        r = refs.hc_post_ref(X, fx, post, comb, pre, w, NORM_EPS, True)
        err = max(refs.rel_err(g[0], r[0]), refs.rel_err(g[1], r[1]),
                  refs.rel_err(refs.act_dequant_ref(g[2], g[3]), refs.act_dequant_ref(r[2], r[3])))
        us_post, how = graph_time_us([lambda s=s: hc_post(s[0], s[1], s[3], s[4], s[2], w, NORM_EPS, True)
                                       for s in sets])
        ref_post, _ = graph_time_us([lambda s=s: refs.hc_post_ref(s[0], s[1], s[3], s[4], s[2], w, NORM_EPS, True)
                                      for s in sets])
        nb = t * 4 * d * 2 * 2 + t * d * 2 + t * d * (2 + 1) + t * d // 32 * 4
        rows.append(_row("hc_post+pre+quant", f"{t}x4x{d}", t, us_post, ref_post, nb, 0, ceil, err, timing=how))
        nb_site = nb + t * k * 2 + 3 * 32 * k * 2

        # one V4.1 site: coefficients + expand fused with the next (lagged-pre) collapse, norm and FP8 quant
        def fused(s):
            p, q, c = hc_mix(s[0].flatten(1), h, base, scale, HC_ITERS, HC_EPS, NORM_EPS)
            return hc_post(s[0], s[1], q, c, p, w, NORM_EPS, True)

        def unfused(s):
            p, q, c = refs.hc_mix_ref(s[0].flatten(1), fn, base, scale, 4, HC_ITERS, HC_EPS, NORM_EPS)
            return refs.hc_post_ref(s[0], s[1], q, c, p, w, NORM_EPS, True)
        us, how = graph_time_us([lambda s=s: fused(s) for s in sets])
        ref_us, _ = graph_time_us([lambda s=s: unfused(s) for s in sets])
        rows.append(_row("mhc_site", f"{t}x4x{d}", t, us, ref_us, nb_site, 0, ceil, None, timing=how))
    return rows


def bench_gemm(ceil: dict, ms: list[int], tuned: dict, deadline: float, only: set[str] | None = None,
               shapes: list = GEMM_SHAPES, group: int = 32) -> list[dict]:
    """The FP8 GEMM rows: V4.1 (group 32) or, with group 128 and GEMM_V4_SHAPES, V4 (ops prefixed "v4_")."""
    from dsflash.plugins.act_quant import act_quant_dequant
    from dsflash.plugins.fp8_gemm import bf16_cache_weight, fp8_gemm, tile_weight
    from dsflash.plugins.fp8_gemm_sm90 import weight_scales_f32
    from dsflash.plugins.registry import device_arch
    pre = "" if group == 32 else "v4_"
    rows = []
    one = torch.ones((), device=DEV)
    # decode and large-M first (the targets), should the time budget run out
    order = sorted(ms, key=lambda m: (0 if m in (1, 8) else 1 if m >= 4096 else 2, m))
    for m in order:
        for name, n, k, tp in shapes:
            if only and f"{name}[{tp}]" not in only:
                continue
            shape = f"{name}[{tp}] {n}x{k}"
            if time.time() > deadline:
                rows.append({"op": pre + "fp8_gemm", "shape": shape, "M": m, "error": "skipped: time budget"})
                continue
            try:
                nb_w = n * k + (n // 32) * (k // 32)
                nbytes = nb_w + m * k * (1 + 1 / 32) + m * n * 2
                n_sets = input_sets(nb_w + m * k)
                ws = []
                for _ in range(n_sets):
                    w_q, w_s = refs.quant_weight_fp8_ref(torch.randn(n, k, device=DEV) * 0.02, group)
                    ws.append((w_q, w_s))
                xs = [(torch.randn(m, k, device=DEV) * 2).to(torch.bfloat16) for _ in range(n_sets)]
                acts = [refs.act_quant_ref(x, "e8m0", block=group) for x in xs]   # as fp8_linear quantizes
                acts16 = [(refs.codes16_ref(q), s) for q, s in acts]   # what acc16 GEMVs read
                acts32 = [(q, refs.scale_to_fp32(s)) for q, s in acts]   # what sm90 configs read (fp8_linear_config)
                ws_t = [weight_scales_f32(wp[1], tma=True) for wp in ws]   # an FP8Linear holds them
                ref32 = refs.fp8_gemm_ref(*acts[0], *ws[0], torch.float32)
                flops = 2 * m * n * k
                # Every path of this shape is built and checked first, then all are timed together, their replays
                # interleaved (`graph_time_many`): a large-M FP8 GEMM meets the card's power limit within ~50 ms and
                # the clock then drops, so paths timed one after another would be compared at different clocks
                # (benchmarks/README.md "Session 27").
                # reference path: torch fake-quant + F.linear on the dequantized BF16 weight (what model_def runs)
                w16 = [bf16_cache_weight(*wp) for wp in ws]
                timed = {"ref": [lambda i=i: torch.nn.functional.linear(refs.act_fake_quant_ref(xs[i], group), w16[i])
                                 for i in range(n_sets)]}
                # FP8 kernel: every candidate config
                dflt_cfg = tuning.default_config(n, k, m, device_arch(torch.device(DEV, torch.cuda.current_device())),
                                                 group)
                errs = {}
                tiled = {}
                for cfg in tuning.candidates(n, k, m, group):
                    if cfg.quant_in_kernel:   # takes the bf16 activation: timed in benchmarks/decode_chain.py
                        continue
                    try:
                        layout = (cfg.block_p, cfg.kgroups, cfg.dequant_bf16)   # what tile_weight depends on
                        if cfg.tiled_w and layout not in tiled:
                            tiled[layout] = [tile_weight(wp[0], cfg) for wp in ws]
                        wt = tiled[layout] if cfg.tiled_w else [None] * n_sets
                        a = acts16 if cfg.acc16 else acts32 if cfg.sm90 else acts
                        out = fp8_gemm(*a[0], *ws[0], cfg, w_tiled=wt[0], group=group, w_s_t=ws_t[0])
                        errs[cfg] = refs.rel_err(out, ref32)
                        timed[cfg] = [lambda i=i, c=cfg, wt=wt, a=a: fp8_gemm(*a[i], *ws[i], c, w_tiled=wt[i],
                                                                              group=group, w_s_t=ws_t[i])
                                      for i in range(n_sets)]
                    except Exception as e:  # a config that fails to compile/launch is reported, not fatal
                        rows.append({"op": pre + "fp8_gemm", "shape": shape, "M": m, "config": cfg.tag(),
                                     "error": f"{type(e).__name__}: {str(e)[:300]}"})
                if not errs:
                    raise RuntimeError("no FP8 GEMM config ran")
                # BF16-cache path: fused quantize/dequantize kernel + cuBLAS BF16
                out16 = torch.matmul(act_quant_dequant(xs[0], block=group), w16[0].t())
                err16 = refs.rel_err(out16, ref32)
                timed["bf16"] = [lambda i=i: torch.matmul(act_quant_dequant(xs[i], block=group), w16[i].t())
                                 for i in range(n_sets)]
                # ceiling at the same shape: torch._scaled_mm (per-tensor scales) on the kernels' own e4m3 codes,
                # where cuBLAS takes the shape
                if m % 16 == 0:
                    timed["smm"] = [lambda i=i: torch._scaled_mm(acts[i][0], ws[i][0].t(), scale_a=one, scale_b=one,
                                                                 out_dtype=torch.bfloat16) for i in range(n_sets)]
                times = dict(zip(timed, graph_time_many(list(timed.values()))))
                ref_us = times["ref"][0]
                best = default_row = None
                tried = []
                for cfg, err in errs.items():
                    us, how = times[cfg]
                    cand = _row(pre + "fp8_gemm", shape, m, us, ref_us, nbytes, flops, ceil, err, rate="fp8",
                                config=cfg.tag(), cfg=cfg.to_dict(), default=cfg == dflt_cfg,
                                timing=how, weight_MB=nb_w / 1e6)
                    tried.append([cfg.tag(), round(us, 2), err])
                    if best is None or us < best["us"]:
                        best = cand
                    if cand["default"]:
                        default_row = cand
                us16, how = times["bf16"]
                nbytes16 = 2 * n * k + m * k * 2 * 3 + m * n * 2
                rows.append(best | {"op": pre + "fp8_gemm[tuned]", "candidates": tried})
                if not best["default"] and default_row is not None:
                    rows.append(default_row | {"op": pre + "fp8_gemm[default]"})
                rows.append(_row(pre + "bf16_cache_gemm", shape, m, us16, ref_us, nbytes16, flops, ceil, err16,
                                 rate="bf16", timing=how, weight_MB=2 * n * k / 1e6))
                if "smm" in times:
                    smm_us = times["smm"][0]
                    rows.append(_row(pre + "scaled_mm(fp8 ceiling)", shape, m, smm_us, None, nbytes, flops, ceil, None,
                                     rate="fp8") | {"fp8_gemm_vs_scaled_mm": smm_us / best["us"]})
                path = "fp8" if best["us"] <= us16 else "bf16cache"
                tuned[pre + tuning.key_str(n, k, tuning.m_bucket(m))] = {"path": path, "config": best["cfg"],
                                                                         "fp8_us": best["us"], "bf16cache_us": us16}
                del ws, xs, acts, w16, tiled, timed
            except Exception as e:
                rows.append({"op": pre + "fp8_gemm", "shape": shape, "M": m, "error": f"{type(e).__name__}: {e}",
                             "trace": traceback.format_exc()[-2000:]})
            torch.cuda.empty_cache()
    return rows


# -- MoE and WO-A -----------------------------------------------------------------------------------------------------
MOE_E, MOE_TOPK, MOE_LIMIT, MOE_SCALE = 384, 6, 10.0, 1.5
# (name, logical intermediate, padded, EP ranks): TP1, one TP8 rank (MoE-TP), one EP8 rank (48 experts of 384)
MOE_SHAPES = [("tp1", 2304, 2304, 1), ("tp8", 288, 320, 1), ("ep8", 2304, 2304, 8)]
# V4-Flash (`moe_v4`, rows "v4_moe..."): 256 experts of 2048, hidden 4096, top-6, activations quantized per 1×128
MOE_V4_SHAPES = [("tp1", 2048, 2048, 1), ("tp8", 256, 256, 1), ("ep8", 2048, 2048, 8)]


@dataclasses.dataclass(frozen=True)
class MoeFamily:
    """What `bench_moe` times: experts, hidden, top-k, shapes, the activation quantization block, the rows' prefix."""
    experts: int
    hidden: int
    topk: int
    shapes: tuple
    qblock: int
    prefix: str


MOE_V41 = MoeFamily(MOE_E, HIDDEN, MOE_TOPK, tuple(MOE_SHAPES), 32, "")
MOE_V4 = MoeFamily(256, 4096, 6, tuple(MOE_V4_SHAPES), 128, "v4_")
WO_A_SHAPES = [("tp1", 64, 8), ("tp8", 8, 1)]                   # (tp, local heads, local o_groups)
WO_A_D, WO_A_RD, WO_A_R = 512, 64, 1024


def _eager_time_us(calls: list, reps: int = 5) -> float:
    """Median per call of `calls` run eagerly (for references that sync with the host and cannot be captured)."""
    for c in calls[:2]:
        c()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for i in range(reps):
        e0.record()
        calls[i % len(calls)]()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1000)
    return statistics.median(ts)


def routed_decode_batches(m: int, gw: torch.Tensor, bias: torch.Tensor, local: int, ep: int, layout: str,
                          gen: torch.Generator, sets: int = 8, qblock: int = 32, topk: int = MOE_TOPK):
    """`sets` batches of m tokens routed as the MoE bench routes them (top-k over gw's experts, this rank holding the
    first `local`; EP ranks list their pairs): (activations BF16 [m, D], shared-expert outputs fp32,
    pair lists or None, router outputs (weights, ids, xq in `layout`), mean count of distinct local experts)."""
    from dsflash.plugins import moe as M
    d = gw.shape[1]
    xs = [(torch.randn(m, d, device=DEV, generator=gen) * 2).to(torch.bfloat16) for _ in range(sets)]
    shared = [torch.randn(m, d, device=DEV, generator=gen) for _ in range(sets)]
    lists = [M.local_pairs(m, topk, DEV) if ep > 1 else None for _ in xs]
    routed = [M.router(x, gw, bias, topk, MOE_SCALE, xq_layout=layout, local_experts=local, pairs=pl,
                       qblock=qblock) for x, pl in zip(xs, lists)]
    distinct = statistics.mean(len(torch.unique(r[1][r[1] < local])) for r in routed)
    return xs, shared, lists, routed, distinct


def bench_moe(ceil: dict, ms: list[int], deadline: float, fam: MoeFamily = MOE_V41,
              only: set[str] | None = None) -> list[dict]:
    """Router, the decode GEMV GEMMs (w13 + SwiGLU epilogue, w2 + weighted reduction) and the whole routed-expert
    pass at V4.1-Flash shapes (384 experts, top-6, hidden 5120; TP1, one TP8 rank, one EP8 rank: its 48 experts,
    routed over all 384), or V4-Flash's (`MOE_V4`: 256 experts of 2048, hidden 4096, 1×128 activations; rows
    prefixed "v4_"). Bytes = the distinct routed experts' MXFP4 weights + e8m0 scales on this rank (what the op must
    read) + activations in/out. only: these shapes ("tp1", "tp8", "ep8"; default all)."""
    from dsflash.plugins import moe as M
    from dsflash.plugins.registry import device_arch
    rows = []
    arch = device_arch(torch.device(DEV))   # the defaults and candidates `build` gives this GPU (sm90: `moe_f8`)
    d, e, k, qb, pre = fam.hidden, fam.experts, fam.topk, fam.qblock, fam.prefix
    gen = torch.Generator(device=DEV).manual_seed(3)
    gw = (torch.randn(e, d, device=DEV, generator=gen) * 0.02).to(torch.bfloat16)
    bias = torch.randn(e, device=DEV, generator=gen) * 0.05
    for i_shape, (tp, inter, ipad, ep) in enumerate(fam.shapes):
        if only and tp not in only:
            continue
        gen.manual_seed(4 + i_shape)   # each shape's experts and routing draws do not depend on which shapes ran
        el = e // ep   # this rank's experts: the first block (expert_start 0)
        w13_q, w13_s, w2_q, w2_s = refs.random_mxfp4_experts(el, d, inter, ipad, gen)
        w1 = (w13_q[:, :ipad], w13_s[:, :ipad], w13_q[:, ipad:], w13_s[:, ipad:])
        # one expert's w13 bytes the op must read: the rows past `inter` (a TP rank's zero padding) are skipped
        # (counted until session 20); w2's padded columns share sectors with real ones, so they count
        b13 = 2 * inter * d // 2 + 2 * inter * d // 32
        b2 = d * ipad // 2 + d * ipad // 32
        for m in ms:
            if time.time() > deadline:
                rows.append({"op": pre + "moe", "shape": tp, "M": m, "error": "skipped: time budget"})
                continue
            shape = (f"{tp} E{e}" + (f"/{el}" if ep > 1 else "") + f" k{k} {d}x{inter}"
                     + (f"(pad {ipad})" if ipad != inter else ""))
            try:
                n_sets = 8 if m <= 64 else 2
                cfg = M.default_moe_config(m, k, el, ipad, d, ep, qb, arch)
                lay = cfg.xq_layout
                # an EP rank lists its pairs, as `moe.moe` does: the decode GEMVs then launch for its share only
                xs, shared, lists, routed, n_act = routed_decode_batches(m, gw, bias, el, ep, lay, gen, n_sets, qb, k)
                p = m * k
                # router (+ the deploy activation quant it also writes)
                if tp == "tp1":
                    nb = e * d * 2 + m * d * 2 + m * d * (4 if cfg.gemv else 2) + p * 8
                    us, how = graph_time_us([lambda x=x: M.router(x, gw, bias, k, MOE_SCALE, xq_layout=lay, qblock=qb)
                                              for x in xs])
                    ref_us, _ = graph_time_us([lambda x=x: (refs.router_ref(x, gw, bias, k, MOE_SCALE),
                                                             refs.fp8_fake_quant_ref(x, qb)) for x in xs])
                    wr, ir = refs.router_ref(xs[0], gw, bias, k, MOE_SCALE)
                    same = (routed[0][1].long().sort(1).values == ir.sort(1).values).float().mean().item()
                    rows.append(_row(pre + "moe_router", f"E{e}xD{d} top{k}", m, us, ref_us, nb, 2 * m * e * d, ceil,
                                     None, timing=how, ids_match=same, config=f"xq={lay}"))
                ref_out = refs.moe_experts_ref(xs[0], routed[0][0], routed[0][1].long(), *w1, w2_q, w2_s, MOE_LIMIT,
                                               inter, shared[0], qb)
                ref_us = _eager_time_us([lambda i=i: refs.moe_experts_ref(xs[i], routed[i][0], routed[i][1].long(),
                                                                          *w1, w2_q, w2_s, MOE_LIMIT, inter,
                                                                          shared[i], qb) for i in range(n_sets)],
                                        reps=5 if m <= 64 else 2)
                nb_w = n_act * (b13 + b2)
                nb_act = m * d * 2 + 2 * m * d * 4
                flops = 2 * p * d * (2 * inter + inter)
                # the whole routed-expert pass, every candidate config
                best = None
                tried = []
                xq_in = {lay: [r[2] for r in routed]}
                for c in M.moe_candidates(m, k, el, ipad, d, ep, qb, arch):
                    try:   # each config reads its own activation layout (the router writes any of them)
                        if c.xq_layout not in xq_in:
                            xq_in[c.xq_layout] = [M.as_layout(r[2], c.xq_layout) for r in routed]
                        xin = xq_in[c.xq_layout]
                        out = M.moe_experts(xin[0], routed[0][0], routed[0][1], w13_q, w13_s, w2_q, w2_s,
                                            MOE_LIMIT, inter, shared[0], c, ep, lists[0], qb)
                        err = refs.rel_err(out, ref_out)
                        us, how = graph_time_us([lambda i=i, c=c, xin=xin: M.moe_experts(
                            xin[i], routed[i][0], routed[i][1], w13_q, w13_s, w2_q, w2_s, MOE_LIMIT, inter,
                            shared[i], c, ep, lists[i], qb) for i in range(n_sets)])
                    except Exception as ex:
                        rows.append({"op": pre + "moe_experts", "shape": shape, "M": m, "config": c.tag(),
                                     "error": f"{type(ex).__name__}: {str(ex)[:300]}"})
                        continue
                    tried.append([c.tag(), round(us, 2), err])
                    r = _row(pre + "moe_experts", shape, m, us, ref_us, nb_w + nb_act, flops, ceil, err, timing=how,
                             config=c.tag(), weight_MB=nb_w / 1e6, active_experts=n_act)
                    if best is None or us < best["us"]:
                        best, best_cfg = r, c
                if best is None:
                    raise RuntimeError("no MoE config ran")
                rows.append(best | {"op": pre + "moe_experts[tuned]", "candidates": tried})
                # the two GEMMs of the decode path on their own (best config; without PDL, which only matters
                # between different kernels: a launch chained to itself would hold SM slots waiting for its twin)
                if best_cfg.gemv:
                    best_cfg = dataclasses.replace(best_cfg, pdl=False, pdl2=False)
                    xin = xq_in[best_cfg.xq_layout]
                    slots = M.local_pair_slots(p, ep)
                    hps = [M.gemv_w13(xin[i], r[0], r[1], w13_q, w13_s, inter, MOE_LIMIT, best_cfg, None, None,
                                      lists[i], slots, qb) for i, r in enumerate(routed)]
                    outs = [torch.zeros(m, d, device=DEV) for _ in range(n_sets)]
                    us13, how = graph_time_us([lambda i=i: M.gemv_w13(xin[i], routed[i][0], routed[i][1],
                                                                       w13_q, w13_s, inter, MOE_LIMIT, best_cfg, None,
                                                                       None, lists[i], slots, qb)
                                                for i in range(n_sets)])
                    us2, _ = graph_time_us([lambda i=i: M.gemv_w2(hps[i], routed[i][1], w2_q, w2_s, outs[i],
                                                                   best_cfg, lists[i], slots) for i in range(n_sets)])
                    rows.append(_row(pre + "moe_w13_gemv", shape, m, us13, None, n_act * b13 + m * d * 4 + p * ipad * 4,
                                     2 * p * d * 2 * inter, ceil, None, timing=how, config=best_cfg.tag(),
                                     weight_MB=n_act * b13 / 1e6))
                    rows.append(_row(pre + "moe_w2_gemv", shape, m, us2, None,
                                     n_act * b2 + p * ipad * 4 + 2 * m * d * 4,
                                     2 * p * d * inter, ceil, None, timing=how, config=best_cfg.tag(),
                                     weight_MB=n_act * b2 / 1e6))
                # router + experts (the EP rank: the op as `moe.moe` runs it, with its pair list)
                if tp == "tp1" or ep > 1:
                    us, how = graph_time_us([lambda i=i: M.moe(xs[i], gw, bias, k, MOE_SCALE, w13_q, w13_s, w2_q,
                                                                w2_s, MOE_LIMIT, inter, shared[i], qblock=qb)
                                              for i in range(n_sets)])
                    ref_full = _eager_time_us([lambda i=i: refs.moe_ref(xs[i], gw, bias, k, MOE_SCALE, *w1, w2_q, w2_s,
                                                                        MOE_LIMIT, inter, shared[i], qblock=qb)
                                               for i in range(n_sets)], reps=5 if m <= 64 else 2)
                    rows.append(_row(pre + "moe(router+experts)", shape, m, us, ref_full, nb_w + nb_act + e * d * 2,
                                     flops, ceil, None, timing=how, weight_MB=nb_w / 1e6))
                del xs, shared, routed, xq_in
            except Exception as ex:
                rows.append({"op": pre + "moe", "shape": shape, "M": m, "error": f"{type(ex).__name__}: {ex}",
                             "trace": traceback.format_exc()[-2000:]})
            torch.cuda.empty_cache()
        del w13_q, w13_s, w2_q, w2_s, w1
        torch.cuda.empty_cache()
    return rows


def bench_wo_a(ceil: dict, ms: list[int]) -> list[dict]:
    """WO-A (inverse RoPE + grouped projection to o_lora_rank) at V4.1-Flash shapes, every tile candidate."""
    from dsflash.plugins.registry import device_arch
    from dsflash.plugins.wo_a import candidates, default_config, wo_a
    rows = []
    inv = 1.0 / (10000.0 ** (torch.arange(0, WO_A_RD, 2, dtype=torch.float64) / WO_A_RD)).float().to(DEV)
    for tp, h, g in WO_A_SHAPES:
        kg = h * WO_A_D // g
        nrows = g * WO_A_R
        nb_w = nrows * kg * 2
        n_sets = input_sets(nb_w, 24)
        ws = [(torch.randn(nrows, kg, device=DEV) * 0.02).to(torch.bfloat16) for _ in range(n_sets)]
        for m in ms:
            shape = f"{tp} H{h} G{g} {nrows}x{kg}"
            try:
                os_ = [(torch.randn(m, h, WO_A_D, device=DEV) * 2).to(torch.bfloat16) for _ in range(n_sets)]
                cs = [refs.rope_cos_sin_ref(torch.randint(0, 1 << 20, (m,), device=DEV), inv) for _ in range(n_sets)]
                ref = refs.wo_a_ref(os_[0], *cs[0], ws[0], torch.float32)
                ref_us, _ = graph_time_us([lambda i=i: refs.wo_a_ref(os_[i], *cs[i], ws[i]) for i in range(n_sets)])
                nb = nb_w + m * h * WO_A_D * 2 + m * WO_A_RD * 4 + m * nrows * 2
                flops = 2 * m * nrows * kg
                best, tried, dflt = None, [], None
                arch = dict(arch=device_arch(torch.device(DEV)), head_d=WO_A_D, rd=WO_A_RD)
                for c in candidates(m, nrows, kg, **arch):
                    out = wo_a(os_[0], *cs[0], ws[0], c)
                    err = refs.rel_err(out, ref)
                    us, how = graph_time_us([lambda i=i, c=c: wo_a(os_[i], *cs[i], ws[i], c) for i in range(n_sets)])
                    tried.append([c.tag(), round(us, 2), err])
                    r = _row("wo_a", shape, m, us, ref_us, nb, flops, ceil, err, timing=how, config=c.tag(),
                             weight_MB=nb_w / 1e6)
                    if c == default_config(m, nrows, kg, **arch):
                        dflt = r
                    if best is None or us < best["us"]:
                        best = r
                rows.append(best | {"op": "wo_a[tuned]", "candidates": tried})
                if dflt is not None and dflt is not best:
                    rows.append(dflt | {"op": "wo_a[default]"})
                del os_, cs
            except Exception as ex:
                rows.append({"op": "wo_a", "shape": shape, "M": m, "error": f"{type(ex).__name__}: {ex}",
                             "trace": traceback.format_exc()[-2000:]})
        del ws
        torch.cuda.empty_cache()
    return rows


# One TP8 rank's decode-slot attention glue (V4.1-Flash): 8 heads of 512 (RoPE on the last 64), window 128, top-512
# entries, 8 index heads of 128; the slots sized for max_seq_len 9216 (E = 4608 entries at ratio 2, 9216 at ratio 1)
# and filled to the seed's 8K-in / 1K-out positions
SLOT_H, SLOT_D, SLOT_RD, SLOT_W, SLOT_TOPK, SLOT_IH, SLOT_ID, SLOT_MAX_SEQ = 8, 512, 64, 128, 512, 8, 128, 9216
ROPE_SITES = [("q", (SLOT_H, SLOT_D), "none", 32), ("window_kv", (SLOT_D,), "fp8", 32),
              ("index_q", (SLOT_IH, SLOT_ID), "fp4_pow2", 32), ("entry", (SLOT_D,), "fp4_e4m3", 16)]


def bench_slots(ceil: dict, ms: list[int]) -> list[dict]:
    """The three decode-slot kernels (`rope_quant`, `slot_attention`, `slot_index_scores`) against their plain-PyTorch
    references (`refs.*_ref`: the torch ops the model runs without them), at decode batches M <= 64. RoPE angles are
    given (the model takes them once per step and table)."""
    from dsflash.plugins.rope_quant import rope_quant
    from dsflash.plugins.slot_attention import slot_attention
    from dsflash.plugins.slot_index import slot_index_scores
    rows = []
    bf = torch.bfloat16
    inv = 1.0 / (10000.0 ** (torch.arange(0, SLOT_RD, 2, dtype=torch.float64) / SLOT_RD)).float().to(DEV)
    for m in [m for m in ms if m <= 64]:
        pos = torch.randint(8192, SLOT_MAX_SEQ, (m,), device=DEV)
        cos, sin = (t.view(m, 1, -1) for t in refs.rope_cos_sin_ref(pos, inv))
        for site, tail, quant, block in ROPE_SITES:
            x = (torch.randn(m, 1, *tail, device=DEV) * 2).to(bf)
            err = refs.rel_err(rope_quant(x, cos, sin, False, quant, block),
                               refs.rope_quant_ref(x, cos, sin, False, quant, block))
            (us, how), (ref_us, _) = graph_time_many([[lambda: rope_quant(x, cos, sin, False, quant, block)],
                                                      [lambda: refs.rope_quant_ref(x, cos, sin, False, quant, block)]])
            rows.append(_row("rope_quant", f"{site} {quant} {m}x{'x'.join(map(str, tail))}", m, us, ref_us,
                             2 * x.numel() * 2, 0, ceil, err, timing=how))
        slots = m + 1
        slot_ids = torch.randperm(slots, device=DEV)[:m]
        for ratio in (2, 1):
            e = SLOT_MAX_SEQ // ratio
            shape = f"ratio {ratio} E{e} slots {slots}"
            try:
                q = (torch.randn(m, SLOT_H, SLOT_D, device=DEV) * 2).to(bf)
                ring = torch.randn(slots, SLOT_W, SLOT_D, device=DEV).to(bf)
                kv = torch.randn(slots, e + 1, SLOT_D, device=DEV).to(bf)
                kv[:, e] = 0
                visible = (pos + 1) // ratio
                sel = (torch.rand(m, SLOT_TOPK, device=DEV) * visible[:, None]).long()
                sink = torch.randn(SLOT_H, device=DEV)
                args = (q, ring, slot_ids, pos, kv, sel, sink, SLOT_D ** -0.5)
                err = refs.rel_err(slot_attention(*args), refs.slot_attention_ref(*args))
                (us, how), (ref_us, _) = graph_time_many([[lambda: slot_attention(*args)],
                                                          [lambda: refs.slot_attention_ref(*args)]])
                nb = m * (SLOT_W + SLOT_TOPK) * SLOT_D * 2 + 2 * q.numel() * 2
                rows.append(_row("slot_attention", shape, m, us, ref_us, nb, 0, ceil, err, timing=how))
                del kv, ring
                qi = (torch.randn(m, SLOT_IH, SLOT_ID, device=DEV) * 2).to(bf)
                wi = torch.randn(m, SLOT_IH, device=DEV)
                index_k = torch.randn(slots, e, SLOT_ID, device=DEV).to(bf)
                iargs = (qi, wi, index_k, slot_ids, pos, ratio, SLOT_ID ** -0.5)
                err = refs.rel_err(slot_index_scores(*iargs), refs.slot_index_scores_ref(*iargs))
                (us, how), (ref_us, _) = graph_time_many([[lambda: slot_index_scores(*iargs)],
                                                          [lambda: refs.slot_index_scores_ref(*iargs)]])
                nb = int(visible.sum()) * SLOT_ID * 2 + m * e * 4
                rows.append(_row("slot_index", shape, m, us, ref_us, nb, 2 * int(visible.sum()) * SLOT_IH * SLOT_ID,
                                 ceil, err, timing=how))
                del index_k
            except Exception as ex:
                rows.append({"op": "slot_attention", "shape": shape, "M": m, "error": f"{type(ex).__name__}: {ex}",
                             "trace": traceback.format_exc()[-2000:]})
        torch.cuda.empty_cache()
    return rows


# -- report -----------------------------------------------------------------------------------------------------------
def targets(rows: list[dict]) -> dict:
    dec, big, site, v4_dec, v4_big = [], [], [], [], []
    by_key = {}
    for r in rows:
        if "error" in r:
            continue
        by_key[(r["op"], r["shape"], r["M"])] = r
    for (op, shape, m), r in by_key.items():
        for pre, d, b in (("", dec, big), ("v4_", v4_dec, v4_big)):
            if op == pre + "fp8_gemm[tuned]" and m <= 8 and r.get("weight_MB", 0) >= 16:
                d.append({"shape": shape, "M": m, "pct_copy_bw": r["pct_copy_bw"], "pass": r["pct_copy_bw"] >= 60})
            if op == pre + "scaled_mm(fp8 ceiling)" and m >= 4096:
                b.append({"shape": shape, "M": m, "ratio": r["fp8_gemm_vs_scaled_mm"],
                          "pass": r["fp8_gemm_vs_scaled_mm"] >= 0.7})
        if op == "mhc_site":
            site.append({"M": m, "speedup": r["speedup"], "pass": r["speedup"] >= 3})
    moe, v4_moe = ([{"op": op, "shape": shape, "M": m, "weight_MB": r["weight_MB"], "pct_copy_bw": r["pct_copy_bw"],
                     "pass": r["pct_copy_bw"] >= 60}
                    for (op, shape, m), r in by_key.items()
                    if op in (pre + "moe_w13_gemv", pre + "moe_w2_gemv", pre + "moe_experts[tuned]") and m <= 8
                    and r.get("weight_MB", 0) >= 16] for pre in ("", "v4_"))
    woa = [{"shape": shape, "M": m, "weight_MB": r["weight_MB"], "pct_copy_bw": r["pct_copy_bw"],
            "pass": r["pct_copy_bw"] >= 60}
           for (op, shape, m), r in by_key.items() if op == "wo_a[tuned]" and m <= 8 and r.get("weight_MB", 0) >= 16]
    return {"decode_gemm_ge16MB_ge60pct_copy_bw": dec, "large_m_fp8_ge70pct_scaled_mm": big,
            "fused_mhc_ge3x_unfused": site, "decode_moe_ge16MB_ge60pct_copy_bw": moe,
            "decode_wo_a_ge16MB_ge60pct_copy_bw": woa, "v4_decode_gemm_ge16MB_ge60pct_copy_bw": v4_dec,
            "v4_large_m_fp8_ge70pct_scaled_mm": v4_big, "v4_decode_moe_ge16MB_ge60pct_copy_bw": v4_moe}


def format_table(rows: list[dict]) -> str:
    hdr = (f"{'op':<22} {'shape':<28} {'M':>5} {'µs':>9} {'GB/s':>7} {'TFLOP/s':>8} {'%ceil':>6} {'bound':>5} "
           f"{'ref µs':>9} {'speedup':>7} {'rel err':>8}  config")
    out = [hdr, "-" * len(hdr)]
    for r in rows:
        if "error" in r:
            out.append(f"{r['op']:<22} {r['shape']:<28} {r['M']:>5}  ERROR {r.get('config', '')} {r['error'][:120]}")
            continue
        sp = f"{r['speedup']:.2f}" if r.get("speedup") else "-"
        ref = f"{r['ref_us']:.1f}" if r.get("ref_us") else "-"
        err = f"{r['err']:.1e}" if r.get("err") is not None else "-"
        out.append(f"{r['op']:<22} {r['shape']:<28} {r['M']:>5} {r['us']:>9.1f} {r['GBps']:>7.0f} {r['TFLOPs']:>8.1f} "
                   f"{r['pct_ceiling']:>6.1f} {r['bound']:>5} {ref:>9} {sp:>7} {err:>8}  {r.get('config', '')}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="write the results JSON here")
    ap.add_argument("--sections", default="mhc,act,gemm,moe,wo_a,gemm_v4,moe_v4,slots")
    ap.add_argument("--merge", action="store_true",
                    help="merge into the existing --out file: replace only the rows of the sections and token counts "
                         "run now")
    ap.add_argument("--ms", default="1,3,8,64,257,4096", help="token counts M")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting GEMM shapes after this many seconds")
    ap.add_argument("--moe-shapes", default="",
                    help="only these shapes of the moe / moe_v4 sections: tp1, tp8, ep8 (default: all); with --merge the "
                         "other shapes' rows are kept")
    ap.add_argument("--gemm-shapes", default="",
                    help="only these GEMM shapes, e.g. 'wq_b[tp1],wo_b[tp8]' (default: all of GEMM_SHAPES); with "
                         "--merge the other shapes' rows are kept")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench-kernels needs a CUDA GPU")
        return 2
    import triton
    torch.backends.cuda.matmul.allow_tf32 = False
    t0 = time.time()
    ms = [int(v) for v in args.ms.split(",")]
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    result = {"machine": {"gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
                          "triton": triton.__version__, "date": datetime.datetime.now(datetime.timezone.utc).isoformat()},
              "command": "python -m dsflash.plugins.bench " + " ".join(argv if argv is not None else sys.argv[1:]),
              "rows": [], "tuned": {}}

    sections = args.sections.split(",")
    moe_only = {v for v in args.moe_shapes.split(",") if v} or None
    gemm_only = {v for v in args.gemm_shapes.split(",") if v} or None
    previous = None
    if args.merge and args.out and os.path.exists(args.out):
        with open(args.out) as f:
            previous = json.load(f)

    def dump():
        result["targets"] = targets(result["rows"])
        if not args.out:
            return
        write_results(args.out, result if previous is None
                      else merged_results(previous, result, sections, ms, moe_only, gemm_only))

    ceil = measure_ceilings()
    result["ceilings"] = ceil
    print(f"ceilings: copy {ceil['copy_GBps']:.0f} GB/s (memcpy {ceil['memcpy_GBps']:.0f}, elementwise "
          f"{ceil['elementwise_GBps']:.0f}), fp8 _scaled_mm {ceil['fp8_scaled_mm_TFLOPs']:.0f} TFLOP/s, "
          f"bf16 mm {ceil['bf16_mm_TFLOPs']:.0f} TFLOP/s", flush=True)
    for sec in ("mhc", "act", "gemm", "moe", "wo_a", "gemm_v4", "moe_v4", "slots"):
        if sec not in sections:
            continue
        try:
            if sec == "mhc":
                result["rows"] += bench_mhc(ceil, ms)
            elif sec == "act":
                result["rows"] += bench_act(ceil, ms)
            elif sec == "moe":
                result["rows"] += bench_moe(ceil, ms, t0 + args.budget_s, only=moe_only)
            elif sec == "moe_v4":
                result["rows"] += bench_moe(ceil, ms, t0 + args.budget_s, MOE_V4, moe_only)
            elif sec == "wo_a":
                result["rows"] += bench_wo_a(ceil, ms)
            elif sec == "slots":
                result["rows"] += bench_slots(ceil, ms)
            elif sec == "gemm_v4":
                result["rows"] += bench_gemm(ceil, ms, result["tuned"], t0 + args.budget_s, gemm_only, GEMM_V4_SHAPES,
                                             128)
            else:
                result["rows"] += bench_gemm(ceil, ms, result["tuned"], t0 + args.budget_s, gemm_only)
        except Exception as e:
            result["rows"].append({"op": sec, "shape": "-", "M": 0, "error": f"{type(e).__name__}: {e}",
                                   "trace": traceback.format_exc()[-3000:]})
        dump()
        print(f"[{sec} done at {time.time() - t0:.0f}s]", flush=True)
    result["rows"].sort(key=lambda r: (r["op"].removeprefix("v4_").split("[")[0] != "fp8_gemm"
                                       and r["op"].removeprefix("v4_") != "bf16_cache_gemm"
                                       and not r["op"].removeprefix("v4_").startswith("scaled_mm"), r["shape"], r["M"]))
    if previous is not None:
        print(f"(merged into {args.out}: rows of sections {sections} at M {ms} replaced, the others kept)")
    print(format_table(result["rows"]))
    print(json.dumps(result["targets"], indent=None, default=str))
    dump()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
