"""The large-M group-32 FP8 GEMM's K loop in SASS: its instruction mix and the issue-rate bound it implies.

Compiles `fp8_gemm_gluon._fp8_gemm_g32_gluon_kernel` for sm_90 (no GPU needed: Triton's bundled ptxas and cuobjdump),
finds the K loop (the backward branch whose body holds the wgmmas) and counts its instructions per opcode. A warp's
loop iteration is one 128-K stage of its 16 rows × BN columns; every instruction takes one of the SM's four issue
slots per clock, so at clock f the loop cannot exceed

    flops per warp-iteration / instructions per warp-iteration × 4 × SMs × f

whatever the memory system does. The group-32 promotion is one FFMA per accumulator element per 32 K, i.e. one FFMA
lane per 64 MMA flops: at 70 % of `_scaled_mm` the FFMAs alone take a fixed share of the issue slots, which the
report states next to the loop's own FFMA share.

    python3 benchmarks/sass_mix.py [--config L64x128w4st3r168] [--smm-tflops 1290] [--clock-ghz 1.98] [--out f.json]
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import tempfile
from pathlib import Path

from dsflash.plugins.tuning import NUM_SMS as SMS

ISSUE_PER_CLK = 4          # one warp instruction per SM sub-partition per clock
TARGET = 0.70              # the issue's line: 70 % of _scaled_mm
_LINE = re.compile(r"/\*([0-9a-f]{4,6})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\.[^ ;]*)?\s*([^;]*);")


def compile_sass(bm: int, bn: int, warps: int, stages: int, maxnreg: int | None) -> str:
    """SASS of the large-M kernel at this tile, e8m0 activation scales (as `fp8_linear` runs it), for sm_90."""
    import torch
    import triton
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton._C.libtriton import native_specialize_impl
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from dsflash.plugins import fp8_gemm_gluon as G

    m, n, k = 4096, 4608, 5120
    a = torch.empty(m, k, dtype=torch.float8_e4m3fn)
    w = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    bk = G.BLOCK_K
    descs = {"a_desc": TensorDescriptor(a, [m, k], [k, 1], [bm, bk],
                                        gl.NVMMASharedLayout.get_default_for([bm, bk], gl.float8e4nv)),
             "b_desc": TensorDescriptor(w, [n, k], [k, 1], [bn, bk],
                                        gl.NVMMASharedLayout.get_default_for([bn, bk], gl.float8e4nv))}
    scalars = {"out_ptr": "*bf16", "as_ptr": "*u8", "ws_ptr": "*u8", "M": "i32", "N": "i32", "K": "i32",
               "stride_om": "i32", "stride_as": "i32", "stride_ws": "i32"}
    const = {"AS_E8M0": True, "GROUP_M": 8, "NUM_STAGES": stages, "G128": False, "num_warps": warps}
    kern = G._fp8_gemm_g32_gluon_kernel
    names = kern.arg_names
    sig = {}
    for p in names:
        if p in const:
            sig[p] = "constexpr"
        elif p in descs:
            sig[p] = native_specialize_impl(BaseBackend, descs[p], False, True, True)[0]
        else:
            sig[p] = scalars[p]
    aligned = ("out_ptr", "as_ptr", "ws_ptr", "K", "stride_om", "stride_as", "stride_ws")
    src = GluonASTSource(kern, sig, {(names.index(p),): v for p, v in const.items()},
                         {(i,): [["tt.divisibility", 16]] for i, p in enumerate(names) if p in aligned})
    opts = {"num_warps": warps, **({"maxnreg": maxnreg} if maxnreg else {})}
    return cubin_sass(triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["cubin"])


def cubin_sass(cubin: bytes) -> str:
    """SASS of a compiled kernel (Triton's bundled cuobjdump; no GPU needed)."""
    import triton
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(cuobjdump), "-sass", f.name], check=True, capture_output=True, text=True).stdout


