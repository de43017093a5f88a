"""One decode step of N requests: fused (one `step_chunks` forward for all) vs a forward per request.

    python3 benchmarks/step_chunks.py --engine out/demo/v41-tiny/engine-cpu-tp1 [--requests 1,8,32]
        [--context 100] [--steps 20] [--json F]

Each request first gets a prompt of --context tokens (its own state), then every timed step feeds each request one
token: "fused" runs them as one forward (what `dsflash serve` does), "per request" as N forwards (what
`--batch-invariant` does). The best of three rounds of --steps steps is reported, in ms per step.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from dsflash.build.engine import load_engine_model
from dsflash.model_def.ragged import Chunk


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_steps(model, n: int, context: int, steps: int, fused: bool) -> float:
    """Best-of-three ms per decode step of n requests."""
    device = model.head.weight.device
    g = torch.Generator().manual_seed(n)
    states = [model.new_state(1) for _ in range(n)]
    model.step_chunks([Chunk(torch.randint(3, 1000, (1, context), generator=g).to(device), s) for s in states])
    best = float("inf")
    for _ in range(3):
        ids = [torch.randint(3, 1000, (1, 1), generator=g).to(device) for _ in range(steps * n)]
        _sync(device)
        t = time.perf_counter()
        for i in range(steps):
            chunks = [Chunk(ids[i * n + j], s) for j, s in enumerate(states)]
            if fused:
                model.step_chunks(chunks)
            else:
                for c in chunks:
                    model.step_chunks([c])
        _sync(device)
        best = min(best, (time.perf_counter() - t) / steps * 1e3)
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", required=True)
    p.add_argument("--requests", default="1,8,32", help="comma list of request counts")
    p.add_argument("--context", type=int, default=100, help="prompt tokens per request before the timed steps")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--json", default=None, help="also write the rows here")
    a = p.parse_args(argv)
    model = load_engine_model(a.engine)[0]
    rows = []
    for n in (int(v) for v in a.requests.split(",")):
        fused = time_steps(model, n, a.context, a.steps, fused=True)
        alone = time_steps(model, n, a.context, a.steps, fused=False)
        rows.append({"requests": n, "fused_ms": round(fused, 2), "per_request_ms": round(alone, 2),
                     "speedup": round(alone / fused, 2)})
    print("| requests | fused ms/step | per-request ms/step | speedup |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['requests']} | {r['fused_ms']} | {r['per_request_ms']} | {r['speedup']} |")
    if a.json:
        meta = {"engine": a.engine, "context": a.context, "steps": a.steps,
                "device": str(model.head.weight.device), "torch": torch.__version__}
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
