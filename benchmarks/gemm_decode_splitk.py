"""Session 17 (H200): the Gluon decode GEMM's split-K partials summed by a statically unrolled loop (SPLIT a
constexpr, every partial's load issued before the adds) against `splitk.splitk_total`'s runtime loop. The variant is
built from the decode kernel as it was before that change (commit 1aa0521), checked
bit-identical to it, and both are timed over the PDL decode candidates at M = 1 and 8
(`gemm_decode_splitk_s17_h200.json`: rows [shape, M, "prod" | "static", config, µs]). The kernel now unrolls the sum
to a power of two >= SPLIT with masked slices (`splitk_total`'s MAX_SPLIT), the same loads.

    git show 1aa0521:plugins/fp8_gemm_gluon.py > /tmp/gluon_words.py
    python3 benchmarks/gemm_decode_splitk.py /tmp/gluon_words.py --out out.json

GPU only.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from gemm_decode_scales import _replace, load_module  # noqa: E402

from dsflash.plugins import refs, tuning  # noqa: E402
from dsflash.plugins.timing import graph_time_us, input_sets  # noqa: E402

DEV = "cuda"
SHAPES = [("shexp_w13[tp1]", 4608, 5120), ("wq_b[tp8]", 4096, 1280)]


def static_splitk_source(src: str) -> str:
    src = _replace(src, "stride_ws, stride_as, SPLIT, AS_E8M0: gl.constexpr, BOXES: gl.constexpr,",
                   "stride_ws, stride_as, SPLIT: gl.constexpr, AS_E8M0: gl.constexpr, BOXES: gl.constexpr,")
    src = _replace(src, "    splitk_store(out_ptr, acc, o_off, o_mask, part_ptr, cnt_ptr, pid, pid_k, SPLIT, M * N)",
                   "    _splitk_store_static(out_ptr, acc, o_off, o_mask, part_ptr, cnt_ptr, pid, pid_k, SPLIT, M * N)")
    src = _replace(src, "import triton\n", "import triton\nimport triton.language as tl\n")
    src = _replace(src, "@gluon.jit\ndef _scale_words", '''@triton.jit
def _splitk_store_static(out_ptr, part, off, mask, ws_ptr, cnt_ptr, tile, pid_k, SPLIT: tl.constexpr, SLAB):
    if SPLIT == 1:
        tl.store(out_ptr + off, part.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(ws_ptr + pid_k * SLAB + off, part, mask=mask)
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT - 1:
            tot = tl.load(ws_ptr + off, mask=mask, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT):
                tot += tl.load(ws_ptr + s * SLAB + off, mask=mask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")
            tl.store(out_ptr + off, tot.to(out_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _scale_words''')
    return src + DECODE_EXP


DECODE_EXP = '''

def decode_exp(a_q, a_s, w_q, w_s, cfg):
    sa, as_e8 = _scale_arg(a_s)
    ws8, _ = _scale_arg(w_s)
    out = torch.empty((a_q.shape[0], w_q.shape[0]), dtype=torch.bfloat16, device=a_q.device)
    return _decode(a_q, sa, as_e8, w_q, ws8, cfg, out)
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kernel_source", help="plugins/fp8_gemm_gluon.py before the unrolled sum (git show 1aa0521:...)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from dsflash.plugins.act_quant import act_quant
    from dsflash.plugins.fp8_gemm import fp8_gemm
    src = pathlib.Path(args.kernel_source).read_text()
    base = load_module(src + DECODE_EXP, "gluon_runtime_splitk")   # "prod": the kernel with the runtime loop
    G = load_module(static_splitk_source(src), "gluon_static_splitk")
    res = []
    for name, n, k in SHAPES:
        nb_w = n * k + (n // 32) * (k // 32)
        for m in (1, 8):
            n_sets = input_sets(nb_w + m * k)
            ws = [refs.quant_weight_fp8_ref(torch.randn(n, k, device=DEV) * 0.02) for _ in range(n_sets)]
            a8 = [act_quant((torch.randn(m, k, device=DEV) * 2).to(torch.bfloat16), "e8m0") for _ in range(n_sets)]
            best = {}
            for cfg in (c for c in tuning.gluon_decode_candidates(n, k) if not c.quant_in_kernel and c.pdl):
                for var, f in (("prod", lambda i, c=cfg: base.decode_exp(*a8[i], *ws[i], c)),
                               ("static", lambda i, c=cfg: G.decode_exp(*a8[i], *ws[i], c))):
                    assert torch.equal(f(0), fp8_gemm(*a8[0], *ws[0], cfg)), (var, cfg.tag())
                    us, _ = graph_time_us([lambda i=i, f=f: f(i) for i in range(n_sets)])
                    res.append([name, m, var, cfg.tag(), us])
                    if var not in best or us < best[var][0]:
                        best[var] = (us, cfg.tag())
            print(name, m, {v: (round(u, 2), t) for v, (u, t) in best.items()}, flush=True)
            del ws, a8
    with open(args.out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