def k_loop(sass: str, marker: str = "QGMMA") -> list[str]:
    """Opcodes of the K loop: the body of the backward branch that spans the most `marker` instructions (the FP8
    wgmma by default; HMMA for an mma.sync kernel)."""
    ins = [(int(mt.group(1), 16), mt.group(3), mt.group(5)) for mt in map(_LINE.search, sass.splitlines()) if mt]
    best = None
    for addr, op, args in ins:
        if op != "BRA":
            continue
        target = re.match(r"`?\(?\.?L?_?x?_?(0x[0-9a-f]+)", args.strip())
        if not target or int(target.group(1), 16) >= addr:
            continue
        body = [o for a, o, _ in ins if int(target.group(1), 16) <= a <= addr]
        if body.count(marker) and (best is None or body.count(marker) > best.count(marker)):
            best = body
    assert best is not None, f"no backward branch around the {marker}s"
    return best


def report(ops: list[str], bm: int, bn: int, warps: int, smm_tflops: float, clock_ghz: float) -> dict:
    mix = collections.Counter(ops)
    n = len(ops)
    ffma = mix["FFMA"]
    flops = 2 * bm * bn * 128 / warps                   # one warp's share of a 128-K stage of the tile
    bound = flops / n * ISSUE_PER_CLK * SMS * clock_ghz * 1e9 / 1e12
    # FFMA lanes per second at the target rate, as a share of all issue slots (32 lanes per warp instruction)
    ffma_slots = TARGET * smm_tflops * 1e12 / 64 / 32 / (ISSUE_PER_CLK * SMS * clock_ghz * 1e9)
    return {"instructions_per_stage": n, "ffma": ffma, "ffma_share": ffma / n, "mix": dict(mix.most_common()),
            "flops_per_instruction": flops / n, "issue_bound_TFLOPs": bound,
            "issue_bound_pct_smm": 100 * bound / smm_tflops, "smm_TFLOPs": smm_tflops, "clock_GHz": clock_ghz,
            "ffma_issue_share_at_target": ffma_slots,
            "issue_utilisation_needed_at_target": ffma_slots / (ffma / n)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="L64x128w4st3r168",
                    help="the large-M tile tag, L<BM>x<BN>w<warps>st<stages>[r<regs>]")
    ap.add_argument("--smm-tflops", type=float, default=None,
                    help="_scaled_mm's FP8 rate (default: kernels_h200.json's measured ceiling)")
    ap.add_argument("--clock-ghz", type=float, default=1.98, help="SM clock (H200 maximum: the most generous bound)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    mt = re.fullmatch(r"L(\d+)x(\d+)w(\d+)st(\d+)(?:r(\d+))?", a.config)
    assert mt, f"config tag {a.config!r}: expected L<BM>x<BN>w<warps>st<stages>[r<regs>]"
    bm, bn, warps, stages = (int(v) for v in mt.groups()[:4])
    regs = int(mt.group(5)) if mt.group(5) else None
    smm = a.smm_tflops
    if smm is None:
        with open(Path(__file__).resolve().parent / "kernels_h200.json") as f:
            smm = json.load(f)["ceilings"]["fp8_scaled_mm_TFLOPs"]
    r = {"config": a.config, **report(k_loop(compile_sass(bm, bn, warps, stages, regs)), bm, bn, warps, smm,
                                        a.clock_ghz)}
    print(f"{a.config}: {r['instructions_per_stage']} instructions per warp and 128-K stage, {r['ffma']} FFMA "
          f"({100 * r['ffma_share']:.0f} %)")
    print("  " + ", ".join(f"{k} {v}" for k, v in list(r["mix"].items())[:16]))
    print(f"  issue bound at {a.clock_ghz} GHz: {r['issue_bound_TFLOPs']:.0f} TFLOP/s = "
          f"{r['issue_bound_pct_smm']:.0f} % of _scaled_mm ({smm:.0f})")
    print(f"  at {100 * TARGET:.0f} % of _scaled_mm the FFMAs alone take {100 * r['ffma_issue_share_at_target']:.0f} % "
          f"of all issue slots; with this loop's mix every slot would have to issue "
          f"{100 * r['issue_utilisation_needed_at_target']:.0f} % of the time")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
