"""KServe v2 / Triton HTTP door: health, server and model metadata, `/infer` (JSON and Triton's binary tensor
extension, so `tritonclient.http` works unchanged), `/generate` and `/generate_stream` (Triton's generate extension).

The model answers to the served name and to TensorRT-LLM's model names (`tensorrt_llm`, `ensemble`,
`tensorrt_llm_bls`), so existing clients and scripts work; version "1" (or none) is accepted.
"""
from __future__ import annotations

import json

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from dsflash.serve.api import tensors
from dsflash.serve.api.core import Frontend, Stream, field
from dsflash.serve.api.httputil import (ClientGone, EventStream, kserve_error, read_body, read_json, sse,
                                        until_disconnect)
from dsflash.serve.api.security import APIError, check_json_object

TRTLLM_NAMES = ("tensorrt_llm", "ensemble", "tensorrt_llm_bls")
SERVER_NAME, SERVER_VERSION = "dsflash", "2.51.0"  # the KServe/Triton protocol version we follow
EXTENSIONS = ["binary_tensor_data", "parameters", "generate"]


# -- running jobs (shared with the gRPC door) -------------------------------------------------------------------------
async def start_jobs(fe: Frontend, jobs: list[tensors.Job], request_id: str | None) -> list[Stream]:
    """Admit every row; if one is refused, abort the ones already admitted."""
    streams: list[Stream] = []
    try:
        for b, j in enumerate(jobs):
            rid = None if not request_id else (request_id if len(jobs) == 1 else f"{request_id}-{b}")
            streams.append(await fe.start(j.prompt_ids, j.params, "infer", request_id=_unique(fe, rid)))
    except BaseException:
        for s in streams:
            await s.aclose()
        raise
    return streams


def _unique(fe: Frontend, rid: str | None) -> str | None:
    """Client ids are echoed back but never trusted as engine ids (two clients may send the same one)."""
    from dsflash.serve.api.core import new_request_id
    return None if rid is None else f"{new_request_id('kserve')}-{rid[:64]}"


async def collect_jobs(streams: list[Stream]) -> list[tuple[list[int], str, list[float]]]:
    import asyncio
    try:
        await asyncio.gather(*(s.collect() for s in streams))
    except BaseException:
        for s in streams:
            await s.aclose()
        raise
    return [(s.token_ids, s.text, [e["logprob"] for e in s.logprobs]) for s in streams]


def check_model_name(fe: Frontend, name: str, version: str | None) -> None:
    if name not in fe.names:
        raise APIError(404, f"model {name!r} not found; this server serves {fe.model_name!r} "
                            f"(also reachable as {', '.join(n for n in sorted(fe.names) if n != fe.model_name)})")
    if version not in (None, "", "1"):
        raise APIError(404, f"model {name!r} has no version {version!r}; the only version is 1")


