"""Build-time autotuning and the `tuned.json` format; serve only looks configs up (never tunes).

tuned.json: {"version": 1, "arch", "gpu", "versions": {torch, triton?}, "entries": [{"op", "bucket", "config",
"time_us", "candidates": {config-key: time_us}}]}. Shapes are bucketed (token counts rounded up to the bucket list);
a lookup that finds no entry returns the op's fallback config and logs that once per (op, bucket) — never silently.
"""
from __future__ import annotations

import functools
import json
import logging
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

TUNED_FILE = "tuned.json"
M_BUCKETS = (1, 8, 64, 512, 4096)
log = logging.getLogger("dsflash.tune")


@dataclass(frozen=True)
class TunableOp:
    name: str
    buckets: Callable[[dict], list[dict]]  # engine meta -> shape buckets to tune
    candidates: Callable[[dict], list[dict]]  # bucket -> candidate configs
    make: Callable[[dict, dict], Callable[[], object]]  # (bucket, config) -> runnable
    fallback: dict


def m_bucket(m: int) -> int:
    return next((b for b in M_BUCKETS if m <= b), M_BUCKETS[-1])


def _lm_head_buckets(engine: dict) -> list[dict]:
    model = engine["model"].get("text_config", engine["model"])
    v, d = model["vocab_size"], model["hidden_size"]
    return [{"m": m, "v": v, "d": d} for m in (1, 64)]


@functools.lru_cache(maxsize=2)
def _lm_head_weight(v: int, d: int) -> torch.Tensor:
    return torch.randn(v, d, generator=torch.Generator().manual_seed(0))


def _lm_head_make(bucket: dict, config: dict):
    from dsflash.plugins.lm_head import chunked_lm_head
    x = torch.randn(bucket["m"], bucket["d"], generator=torch.Generator().manual_seed(1))
    w = _lm_head_weight(bucket["v"], bucket["d"])
    return lambda: chunked_lm_head(x, w, config["chunk"])


def _lm_head_candidates(bucket: dict) -> list[dict]:
    from dsflash.plugins.lm_head import CHUNK_CANDIDATES
    return [{"chunk": c} for c in CHUNK_CANDIDATES]


LM_HEAD = TunableOp("lm_head", _lm_head_buckets, _lm_head_candidates, _lm_head_make, {"chunk": 32768})
TUNABLE_OPS = {"cpu": [LM_HEAD], "sm90": [LM_HEAD], "sm100": [LM_HEAD]}


def _time_us(fn, reps: int = 2) -> float:
    fn()  # warm-up, not counted
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) * 1e6)
    return best


def _key(config: dict) -> str:
    return json.dumps(config, sort_keys=True)


def tune(engine: dict, arch: str, ops: list[TunableOp] | None = None) -> dict:
    entries = []
    for op in ops if ops is not None else TUNABLE_OPS[arch]:
        for bucket in op.buckets(engine):
            times = {_key(c): _time_us(op.make(bucket, c)) for c in op.candidates(bucket)}
            best = min(times, key=times.get)
            entries.append({"op": op.name, "bucket": bucket, "config": json.loads(best), "time_us": times[best],
                            "candidates": times})
    versions = {"torch": torch.__version__, "python": platform.python_version()}
    try:
        import triton
        versions["triton"] = triton.__version__
    except ImportError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu:{platform.processor() or 'x86_64'}"
    return {"version": 1, "arch": arch, "gpu": gpu, "versions": versions, "entries": entries}


def write_tuned(engine_dir: Path, engine: dict, arch: str) -> None:
    (Path(engine_dir) / TUNED_FILE).write_text(json.dumps(tune(engine, arch), indent=2))


class TunedTable:
    """Lookups from tuned.json with a guaranteed, logged fallback."""

    def __init__(self, data: dict | None, ops: list[TunableOp] | None = None):
        self.data = data or {"entries": []}
        self.fallbacks = {op.name: op.fallback for op in (ops or sum(TUNABLE_OPS.values(), []))}
        self._warned: set = set()

    @classmethod
    def load(cls, engine_dir: str | Path) -> "TunedTable":
        f = Path(engine_dir) / TUNED_FILE
        return cls(json.loads(f.read_text()) if f.is_file() else None)

    def lookup(self, op: str, bucket: dict) -> dict:
        for e in self.data["entries"]:
            if e["op"] == op and e["bucket"] == bucket:
                return e["config"]
        key = (op, _key(bucket))
        if key not in self._warned:
            self._warned.add(key)
            log.warning("tuned.json has no entry for %s at %s; using fallback config %s", op, bucket,
                        self.fallbacks[op])
        return self.fallbacks[op]
