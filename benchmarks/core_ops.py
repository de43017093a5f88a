"""Torch ops per decode step inside the attention cores (`Attention.core`: what stays eager between the CUDA-graph
pieces), counted at the dispatcher, on any device.

    python3 benchmarks/core_ops.py --engine out/demo/v41-tiny/engine-cpu-tp1 [--requests 1] [--steps 4] [--json F]

Each request gets a 100-token prompt and 3 untimed decode steps, then --steps decode steps are counted: aten ops per
step in the cores, per core, and the most frequent ops.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dsflash.build.engine import load_engine_model
from dsflash.model_def import csa2, v4
from dsflash.model_def.ragged import Chunk


class _Count(TorchDispatchMode):
    def __init__(self, into: Counter):
        super().__init__()
        self.into = into

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.into[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def count_core_ops(model, n: int, steps: int) -> dict:
    cls = csa2.Attention if model.args.family == "v41" else v4.Attention
    ops, calls = Counter(), [0]
    core = cls.core

    def counted(self, *a, **k):
        calls[0] += 1
        with _Count(ops):
            return core(self, *a, **k)

    device = model.head.weight.device
    g = torch.Generator().manual_seed(0)
    states = [model.new_state(1) for _ in range(n)]
    model.step_chunks([Chunk(torch.randint(3, 1000, (1, 100), generator=g).to(device), s) for s in states])
    for _ in range(3):
        model.step_chunks([Chunk(torch.randint(3, 1000, (1, 1), generator=g).to(device), s) for s in states])
    cls.core = counted
    try:
        for _ in range(steps):
            model.step_chunks([Chunk(torch.randint(3, 1000, (1, 1), generator=g).to(device), s) for s in states])
    finally:
        cls.core = core
    total = sum(ops.values())
    return {"requests": n, "core_ops_per_step": total / steps, "cores_per_step": calls[0] / steps,
            "ops_per_core": round(total / calls[0], 1),
            "top_ops_per_core": {k: round(v / calls[0], 1) for k, v in ops.most_common(20)}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", required=True)
    p.add_argument("--requests", default="1", help="comma list of request counts")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--json", default=None, help="also write the rows here")
    a = p.parse_args(argv)
    model = load_engine_model(a.engine)[0]
    rows = [count_core_ops(model, int(n), a.steps) for n in a.requests.split(",")]
    print("| requests | core ops per step | cores per step | ops per core |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['requests']} | {r['core_ops_per_step']:.0f} | {r['cores_per_step']:.0f} | {r['ops_per_core']} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": {"engine": a.engine, "steps": a.steps, "torch": torch.__version__}, "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
