"""Host cost of one launch on a GPU, by how it is made: a torch op, a Triton kernel, a `dsflash` custom op through
`torch.ops` (the dispatcher) and the same kernel's wrapper called directly.

    python3 benchmarks/launch_overhead.py [--calls 3000] [--json F]

Each row issues --calls back-to-back calls on tiny tensors (so the GPU keeps up and the host sets the pace) and
reports host µs per call, best of five rounds. A decode step of a full-size rank issues thousands of launches
(benchmarks/README.md, "Session 36"), so these figures bound what an eager step can reach.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import triton
import triton.language as tl


@triton.jit
def _bump_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=m) + 1, mask=m)


def per_call_us(fn, calls: int) -> float:
    """Best of five rounds of `calls` calls, host µs per call (one sync per round)."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / calls * 1e6)
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    import dsflash.plugins.registry  # noqa: F401  (registers torch.ops.dsflash)
    from dsflash.plugins import act_quant as aq
    dev = torch.device("cuda")
    x = torch.zeros(256, device=dev)
    h = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)
    w = torch.ones(4096, device=dev, dtype=torch.float32)
    rows = {
        "torch x.add_(1)": lambda: x.add_(1),
        "torch x.float() (cast, new tensor)": lambda: h.float(),
        "triton kernel[grid](...)": lambda: _bump_kernel[(1,)](x, 256, BLOCK=256),
        "dsflash rmsnorm via torch.ops": lambda: torch.ops.dsflash.rmsnorm(h, w, 1e-6),
        "dsflash rmsnorm wrapper direct": lambda: aq.rmsnorm(h, w, 1e-6),
        "dsflash act_quant via torch.ops": lambda: torch.ops.dsflash.act_quant(h, True),
        "dsflash act_quant wrapper direct": lambda: aq.act_quant(h, "e8m0"),
    }
    out = {name: round(per_call_us(fn, a.calls), 2) for name, fn in rows.items()}
    print("| launch | host µs per call |\n|---|---|")
    for name, us in out.items():
        print(f"| {name} | {us} |")
    if a.json:
        meta = {"torch": torch.__version__, "triton": triton.__version__, "gpu": torch.cuda.get_device_name(),
                "calls": a.calls}
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "rows": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
