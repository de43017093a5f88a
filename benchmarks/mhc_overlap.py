"""mHC coefficients on a side stream (`mhc` plugin `fused_overlap`) against the serial order (`fused`), GPU.

One decode step of `--layers` full-size V4.1-Flash blocks of one TP8 rank (TP8/EP1: 384 experts of 288, padded to 320;
shared expert 288; 8 heads), dummy weights generated in place, the model's own `Block` code with the plugins bound:
mHC (`hc_mix` + `hc_pre` + `hc_post_pre` + `hc_post`), the MoE op (router + MXFP4 experts) with the shared expert's
FP8 linears and fused SwiGLU, the norms. The attention site runs the attention's projections on their plugins ([wq_a;
wkv] as one GEMM → q_norm → wq_b and kv_norm, WO-A with inverse RoPE, wo_b); its core (a reference op in this repo,
not graph-safe) is left out, so the attention site here is shorter than a real one and the overlap has less to hide
behind. The step is captured in one CUDA graph per order (`ORDERS`) and per token count T; the graphs are replayed in
turn. Also timed: `hc_mix` alone (what the overlap can hide, two per layer), and the step with the shared expert's
SwiGLU as torch ops (what the `swiglu` plugin saves), with its w1 and w3 as two GEMMs instead of one over the stacked
weight (what `Expert.w13_plugin` saves), with the shared expert on a second side stream while the router and the
routed experts run (the `moe` plugin `mxfp4_overlap`), and that order again with the MoE's decode configs with
programmatic dependent launch (both GEMVs, or w2 alone), or with the dense GEMMs' without it (what PDL does in a
real decode chain; untuned buckets only: the default rules' configs), with the attention's wq_a and wkv as two GEMMs
(what `Attention.wqkv_a_plugin` saves), with the untuned decode GEMMs quantizing their activation in the kernel, or with
q_norm and kv_norm as two launches (what `Attention.qkv_norm_plugin` saves). Prints a table, writes `--out` JSON.

    python3 benchmarks/mhc_overlap.py --out mhc_overlap_h200.json [--ts 1,4,16,64] [--layers 4]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import torch

from dsflash.model_def import dispatch, get_preset
from dsflash.model_def.csa2 import layer_inv_freq
from dsflash.model_def.layers import LocalComm, Numerics, RMSNorm, norm_pair, stacked_or_each
from dsflash.model_def.mapping import Mapping
from dsflash.model_def.v41 import Block

DEV = "cuda"
TP = 8
RERUNS = 4    # replays of each order compared against the first serial one
# serial: mHC coefficients in line; overlap: on the side stream (the default); torch_swiglu: overlap, with the shared
# expert's SwiGLU as the reference's torch ops instead of the fused kernel; separate_w13: overlap, with the shared
# expert's w1 and w3 as two GEMMs instead of one over the stacked weight (what engines bind); shared_overlap: overlap,
# with the shared expert on the second side stream, concurrent with the router and routed experts (`mxfp4_overlap`)
# moe_pdl: shared_overlap with PDL on for the MoE decode configs (off by default); moe_pdl2: the same with only their
# w2 launched with PDL (`MoeConfig.pdl2`); no_pdl: shared_overlap with the dense FP8 GEMMs' default configs without it
# separate_qkv_a: shared_overlap with the attention's wq_a and wkv as two GEMMs instead of one over the stacked weight;
# qa_default: shared_overlap with the untuned Gluon decode GEMMs quantizing their activation in the kernel;
# separate_norms: shared_overlap with q_norm and kv_norm as two launches instead of one
ORDERS = ("serial", "overlap", "torch_swiglu", "separate_w13", "shared_overlap", "moe_pdl", "moe_pdl2", "no_pdl",
          "separate_qkv_a", "qa_default", "separate_norms")


def _fp8_linear(lin, g: torch.Generator) -> dispatch.FP8Linear:
    """Random e4m3 codes + e8m0 32×32 block scales of the linear's (local) shape."""
    n, k = lin.weight.shape
    w_q = (torch.randn(n, k, device=DEV, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    w_s = torch.randint(117, 121, (-(-n // 32), k // 32), dtype=torch.uint8, device=DEV, generator=g)
    return dispatch.FP8Linear(w_q, w_s.view(torch.float8_e8m0fnu), None)


def make_block(args, layer: int, seed: int) -> Block:
    """A TP8-rank block with every plugin bound to dummy weights; the reference experts are dropped."""
    import dsflash.plugins.registry  # noqa: F401  (registers torch.ops.dsflash.*)
    from dsflash.build.bind import fused_hc, stacked_fp8_linear
    from dsflash.plugins.bench import randomize_mhc
    from dsflash.plugins.refs import random_mxfp4_experts
    g = torch.Generator(device=DEV).manual_seed(seed)
    with torch.device(DEV):
        blk = Block(args, layer, Numerics("deploy", args.act_block), Mapping(world_size=TP, tp_size=TP, rank=0),
                    LocalComm(), torch.bfloat16, args.n_routed_experts, args.num_experts_per_tok)
    moe = blk.ffn
    moe.experts = torch.nn.ModuleDict()          # the plugin reads the stacked MXFP4 tensors below
    torch.cuda.empty_cache()
    d, e = args.hidden_size, args.n_routed_experts
    inter = args.moe_intermediate_size // TP
    ipad = -(-inter // 64) * 64
    randomize_mhc(blk, g)
    blk.hc_plugin = fused_hc(blk, overlap=False)
    with torch.no_grad():
        for m in blk.modules():
            if isinstance(m, RMSNorm):
                m.weight.copy_(torch.rand(m.weight.shape, device=DEV, generator=g) + 0.5)
                m.plugin = dispatch.FusedRMSNorm()
        moe.gate.weight.copy_(torch.randn(moe.gate.weight.shape, device=DEV, generator=g) * 0.02)
        moe.gate.bias.copy_(torch.randn(e, device=DEV, generator=g) * 0.05)
        moe.plugin = dispatch.MXFP4MoE(*random_mxfp4_experts(e, d, inter, ipad, g), inter, moe.gate.topk,
                                       moe.gate.scale, moe.gate.temp, args.swiglu_limit)
        moe.shared_experts.act_plugin = dispatch.FusedSwiGLU()
        for lin in (moe.shared_experts.w1, moe.shared_experts.w2, moe.shared_experts.w3, blk.attn.wq_a,
                    blk.attn.wq_b, blk.attn.wkv, blk.attn.wo_b):
            lin.plugin = _fp8_linear(lin, g)
        sh = moe.shared_experts
        sh.w13_plugin = stacked_fp8_linear([{"q": w.plugin.w_q, "s": w.plugin.w_s} for w in (sh.w1, sh.w3)])
        at = blk.attn
        at.wqkv_a_plugin = stacked_fp8_linear([{"q": w.plugin.w_q, "s": w.plugin.w_s} for w in (at.wq_a, at.wkv)])
        at.qkv_norm_plugin = dispatch.FusedRMSNormPair()
        blk.attn.wo_a.weight.copy_(torch.randn(blk.attn.wo_a.weight.shape, device=DEV, generator=g)
                                   * blk.attn.wo_a.weight.shape[1] ** -0.5)
    return blk


def attention_projections(blk: Block, t: int):
    """`attend` for the block: the attention's projections on their plugins, its core left out (the core's output
    has the query's shape, so the query stands in for it; the window KV row joins it so that its GEMM counts)."""
    a = blk.attn
    inv = layer_inv_freq(a.args, a.layer, torch.device(DEV))
    cos, sin = dispatch.rope_cos_sin(torch.arange(t, device=DEV), inv)

    def attend(x):                                          # x [1, T, D]
        qa, kva = stacked_or_each(a.wqkv_a_plugin, x, (a.wq_a, a.wkv))
        q_res, kvn = norm_pair(a.qkv_norm_plugin, (a.q_norm, a.kv_norm), (qa, kva))
        q = a.wq_b(q_res).view(t, a.n_local, a.head_dim)
        kv = kvn.view(t, 1, a.head_dim)
        z = dispatch.ops().wo_a((q + kv).contiguous(), cos, sin, a.wo_a.weight)
        return a.wo_b(z.view(1, t, -1))
    return attend


def _capture(fn) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):               # warm-up off the capture stream (compiles, tuned-table lookups)
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _alternate_us(graphs: dict, replays: int) -> dict:
    """Median µs per replay of each graph, replayed in turn so that clock and thermal drift hit all alike."""
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = {k: [] for k in graphs}
    for g in graphs.values():
        g.replay()
    torch.cuda.synchronize()
    for _ in range(replays):
        for k, g in graphs.items():
            e0.record()
            g.replay()
            e1.record()
            e1.synchronize()
            times[k].append(e0.elapsed_time(e1) * 1000)
    return {k: statistics.median(v) for k, v in times.items()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _kernel_breakdown(graphs: dict, n_layers: int, replays: int = 5) -> dict:
    """Per order: GPU time per layer of each kernel name in the step (torch profiler over graph replays), largest
    first; the serial one tells where a layer's time goes."""
    from torch.profiler import ProfilerActivity, profile
    out = {}
    for order in ("serial", "overlap"):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                graphs[order].replay()
            torch.cuda.synchronize()
        agg: dict[str, list] = {}
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                a = agg.setdefault(ev.name, [0.0, 0])
                a[0] += ev.device_time
                a[1] += 1
        n = replays * n_layers
        out[order] = sorted(({"name": k, "us": round(v[0] / n, 2), "calls": round(v[1] / n, 2)}
                             for k, v in agg.items()), key=lambda r: -r["us"])
    return out


def install_tuned(args, blocks: list[Block], max_tokens: int, budget_s: float) -> dict:
    """Tune the blocks' dense FP8 GEMM shapes and MoE tiles as `build` does for a TP8 engine and install the
    tables, so that the step runs the configs an engine built on this GPU would (in-kernel activation quantization
    where it wins, tuned MoE tiles). Returns a summary of what was tuned."""
    from dsflash.build.engine import default_plugins
    from dsflash.build.tune import FP8_GEMM, MOE, gemm_table, moe_table, tune
    from dsflash.plugins import moe_config, tuning
    inter = args.moe_intermediate_size // TP
    engine = {"model": args.to_hf_dict(), "mapping": Mapping(world_size=TP, tp_size=TP).to_dict(), "arch": "sm90",
              "layout": "hf", "plugins": default_plugins("sm90"), "expert_inter_local": inter,
              "expert_inter_padded": -(-inter // 64) * 64,
              "build_config": {"max_num_tokens": max_tokens, "tune_budget_s": budget_s}}
    used = {tuple(m.w_q.shape) for b in blocks for m in b.modules() if isinstance(m, dispatch.FP8Linear)}
    gemms = dataclasses.replace(FP8_GEMM, buckets=lambda e: [b for b in FP8_GEMM.buckets(e)
                                                             if (b["n"], b["k"]) in used])
    tuned = tune(engine, "sm90", [gemms, MOE])
    tuning.set_table(gemm_table(tuned))
    moe_config.set_table(moe_table(tuned))
    return {"entries": len(tuned["entries"]), "skipped": tuned["skipped"],
            "chosen": {f"{e['op']} {e['bucket']}": e["config"] for e in tuned["entries"]}}


def make_blocks(args, n_layers: int) -> list[Block]:
    layers = [i for i in range(args.n_layers) if i not in args.engram_layer_ids][:n_layers]
    return [make_block(args, layer, seed) for seed, layer in enumerate(layers)]


def _with_quant_in_kernel(rule):
    """The GEMM default rule, with a Gluon decode default replaced by the same ring quantizing its activation in the
    kernel (`GemmConfig.quant_in_kernel`; the fewest K slices offered)."""
    from dsflash.plugins import tuning

    def qa_rule(n, k, m, arch=None, group=32):
        c = rule(n, k, m, arch, group)
        fits = [x for x in tuning.gluon_decode_candidates(n, k) if c.gluon and x.pdl and x.quant_in_kernel
                and (x.kgroups, x.num_stages) == (c.kgroups, c.num_stages)]
        return min(fits, key=lambda x: x.split_k) if fits else c
    return qa_rule


def _with_pdl(module, name: str, pdl: bool, field: str = "pdl"):
    """A default-config rule of `module` (what its `lookup` falls back to, per call) and the same rule with its PDL
    flag `field` set."""
    rule = getattr(module, name)
    return rule, lambda *a, **k: dataclasses.replace(rule(*a, **k), **{field: pdl})


def run(args, blocks: list[Block], ts: list[int], replays: int, profile: set[int] = frozenset()) -> list[dict]:
    n_layers = len(blocks)
    from dsflash.plugins import moe_config, tuning
    moe_rule, moe_rule_pdl = _with_pdl(moe_config, "default_moe_config", True)
    moe_rule_pdl2 = _with_pdl(moe_config, "default_moe_config", True, "pdl2")[1]
    gemm_rule, gemm_rule_no_pdl = _with_pdl(tuning, "default_config", False)
    gemm_rule_qa = _with_quant_in_kernel(gemm_rule)
    rows = []
    w13 = [b.ffn.shared_experts.w13_plugin for b in blocks]   # (once: the separate_w13 order unbinds them)
    qkv_a = [b.attn.wqkv_a_plugin for b in blocks]             # (and separate_qkv_a these,
    norms = [b.attn.qkv_norm_plugin for b in blocks]           # separate_norms these)
    for t in ts:
        g = torch.Generator(device=DEV).manual_seed(100 + t)
        X = (torch.randn(1, t, 4, args.hidden_size, device=DEV, generator=g) * 2).to(torch.bfloat16)
        pre = torch.rand(1, t, 4, device=DEV, generator=g) + 0.1
        attends = [attention_projections(b, t) for b in blocks]
        outs = {}

        def step(order: str):
            def fn():
                Y, p = X, pre
                for b, att, stacked, stacked_qkv, pair in zip(blocks, attends, w13, qkv_a, norms):
                    b.hc_plugin.overlap = order != "serial"
                    b.ffn.shared_experts.act_plugin = None if order == "torch_swiglu" else dispatch.FusedSwiGLU()
                    b.ffn.shared_experts.w13_plugin = None if order == "separate_w13" else stacked
                    b.attn.wqkv_a_plugin = None if order == "separate_qkv_a" else stacked_qkv
                    b.attn.qkv_norm_plugin = None if order == "separate_norms" else pair
                    b.ffn.plugin.overlap_shared = order not in ("serial", "overlap", "torch_swiglu", "separate_w13")
                    moe_config.default_moe_config = {"moe_pdl": moe_rule_pdl, "moe_pdl2": moe_rule_pdl2}.get(order,
                                                                                                          moe_rule)
                    tuning.default_config = {"no_pdl": gemm_rule_no_pdl, "qa_default": gemm_rule_qa}.get(order,
                                                                                                         gemm_rule)
                    Y, p = b(Y, p, att, None)
                moe_config.default_moe_config, tuning.default_config = moe_rule, gemm_rule
                outs[order] = (Y, p)
            return fn

        with torch.no_grad():
            graphs = {order: _capture(step(order)) for order in ORDERS}
            hc, b0 = blocks[0].hc_plugin, blocks[0]
            xflat = X.view(t, -1)

            def mixes():                       # as many as the step runs, so that the graph launch is amortised
                for _ in range(2 * n_layers):
                    dispatch.ops().hc_mix(xflat, b0.hc_attn_fn, hc.attn_split, b0.hc_attn_base, b0.hc_attn_scale,
                                          b0.iters, b0.hc_eps, b0.norm_eps)
            graphs["hc_mix"] = _capture(mixes)
            us = _alternate_us(graphs, replays)
            us["hc_mix"] /= 2 * n_layers
            # numerics: the overlap against the serial order, and the serial order against itself (control: the
            # MoE's atomic reductions make reruns differ where several experts' rows meet, and the deploy
            # quantizers amplify such last-bit differences over the layers)
            runs = {}
            for name, order in [("serial", "serial")] + [(f"{o}{i}", o) for i in range(RERUNS)
                                                         for o in ("serial_again", "overlap", "shared_overlap")]:
                graphs[order.removesuffix("_again")].replay()
                torch.cuda.synchronize()
                runs[name] = outs[order.removesuffix("_again")][0].float().clone()
            kernels = _kernel_breakdown(graphs, n_layers) if t in profile else None
        rel = max(_rel(runs[f"overlap{i}"], runs["serial"]) for i in range(RERUNS))
        rerun = max(_rel(runs[f"serial_again{i}"], runs["serial"]) for i in range(RERUNS))
        rel_sh = max(_rel(runs[f"shared_overlap{i}"], runs["serial"]) for i in range(RERUNS))
        ser, ovl = us["serial"] / n_layers, us["overlap"] / n_layers
        sh = us["shared_overlap"] / n_layers
        moe_pdl, dense_no_pdl = us["moe_pdl"] / n_layers, us["no_pdl"] / n_layers
        moe_pdl2 = us["moe_pdl2"] / n_layers
        sep_qkv, qa = us["separate_qkv_a"] / n_layers, us["qa_default"] / n_layers
        sep_norms = us["separate_norms"] / n_layers
        tsw, sep = us["torch_swiglu"] / n_layers, us["separate_w13"] / n_layers
        row = {"T": t, "layers": n_layers, "serial_us_per_layer": round(ser, 2), "overlap_us_per_layer": round(ovl, 2),
               "saved_us_per_layer": round(ser - ovl, 2), "speedup": round(ser / ovl, 3),
               "hc_mix_us": round(us["hc_mix"], 2),
               "hidden_fraction_of_2_hc_mix": round((ser - ovl) / (2 * us["hc_mix"]), 2),
               "max_rel_diff_overlap_vs_serial": rel, "max_rel_diff_serial_rerun": rerun,
               "torch_swiglu_us_per_layer": round(tsw, 2), "saved_by_fused_swiglu_us": round(tsw - ovl, 2),
               "separate_w13_us_per_layer": round(sep, 2), "saved_by_stacked_w13_us": round(sep - ovl, 2),
               "shared_overlap_us_per_layer": round(sh, 2), "saved_by_shared_overlap_us": round(ovl - sh, 2),
               "max_rel_diff_shared_overlap_vs_serial": rel_sh,
               "moe_pdl_us_per_layer": round(moe_pdl, 2), "cost_of_moe_pdl_us": round(moe_pdl - sh, 2),
               "moe_pdl2_us_per_layer": round(moe_pdl2, 2), "cost_of_moe_pdl2_us": round(moe_pdl2 - sh, 2),
               "no_pdl_us_per_layer": round(dense_no_pdl, 2),
               "cost_of_dense_without_pdl_us": round(dense_no_pdl - sh, 2),
               "separate_qkv_a_us_per_layer": round(sep_qkv, 2), "saved_by_stacked_qkv_a_us": round(sep_qkv - sh, 2),
               "qa_default_us_per_layer": round(qa, 2), "saved_by_qa_default_us": round(sh - qa, 2),
               "separate_norms_us_per_layer": round(sep_norms, 2), "saved_by_norm_pair_us": round(sep_norms - sh, 2)}
        if kernels:
            row["kernels_per_layer"] = kernels
        rows.append(row)
        print(f"T={t:3d}  serial {ser:7.1f} µs/layer  overlap {ovl:7.1f}  saved {ser - ovl:5.1f}  "
              f"(2 × hc_mix = {2 * us['hc_mix']:.1f})  rel diff ≤ {rel:.1e} (serial reruns ≤ {rerun:.1e})  "
              f"torch SwiGLU {tsw:.1f}  separate w1/w3 {sep:.1f}  shared expert overlapped {sh:.1f} "
              f"(rel diff ≤ {rel_sh:.1e})  MoE with PDL {moe_pdl:.1f}  MoE w2 alone with PDL {moe_pdl2:.1f}  "
              f"dense GEMMs without PDL {dense_no_pdl:.1f}  "
              f"wq_a and wkv apart {sep_qkv:.1f}  in-kernel activation quantization by default {qa:.1f}  "
              f"q_norm and kv_norm apart {sep_norms:.1f}",
              flush=True)
        if kernels:
            for k in kernels["serial"][:25]:
                print(f"    {k['us']:7.2f} µs  {k['calls']:5.2f}×  {k['name'][:110]}")
        del graphs
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ts", default="1,4,16,64")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--profile", default="1", help="token counts whose step is broken down by kernel ('' = none)")
    ap.add_argument("--tune-budget-s", type=float, default=180.0,
                    help="tune the GEMMs and MoE tiles first, as `build` does (0: untuned defaults, logged)")
    ap.add_argument("--out", default="mhc_overlap_h200.json")
    a = ap.parse_args(argv)
    ts = [int(t) for t in a.ts.split(",")]
    args = get_preset("v41", "full")
    blocks = make_blocks(args, a.layers)
    tuned = install_tuned(args, blocks, max(ts), a.tune_budget_s) if a.tune_budget_s > 0 else None
    rows = run(args, blocks, ts, a.replays, {int(t) for t in a.profile.split(",") if t})
    print(f"\n{'T':>4} {'serial µs/layer':>16} {'overlap':>9} {'saved':>7} {'2×hc_mix':>9} {'speedup':>8} "
          f"{'+shared overlap':>16} {'saved':>7} {'MoE PDL':>8} {'w2 PDL':>7} {'dense no PDL':>13} "
          f"{'wq_a, wkv apart':>16}")
    for r in rows:
        print(f"{r['T']:>4} {r['serial_us_per_layer']:>16.1f} {r['overlap_us_per_layer']:>9.1f} "
              f"{r['saved_us_per_layer']:>7.1f} {2 * r['hc_mix_us']:>9.1f} {r['speedup']:>8.3f} "
              f"{r['shared_overlap_us_per_layer']:>16.1f} {r['saved_by_shared_overlap_us']:>7.1f} "
              f"{r['moe_pdl_us_per_layer']:>8.1f} {r['moe_pdl2_us_per_layer']:>7.1f} {r['no_pdl_us_per_layer']:>13.1f} "
              f"{r['separate_qkv_a_us_per_layer']:>16.1f}")
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "what": "one decode step of full-size V4.1-Flash blocks of a TP8 rank, CUDA graph; attention core left out",
            "tuned": tuned}
    with open(a.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
