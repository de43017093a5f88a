"""KServe v2 tensors of the tensorrtllm backend (conventions.md §5.3), shared by the HTTP and gRPC doors and by
the Triton Python-backend model.

Inputs (leading batch dimension; scalars as [B, 1], [B] or [1]):
- token path: `input_ids` INT32 [B, L], `input_lengths` INT32 (default: the row length), `request_output_len` INT32,
  `end_id` / `pad_id` INT32, `streaming` BOOL, `exclude_input_in_output` BOOL -> `output_ids` INT32 [B, 1, T] and
  `sequence_length` INT32 [B, 1]. As in TensorRT-LLM, without `end_id` no token stops generation, rows are padded
  with `pad_id`, and the prompt is part of `output_ids` unless `exclude_input_in_output` (streamed responses carry
  only their new tokens).
- text path (ensemble / BLS names): `text_input` BYTES, `max_tokens` INT32, `stream` BOOL, `stop_words` /
  `bad_words` BYTES -> `text_output` BYTES [B, 1]; `end_id` defaults to the tokenizer's EOS; the prompt text leads
  the output unless `exclude_input_in_output`.
- sampling, both paths: `temperature`, `runtime_top_k`/`top_k`, `runtime_top_p`/`top_p`, `random_seed`,
  `return_log_probs` (-> `cum_log_probs` FP32 [B, 1], `output_log_probs` FP32 [B, 1, N]).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np

from dsflash.serve.api.security import APIError

DTYPES = {"BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
          "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64, "FP16": np.float16,
          "FP32": np.float32, "FP64": np.float64, "BYTES": np.object_}

# name -> (datatype, dims without batch, optional)
INPUTS = {
    "input_ids": ("INT32", [-1], True), "input_lengths": ("INT32", [1], True),
    "request_output_len": ("INT32", [1], True), "end_id": ("INT32", [1], True), "pad_id": ("INT32", [1], True),
    "streaming": ("BOOL", [1], True), "exclude_input_in_output": ("BOOL", [1], True),
    "text_input": ("BYTES", [1], True), "max_tokens": ("INT32", [1], True), "stream": ("BOOL", [1], True),
    "stop_words": ("BYTES", [-1], True), "bad_words": ("BYTES", [-1], True),
    "temperature": ("FP32", [1], True), "runtime_top_k": ("INT32", [1], True), "runtime_top_p": ("FP32", [1], True),
    "top_k": ("INT32", [1], True), "top_p": ("FP32", [1], True), "random_seed": ("UINT64", [1], True),
    "return_log_probs": ("BOOL", [1], True), "beam_width": ("INT32", [1], True),
}
OUTPUTS = {
    "output_ids": ("INT32", [-1, -1]), "sequence_length": ("INT32", [-1]), "text_output": ("BYTES", [-1]),
    "cum_log_probs": ("FP32", [-1]), "output_log_probs": ("FP32", [-1, -1]),
}


# -- wire formats ---------------------------------------------------------------------------------------------------
def from_raw(raw: bytes, datatype: str, shape: list[int]) -> np.ndarray:
    """Triton's raw tensor bytes (little-endian; BYTES = 4-byte length + data per element) -> array."""
    if datatype not in DTYPES:
        raise APIError(400, f"unsupported datatype {datatype!r}")
    n = int(np.prod(shape)) if shape else 1
    if datatype == "BYTES":
        items, pos = [], 0
        while pos < len(raw):
            if pos + 4 > len(raw):
                raise APIError(400, "malformed BYTES tensor: truncated length prefix")
            (k,) = struct.unpack_from("<I", raw, pos)
            if pos + 4 + k > len(raw):
                raise APIError(400, "malformed BYTES tensor: element runs past the end of the data")
            items.append(raw[pos + 4:pos + 4 + k])
            pos += 4 + k
        arr = np.empty(len(items), dtype=np.object_)
        arr[:] = items
    else:
        dt = np.dtype(DTYPES[datatype]).newbyteorder("<")
        if len(raw) != n * dt.itemsize:
            raise APIError(400, f"tensor data is {len(raw)} bytes; shape {shape} of {datatype} needs {n * dt.itemsize}")
        arr = np.frombuffer(raw, dtype=dt)
    if arr.size != n:
        raise APIError(400, f"tensor has {arr.size} elements; shape {shape} needs {n}")
    return arr.reshape(shape)


