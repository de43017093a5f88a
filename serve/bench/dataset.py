"""Benchmark datasets in trtllm-bench's JSON Lines format: one request per line,
`{"task_id": ..., "input_ids": [...] | "prompt": "...", "output_tokens": N}`.

Synthetic lengths follow trtllm-bench's `prepare-dataset`: normal draws become max(1, ceil(x)), uniform draws are
inclusive; prompt token ids are uniform over the vocabulary minus the EOS id.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dsflash.convert.atomic import write_text_atomic


class DatasetError(ValueError):
    """A malformed dataset file or line; the message names the file, the line and the field."""


@dataclass
class BenchRequest:
    task_id: int | str
    input_ids: list[int]
    output_tokens: int


def token_norm_dist(num_requests: int, input_mean: float, input_stdev: float, output_mean: float,
                    output_stdev: float, vocab_size: int, eos_id: int | None, seed: int = 420) -> list[BenchRequest]:
    """Requests whose input/output lengths are normal draws (stdev 0: every request exactly the mean)."""
    _need(num_requests >= 1, f"--num-requests must be >= 1, got {num_requests}")
    _need(input_mean >= 1 and output_mean >= 1, "--input-mean and --output-mean must be >= 1")
    _need(input_stdev >= 0 and output_stdev >= 0, "--input-stdev and --output-stdev must be >= 0")
    rng = np.random.RandomState(seed)
    isl = [max(1, math.ceil(x)) for x in rng.normal(input_mean, input_stdev, num_requests)]
    osl = [max(1, math.ceil(x)) for x in rng.normal(output_mean, output_stdev, num_requests)]
    return _with_tokens(isl, osl, vocab_size, eos_id, seed)


def token_unif_dist(num_requests: int, input_min: int, input_max: int, output_min: int, output_max: int,
                    vocab_size: int, eos_id: int | None, seed: int = 420) -> list[BenchRequest]:
    """Requests whose input/output lengths are uniform over [min, max] (inclusive)."""
    _need(num_requests >= 1, f"--num-requests must be >= 1, got {num_requests}")
    _need(1 <= input_min <= input_max, f"need 1 <= --input-min <= --input-max, got {input_min}, {input_max}")
    _need(1 <= output_min <= output_max, f"need 1 <= --output-min <= --output-max, got {output_min}, {output_max}")
    rng = np.random.default_rng(seed)
    isl = rng.integers(input_min, input_max + 1, num_requests).tolist()
    osl = rng.integers(output_min, output_max + 1, num_requests).tolist()
    return _with_tokens(isl, osl, vocab_size, eos_id, seed)


def _with_tokens(isl: list[int], osl: list[int], vocab_size: int, eos_id: int | None, seed: int
                 ) -> list[BenchRequest]:
    _need(vocab_size >= 2, f"vocab_size must be >= 2, got {vocab_size}")
    rng = np.random.default_rng(seed + 1)
    out = []
    for i, (n_in, n_out) in enumerate(zip(isl, osl)):
        ids = rng.integers(0, vocab_size - (eos_id is not None), n_in)
        if eos_id is not None:
            ids[ids >= eos_id] += 1              # uniform over the vocabulary without EOS
        out.append(BenchRequest(i, ids.tolist(), int(n_out)))
    return out


def warmup_requests(requests: list[BenchRequest], n: int) -> list[BenchRequest]:
    """n untimed requests shaped like the dataset's first ones (cycled), ids w0, w1, ..."""
    return [BenchRequest(f"w{i}", requests[i % len(requests)].input_ids, requests[i % len(requests)].output_tokens)
            for i in range(n)]


def write_dataset(requests: list[BenchRequest], path: str | Path | None) -> None:
    """JSON Lines to `path` (through a `.part` file renamed at the end), or to stdout when path is None."""
    lines = "".join(json.dumps({"task_id": r.task_id, "input_ids": r.input_ids, "output_tokens": r.output_tokens})
                    + "\n" for r in requests)
    if path is None:
        print(lines, end="")
        return
    write_text_atomic(path, lines)


def load_dataset(path: str | Path, vocab_size: int, encode: Callable[[str], list[int]] | None = None
                 ) -> list[BenchRequest]:
    """Read and check a dataset file. `encode` tokenizes `prompt` entries (None: only `input_ids` are accepted)."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: dataset file not found")
    out: list[BenchRequest] = []
    seen: set = set()
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{where}: not a JSON object ({e.msg})") from None
            req = _request(row, where, vocab_size, encode)
            if req.task_id in seen:
                raise DatasetError(f"{where}: task_id {req.task_id!r} appears twice")
            seen.add(req.task_id)
            out.append(req)
    if not out:
        raise DatasetError(f"{path}: the dataset holds no requests")
    return out


def _request(row, where: str, vocab_size: int, encode) -> BenchRequest:
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected a JSON object per line, got {type(row).__name__}")
    tid = row.get("task_id")
    if isinstance(tid, bool) or not isinstance(tid, (int, str)):
        raise DatasetError(f"{where}: task_id must be an integer or a string, got {tid!r}")
    n_out = row.get("output_tokens")
    if isinstance(n_out, bool) or not isinstance(n_out, int) or n_out < 1:
        raise DatasetError(f"{where}: output_tokens must be an integer >= 1, got {n_out!r}")
    if "input_ids" in row:             # as in trtllm-bench, input_ids win over prompt
        ids = row["input_ids"]
        if not isinstance(ids, list) or not ids or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids):
            raise DatasetError(f"{where}: input_ids must be a non-empty list of token ids in [0, {vocab_size})")
    elif "prompt" in row:
        if not isinstance(row["prompt"], str) or not row["prompt"]:
            raise DatasetError(f"{where}: prompt must be a non-empty string")
        if encode is None:
            raise DatasetError(f"{where}: a prompt entry needs the engine's tokenizer (tokenizer.json missing)")
        ids = encode(row["prompt"])
    else:
        raise DatasetError(f"{where}: each line needs input_ids or prompt")
    return BenchRequest(tid, list(ids), n_out)


def dataset_metadata(requests: list[BenchRequest], path: str | Path | None) -> dict:
    """trtllm-bench's `dataset` report section."""
    isl = [len(r.input_ids) for r in requests]
    osl = [r.output_tokens for r in requests]
    seq = [a + b for a, b in zip(isl, osl)]
    return {"dataset_path": None if path is None else str(path), "num_requests": len(requests),
            "avg_isl": sum(isl) / len(isl), "max_isl": max(isl), "avg_osl": sum(osl) / len(osl), "max_osl": max(osl),
            "avg_sequence_length": sum(seq) / len(seq), "max_sequence_length": max(seq)}


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise DatasetError(msg)
