"""Session 17's experiment on the Gluon decode FP8 GEMM (H200): where its time grows with M, and how the scale loads
were changed. Builds variants of the session-16 decode kernel and times each over every decode candidate
(`tuning.gluon_decode_candidates`), the best per (shape, M, variant) printed and all timings written as JSON.

Variants (the names of `gemm_decode_scales_s17*_h200.json`):
  f32_m0        the session-16 kernel, fp32 activation scales (what `make bench-kernels` fed it until session 17);
  e8_m0         the same kernel, e8m0 activation scales (what `fp8_linear` feeds it): one byte load per token and
                32-K block, in the fold after the MMA wait;
  e8_m3         weight and activation scales as one 32-bit word (4 K blocks) per box, loaded before the MMAs;
  e8_m4         e8_m3 a stage ahead (the first stage's weight words before `griddepcontrol.wait`);
  e8_m5         e8_m4 with the next stage's loads masked past the slice: what `fp8_gemm_gluon` now runs when a slice
                has more than one stage (with one stage it runs e8_m3);
  f32_m1_diag   no activation scale at all (wrong results; the cost of the scale loads);
  chain_e8      `act_quant` then the GEMM (two launches), as `fp8_linear_config` runs a plain config;
  qa_one_launch the in-kernel quantization configs (one launch, bf16 activation in).
With --bp128 the candidates also include 128-row tiles (8 warps, a variant of the launch): slower everywhere.

    git show e7fd5c3:plugins/fp8_gemm_gluon.py > /tmp/gluon_s16.py
    python3 benchmarks/gemm_decode_scales.py /tmp/gluon_s16.py --out out.json [--shapes ...] [--variants ...]

GPU only.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import tempfile
import time

import torch

from dsflash.plugins import refs, tuning
from dsflash.plugins.timing import graph_time_us, input_sets

DEV = "cuda"
SHAPES = {"shexp_w13[tp1]": (4608, 5120), "wo_b[tp1]": (5120, 8192), "wq_b[tp1]": (32768, 1280),
          "wq_b[tp8]": (4096, 1280), "wo_b[tp8]": (5120, 1024), "shexp_w13[tp8]": (576, 5120)}
KERNEL_MODES = {"f32_m0": 0, "e8_m0": 0, "e8_m3": 3, "e8_m4": 4, "e8_m5": 5, "f32_m1_diag": 1}


def _replace(src: str, old: str, new: str) -> str:
    assert src.count(old) == 1, f"the kernel source does not match the session-16 kernel at: {old[:60]!r}"
    return src.replace(old, new)


# the session-16 kernel sets up its scale pointers after the ring's first loads; the word modes move them before
SCALE_POINTERS = """    rows = off_n + gl.arange(0, BP, layout=rows_l)
    rows_ok = rows < N
    toks = gl.arange(0, BQ, layout=cols_l)
    toks_ok = toks < M
    sw_row = ws_ptr + (rows // 32) * stride_ws
    sa_col = as_ptr + toks * stride_as
    n_kb = K // 32
"""


def variant_source(src: str) -> str:
    """The session-16 `fp8_gemm_gluon.py` with an SA_MODE constexpr on the decode kernel (the modes of
    KERNEL_MODES) and `decode_exp(a_q, a_s, w_q, w_s, cfg, mode)` to launch it."""
    src = _replace(src, "A128: gl.constexpr, num_warps: gl.constexpr):\n    \"\"\"Decode",
                   "A128: gl.constexpr, num_warps: gl.constexpr, SA_MODE: gl.constexpr = 0):\n    \"\"\"Decode")
    src = _replace(src, """    n_st = gl.cdiv(K, BK * BOXES)
    per = gl.cdiv(n_st, SPLIT)
    st0 = pid_k * per
    n_my = gl.minimum(st0 + per, n_st) - st0
    # every slot""", """    n_st = gl.cdiv(K, BK * BOXES)
    per = gl.cdiv(n_st, SPLIT)
    st0 = pid_k * per
    n_my = gl.minimum(st0 + per, n_st) - st0
""" + SCALE_POINTERS + """    if SA_MODE >= 4:
        pw = _words(sw_row, st0 * BOXES * _KB, n_kb, rows_ok, BOXES)
    # every slot""")
    src = _replace(src, SCALE_POINTERS + """    zero = gl""", """    if SA_MODE >= 4:
        pa = _words(sa_col, st0 * BOXES * _KB, n_kb, toks_ok, BOXES)
    zero = gl""")
    src = _replace(src, """        parts = ()
        for b in gl.static_range(BOXES):
            w_s = w_bufs.index(st * BOXES + b)""", """        if SA_MODE >= 4:
            wwords = pw
            awords = pa
            more = (i + 1 < n_my) | (SA_MODE == 4)
            pw = _words(sw_row, kb0 + BOXES * _KB, n_kb, rows_ok & more, BOXES)
            pa = _words(sa_col, kb0 + BOXES * _KB, n_kb, toks_ok & more, BOXES)
        if SA_MODE == 3:
            wwords = _words(sw_row, kb0, n_kb, rows_ok, BOXES)
            awords = _words(sa_col, kb0, n_kb, toks_ok, BOXES)
        parts = ()
        for b in gl.static_range(BOXES):
            w_s = w_bufs.index(st * BOXES + b)""")
    src = _replace(src, """            words = gl.load((sw_row + kb0 + b * _KB).to(gl.pointer_type(gl.int32)),
                            mask=rows_ok & (kb0 + b * _KB < n_kb), other=0)
            for kk in gl.static_range(_KB):
                kb = kb0 + b * _KB + kk
                sw = e8m0_to_f32((words >> (8 * kk)) & 255)
                if QUANT_A:
                    sa = sa_q[b * _KB + kk]
                else:""", """            if SA_MODE >= 3:
                words = wwords[b]
            else:
                words = gl.load((sw_row + kb0 + b * _KB).to(gl.pointer_type(gl.int32)),
                                mask=rows_ok & (kb0 + b * _KB < n_kb), other=0)
            for kk in gl.static_range(_KB):
                kb = kb0 + b * _KB + kk
                sw = e8m0_to_f32((words >> (8 * kk)) & 255)
                if QUANT_A:
                    sa = sa_q[b * _KB + kk]
                elif SA_MODE == 1:
                    sa = gl.full([BQ], 1.0, gl.float32, cols_l)
                elif SA_MODE >= 3:
                    sa = e8m0_to_f32((awords[b] >> (8 * kk)) & 255)
                else:""")
    src = _replace(src, """@gluon.jit
def _fp8_gemm_g32_gluon_decode_kernel""", """@gluon.jit
def _words(base, kb, n_kb, ok, BOXES: gl.constexpr):
    out = ()
    for b in gl.static_range(BOXES):
        out = out + (gl.load((base + kb + b * _KB).to(gl.pointer_type(gl.int32)), mask=ok & (kb + b * _KB < n_kb),
                             other=0), )
    return out


@gluon.jit
def _fp8_gemm_g32_gluon_decode_kernel""")
    src = _replace(src, """            cfg: GemmConfig, out: torch.Tensor, a128: bool = False) -> torch.Tensor:""",
                   """            cfg: GemmConfig, out: torch.Tensor, a128: bool = False, sa_mode: int = 0) -> torch.Tensor:""")
    src = _replace(src, """        num_warps=4, launch_pdl=cfg.pdl)
    return out""", """        num_warps=cfg.num_warps, launch_pdl=cfg.pdl, SA_MODE=sa_mode)
    return out""")
    return src + '''

def decode_exp(a_q, a_s, w_q, w_s, cfg, sa_mode):
    sa, as_e8 = _scale_arg(a_s)
    ws8, _ = _scale_arg(w_s)
    assert sa_mode < 3 or (as_e8 and sa.stride(0) % 4 == 0), "word modes need e8m0 activation scales"
    out = torch.empty((a_q.shape[0], w_q.shape[0]), dtype=torch.bfloat16, device=a_q.device)
    return _decode(a_q, sa, as_e8, w_q, ws8, cfg, out, sa_mode=sa_mode)
'''


def load_module(src: str, name: str):
    path = pathlib.Path(tempfile.mkdtemp()) / f"{name}.py"   # Triton's JIT reads the kernels' source from a file
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _bp128(split: int, stages: int, boxes: int) -> tuning.GemmConfig:
    """A 128-row decode tile on 8 warps (GemmConfig admits only 64×8 on 4 warps: set past its check)."""
    c = tuning.GemmConfig(64, 8, split, 4, stages, swap_ab=True, kgroups=boxes, gluon=True, pdl=True)
    object.__setattr__(c, "block_p", 128)
    object.__setattr__(c, "num_warps", 8)
    return c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kernel_source", help="the session-16 plugins/fp8_gemm_gluon.py (git show e7fd5c3:...)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="shexp_w13[tp1],wo_b[tp1]")
    ap.add_argument("--variants", default="f32_m0,e8_m0,e8_m3,f32_m1_diag,chain_e8,qa_one_launch")
    ap.add_argument("--ms", default="1,3,8")
    ap.add_argument("--bp128", action="store_true")
    ap.add_argument("--budget-s", type=float, default=420.0)
    args = ap.parse_args()
    from dsflash.plugins.act_quant import act_quant   # Triton from here on
    from dsflash.plugins.bench import measure_ceilings
    from dsflash.plugins.fp8_gemm_gluon import fp8_linear_gluon_decode
    from dsflash.plugins.registry import fp8_linear_config
    G = load_module(variant_source(pathlib.Path(args.kernel_source).read_text()), "gluon_decode_variants")
    variants = args.variants.split(",")
    t_end = time.time() + args.budget_s
    ceil = measure_ceilings()
    bw = ceil["copy_GBps"] * 1e3
    rows, summary = [], []
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        nb_w = n * k + (n // 32) * (k // 32)
        for m in (int(v) for v in args.ms.split(",")):
            if time.time() > t_end:
                break
            nbytes = nb_w + m * k * (1 + 4 / 32) + m * n * 2
            n_sets = input_sets(nb_w + m * k)
            g = torch.Generator(device=DEV).manual_seed(m)
            ws = [refs.quant_weight_fp8_ref(torch.randn(n, k, device=DEV, generator=g) * 0.02) for _ in range(n_sets)]
            xs = [(torch.randn(m, k, device=DEV, generator=g) * 2).to(torch.bfloat16) for _ in range(n_sets)]
            a32 = [refs.act_quant_ref(x) for x in xs]
            a8 = [act_quant(x, "e8m0") for x in xs]
            ref32 = refs.fp8_gemm_ref(*a32[0], *ws[0], torch.float32)
            cands = tuning.gluon_decode_candidates(n, k)
            plain = [c for c in cands if not c.quant_in_kernel]
            if args.bp128 and n >= 4096 and k >= 4096:
                plain += [_bp128(sp, st, bx) for bx, st in ((1, 3), (1, 4), (2, 2), (1, 2)) for sp in (4, 5, 8, 10)]
            best = {}

            def record(var, cfg, fn_i):
                if var not in variants:
                    return
                try:
                    err = refs.rel_err(fn_i(0), ref32)
                    us, _ = graph_time_us([lambda i=i: fn_i(i) for i in range(n_sets)])
                except Exception as e:   # a variant that fails to compile is reported, not fatal
                    rows.append({"shape": name, "M": m, "var": var, "config": cfg.tag(), "error": str(e)[:400]})
                    return
                r = {"shape": name, "M": m, "var": var, "config": cfg.tag(), "us": us, "err": err,
                     "pct_copy_bw": 100 * nbytes / bw / us}
                rows.append(r)
                if var not in best or us < best[var]["us"]:
                    best[var] = r

            for cfg in plain:
                for var, mode in KERNEL_MODES.items():
                    acts = a32 if var.startswith("f32") else a8
                    record(var, cfg, lambda i, c=cfg, a=acts, md=mode: G.decode_exp(*a[i], *ws[i], c, md))
                record("chain_e8", cfg, lambda i, c=cfg: fp8_linear_config(xs[i], *ws[i], c))
            for cfg in (c for c in cands if c.quant_in_kernel):
                record("qa_one_launch", cfg, lambda i, c=cfg: fp8_linear_gluon_decode(xs[i], *ws[i], c))
            for var, r in best.items():
                line = (f"{name:16s} M={m} {var:14s} {r['us']:7.2f} us {r['pct_copy_bw']:5.1f} % err {r['err']:.1e} "
                        f"{r['config']}")
                print(line, flush=True)
                summary.append(line)
            del ws, xs, a32, a8
            torch.cuda.empty_cache()
            with open(args.out, "w") as f:
                json.dump({"ceilings": ceil, "rows": rows, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
