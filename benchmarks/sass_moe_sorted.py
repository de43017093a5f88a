"""The sorted MoE path's w13 K loop in SASS: instructions per weight element at a list of tiles (no GPU needed).

Compiles `plugins.moe._moe_w13_kernel` (the prefill path: one expert's block of tokens × w1 and w3 rows, MXFP4
weights upcast by `tl.dot_scaled`) for sm_90 with this machine's Triton, finds its K loop (the backward branch around
the most HMMA / HGMMA) and reports the loop's warp instructions and the thread instructions each weight element
costs: loop × 32 lanes × warps / (2 · BN · BK). With `benchmarks/moe_sorted_upcast_s43.patch` applied, `--upcast`
compiles the BF16-upcast variant instead. `--f8` compiles the FP8 tensor-core path's two Gluon kernels
(`plugins.moe_f8`, session 44) at `--stages` and `--tiles2` and reports each K loop per 64 × 128 chunk and the
registers per thread (cuobjdump -res-usage). Session 43 (benchmarks/README.md) used it: ~20 per element for
`tl.dot_scaled` at the default 32 × 128 tile, 5.2-10.6 for the upcast; the GPU timing then showed the upcast slower,
so the count is not what bounds that kernel. Triton's version matters: the figures are for the one installed here.

    python3 benchmarks/sass_moe_sorted.py [--tiles 32x128w4,64x128w4] [--upcast] [--out f.json]
    python3 benchmarks/sass_moe_sorted.py --f8 [--stages 2] [--tiles2 4]
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sass_mix import cubin_sass, k_loop  # noqa: E402

SIGNATURE = {"xq_ptr": "*bf16", "w13_ptr": "*u8", "s13_ptr": "*u8", "h_ptr": "*bf16", "sorted_ptr": "*i32",
             "off_ptr": "*i32", "topw_ptr": "*fp32", "N": "i32", "N_VALID": "i32", "K": "i32", "E": "i32", "P": "i32",
             "TOPK": "i32", "stride_x": "i32", "stride_we": "i64", "stride_wn": "i32", "stride_se": "i64",
             "stride_sn": "i32", "stride_h": "i32", "limit": "fp32"}


def loop_mix(bn: int, bk: int, warps: int, block_m: int = 16, stages: int = 3, upcast: bool = False) -> list[str]:
    """Opcodes of `_moe_w13_kernel`'s K loop at this tile (V4.1: 1×32 blocks of h, 384 experts)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dsflash.plugins import moe
    kern = moe._moe_w13_kernel
    const = {"BLOCK_M": block_m, "BLOCK_N": bn, "BLOCK_K": bk, "NB_E": 512, "NUM_STAGES": stages, "QB": 32}
    if "UPCAST" in kern.arg_names:
        const["UPCAST"] = upcast
    elif upcast:
        raise SystemExit("--upcast needs benchmarks/moe_sorted_upcast_s43.patch applied")
    sig = {p: ("constexpr" if p in const else SIGNATURE[p]) for p in kern.arg_names}
    ck = triton.compile(ASTSource(kern, sig, const), target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    sass = cubin_sass(ck.asm["cubin"])
    for marker in ("HGMMA", "HMMA"):
        try:
            return k_loop(sass, marker)
        except AssertionError:
            continue
    raise AssertionError("no K loop around HMMA or HGMMA")


def f8_mix(stages: int, tiles2: int) -> list[dict]:
    """`moe_f8`'s w13 and w2 kernels (16-token blocks) for sm_90: each K loop's opcodes (one trip: a 128-K chunk of
    64 weight rows), thread instructions per weight element, registers per thread."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from dsflash.plugins import moe_f8, moe_tc
    rows = []
    for name, box in (("_moe_w13_f8_kernel", 32), ("_moe_w2_f8_kernel", 64)):
        kern = getattr(moe_f8, name)
        const = {"BM": 16, "STAGES": stages, "NB_E": 512, **moe_f8._layouts(16)}
        if "TILES" in kern.arg_names:
            const.update(TILES=tiles2, SW_WORDS=False)   # one TP8 rank's w2: 10 scale bytes per row
        ptrs = {"xc_ptr": "*fp8e4nv", "hc_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "hs_ptr": "*fp32", "topw_ptr": "*fp32",
                "out_ptr": "*fp32", "s13_ptr": "*u8", "s2_ptr": "*u8", "sorted_ptr": "*i32", "off_ptr": "*i32",
                "limit": "fp32", "w_desc": f"tensordesc<i32[{box}, 16],{moe_tc._words_smem()!r}>"}
        sig = {p: "constexpr" if p in const else ptrs.get(p, "i32") for p in kern.arg_names}
        ck = triton.compile(GluonASTSource(kern, sig, const), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": 4})
        ops = k_loop(cubin_sass(ck.asm["cubin"]), "QGMMA")
        rows.append({"kernel": name, "stages": stages, "tiles2": tiles2, "loop_warp_instructions": len(ops),
                     "thread_instructions_per_weight_element": round(len(ops) * 32 * 4 / (64 * 128), 2),
                     "registers": _registers(ck.asm["cubin"]), "mix": dict(collections.Counter(ops).most_common(12))})
    return rows


def _registers(cubin: bytes) -> int:
    import subprocess
    import tempfile

    import triton
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        res = subprocess.run([str(tool), "-res-usage", f.name], check=True, capture_output=True, text=True).stdout
    return int(re.search(r"REG:(\d+)", res).group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiles", default="32x128w4,32x128w2,64x128w4,128x128w4",
                    help="w13 tiles <BN>x<BK>w<warps> (BN rows of w1 and of w3)")
    ap.add_argument("--upcast", action="store_true", help="the BF16-upcast variant (its patch applied)")
    ap.add_argument("--f8", action="store_true", help="the FP8 tensor-core path's kernels (`plugins.moe_f8`)")
    ap.add_argument("--stages", type=int, default=2, help="--f8: the TMA ring's depth")
    ap.add_argument("--tiles2", type=int, default=4, help="--f8: w2's 64-row tiles per program")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import triton
    if a.f8:
        rows = f8_mix(a.stages, a.tiles2)
        for r in rows:
            print(f"{r['kernel']}: {r['loop_warp_instructions']} warp instructions per 128-K chunk, "
                  f"{r['thread_instructions_per_weight_element']} per weight element, {r['registers']} registers; "
                  + ", ".join(f"{k} {v}" for k, v in list(r["mix"].items())[:8]))
        if a.out:
            with open(a.out, "w") as f:
                json.dump({"triton": triton.__version__, "rows": rows}, f, indent=1)
        return
    rows = []
    for tag in a.tiles.split(","):
        mt = re.fullmatch(r"(\d+)x(\d+)w(\d+)", tag)
        assert mt, f"tile {tag!r}: expected <BN>x<BK>w<warps>"
        bn, bk, warps = (int(v) for v in mt.groups())
        ops = loop_mix(bn, bk, warps, upcast=a.upcast)
        per_elem = len(ops) * 32 * warps / (2 * bn * bk)
        rows.append({"tile": tag, "upcast": a.upcast, "loop_warp_instructions": len(ops),
                     "thread_instructions_per_weight_element": round(per_elem, 2),
                     "mix": dict(collections.Counter(ops).most_common(12))})
        print(f"{tag}{' upcast' if a.upcast else ''}: {len(ops)} warp instructions per K step, "
              f"{per_elem:.2f} per weight element; " + ", ".join(f"{k} {v}" for k, v in list(rows[-1]["mix"].items())[:8]))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"triton": triton.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