def to_raw(arr: np.ndarray, datatype: str) -> bytes:
    if datatype == "BYTES":
        parts = []
        for v in arr.reshape(-1):
            b = v if isinstance(v, bytes) else str(v).encode()
            parts.append(struct.pack("<I", len(b)) + b)
        return b"".join(parts)
    return np.ascontiguousarray(arr, dtype=np.dtype(DTYPES[datatype]).newbyteorder("<")).tobytes()


def from_json(data, datatype: str, shape: list[int]) -> np.ndarray:
    """A KServe JSON `data` list (flat or nested) -> array."""
    if datatype not in DTYPES:
        raise APIError(400, f"unsupported datatype {datatype!r}")
    try:
        if datatype == "BYTES":
            flat = np.asarray(data, dtype=np.object_).reshape(-1)
            arr = np.array([v.encode() if isinstance(v, str) else v for v in flat], dtype=np.object_)
        else:
            arr = np.asarray(data, dtype=DTYPES[datatype])
        return arr.reshape(shape)
    except (ValueError, TypeError) as e:
        raise APIError(400, f"tensor data does not match datatype {datatype} and shape {shape}: {e}") from None


def to_json(arr: np.ndarray, datatype: str) -> list:
    flat = arr.reshape(-1)
    if datatype == "BYTES":
        return [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in flat]
    return flat.tolist()


# -- tensorrtllm-backend semantics --------------------------------------------------------------------------------
@dataclass
class Job:
    """One batch row of an infer request."""
    prompt_ids: list[int]
    params: object                # SamplingParams
    text_mode: bool
    include_input: bool
    streaming: bool
    pad_id: int
    prompt_text: str = ""
    logprobs: bool = False
    extra: dict = field(default_factory=dict)


def _scalar(inputs: dict, name: str, b: int, batch: int, cast, default=None):
    arr = inputs.get(name)
    if arr is None:
        return default
    flat = np.asarray(arr).reshape(-1)
    if flat.size == 1:
        v = flat[0]
    elif flat.size == batch:
        v = flat[b]
    else:
        raise APIError(400, f"input '{name}' must hold one value per batch row ({batch}), got shape {list(arr.shape)}")
    try:
        return cast(v.decode() if isinstance(v, bytes) else v)
    except (TypeError, ValueError):
        raise APIError(400, f"input '{name}' has an invalid value {v!r}") from None


def _words(inputs: dict, name: str, b: int, batch: int) -> list[str]:
    arr = inputs.get(name)
    if arr is None:
        return []
    arr = np.asarray(arr, dtype=np.object_)
    rows = arr.reshape(batch, -1)[b] if arr.size % batch == 0 and arr.ndim > 1 else arr.reshape(-1)
    out = []
    for v in rows:
        s = v.decode() if isinstance(v, bytes) else str(v)
        out += [w.strip() for w in s.split(",") if w.strip()]
    return out


