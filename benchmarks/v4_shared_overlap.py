"""V4-Flash's MoE with its replicated shared expert on a side stream (`moe` plugin `mxfp4_overlap`) against in line
(`mxfp4`), GPU.

One TP8 rank of full-size V4-Flash MoE layers (256 experts of 2048 / 8 = 256, hidden 4096, top-6; the shared
expert replicated: 2048 wide), dummy weights generated in place, the model's own `v4.MoE` code with the plugins
bound as an engine binds them: the MoE op (router + MXFP4 experts, 1×128 activations), the shared expert's stacked
w1|w3 FP8 GEMM, fused SwiGLU and w2. Under TP the shared output joins after the all-reduce either way; here the
all-reduce is the single-process stand-in (`LocalComm`), so the figures are the rank's compute only. `--layers`
scored layers (the hash-routed first three are left out) run back to back in one CUDA graph per order and token
count T; the graphs are replayed in turn. Untuned buckets (every op on its default rule), as in both orders.
Prints a table, writes `--out` JSON.

    python3 benchmarks/v4_shared_overlap.py --out v4_shared_overlap_h200.json [--ts 1,4,8] [--layers 4]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from dsflash.model_def import dispatch, get_preset
from dsflash.model_def.layers import LocalComm, Numerics
from dsflash.model_def.mapping import Mapping
from dsflash.model_def.v4 import MoE

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mhc_overlap import _alternate_us, _capture, _rel  # noqa: E402  (the block benchmark's graph timing)

DEV = "cuda"
TP = 8
ORDERS = ("inline", "overlap")


def _fp8_linear(n: int, k: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Random e4m3 codes [n, k] and e8m0 128×128 block scales (V4's checkpoint format)."""
    q = (torch.randn(n, k, device=DEV, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.randint(117, 121, (-(-n // 128), k // 128), dtype=torch.uint8, device=DEV, generator=g)
    return {"q": q, "s": s.view(torch.float8_e8m0fnu)}


def make_moe(args, layer: int, seed: int) -> MoE:
    """A TP8-rank V4 MoE with its plugins bound to dummy weights; the reference experts are dropped."""
    import dsflash.plugins.registry  # noqa: F401  (registers torch.ops.dsflash.*)
    from dsflash.build.bind import stacked_fp8_linear
    from dsflash.plugins.refs import random_mxfp4_experts
    g = torch.Generator(device=DEV).manual_seed(seed)
    with torch.device(DEV):
        moe = MoE(args, layer, Numerics("deploy", 128), Mapping(world_size=TP, tp_size=TP, rank=0), LocalComm(),
                  torch.bfloat16)
    moe.experts = torch.nn.ModuleList()
    torch.cuda.empty_cache()
    d, e, inter = args.hidden_size, args.n_routed_experts, args.moe_intermediate_size // TP
    with torch.no_grad():
        # the gate's weight as an engine holds it (BF16; its bias stays fp32)
        moe.gate.weight.data = (torch.randn(moe.gate.weight.shape, device=DEV, generator=g) * 0.02).to(torch.bfloat16)
        moe.gate.bias.copy_(torch.randn(e, device=DEV, generator=g) * 0.05)
        moe.plugin = dispatch.MXFP4MoE(*random_mxfp4_experts(e, d, inter, inter, g), inter, moe.gate.topk,
                                       moe.gate.route_scale, 1.0, args.swiglu_limit, qblock=128)
    sh = moe.shared_experts
    w1, w3, w2 = (_fp8_linear(*lin.weight.shape, g) for lin in (sh.w1, sh.w3, sh.w2))
    sh.w13_plugin = stacked_fp8_linear([w1, w3], 128)
    sh.w2.plugin = stacked_fp8_linear([w2], 128)
    sh.act_plugin = dispatch.FusedSwiGLU()
    return moe


def run(args, moes: list[MoE], ts: list[int], replays: int) -> list[dict]:
    rows = []
    for t in ts:
        g = torch.Generator(device=DEV).manual_seed(100 + t)
        x = (torch.randn(1, t, args.hidden_size, device=DEV, generator=g) * 2).to(torch.bfloat16)
        ids = torch.randint(0, args.vocab_size, (1, t), device=DEV, generator=g)
        outs = {}

        def step(order: str):
            def fn():
                y = x
                for m in moes:
                    m.plugin.overlap_shared = order == "overlap"
                    y = m(y, ids)
                outs[order] = y
            return fn

        with torch.no_grad():
            graphs = {order: _capture(step(order)) for order in ORDERS}
            us = _alternate_us(graphs, replays)
            res = {}
            for order in ("inline", "overlap"):
                graphs[order].replay()
                torch.cuda.synchronize()
                res[order] = outs[order].float().clone()
            graphs["inline"].replay()
            torch.cuda.synchronize()
            rerun = _rel(outs["inline"].float(), res["inline"])
        n = len(moes)
        inl, ovl = us["inline"] / n, us["overlap"] / n
        row = {"T": t, "layers": n, "inline_us_per_layer": round(inl, 2), "overlap_us_per_layer": round(ovl, 2),
               "saved_us_per_layer": round(inl - ovl, 2), "max_rel_diff_overlap_vs_inline": _rel(res["overlap"],
                                                                                                 res["inline"]),
               "max_rel_diff_inline_rerun": rerun}
        rows.append(row)
        print(f"T={t:3d}  in line {inl:7.1f} µs/layer  overlapped {ovl:7.1f}  saved {inl - ovl:5.1f}  "
              f"rel diff {row['max_rel_diff_overlap_vs_inline']:.1e} (in-line rerun {rerun:.1e})", flush=True)
        del graphs
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ts", default="1,4,8")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--out", default="v4_shared_overlap_h200.json")
    a = ap.parse_args(argv)
    args = get_preset("v4", "full")
    first = args.num_hash_layers
    moes = [make_moe(args, layer, seed) for seed, layer in enumerate(range(first, first + a.layers))]
    rows = run(args, moes, [int(v) for v in a.ts.split(",")], a.replays)
    props = torch.cuda.get_device_properties(0)
    doc = {"machine": {"gpu": props.name, "torch": torch.__version__},
           "command": "python3 benchmarks/v4_shared_overlap.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "rows": rows}
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"{'T':>3} {'in line':>9} {'overlap':>9} {'saved':>7}  (µs per layer)")
    for r in rows:
        print(f"{r['T']:>3} {r['inline_us_per_layer']:>9.1f} {r['overlap_us_per_layer']:>9.1f} "
              f"{r['saved_us_per_layer']:>7.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
