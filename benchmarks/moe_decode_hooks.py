"""A/B of decode-MoE GEMV variants that live as environment hooks in a patch, not in the code (GPU).

The hooks of `moe_tail_s22.patch` (on plugins/moe.py; off by default), session 22's probe of the split w13's tail:
- `NO_TAIL=1`: each K slice of a split w13 tile stores its partial and ends: no counter, no slice-order sum, no
  epilogue (h is not written, so the op's output is wrong: a timing probe only);
- `NO_TAIL=2`: the counter and the sum as usual, the epilogue (clipped SwiGLU, 1×32 quantization, h) skipped.

The hooks of `moe_decode_hooks_s15.patch` (on the session-15 plugins/moe.py; each off by default) were the session-15
experiments:
- `WBLK=r[,SBLK=r]`: the MXFP4 weights (and e8m0 scales) stored in r-row × 128-byte chunks, one K step of r rows
  contiguous, instead of row-major (this harness permutes the tensors to match; w2 only where the Triton GEMV reads it);
- `PF_SELF=1`: each program asks L2 for its whole weight slice at its start (`cp.async.bulk.prefetch.L2`);
- `PF_W2=1`: each w13 program asks L2 for a share of its expert's w2 weights, for the w2 GEMV that follows;
- `PRMT=1`: e2m1 codes become f16 by byte permutes (`prmt`) instead of `cvt.rn.f16x2.e4m3x2` (a performance probe only:
  its f16 values are 2^-8 of the kernels', so its outputs are wrong: rel err 1.0).
Each setting runs in its own process (the hooks are read at import). Per shape (one TP8 rank, one EP8 rank, TP1) and
token count: the `moe_experts` op, w13 alone and w2 alone, and rel err against `moe_experts_ref`.

    git apply benchmarks/moe_decode_hooks_s15.patch
    python3 benchmarks/moe_decode_hooks.py --out hooks.json --settings 'base;WBLK=16;WBLK=16,SBLK=16;PF_SELF=1'
    git apply -R benchmarks/moe_decode_hooks_s15.patch

    git apply benchmarks/moe_tail_s22.patch
    python3 benchmarks/moe_decode_hooks.py --out tail.json --settings 'base;NO_TAIL=1;NO_TAIL=2' \
        --cases tp8:1,tp8:3,ep8:1,ep8:3,ep8:8
    git apply -R benchmarks/moe_tail_s22.patch
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys

import torch

SHAPES = {"tp8": (288, 320, 1), "ep8": (2304, 2304, 8), "tp1": (2304, 2304, 1)}   # inter, padded, ep
CASES = [("tp8", 3), ("tp8", 8), ("ep8", 3), ("ep8", 8), ("tp1", 1), ("tp1", 8)]
DEV = "cuda"
D, E, TOPK, LIMIT, SETS = 5120, 384, 6, 10.0, 8   # (TOPK: the bench's MOE_TOPK)


def blocked(q: torch.Tensor, rb: int, c: int) -> torch.Tensor:
    """[E, R, W] stored as [E, R/rb, W/c, rb, c] (rb-row × c-column chunks), viewed back as [E, R, W]."""
    e, r, w = q.shape
    return q.view(e, r // rb, rb, w // c, c).permute(0, 1, 3, 2, 4).contiguous().view(e, r, w)


def child(setting: dict, cases: list[tuple[str, int]]) -> None:
    from dsflash.plugins import moe as M
    from dsflash.plugins import refs
    from dsflash.plugins.bench import routed_decode_batches
    from dsflash.plugins.timing import graph_time_us
    wblk, sblk = setting.get("WBLK", 0), setting.get("SBLK", 0)
    gen = torch.Generator(device=DEV).manual_seed(3)
    gw = (torch.randn(E, D, device=DEV, generator=gen) * 0.02).to(torch.bfloat16)
    bias = torch.randn(E, device=DEV, generator=gen) * 0.05
    cur = weights = None
    for tp, m in cases:
        inter, ipad, ep = SHAPES[tp]
        el = E // ep
        if cur != tp:
            gen.manual_seed(11)
            weights = refs.random_mxfp4_experts(el, D, inter, ipad, gen)
            cur = tp
        w13_q, w13_s, w2_q, w2_s = weights
        w1 = (w13_q[:, :ipad], w13_s[:, :ipad], w13_q[:, ipad:], w13_s[:, ipad:])
        cfg = M.default_moe_config(m, TOPK, el, ipad, D, ep)
        kq13, ks13, kq2, ks2 = w13_q, w13_s, w2_q, w2_s
        if wblk:   # 32 words (128 bytes) per chunk row: one K step of the default 256-deep tiles
            kq13 = blocked(w13_q.view(torch.int32), wblk, 32).view(torch.int8).view(w13_q.shape)
            if not cfg.rows2:
                kq2 = blocked(w2_q.view(torch.int32), wblk, 32).view(torch.int8).view(w2_q.shape)
        if sblk:
            ks13 = blocked(w13_s.view(torch.uint8), sblk, 8).view(w13_s.dtype)
            if not cfg.rows2:
                ks2 = blocked(w2_s.view(torch.uint8), sblk, 8).view(w2_s.dtype)
        gen.manual_seed(100 + m)
        xs, shared, lists, routed, n_act = routed_decode_batches(m, gw, bias, el, ep, cfg.xq_layout, gen, SETS)
        b13 = 2 * ipad * D // 2 + 2 * ipad * D // 32
        b2 = D * ipad // 2 + D * ipad // 32
        ref = refs.moe_experts_ref(xs[0], routed[0][0], routed[0][1].long(), *w1, w2_q, w2_s, LIMIT, inter, shared[0])
        got = M.moe_experts(routed[0][2], routed[0][0], routed[0][1], kq13, ks13, kq2, ks2, LIMIT, inter, shared[0],
                            cfg, ep, lists[0])
        us, _ = graph_time_us([lambda i=i: M.moe_experts(routed[i][2], routed[i][0], routed[i][1], kq13, ks13, kq2,
                                                         ks2, LIMIT, inter, shared[i], cfg, ep, lists[i])
                               for i in range(SETS)])
        c0 = dataclasses.replace(cfg, pdl=False)
        slots = M.local_pair_slots(m * TOPK, ep)
        hps = [M.gemv_w13(routed[i][2], routed[i][0], routed[i][1], kq13, ks13, inter, LIMIT, c0, None, None,
                          lists[i], slots) for i in range(SETS)]
        us13, _ = graph_time_us([lambda i=i: M.gemv_w13(routed[i][2], routed[i][0], routed[i][1], kq13, ks13, inter,
                                                         LIMIT, c0, None, None, lists[i], slots) for i in range(SETS)])
        outs = [torch.zeros(m, D, device=DEV) for _ in range(SETS)]
        us2, _ = graph_time_us([lambda i=i: M.gemv_w2(hps[i], routed[i][1], kq2, ks2, outs[i], c0, lists[i], slots)
                                for i in range(SETS)])
        row = dict(setting=setting, shape=tp, M=m, config=cfg.tag(), distinct_experts=n_act,
                   err=refs.rel_err(got, ref), us=us, w13_us=us13, w2_us=us2, w13_GBps=n_act * b13 / us13 / 1e3,
                   w2_GBps=n_act * b2 / us2 / 1e3, all_GBps=n_act * (b13 + b2) / us / 1e3)
        print("ROW " + json.dumps(row), flush=True)


def parse(spec: str) -> dict:
    return {} if spec in ("", "base") else {k: int(v) for k, v in (kv.split("=") for kv in spec.split(","))}


def main() -> None:
    if len(sys.argv) > 3 and sys.argv[1] == "--child":
        child(json.loads(sys.argv[2]), [tuple(c) for c in json.loads(sys.argv[3])])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--settings", default="base;WBLK=16;WBLK=16,SBLK=16;PF_SELF=1;PF_W2=1;PRMT=1",
                    help="';'-separated hook settings, each 'base' or 'NAME=v,...'")
    ap.add_argument("--cases", default=",".join(f"{s}:{m}" for s, m in CASES),
                    help="shape:M pairs, shape one of " + ", ".join(SHAPES))
    a = ap.parse_args()
    cases = [(s, int(m)) for s, m in (c.split(":") for c in a.cases.split(","))]
    assert all(s in SHAPES for s, _ in cases), f"--cases: shapes are {', '.join(SHAPES)}"
    rows = []
    for spec in a.settings.split(";"):
        s = parse(spec)
        env = dict(os.environ, **{"DSF_" + k: str(v) for k, v in s.items()})
        p = subprocess.run([sys.executable, __file__, "--child", json.dumps(s), json.dumps(cases)], env=env,
                           capture_output=True, text=True)
        rows += [json.loads(line[4:]) for line in p.stdout.splitlines() if line.startswith("ROW ")]
        if p.returncode:
            print(spec, "FAILED", p.stderr[-3000:], flush=True)
    with open(a.out, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"{'setting':24s} {'shape':5s} {'M':>2s} {'err':>8s} {'all µs':>7s} {'w13 µs':>7s} {'w2 µs':>7s} "
          f"{'w13 GB/s':>8s} {'w2 GB/s':>8s} {'all GB/s':>8s}")
    for r in rows:
        name = ",".join(f"{k}={v}" for k, v in r["setting"].items()) or "base"
        print(f"{name:24s} {r['shape']:5s} {r['M']:2d} {r['err']:8.1e} {r['us']:7.1f} {r['w13_us']:7.1f} "
              f"{r['w2_us']:7.1f} {r['w13_GBps']:8.0f} {r['w2_GBps']:8.0f} {r['all_GBps']:8.0f}")


if __name__ == "__main__":
    main()
