"""Session 18 (H200): where the Gluon decode GEMM's extra time at M = 8 over M = 1 goes, on the 24 MB shared w13
(TP1, 4608×5120), and the fix. Variants of the kernel before the fix (commit 3e40ae5), built as text patches:

- ``prod``: that kernel as it was (split-K workspace [split, M, N], token-major);
- ``tok1`` (diagnostic, wrong results): the token TMA descriptor covers one row, so each box moves 128 bytes as at
  M = 1 (the kernel still computes and stores 8 tokens; rows 1..7 read as zeros);
- ``part1`` (diagnostic): only token 0's split-K partial is stored and summed (the workspace traffic of M = 1);
- ``tok1_part1``: both;
- ``ws8``: the workspace as [split, N, 8] with every token column stored, so a thread's two adjacent tokens (the
  MMA layout) are one 8-byte access and the mask is constant along tokens;
- ``ws8b``: the same slab, the partial first converted to a blocked layout of 4 tokens per thread (16-byte
  accesses);
- ``bp128`` (a candidate): 128 weight rows per program on the same 4 warps;

and ``new``: the installed kernel (`dsflash.plugins.fp8_gemm_gluon`, the workspace of `splitk.decode_ws_tokens`),
``new_q8`` the same with all 8 token columns in the workspace at every M > 1 (session 18's first form).
Each is timed over the leading PDL decode configs of the shape (rows [variant, shape, M, config, µs, max |Δ|
against prod or null for the diagnostics]).

    git show 3e40ae5:plugins/fp8_gemm_gluon.py > /tmp/gluon_s17.py
    python3 benchmarks/gemm_decode_m8.py /tmp/gluon_s17.py --out out.json [--variants ...] [--shapes ...] [--ms ...]

GPU only.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from gemm_decode_scales import _replace, load_module  # noqa: E402
from gemm_decode_splitk import DECODE_EXP  # noqa: E402

from dsflash.plugins import refs, tuning  # noqa: E402
from dsflash.plugins.timing import graph_time_us, input_sets  # noqa: E402

DEV = "cuda"
SHAPES = {"shexp_w13[tp1]": (4608, 5120), "wo_b[tp1]": (5120, 8192), "wq_b[tp1]": (32768, 1280),
          "wq_b[tp8]": (4096, 1280)}
CONFIGS = {   # the leading decode configs of each shape in session 17's kernels_h200.json
    "shexp_w13[tp1]": ["LT64x8b4s5st2_pdl", "LT64x8b1s6st2_pdl", "LT64x8b1s5st4_pdl", "LT64x8b1s5st3_pdl",
                       "LT64x8b2s5st3_pdl", "LT64x8b1s7st4_pdl"],
}
TOK_DESC = "    a_desc = TensorDescriptor(a, [m, k], [a.stride(0), 1], [cfg.block_q, BLOCK_K], a_layout)"
PART_MASK = "    o_mask = gl.expand_dims(rows_ok, 1) & gl.expand_dims(toks_ok, 0)\n    splitk_store"
STORE = "    splitk_store(out_ptr, acc, o_off, o_mask, part_ptr, cnt_ptr, pid, pid_k, SPLIT, M * N, MAX_SPLIT)\n"
WS_ALLOC = "part = torch.empty((split, m, n), dtype=torch.float32, device=out.device)"
# the workspace as [split, N, 8 tokens]: a thread's two adjacent tokens (the MMA layout) are one 8-byte access, a
# warp's 256 contiguous bytes; all 8 token columns stored (zeros past M), so its mask is constant along tokens
WS8_STORE = """    if SPLIT == 1:
        gl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        w_off = gl.expand_dims(rows * BQ, 1) + gl.expand_dims(toks, 0)
        w_mask = gl.expand_dims(rows_ok, 1) & gl.expand_dims(toks < BQ, 0)
        if splitk_arrive(acc, part_ptr, w_off, w_mask, cnt_ptr, pid, pid_k, SPLIT, N * BQ):
            tot = splitk_total(part_ptr, w_off, w_mask, cnt_ptr, pid, SPLIT, N * BQ, MAX_SPLIT)
            gl.store(out_ptr + o_off, tot.to(out_ptr.dtype.element_ty), mask=o_mask)
"""
# the same workspace, the partial first converted to a blocked layout of 4 tokens per thread (16-byte accesses)
WS8B_STORE = """    if SPLIT == 1:
        gl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        blk: gl.constexpr = gl.BlockedLayout([1, 4], [16, 2], [num_warps, 1], [1, 0])
        accb = gl.convert_layout(acc, blk)
        rows_b = off_n + gl.arange(0, BP, layout=gl.SliceLayout(1, blk))
        toks_b = gl.arange(0, BQ, layout=gl.SliceLayout(0, blk))
        w_off = gl.expand_dims(rows_b * BQ, 1) + gl.expand_dims(toks_b, 0)
        w_mask = gl.expand_dims(rows_b < N, 1) & gl.expand_dims(toks_b < BQ, 0)
        if splitk_arrive(accb, part_ptr, w_off, w_mask, cnt_ptr, pid, pid_k, SPLIT, N * BQ):
            tot = splitk_total(part_ptr, w_off, w_mask, cnt_ptr, pid, SPLIT, N * BQ, MAX_SPLIT)
            ob_off = gl.expand_dims(toks_b * N, 0) + gl.expand_dims(rows_b, 1)
            ob_mask = gl.expand_dims(rows_b < N, 1) & gl.expand_dims(toks_b < M, 0)
            gl.store(out_ptr + ob_off, tot.to(out_ptr.dtype.element_ty), mask=ob_mask)