def parse_jobs(fe, inputs: dict[str, np.ndarray]) -> list[Job]:
    """Validate an infer request's tensors into jobs (one per batch row); APIError 400 names the tensor."""
    unknown = sorted(set(inputs) - set(INPUTS))
    if unknown:
        raise APIError(400, f"unexpected input tensor(s) {unknown}; this model takes {sorted(INPUTS)}")
    if ("input_ids" in inputs) == ("text_input" in inputs):
        raise APIError(400, "send exactly one of 'input_ids' (token path) or 'text_input' (text path)")
    text_mode = "text_input" in inputs
    if text_mode:
        texts = np.asarray(inputs["text_input"], dtype=np.object_).reshape(-1)
        batch = len(texts)
    else:
        ids = np.asarray(inputs["input_ids"])
        if ids.dtype.kind not in "iu":
            raise APIError(400, f"input 'input_ids' must be an integer tensor, got {ids.dtype}")
        ids = ids.reshape(1, -1) if ids.ndim == 1 else ids
        if ids.ndim != 2:
            raise APIError(400, f"input 'input_ids' must be [batch, length], got shape {list(ids.shape)}")
        batch = ids.shape[0]
    if batch < 1:
        raise APIError(400, "empty batch")
    if _scalar(inputs, "beam_width", 0, batch, int, 1) != 1:
        raise APIError(400, "beam_width must be 1 (beam search is not supported)")
    jobs = []
    for b in range(batch):
        sc = lambda name, cast, default=None: _scalar(inputs, name, b, batch, cast, default)  # noqa: E731
        if text_mode:
            t = texts[b]
            prompt_text = t.decode("utf-8", "replace") if isinstance(t, bytes) else str(t)
            prompt = fe.encode(prompt_text, add_bos=True)
            end_id = sc("end_id", int, fe.eos_token_id)
        else:
            prompt_text = ""
            n = sc("input_lengths", int, ids.shape[1])
            if not 1 <= n <= ids.shape[1]:
                raise APIError(400, f"input_lengths[{b}]={n} must be in [1, {ids.shape[1]}]")
            prompt = [int(t) for t in ids[b, :n]]
            end_id = sc("end_id", int, None)
        max_tokens = sc("request_output_len", int, None) if not text_mode else None
        max_tokens = sc("max_tokens", int, max_tokens)
        if max_tokens is None:
            raise APIError(400, "input 'request_output_len' (or 'max_tokens') is required")
        streaming = bool(sc("streaming", bool, False) or sc("stream", bool, False))
        top_k = sc("runtime_top_k", int, None)
        top_p = sc("runtime_top_p", float, None)
        want_lp = bool(sc("return_log_probs", bool, False))
        if _words(inputs, "bad_words", b, batch):
            raise APIError(400, "input 'bad_words' is not supported by this server")
        params = fe.sampling(
            max_tokens=max_tokens, temperature=sc("temperature", float, None),
            top_k=sc("top_k", int, top_k), top_p=sc("top_p", float, top_p), seed=sc("random_seed", int, None),
            stop_token_ids=[end_id] if end_id is not None and end_id >= 0 else [], ignore_eos=True,
            stop=_words(inputs, "stop_words", b, batch) or None, logprobs=0 if want_lp else None)
        jobs.append(Job(prompt, params, text_mode, not sc("exclude_input_in_output", bool, False), streaming,
                        sc("pad_id", int, end_id if end_id is not None and end_id >= 0 else fe.eos_token_id),
                        prompt_text, want_lp))
    if any(j.streaming for j in jobs) and batch > 1:
        raise APIError(400, "streaming requests must have batch size 1")
    return jobs


def outputs_for(jobs: list[Job], results: list[tuple[list[int], str, list[float]]], streamed: bool = False
                ) -> dict[str, tuple[np.ndarray, str]]:
    """Output tensors for finished (or, when `streamed`, partial) rows: results[b] = (new ids, new text, logprobs)."""
    out: dict[str, tuple[np.ndarray, str]] = {}
    if jobs[0].text_mode:
        texts = [(j.prompt_text if j.include_input and not streamed else "") + r[1] for j, r in zip(jobs, results)]
        arr = np.empty((len(jobs), 1), dtype=np.object_)
        arr[:, 0] = [t.encode() for t in texts]
        out["text_output"] = (arr, "BYTES")
    else:
        rows = [(j.prompt_ids if j.include_input and not streamed else []) + r[0] for j, r in zip(jobs, results)]
        width = max(len(r) for r in rows)
        ids = np.full((len(jobs), 1, width), 0, dtype=np.int32)
        for b, (j, r) in enumerate(zip(jobs, rows)):
            ids[b, 0, :] = j.pad_id
            ids[b, 0, :len(r)] = r
        out["output_ids"] = (ids, "INT32")
        out["sequence_length"] = (np.array([[len(r)] for r in rows], dtype=np.int32), "INT32")
    if any(j.logprobs for j in jobs):
        width = max(len(r[2]) for r in results)
        lps = np.zeros((len(jobs), 1, width), dtype=np.float32)
        for b, r in enumerate(results):
            lps[b, 0, :len(r[2])] = r[2]
        out["output_log_probs"] = (lps, "FP32")
        out["cum_log_probs"] = (np.array([[sum(r[2])] for r in results], dtype=np.float32), "FP32")
    return out


def metadata(name: str) -> dict:
    """KServe model metadata (`GET /v2/models/{m}`, gRPC ModelMetadata); shapes include the batch dimension."""
    return {"name": name, "versions": ["1"], "platform": "dsflash",
            "inputs": [{"name": n, "datatype": d, "shape": [-1, *s]} for n, (d, s, _) in INPUTS.items()],
            "outputs": [{"name": n, "datatype": d, "shape": [-1, *s]} for n, (d, s) in OUTPUTS.items()]}
