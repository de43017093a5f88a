"""KServe v2 gRPC door (`inference.GRPCInferenceService`, grpc.aio): ServerLive, ServerReady, ModelReady,
ServerMetadata, ModelMetadata, ModelInfer and the bidirectional ModelStreamInfer, so `tritonclient.grpc` works
unchanged (including `start_stream` / `async_stream_infer` with decoupled, token-by-token responses).

Streaming follows Triton's decoupled protocol: every response carries the parameter `triton_final_response`
(true on the last one); when the request sets `triton_enable_empty_final_response`, the data responses are
non-final and an empty final response closes the request. A cancelled call aborts its requests (pages freed).
"""
from __future__ import annotations

import asyncio
import logging

import grpc
import numpy as np

from dsflash.serve.api import kserve_proto as pb
from dsflash.serve.api import tensors
from dsflash.serve.api.core import Frontend
from dsflash.serve.api.kserve_http import EXTENSIONS, SERVER_NAME, SERVER_VERSION, check_model_name, collect_jobs, \
    start_jobs
from dsflash.serve.api.security import APIError, bearer_ok

log = logging.getLogger("dsflash.serve")
STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
          404: grpc.StatusCode.NOT_FOUND, 413: grpc.StatusCode.INVALID_ARGUMENT,
          429: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE}


def _param_value(p) -> object:
    kind = p.WhichOneof("parameter_choice")
    return getattr(p, kind) if kind else None


def request_inputs(req) -> dict[str, np.ndarray]:
    """Input tensors of a ModelInferRequest (raw_input_contents, or typed `contents`)."""
    inputs = {}
    raw = list(req.raw_input_contents)
    if raw and len(raw) != len(req.inputs):
        raise APIError(400, f"{len(raw)} raw_input_contents for {len(req.inputs)} inputs")
    for i, t in enumerate(req.inputs):
        shape = list(t.shape)
        if raw:
            inputs[t.name] = tensors.from_raw(raw[i], t.datatype, shape)
            continue
        c = t.contents
        data = {"BOOL": c.bool_contents, "INT8": c.int_contents, "INT16": c.int_contents, "INT32": c.int_contents,
                "INT64": c.int64_contents, "UINT8": c.uint_contents, "UINT16": c.uint_contents,
                "UINT32": c.uint_contents, "UINT64": c.uint64_contents, "FP32": c.fp32_contents,
                "FP64": c.fp64_contents, "BYTES": c.bytes_contents}.get(t.datatype)
        if data is None:
            raise APIError(400, f"input '{t.name}': unsupported datatype {t.datatype!r}")
        inputs[t.name] = tensors.from_json(list(data), t.datatype, shape)
    return inputs


def infer_response(model: str, request_id: str, outs: dict, final: bool | None = None, requested=()):
    resp = pb.ModelInferResponse(model_name=model, model_version="1", id=request_id)
    for name, (arr, dt) in outs.items():
        if requested and name not in requested:
            continue
        resp.outputs.add(name=name, datatype=dt, shape=list(arr.shape))
        resp.raw_output_contents.append(tensors.to_raw(arr, dt))
    if final is not None:
        resp.parameters["triton_final_response"].bool_param = final
    return resp