# -- JSON / binary infer bodies ------------------------------------------------------------------------------------
def parse_infer_body(body: bytes, header_length: str | None, limit: int) -> tuple[dict, dict[str, np.ndarray]]:
    if header_length is not None:
        if not header_length.isdigit() or int(header_length) > len(body):
            raise APIError(400, f"Inference-Header-Content-Length {header_length!r} does not fit the body")
        n = int(header_length)
        head, blob = check_json_object(body[:n], limit), body[n:]
    else:
        head, blob = check_json_object(body, limit), b""
    inputs, pos = {}, 0
    items = head.get("inputs")
    if not isinstance(items, list) or not items:
        raise APIError(400, "field 'inputs' must be a non-empty list of tensors")
    for i, t in enumerate(items):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise APIError(400, f"inputs[{i}] must be an object with a 'name'")
        name, dt, shape = t["name"], t.get("datatype"), t.get("shape")
        if not isinstance(dt, str) or not isinstance(shape, list) or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise APIError(400, f"input '{name}' needs a 'datatype' string and a 'shape' list of sizes")
        size = (t.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or pos + size > len(blob):
                raise APIError(400, f"input '{name}': binary_data_size {size!r} runs past the body")
            inputs[name] = tensors.from_raw(blob[pos:pos + size], dt, shape)
            pos += size
        elif "data" in t:
            inputs[name] = tensors.from_json(t["data"], dt, shape)
        else:
            raise APIError(400, f"input '{name}' has neither 'data' nor binary data")
    return head, inputs


def infer_response(model: str, request_id: str | None, outs: dict, head: dict) -> Response:
    """JSON outputs, or Triton's binary layout when the client asked (binary_data_output / per-output binary_data)."""
    req_params = head.get("parameters") or {}
    wanted = {o.get("name"): (o.get("parameters") or {}) for o in head.get("outputs") or [] if isinstance(o, dict)}
    for name in wanted:
        if name not in outs:
            raise APIError(400, f"requested output '{name}' is not produced for this request; "
                                f"available: {sorted(outs)}")
    names = [n for n in outs if not wanted or n in wanted]
    entries, blobs = [], []
    for n in names:
        arr, dt = outs[n]
        entry = {"name": n, "datatype": dt, "shape": list(arr.shape)}
        if wanted.get(n, {}).get("binary_data", req_params.get("binary_data_output", False)):
            raw = tensors.to_raw(arr, dt)
            entry["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            entry["data"] = tensors.to_json(arr, dt)
        entries.append(entry)
    body = {"model_name": model, "model_version": "1", "outputs": entries}
    if request_id:
        body["id"] = request_id
    head_bytes = json.dumps(body).encode()
    if not blobs:
        return Response(head_bytes, media_type="application/json")
    return Response(head_bytes + b"".join(blobs), media_type="application/octet-stream",
                    headers={"Inference-Header-Content-Length": str(len(head_bytes))})


# -- routes ----------------------------------------------------------------------------------------------------------
async def server_metadata(fe: Frontend, request: Request) -> Response:
    return JSONResponse({"name": SERVER_NAME, "version": SERVER_VERSION, "extensions": EXTENSIONS})


async def live(fe: Frontend, request: Request) -> Response:
    return Response(status_code=200)


async def ready(fe: Frontend, request: Request) -> Response:
    return Response(status_code=200 if fe.engine.ready and not fe.draining else 503)


async def model_metadata(fe: Frontend, request: Request) -> Response:
    try:
        name = request.path_params["model"]
        check_model_name(fe, name, request.path_params.get("version"))
    except APIError as e:
        return kserve_error(e)
    return JSONResponse(tensors.metadata(name))


async def model_ready(fe: Frontend, request: Request) -> Response:
    try:
        check_model_name(fe, request.path_params["model"], request.path_params.get("version"))
    except APIError as e:
        return kserve_error(e)
    return Response(status_code=200 if fe.engine.ready and not fe.draining else 503)


async def model_config(fe: Frontend, request: Request) -> Response:
    """Triton's model-configuration extension, in its JSON form (enough for tools that read limits)."""
    try:
        name = request.path_params["model"]
        check_model_name(fe, name, request.path_params.get("version"))
    except APIError as e:
        return kserve_error(e)
    md = tensors.metadata(name)
    return JSONResponse({
        "name": name, "platform": "dsflash", "backend": "dsflash", "max_batch_size": fe.engine.engine.max_batch_size,
        "input": [{"name": t["name"], "data_type": "TYPE_" + t["datatype"].replace("BYTES", "STRING"),
                   "dims": t["shape"][1:], "optional": True} for t in md["inputs"]],
        "output": [{"name": t["name"], "data_type": "TYPE_" + t["datatype"].replace("BYTES", "STRING"),
                    "dims": t["shape"][1:]} for t in md["outputs"]],
        "model_transaction_policy": {"decoupled": False},
        "parameters": {"max_seq_len": {"string_value": str(fe.max_seq_len)}}})


async def infer(fe: Frontend, request: Request) -> Response:
    try:
        name = request.path_params["model"]
        check_model_name(fe, name, request.path_params.get("version"))
        body = await read_body(request, fe.limits.max_body_bytes)
        head, inputs = parse_infer_body(body, request.headers.get("inference-header-content-length"),
                                        fe.limits.max_body_bytes)
        rid = head.get("id") if isinstance(head.get("id"), str) else None
        jobs = tensors.parse_jobs(fe, inputs)
        if any(j.streaming for j in jobs):
            raise APIError(400, "streaming needs the gRPC ModelStreamInfer call or /generate_stream; "
                                "HTTP /infer returns one response")
        streams = await start_jobs(fe, jobs, rid)
        try:
            results = await until_disconnect(request, collect_jobs(streams))
        except ClientGone:
            return Response(status_code=499)
        return infer_response(name, rid, tensors.outputs_for(jobs, results), head)
    except APIError as e:
        fe.metrics.record_error(e.status)
        return kserve_error(e)


def _generate_inputs(body: dict) -> dict[str, np.ndarray]:
    """Generate-extension fields -> input tensors by name (`parameters` entries count as fields too)."""
    params = field(body, "parameters", "object", {})
    merged = {**params, **{k: v for k, v in body.items() if k not in ("id", "parameters")}}
    inputs = {}
    for name, value in merged.items():
        spec = tensors.INPUTS.get(name)
        if spec is None:
            raise APIError(400, f"unknown field '{name}'; the generate endpoint takes {sorted(tensors.INPUTS)}")
        dt = spec[0]
        if dt == "BYTES":
            vals = value if isinstance(value, list) else [value]
            if not all(isinstance(v, str) for v in vals):
                raise APIError(400, f"field '{name}' must be a string or a list of strings")
            inputs[name] = tensors.from_json(vals, dt, [1, len(vals)])
        else:
            ok = isinstance(value, bool) if dt == "BOOL" else (
                isinstance(value, (int, float)) and not isinstance(value, bool) if dt.startswith("FP")
                else isinstance(value, int) and not isinstance(value, bool))
            if name == "input_ids":
                ok = isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
                inputs[name] = tensors.from_json(value, dt, [1, len(value)]) if ok else None
            elif ok:
                inputs[name] = tensors.from_json([value], dt, [1, 1])
            if not ok:
                raise APIError(400, f"field '{name}' must be {'a list of integers' if name == 'input_ids' else dt}, "
                                    f"got {value!r}"[:300])
    return inputs


async def generate(fe: Frontend, request: Request, stream: bool = False) -> Response:
    try:
        name = request.path_params["model"]
        check_model_name(fe, name, request.path_params.get("version"))
        body = await read_json(request, fe.limits.max_body_bytes)
        rid = body.get("id") if isinstance(body.get("id"), str) else None
        jobs = tensors.parse_jobs(fe, _generate_inputs(body))
        if len(jobs) != 1:
            raise APIError(400, "the generate endpoint takes one prompt")
        streams = await start_jobs(fe, jobs, rid)
    except APIError as e:
        fe.metrics.record_error(e.status)
        return kserve_error(e)
    base = {"model_name": name, "model_version": "1", **({"id": rid} if rid else {})}

    def payload(outs: dict) -> dict:
        out = dict(base)
        for key, (arr, dt) in outs.items():
            vals = tensors.to_json(arr, dt)
            out[key] = vals[0] if key in ("text_output", "sequence_length", "cum_log_probs") else vals
        return out

    if not stream:
        try:
            results = await until_disconnect(request, collect_jobs(streams))
        except ClientGone:
            return Response(status_code=499)
        except APIError as e:
            fe.metrics.record_error(e.status)
            return kserve_error(e)
        return JSONResponse(payload(tensors.outputs_for(jobs, results)))

    s = streams[0]

    async def events():
        try:
            async for o in s:
                lp = [e["logprob"] for e in o.logprobs or []]
                yield sse(payload(tensors.outputs_for(jobs, [(o.new_token_ids, o.text, lp)], streamed=True)))
        except APIError as e:
            fe.metrics.record_error(e.status)
            yield sse({"error": e.message})
    return EventStream(events(), on_close=s.aclose)