"""


def variant(src: str, name: str) -> str:
    if "tok1" in name:
        src = _replace(src, TOK_DESC, TOK_DESC.replace("[m, k]", "[1, k]"))
    if "part1" in name:
        src = _replace(src, PART_MASK, PART_MASK.replace("toks_ok, 0)", "toks < 1, 0)"))
    if name.startswith("ws8"):
        src = _replace(src, STORE, WS8B_STORE if name == "ws8b" else WS8_STORE)
        src = _replace(src, WS_ALLOC, WS_ALLOC.replace("(split, m, n)", "(split, n, cfg.block_q)"))
        src = _replace(src, "import k_slices, split_counter, splitk_store",
                       "import k_slices, split_counter, splitk_arrive, splitk_store, splitk_total")
    return src + DECODE_EXP


def _cfg(n: int, k: int, tag: str) -> tuning.GemmConfig:
    for c in tuning.gluon_decode_candidates(n, k):
        if c.tag() == tag:
            return c
    raise KeyError(tag)


def leading_configs(shape: str, m: int, count: int = 6) -> list[str]:
    """The `count` fastest PDL Gluon decode configs of this shape in benchmarks/kernels_h200.json, at the decode M
    there nearest to m."""
    if shape in CONFIGS:
        return CONFIGS[shape]
    doc = json.loads((pathlib.Path(__file__).parent / "kernels_h200.json").read_text())
    rows = [r for r in doc["rows"] if r["op"] == "fp8_gemm[tuned]" and r["shape"].startswith(shape) and r["M"] <= 8]
    r = min(rows, key=lambda r: abs(r["M"] - m))
    tags = [c[0] for c in sorted(r["candidates"], key=lambda c: c[1])
            if c[0].startswith("LT") and c[0].endswith("_pdl")]
    return tags[:count]


DIAGNOSTICS = ("tok1", "part1", "tok1_part1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kernel_source", help="plugins/fp8_gemm_gluon.py before the fix (git show 3e40ae5:...)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", default="prod,tok1,part1,tok1_part1,bp128")
    ap.add_argument("--shapes", default="shexp_w13[tp1]")
    ap.add_argument("--ms", default="1,3,8")
    ap.add_argument("--diag-ms", default="8", help="the token counts the diagnostics and bp128 run at")
    args = ap.parse_args()
    from dsflash.plugins import fp8_gemm_gluon
    from dsflash.plugins.act_quant import act_quant
    from dsflash.plugins.splitk import decode_ws_tokens
    src = pathlib.Path(args.kernel_source).read_text()
    variants = args.variants.split(",")
    mods = {v: load_module(variant(src, v), f"gluon_m8_{v}") for v in ["prod"] + variants
            if v not in ("bp128", "new", "new_q8")}
    new = fp8_gemm_gluon
    diag_ms = {int(x) for x in args.diag_ms.split(",")}
    ms = [int(x) for x in args.ms.split(",")]
    res = []
    for shape in args.shapes.split(","):
        n, k = SHAPES[shape]
        nb_w = n * k + (n // 32) * (k // 32)
        for m in ms:
            n_sets = input_sets(nb_w + m * k)
            ws = [refs.quant_weight_fp8_ref(torch.randn(n, k, device=DEV) * 0.02) for _ in range(n_sets)]
            a8 = [act_quant((torch.randn(m, k, device=DEV) * 2).to(torch.bfloat16), "e8m0") for _ in range(n_sets)]
            for v in variants:
                if (v in DIAGNOSTICS or v == "bp128") and m not in diag_ms:
                    continue
                for tag in leading_configs(shape, m):
                    cfg = _cfg(n, k, tag)
                    if v.startswith("new"):
                        def f(i, c=cfg, q8=v == "new_q8"):
                            new.decode_ws_tokens = (lambda m_, t: 1 if m_ == 1 else t) if q8 else decode_ws_tokens
                            sa, as_e8 = new._scale_arg(a8[i][1])
                            out = torch.empty((m, n), dtype=torch.bfloat16, device=DEV)
                            return new._decode(a8[i][0], sa, as_e8, ws[i][0], new._scale_arg(ws[i][1])[0], c, out)
                    else:
                        if v == "bp128":
                            cfg = dataclasses.replace(cfg)
                            object.__setattr__(cfg, "block_p", 128)
                        mod = mods["prod" if v == "bp128" else v]
                        f = lambda i, c=cfg, mod=mod: mod.decode_exp(*a8[i], *ws[i], c)   # noqa: E731
                    try:
                        got = f(0)
                        ref = mods["prod"].decode_exp(*a8[0], *ws[0], _cfg(n, k, tag))
                        err = None if v in DIAGNOSTICS else float((got.float() - ref.float()).abs().max())
                        us, _ = graph_time_us([lambda i=i, f=f: f(i) for i in range(n_sets)])
                    except Exception as e:   # a variant that does not compile is a result too
                        print(v, shape, m, tag, "failed:", type(e).__name__, str(e)[:300], flush=True)
                        res.append([v, shape, m, tag, None, str(e)[:300]])
                        continue
                    res.append([v, shape, m, tag, us, err])
                    print(f"{v:11s} {shape:15s} M={m} {tag:20s} {us:7.2f} us  err={err}", flush=True)
            del ws, a8
    with open(args.out, "w") as fh:
        json.dump(res, fh, indent=0)
    print("\nbest per variant (shape, M, µs, config):")
    for shape in args.shapes.split(","):
        for m in ms:
            for v in variants:
                rows = [r for r in res if r[0] == v and r[1] == shape and r[2] == m and r[4] is not None]
                if rows:
                    b = min(rows, key=lambda r: r[4])
                    print(f"  {shape:15s} M={m} {v:11s} {b[4]:6.2f} {b[3]}")


if __name__ == "__main__":
    main()
