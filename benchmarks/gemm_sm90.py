"""The large-M group-32 FP8 GEMM as a hand-scheduled CUDA kernel (`plugins/fp8_gemm_sm90.py`) against
`torch._scaled_mm` and the Gluon kernel the build picks today, at the V4.1 dense shapes (bench.GEMM_SHAPES).

    python3 benchmarks/gemm_sm90.py [--ms 4096] [--variants 1x4d4c2h2tw,2x4n256d2h4tw] [--out gemm_sm90_h200.json]
    python3 benchmarks/gemm_sm90.py --mma-probe 1x1x1,2x2x1 --shapes none   # the MMA pipeline alone

A variant is WGSxSTAGES[gGROUP_M][nBN][dDEPTH][bBODY][cCTAS][hSPLIT][mCLUSTER][t][w][p][:PROBE] (`parse_variants`;
t: TMA ring; w: filled by a producer warpgroup; c2: two CTAs per SM; h2 / h4: MMAs in halves / quarters; m2 / m4:
clusters of 2 / 4 row tiles sharing one multicast W tile; p: scale products by the producer; probes NO_FOLD / NO_LOAD
/ NO_MMA time a kernel with a quarter of the fold arithmetic / no loads after the prologue / loads only: wrong
results; NO_MCAST launches a cluster variant's clusters without the multicast).
First checks every variant against `fp8_gemm_ref` at awkward shapes (rows, columns and K past tile and ring ends),
then times each shape with the bench's graph-replayed timing (input sets rotated past the L2; all paths of a shape
interleaved, `_scaled_mm` on the kernels' own codes, block-quantized weights: the recipe of `bench-kernels` since
session 27). Prints one table (µs, TFLOP/s, ratio to `_scaled_mm` at the same shape) and writes the rows as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

import torch

from dsflash.plugins import refs, tuning
from dsflash.plugins.act_quant import act_quant
from dsflash.plugins.bench import GEMM_SHAPES
from dsflash.plugins.fp8_gemm import fp8_gemm
from dsflash.plugins.fp8_gemm_sm90 import fp8_gemm_sm90, weight_scales_f32
from dsflash.plugins.timing import graph_time_many, input_sets

DEV = "cuda"
PARITY_SHAPES = [(1, 136, 160), (77, 200, 288), (130, 264, 416), (257, 520, 1312), (300, 4096, 1280),
                 (4096, 576, 5120)]


def weight(n: int, k: int, gen: torch.Generator, quantized: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """An e4m3 weight and its e8m0 32×32 scales: N(0, 2) cast to e4m3 with random scales (sessions 23-25), or
    (quantized) a N(0, 0.02) weight block-quantized as the converter does, each block's codes spanning e4m3's range
    (the build's tuner and `bench-kernels` time these; session 26: within 0-6 % of the N(0, 2) codes)."""
    if quantized:
        return refs.quant_weight_fp8_ref(torch.randn(n, k, device=DEV, generator=gen) * 0.02)
    w = (torch.randn(n, k, device=DEV, generator=gen) * 2).to(torch.float8_e4m3fn)
    s = torch.randint(116, 124, (-(-n // 32), k // 32), device=DEV, dtype=torch.uint8, generator=gen)
    return w, s.view(refs.E8M0)


VARIANT = re.compile(r"(\d)x(\d)(?:g(\d+))?(?:n(\d+))?(?:d(\d))?(?:b(\d))?(?:c(\d))?(?:h(\d))?(?:m(\d))?(t)?(w)?(p)?"
                     r"(?::(\w+))?$")


def parse_variants(text: str) -> list[dict]:
    """'WGSxSTAGES[gGROUP_M][nBN][dDEPTH][bBODY][cCTAS][hSPLIT][mCLUSTER][t][w][p][:PROBE]' (t: TMA loads; w: by a
    producer warpgroup; cCTAS: CTAs per SM, 2 with one consumer warpgroup and w; hSPLIT: MMA units per K block (2 or 4
    narrower MMAs, DEPTH then counting the narrower partials); mCLUSTER: CTAs per cluster sharing a multicast W tile
    (with w); p: scale products by the producer; bBODY defaults to 2, or to STAGES with w), comma-separated ->
    fp8_gemm_sm90 keyword sets."""
    out = []
    for item in text.split(","):
        hit = VARIANT.match(item)
        assert hit, f"bad variant {item!r}"
        wgs, st, grp, bn, depth, body, ctas, split, cluster, tma, ws, ps, probe = hit.groups()
        out.append({"wgs": int(wgs), "stages": int(st), "group_m": int(grp or 8), "bn": int(bn or 128),
                    "depth": int(depth or 2), "body": int(body or (st if ws else 2)), "tma": bool(tma),
                    "ws": bool(ws), "ctas": int(ctas or 1), "split": int(split or 1), "ps": bool(ps),
                    "cluster": int(cluster or 1), "probe": probe or ""})
    return out


def tag(v: dict) -> str:
    return (f"{v['wgs']}x{v['stages']}g{v['group_m']}n{v['bn']}d{v['depth']}b{v['body']}"
            + (f"c{v['ctas']}" if v.get("ctas", 1) > 1 else "") + (f"h{v['split']}" if v.get("split", 1) > 1 else "")
            + (f"m{v['cluster']}" if v.get("cluster", 1) > 1 else "")
            + ("t" if v["tma"] else "") + ("w" if v.get("ws") else "") + ("p" if v.get("ps") else "")
            + (f":{v['probe']}" if v["probe"] else ""))


_MMA_PROBE = r"""
PTX_HELPERS
MMA_ACC
// CHAIN accumulating MMAs into d as one commit group, then a wait that leaves DEPTH - 1 groups in flight.
__device__ __forceinline__ void group(float (&d)[64], u64 da, u64 db) {
  mma_fence();
#pragma unroll
  for (int c = 0; c < CHAIN; ++c) mma_acc(d, da + 2 * c, db + 2 * c);
  mma_commit();
  mma_wait<DEPTH - 1>();
}
extern "C" __global__ void __launch_bounds__(128 * WGS, 1) mma_probe(float* out, int iters) {
  extern __shared__ unsigned char smem_raw[];
  const u32 ring = ((u32)__cvta_generic_to_shared(smem_raw) + 1023) & ~1023u;
  for (int i = threadIdx.x; i < 65536 / 4; i += blockDim.x) ((u32*)smem_raw)[i] = 0x38383838u;   // e4m3 1.0
  __syncthreads();
  const int wg = threadIdx.x >> 7;
  const u64 da = desc_sw128(ring + wg * 8192), db = desc_sw128(ring + 32768);
  float p0[64], p1[64], p2[64];
#pragma unroll
  for (int j = 0; j < 64; ++j) p0[j] = p1[j] = p2[j] = 0.f;
  for (int i = 0; i < iters; ++i) {
    group(p0, da, db);
    if (DEPTH >= 2) group(p1, da, db);
    if (DEPTH >= 3) group(p2, da, db);
  }
  mma_wait<0>();
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < 64; ++j) s += p0[j] + p1[j] + p2[j];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
"""


def mma_probe(combos: str) -> list[dict]:
    """The MMA pipeline alone (no loads, no folds): one CTA per SM of WGS warpgroups; each issues commit groups of
    CHAIN accumulating m64n128k32 MMAs into DEPTH rotating accumulators and waits after each group until DEPTH - 1
    are in flight. DEPTH = CHAIN = 1 is the issue-to-completion latency of one MMA (each waits for the last)."""
    from dsflash.plugins.bench import _event_time_us
    from dsflash.plugins.fp8_gemm_sm90 import _PTX_HELPERS, _wgmma_asm, load_kernel
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for item in combos.split(","):
        wgs, depth, chain = (int(v) for v in item.split("x"))
        src = f"#define WGS {wgs}\n#define DEPTH {depth}\n#define CHAIN {chain}\n" + _MMA_PROBE.replace(
            "PTX_HELPERS", _PTX_HELPERS).replace("MMA_ACC", _wgmma_asm("mma_acc", 1))
        smem = 200 * 1024   # one CTA per SM
        kern = load_kernel(src, "mma_probe", smem)
        out = torch.empty(sms * 128 * wgs, device=DEV)
        iters = 2000
        us = _event_time_us(lambda: kern(grid=(sms, 1, 1), block=(128 * wgs, 1, 1), args=[out, iters],
                                         shared_mem=smem), reps=5)
        mmas = wgs * depth * chain * iters   # per SM
        ns_per_group = us * 1000 / (iters * depth)   # per warpgroup
        row = {"op": "mma_probe", "wgs": wgs, "depth": depth, "chain": chain, "us": us,
               "TFLOPs": sms * mmas * 2 * 64 * 128 * 32 / us / 1e6, "ns_per_group_per_wg": ns_per_group,
               "out_finite": bool(torch.isfinite(out).all())}
        rows.append(row)
        print(f"mma_probe wgs={wgs} depth={depth} chain={chain}: {row['TFLOPs']:6.0f} TFLOP/s, "
              f"{ns_per_group:6.1f} ns per group per warpgroup", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="4096")
    ap.add_argument("--variants", default="1x4d4c2h2tw,2x4n256d2h4tw",
                    help="WGSxSTAGES[gGROUP_M][nBN][dDEPTH][bBODY][cCTAS][hSPLIT][mCLUSTER][t][w][p]"
                         "[:NO_FOLD|NO_LOAD|NO_MMA|NO_MCAST], comma-separated")
    ap.add_argument("--shapes", default="", help="only these GEMM shapes, e.g. 'wq_b[tp1],wo_b[tp8]'")
    ap.add_argument("--no-gluon", action="store_true")
    ap.add_argument("--mma-probe", default="", help="WGSxDEPTHxCHAIN combos of the MMA-only probe, e.g. 1x1x1,2x2x1")
    ap.add_argument("--raw-weights", action="store_true",
                    help="time N(0, 2) e4m3 codes with random scales (sessions 23-26) instead of block-quantized "
                         "weights (as the build's tuner and bench-kernels do)")
    ap.add_argument("--out", default="gemm_sm90_h200.json")
    args = ap.parse_args()
    variants = parse_variants(args.variants)
    gen = torch.Generator(device=DEV).manual_seed(0)
    rows: list[dict] = mma_probe(args.mma_probe) if args.mma_probe else []

    for m, n, k in PARITY_SHAPES:
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen)
        w, ws = weight(n, k, gen)
        a_q, a_s = act_quant(x, "fp32")
        ref = refs.fp8_gemm_ref(a_q, a_s, w, ws)
        first = None   # every variant folds each element's 32-blocks in the same order: the same bits expected
        for v in variants:
            if v["probe"]:
                continue
            out = fp8_gemm_sm90(a_q, a_s, w, weight_scales_f32(ws, v["tma"]), **v)
            err = refs.rel_err(out, ref)
            first = out if first is None else first
            same = bool(torch.equal(out, first))
            rows.append({"op": "parity", "M": m, "N": n, "K": k, "variant": tag(v), "err": err, "same_bits": same})
            print(f"parity M={m} N={n} K={k} {tag(v)}: {err:.2e}" + ("" if same else " (bits differ from the first)"),
                  flush=True)
            if not err < 1e-2:
                print("PARITY FAILED", file=sys.stderr)

    wanted = {s for s in args.shapes.split(",") if s}
    for name, n, k, tp in GEMM_SHAPES:
        shape = f"{name}[{tp}]"
        if wanted and shape not in wanted:
            continue
        for m in (int(v) for v in args.ms.split(",")):
            flops = 2 * m * n * k
            n_sets = input_sets(n * k + m * k)
            ws = [weight(n, k, gen, not args.raw_weights) for _ in range(n_sets)]
            sws = {t: [weight_scales_f32(s, t) for _, s in ws] for t in (False, True)}
            acts32 = [act_quant(torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen), "fp32")
                      for _ in range(n_sets)]
            ref = refs.fp8_gemm_ref(*acts32[0], *ws[0])
            one = torch.ones((), device=DEV)
            # every path of the shape is built and checked first, then all are timed together, their replays
            # interleaved (`graph_time_many`): the card reaches its power limit within ~50 ms of a large-M GEMM, so
            # paths timed one after another meet different clocks (benchmarks/README.md "Session 27"). `_scaled_mm`
            # runs on the kernels' own e4m3 codes, as in `bench-kernels`.
            paths = {"scaled_mm": [lambda i=i: torch._scaled_mm(acts32[i][0], ws[i][0].t(), scale_a=one, scale_b=one,
                                                                out_dtype=torch.bfloat16) for i in range(n_sets)]}
            line = {"shape": shape, "M": m, "N": n, "K": k}
            if not args.no_gluon:
                cfg = tuning.default_config(n, k, m)
                acts8 = [act_quant(torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen), "e8m0")
                         for _ in range(n_sets)]
                paths["gluon"] = [lambda i=i: fp8_gemm(*acts8[i], *ws[i], cfg) for i in range(n_sets)]
                line["gluon_config"] = cfg.tag()
            for v in variants:
                sw = sws[v["tma"]]
                out = fp8_gemm_sm90(*acts32[0], ws[0][0], sw[0], **v)
                line[f"sm90_{tag(v)}"] = {"err": refs.rel_err(out, ref)}
                paths[f"sm90_{tag(v)}"] = [lambda i=i, v=v, sw=sw: fp8_gemm_sm90(*acts32[i], ws[i][0], sw[i], **v)
                                           for i in range(n_sets)]
            timed = dict(zip(paths, graph_time_many(list(paths.values()))))
            smm_us = timed["scaled_mm"][0]
            line |= {"scaled_mm_us": smm_us, "scaled_mm_TFLOPs": flops / smm_us / 1e6}
            if "gluon" in timed:
                line |= {"gluon_us": timed["gluon"][0], "gluon_ratio": smm_us / timed["gluon"][0]}
            for key, (us, how) in timed.items():
                if key.startswith("sm90_"):
                    line[key] |= {"us": us, "TFLOPs": flops / us / 1e6, "ratio": smm_us / us, "timing": how}
            rows.append(line)
            best = max((v for kk, v in line.items() if kk.startswith("sm90_") and ":" not in kk),
                       key=lambda v: v["ratio"], default={"ratio": 0.0})
            print(f"{shape:22s} M={m:5d} scaled_mm {smm_us:8.1f} µs {line['scaled_mm_TFLOPs']:6.0f} TF | "
                  + (f"gluon {line['gluon_us']:8.1f} ({line['gluon_ratio']:.2f}) | " if "gluon_us" in line else "")
                  + " ".join(f"{kk[5:]} {v['us']:7.1f} ({v['ratio']:.2f})"
                             for kk, v in line.items() if kk.startswith("sm90_"))
                  + f" | best {best['ratio']:.2f}", flush=True)
            del ws, sws, acts32, paths, timed
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"machine": torch.cuda.get_device_name(), "command": " ".join(os.path.basename(a) if a.startswith("/") else a
                                                                              for a in sys.argv), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
