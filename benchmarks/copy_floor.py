"""The floor at decode-weight sizes: how fast one launch that moves B bytes runs in the graph-replayed timing every
kernel row uses, as a % of the copy-bandwidth ceiling.

- `copy` (default): a device-to-device copy moving B bytes (B/2 read, B/2 written: the ceiling's own accounting).
- `read`: a kernel that only reads B bytes (each program sums its contiguous chunk of 16-byte words into one int64),
  which is what a decode GEMM or GEMV does with its weights: the floor it is reachable against at each size.

    python3 benchmarks/copy_floor.py --out floor.json [--mode copy|read|both] [--mb 15.7,23.6,30.9,38.7,46.3,77.5,113]

GPU only.
"""
from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from dsflash.plugins.bench import measure_ceilings
from dsflash.plugins.timing import graph_time_us, input_sets

DEV = "cuda"


@triton.jit
def _read_sum_kernel(src_ptr, out_ptr, n_words, per_prog, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
    """Program i sums the int64 words [i·per_prog, +per_prog) of src (two per 16-byte vector), UNROLL blocks in
    flight per iteration, and writes the sum (so the loads cannot be dropped)."""
    pid = tl.program_id(0)
    lo = pid.to(tl.int64) * per_prog
    hi = tl.minimum(lo + per_prog, n_words)
    acc = tl.zeros([BLOCK], dtype=tl.int64)
    for c in range(lo, hi, BLOCK * UNROLL):
        for u in tl.static_range(UNROLL):
            o = c + u * BLOCK + tl.arange(0, BLOCK)
            acc += tl.load(src_ptr + o, mask=o < hi, other=0, cache_modifier=".cg")
    tl.store(out_ptr + pid, tl.sum(acc, 0))


def read_programs(n: int, programs: int, block: int = 1024) -> tuple[int, int]:
    """(programs launched, words per program) for about `programs` programs over n int64 words."""
    per = triton.cdiv(triton.cdiv(n, programs), 2 * block) * 2 * block
    return triton.cdiv(n, per), per


def read_sum(src: torch.Tensor, out: torch.Tensor, block: int = 1024, unroll: int = 4) -> None:
    """Launch `_read_sum_kernel` over src (int64 words), one program per entry of out (int64, sized by
    `read_programs`)."""
    n = src.numel()
    grid, per = read_programs(n, out.numel(), block)
    assert grid == out.numel(), f"out must hold one sum per program: {grid}, got {out.numel()}"
    _read_sum_kernel[(out.numel(),)](src, out, n, per, BLOCK=block, UNROLL=unroll, num_warps=8)


def _copy_row(mb: float, ceil: dict) -> dict:
    n = int(mb * 1e6 / 2) // 16 * 16          # bytes read (= bytes written)
    sets = input_sets(2 * n)
    src = [torch.randint(0, 255, (n,), dtype=torch.uint8, device=DEV) for _ in range(sets)]
    dst = [torch.empty_like(s) for s in src]
    us, how = graph_time_us([lambda i=i: dst[i].copy_(src[i]) for i in range(sets)])
    gbps = 2 * n / us / 1e3
    return {"mode": "copy", "MB_moved": 2 * n / 1e6, "us": us, "GBps": gbps,
            "pct_copy_bw": 100 * gbps / ceil["copy_GBps"], "timing": how, "sets": sets}


PER_SM = (2, 4, 8, 16)   # programs resident at once, or a few waves of short chunks


class ReadSets:
    """Rotating int64 input sets of about `mb` MB (whole 16-byte vectors) for `read_sum`, and per programs-per-SM
    choice of PER_SM the sums buffer its grid fills (each grid checked to read every word)."""

    def __init__(self, mb: float, sets: int, sms: int, gen: torch.Generator | None = None):
        n = int(mb * 1e6) // 16 * 2            # int64 words
        self.mb = n * 8 / 1e6
        self.src = [torch.randint(-2 ** 62, 2 ** 62, (n,), dtype=torch.int64, device=DEV, generator=gen)
                    for _ in range(sets)]
        self.outs = {k: torch.empty(read_programs(n, k * sms)[0], dtype=torch.int64, device=DEV) for k in PER_SM}
        want = self.src[0].sum()                   # int64 sums wrap the same way in any order
        for out in self.outs.values():
            read_sum(self.src[0], out)
            assert out.sum() == want, "read kernel: wrong sum"

    def call(self, i: int, per_sm: int) -> None:
        read_sum(self.src[i], self.outs[per_sm])


def best_read_us(make_calls) -> tuple[float, int, str]:
    """The fastest (µs, programs per SM, timing) over PER_SM; make_calls(per_sm) -> one callable per input set."""
    best = None
    for per_sm in PER_SM:
        us, how = graph_time_us(make_calls(per_sm))
        if best is None or us < best[0]:
            best = (us, per_sm, how)
    return best


def _read_row(mb: float, ceil: dict, sms: int) -> dict:
    sets = input_sets(int(mb * 1e6) // 16 * 16)
    r = ReadSets(mb, sets, sms)
    us, per_sm, how = best_read_us(lambda k: [lambda i=i: r.call(i, k) for i in range(sets)])
    gbps = r.mb * 1e3 / us
    return {"mode": "read", "MB_moved": r.mb, "us": us, "GBps": gbps, "pct_copy_bw": 100 * gbps / ceil["copy_GBps"],
            "timing": how, "sets": sets, "programs_per_sm": per_sm}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--mode", choices=("copy", "read", "both"), default="copy")
    ap.add_argument("--mb", default="15.7,23.6,30.9,38.7,46.3,77.5,113")
    args = ap.parse_args()
    ceil = measure_ceilings()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    print(f"copy ceiling {ceil['copy_GBps']:.0f} GB/s")
    print(f"{'mode':>5} {'MB moved':>9} {'us':>8} {'GB/s':>7} {'% ceiling':>9}")
    modes = ("copy", "read") if args.mode == "both" else (args.mode,)
    for mode in modes:
        for mb in (float(v) for v in args.mb.split(",")):
            r = _copy_row(mb, ceil) if mode == "copy" else _read_row(mb, ceil, sms)
            rows.append(r)
            print(f"{mode:>5} {r['MB_moved']:9.1f} {r['us']:8.2f} {r['GBps']:7.0f} {r['pct_copy_bw']:9.1f}")
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"ceilings": ceil, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