class InferenceService:
    """The RPC implementations; errors become gRPC status codes (Triton's mapping: conventions.md §5.5)."""

    def __init__(self, fe: Frontend, api_key: str | None):
        self.fe, self.api_key = fe, api_key

    async def _check(self, context) -> None:
        md = dict(context.invocation_metadata() or ())
        if not bearer_ok(md.get("authorization"), self.api_key):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key "
                                "(send metadata 'authorization: Bearer <key>')")

    async def _fail(self, context, e: APIError):
        self.fe.metrics.record_error(e.status)
        if e.retry_after is not None:
            context.set_trailing_metadata((("retry-after", str(e.retry_after)),))
        await context.abort(STATUS.get(e.status, grpc.StatusCode.INTERNAL), e.message)

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.fe.engine.ready and not self.fe.draining)

    async def ModelReady(self, request, context):
        await self._check(context)
        try:
            check_model_name(self.fe, request.name, request.version)
        except APIError as e:
            await self._fail(context, e)
        return pb.ModelReadyResponse(ready=self.fe.engine.ready and not self.fe.draining)

    async def ServerMetadata(self, request, context):
        await self._check(context)
        return pb.ServerMetadataResponse(name=SERVER_NAME, version=SERVER_VERSION, extensions=EXTENSIONS)

    async def ModelMetadata(self, request, context):
        await self._check(context)
        try:
            check_model_name(self.fe, request.name, request.version)
        except APIError as e:
            await self._fail(context, e)
        md = tensors.metadata(request.name)
        resp = pb.ModelMetadataResponse(name=md["name"], versions=md["versions"], platform=md["platform"])
        for key in ("inputs", "outputs"):
            for t in md[key]:
                getattr(resp, key).add(name=t["name"], datatype=t["datatype"], shape=t["shape"])
        return resp

    def _jobs(self, request):
        check_model_name(self.fe, request.model_name, request.model_version)
        if request.ByteSize() > self.fe.limits.max_body_bytes:
            raise APIError(413, f"request is {request.ByteSize()} bytes; the limit is "
                                f"{self.fe.limits.max_body_bytes} (--max-body-bytes)")
        return tensors.parse_jobs(self.fe, request_inputs(request))

    async def ModelInfer(self, request, context):
        await self._check(context)
        try:
            jobs = self._jobs(request)
            if any(j.streaming for j in jobs):
                raise APIError(400, "streaming=true needs the ModelStreamInfer call")
            streams = await start_jobs(self.fe, jobs, request.id or None)
            results = await collect_jobs(streams)  # a cancelled call cancels this task: the rows are aborted
        except APIError as e:
            await self._fail(context, e)
        requested = {o.name for o in request.outputs}
        return infer_response(request.model_name, request.id, tensors.outputs_for(jobs, results), None, requested)

    async def _stream_one(self, request, queue: asyncio.Queue) -> None:
        """Serve one request of a stream: put its responses (or an error) on the call's queue."""
        rid, model = request.id, request.model_name
        params = {k: _param_value(v) for k, v in request.parameters.items()}
        empty_final = bool(params.get("triton_enable_empty_final_response", False))
        requested = {o.name for o in request.outputs}
        try:
            jobs = self._jobs(request)
            streams = await start_jobs(self.fe, jobs, rid or None)
            if not jobs[0].streaming:
                results = await collect_jobs(streams)
                await queue.put(pb.ModelStreamInferResponse(infer_response=infer_response(
                    model, rid, tensors.outputs_for(jobs, results), not empty_final, requested)))
            else:
                s = streams[0]
                try:
                    async for o in s:
                        lp = [e["logprob"] for e in o.logprobs or []]
                        outs = tensors.outputs_for(jobs, [(o.new_token_ids, o.text, lp)], streamed=True)
                        final = o.finished and not empty_final
                        await queue.put(pb.ModelStreamInferResponse(
                            infer_response=infer_response(model, rid, outs, final, requested)))
                finally:
                    await s.aclose()
            if empty_final:
                resp = pb.ModelInferResponse(model_name=model, model_version="1", id=rid)
                resp.parameters["triton_final_response"].bool_param = True
                await queue.put(pb.ModelStreamInferResponse(infer_response=resp))
        except Exception as e:  # noqa: BLE001 - reported on the stream; the other requests of the call go on
            if not isinstance(e, APIError):
                log.exception("stream request %r failed", rid)
                e = APIError(500, f"internal error: {type(e).__name__}: {e}")
            self.fe.metrics.record_error(e.status)
            err = pb.ModelInferResponse(model_name=model, model_version="1", id=rid)
            await queue.put(pb.ModelStreamInferResponse(error_message=e.message, infer_response=err))

    async def ModelStreamInfer(self, request_iterator, context):
        await self._check(context)
        queue: asyncio.Queue = asyncio.Queue()
        tasks: set[asyncio.Task] = set()
        done = object()

        async def reader():
            async for req in request_iterator:
                t = asyncio.ensure_future(self._stream_one(req, queue))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
            await queue.put(done)

        read = asyncio.ensure_future(reader())
        try:
            reading = True
            while reading or tasks or not queue.empty():
                item = await queue.get()
                if item is done:
                    reading = False
                    if tasks:
                        await asyncio.wait(set(tasks))
                    continue
                yield item
        finally:  # the call ended or was cancelled: abort whatever still runs
            read.cancel()
            for t in list(tasks):
                t.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)


def make_server(fe: Frontend, host: str, port: int, api_key: str | None):
    """(grpc.aio server, bound port): not started yet; OSError when the port cannot be bound."""
    svc = InferenceService(fe, api_key)
    handlers = {}
    for rpc, (req_name, resp_name, streaming) in pb.METHODS.items():
        req_cls = pb.message(req_name)
        kind = grpc.stream_stream_rpc_method_handler if streaming else grpc.unary_unary_rpc_method_handler
        handlers[rpc] = kind(getattr(svc, rpc), request_deserializer=req_cls.FromString,
                             response_serializer=lambda m: m.SerializeToString())
    limit = max(fe.limits.max_body_bytes, 4 * 2 ** 20) + 2 ** 16
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", limit),
                                      ("grpc.max_send_message_length", 64 * 2 ** 20),
                                      ("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(f"{pb.PACKAGE}.{pb.SERVICE}", handlers),))
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind the gRPC port {host}:{port}")
    return server, bound
