"""The cost of a TP all-reduce by message size, measured on the ranks at hand, for the TP-rank simulation.

design.md §5: while the eight GPUs a full TP8 engine needs are not there, one process runs one rank's work with its
all-reduces as local no-ops (`SimulatedComm`), and the time those collectives take is measured separately on the
GPUs that are (`dsflash bench collectives`: fp32 all-reduces over torch.distributed, NCCL on GPUs, gloo on CPU) and
added back: each simulated all-reduce waits the measured time of its size (`CollectiveCost.wait`), so every reported
latency includes it, and the report says how much was added.
"""
from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path

import torch

DEFAULT_SIZES = tuple(1 << k for k in range(10, 27, 2))      # 1 KiB .. 64 MiB


def measure_all_reduce(sizes: list[int], iters: int, device: str, group=None) -> list[tuple[int, float]]:
    """[(message bytes, µs per fp32 all-reduce)] on this process group (every rank calls it; all get the table).
    Each size: warm-up, then the median of 5 timed rounds of `iters` back-to-back all-reduces."""
    import torch.distributed as dist
    out = []
    for nbytes in sizes:
        x = torch.ones(max(nbytes // 4, 1), dtype=torch.float32, device=device)
        n = max(2, min(iters, (1 << 26) // max(nbytes, 1)))
        for _ in range(2):
            dist.all_reduce(x, group=group)
        rounds = []
        for _ in range(5):
            _sync(device)
            dist.barrier(group=group)
            t0 = time.perf_counter()
            for _ in range(n):
                dist.all_reduce(x, group=group)
            _sync(device)
            rounds.append((time.perf_counter() - t0) / n * 1e6)
        us = torch.tensor([statistics.median(rounds)], dtype=torch.float64)
        dist.all_reduce(us, op=dist.ReduceOp.MAX, group=group)      # the slowest rank sets the pace
        out.append((x.numel() * 4, float(us)))
    return out


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class CostTableError(ValueError):
    """A collective-cost file that is missing or malformed; the message names the file and the field."""


class CollectiveCost:
    """µs of one all-reduce of `nbytes`, interpolated in log-log between measured sizes (below the smallest: its
    time; above the largest: its bandwidth)."""

    def __init__(self, points: list[tuple[int, float]], meta: dict | None = None, source: str | None = None):
        pts = sorted((int(b), float(us)) for b, us in points)
        if not pts or any(b <= 0 or not us > 0 for b, us in pts):
            raise CostTableError(f"{source or 'cost table'}: points must be [bytes > 0, µs > 0] pairs, got {points!r}")
        self.points, self.meta, self.source = pts, meta or {}, source
        self.waited_us = 0.0
        self._cycles_per_us: float | None = None

    @classmethod
    def load(cls, path: str | Path) -> CollectiveCost:
        path = Path(path)
        if not path.is_file():
            raise CostTableError(f"{path}: collective-cost file not found (write it with `dsflash bench collectives`)")
        try:
            doc = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise CostTableError(f"{path}: not valid JSON ({e.msg})") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("all_reduce_us"), list):
            raise CostTableError(f"{path}: expected an object with all_reduce_us: [[bytes, µs], ...]")
        try:
            points = [(int(b), float(us)) for b, us in doc["all_reduce_us"]]
        except (TypeError, ValueError):
            raise CostTableError(f"{path}: all_reduce_us must hold [bytes, µs] pairs") from None
        return cls(points, {k: v for k, v in doc.items() if k != "all_reduce_us"}, str(path))

    def us(self, nbytes: int) -> float:
        pts = self.points
        if nbytes <= pts[0][0]:
            return pts[0][1]
        if nbytes >= pts[-1][0]:
            return pts[-1][1] * nbytes / pts[-1][0]
        for (b0, t0), (b1, t1) in zip(pts, pts[1:]):
            if nbytes <= b1:
                f = (math.log(nbytes) - math.log(b0)) / (math.log(b1) - math.log(b0))
                return math.exp(math.log(t0) + f * (math.log(t1) - math.log(t0)))
        raise AssertionError("unreachable")

    def wait(self, nbytes: int, device: str = "cpu") -> None:
        """Spend the all-reduce's time where it would be spent: a busy wait on CPU, a sleep kernel in the stream on
        a GPU (so graph-free asynchronous execution keeps its shape)."""
        us = self.us(nbytes)
        self.waited_us += us
        if device.startswith("cuda"):
            torch.cuda._sleep(max(1, int(us * self._gpu_cycles_per_us())))
            return
        end = time.perf_counter() + us * 1e-6
        while time.perf_counter() < end:
            pass

    def _gpu_cycles_per_us(self) -> float:
        if self._cycles_per_us is None:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(1_000_000)
            start.record()
            torch.cuda._sleep(10_000_000)
            stop.record()
            stop.synchronize()
            self._cycles_per_us = 10_000_000 / (start.elapsed_time(stop) * 1e3)
        return self._cycles_per_us
