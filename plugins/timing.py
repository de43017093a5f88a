"""GPU timing shared by the kernel bench and build-time tuning: calls captured round-robin into one CUDA graph;
candidates compared with each other are timed interleaved (`graph_time_many`).

Each call uses its own input set, and enough sets are rotated (`input_sets`) that their weights exceed the L2 several
times over, so a weight-streaming op is timed from HBM, as serve runs it. Triton-free; imports torch only.
"""
from __future__ import annotations

import math
import statistics

import torch

L2_BYTES = 60e6   # H200 L2 as PyTorch reports it


def input_sets(bytes_per_call: float, cap: int = 48) -> int:
    """Input sets to rotate so that together they are at least 3× the L2."""
    return max(1, min(cap, math.ceil(3 * L2_BYTES / max(bytes_per_call, 1.0))))


def graph_time_us(calls: list, target_us: float = 3000.0, replays: int = 15, max_rounds: int = 64,
                  max_calls: int = 1024) -> tuple[float, str]:
    """Median time per call of `calls` (one per input set) captured round-robin into one CUDA graph of about
    `target_us` (at most `max_rounds` passes over the sets, and `max_calls` calls beyond one pass); eager launches
    between CUDA events when the calls cannot be captured. -> (µs per call, "graph" | "eager")."""
    return graph_time_many([calls], target_us, replays, max_rounds, max_calls)[0]


def graph_time_many(candidates: list[list], target_us: float = 3000.0, replays: int = 15, max_rounds: int = 64,
                    max_calls: int = 1024) -> list[tuple[float, str]]:
    """`graph_time_us` of several candidates (each a list of calls, one per input set), their timed replays
    interleaved: A B C, A B C, ... A large-M FP8 GEMM draws an H200 to its power limit within about 50 ms and the
    driver then lowers the SM clock (benchmarks/README.md "Session 27"); timed one after another, a later candidate
    would meet a hotter, slower card than an earlier one. Interleaved, each sees the same run of clock states.
    -> [(µs per call, "graph" | "eager")] in the candidates' order."""
    runs = [replayable(calls, target_us, max_rounds, max_calls) for calls in candidates]
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts: list[list[float]] = [[] for _ in runs]
    for _ in range(replays):
        for (run, inner, _how), out in zip(runs, ts):
            e0.record()
            run()
            e1.record()
            e1.synchronize()
            out.append(e0.elapsed_time(e1) * 1000 / inner)
    return [(statistics.median(t), how) for t, (_, _, how) in zip(ts, runs)]


def replayable(calls: list, target_us: float, max_rounds: int, max_calls: int):
    """Warm `calls` up (on the current and on a side stream, as capture requires of lazily set-up libraries), size
    a pass of about `target_us`, capture it into a CUDA graph -> (run, calls per run, "graph" | "eager")."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for c in calls:
        c()
    e1.record()
    e1.synchronize()
    est = max(e0.elapsed_time(e1) * 1000 / len(calls), 1.0)
    inner = len(calls) * max(1, min(max_rounds, math.ceil(target_us / (est * len(calls)))))
    inner = min(inner, max(len(calls), max_calls))
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(inner):
                calls[i % len(calls)]()
        g.replay()
        torch.cuda.synchronize()
        return g.replay, inner, "graph"
    except Exception:  # not capturable: eager launches
        torch.cuda.synchronize()

        def eager():
            for i in range(inner):
                calls[i % len(calls)]()
        return eager, inner, "eager"
