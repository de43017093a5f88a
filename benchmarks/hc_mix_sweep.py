"""K-slice sweep of the mHC coefficients (`hc_mix`, D 5120): the projection kernel alone and projection + epilogue
back to back, timed in CUDA graphs, per token count and slice count, each checked against `hc_mix_ref`. What
`hc_mix_tiles` picks for small T comes from this output (`benchmarks/mhc_s8_h200.json`, "split_sweep").

    python3 benchmarks/hc_mix_sweep.py --out hc_mix_sweep.json [--ts 1,8,64] [--splits 32,64,128,160]

GPU only.
"""
from __future__ import annotations

import argparse
import json

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from dsflash.plugins import mhc, refs
from dsflash.plugins.timing import graph_time_us

DEV = "cuda"
D = 5120


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ts", default="1,8,64")
    ap.add_argument("--splits", default="32,64,128,160")
    args = ap.parse_args()
    k = mhc.NS * D
    gen = torch.Generator(device=DEV).manual_seed(3)
    fn = torch.randn(mhc.NMIX, k, device=DEV, generator=gen) * 0.01
    h = refs.hc_split_weight(fn)
    base = torch.randn(mhc.NMIX, device=DEV, generator=gen) * 0.1
    scale = torch.rand(3, device=DEV, generator=gen) + 0.5
    hd = TensorDescriptor(h.view(3 * mhc.NMIX_PAD, k), [3 * mhc.NMIX_PAD, k], [k, 1], [mhc.NMIX_PAD, 64])
    rows = []
    for t in [int(v) for v in args.ts.split(",")]:
        xs = [torch.randn(t, k, device=DEV, generator=gen).to(torch.bfloat16) for _ in range(4)]
        want = refs.hc_mix_ref(xs[0], fn, base, scale)
        bt, bk, _ = mhc.hc_mix_tiles(t, k)
        xds = [TensorDescriptor(x, [t, k], [x.stride(0), 1], [bt, bk]) for x in xs]
        pre, post = torch.empty((t, 4), device=DEV), torch.empty((t, 4), device=DEV)
        comb = torch.empty((t, 4, 4), device=DEV)
        for split in [int(v) for v in args.splits.split(",")]:
            ws = torch.empty((split, t, mhc.NMIX_PAD), device=DEV)

            def proj(i: int, split=split, ws=ws) -> None:
                mhc._hc_mix_proj_kernel[(triton.cdiv(t, bt), split)](
                    xds[i], hd, ws, t, k, ws.stride(0), SPLIT=split, BLOCK_T=bt, BLOCK_K=bk, NUM_STAGES=4,
                    num_warps=4)

            def epi(warps: int, split=split, ws=ws) -> None:
                mhc._hc_mix_epilogue_kernel[(t,)](
                    ws, base, scale, pre, post, comb, k, ws.stride(0), 1e-6, 1e-20, SPLIT=split, ITERS=20,
                    SPLIT_P2=triton.next_power_of_2(split), num_warps=warps)

            r = {"T": t, "bk": bk, "split": split,
                 "proj": graph_time_us([lambda i=i: proj(i) for i in range(4)])[0],
                 "both": graph_time_us([lambda i=i: (proj(i), epi(4)) for i in range(4)])[0],
                 "both_w1": graph_time_us([lambda i=i: (proj(i), epi(1)) for i in range(4)])[0]}
            proj(0)
            epi(4)
            torch.cuda.synchronize()
            r["err"] = max(refs.rel_err(a, b) for a, b in zip((pre, post, comb), want))
            rows.append(r)
            print(f"T={t:5d} split={split:4d}  proj {r['proj']:6.2f}  proj+epilogue {r['both']:6.2f} "
                  f"(1-warp epilogue {r['both_w1']:6.2f}) µs  err {r['err']:.1e}", flush=True)
    json.dump({"rows": rows}, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
