"""Triton Inference Server Python-backend models that serve an engine dir (written out by `dsflash triton-repo`).

- `TritonPythonModel` (decoupled): owns an `AsyncLLMEngine` (in-flight batching over every request Triton hands
  it); takes the tensorrtllm-backend tensors of dsflash.serve.api.tensors; streams one response per generated
  step when `streaming`/`stream` is set, else one response; closes each request with
  TRITONSERVER_RESPONSE_COMPLETE_FINAL; a cancelled request is aborted (its cache pages freed).
- `TritonBLSModel` (not decoupled): forwards a request to the decoupled model and returns its single response, so
  unary HTTP `/infer` and gRPC `ModelInfer` work too (Triton refuses both on decoupled models); the pattern of
  TensorRT-LLM's `tensorrt_llm_bls`.

`triton_python_backend_utils` exists only inside Triton's Python stub, so it is imported in `initialize`.
"""
from __future__ import annotations

import asyncio
import json
import threading


def _params(model_config: dict) -> dict[str, str]:
    return {k: v.get("string_value", "") for k, v in (model_config.get("parameters") or {}).items()}


def bool_param(params: dict[str, str], key: str) -> bool:
    """A config.pbtxt flag: "true" / "false" (any case), unset or empty = false."""
    value = params.get(key, "").strip().lower()
    if value not in ("", "true", "false"):
        raise ValueError(f"config.pbtxt parameter {key!r} must be \"true\" or \"false\", got {params[key]!r}")
    return value == "true"


class TritonPythonModel:
    def initialize(self, args):
        import triton_python_backend_utils as pb_utils
        from dsflash.serve.api.core import Frontend
        from dsflash.serve.api.security import Limits
        from dsflash.serve.llm_engine import AsyncLLMEngine, LLMEngine
        self.pb = pb_utils
        cfg = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(cfg):
            raise ValueError(f"model {args['model_name']!r} must set model_transaction_policy {{ decoupled: true }}")
        p = _params(cfg)
        if not p.get("engine_dir"):
            raise ValueError(f"model {args['model_name']!r}: parameter 'engine_dir' is missing from config.pbtxt")
        as_int = lambda key: int(p[key]) if p.get(key) else None  # noqa: E731
        core = LLMEngine(p["engine_dir"], kv_cache_bytes=as_int("kv_cache_bytes"),
                         kv_cache_free_gpu_memory_fraction=float(p.get("kv_cache_free_gpu_mem_fraction") or 0.9),
                         max_queue=as_int("max_queue_size") or 256, max_batch_size=as_int("max_batch_size"),
                         max_num_tokens=as_int("max_num_tokens"), max_seq_len=as_int("max_seq_len"),
                         batch_invariant=bool_param(p, "batch_invariant"))
        top = core.max_seq_len - 1
        limits = Limits(max_prompt_len=as_int("max_prompt_len") or top, max_tokens_limit=as_int("max_tokens_limit")
                        or top)
        self.engine = AsyncLLMEngine(core)
        self.fe = Frontend(self.engine, limits, served_name=args["model_name"])
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="dsflash-triton", daemon=True)
        self.thread.start()

    def execute(self, requests):
        for request in requests:
            inputs = {t.name(): t.as_numpy() for t in request.inputs()}
            asyncio.run_coroutine_threadsafe(self._serve(request, inputs, request.get_response_sender()), self.loop)
        return None

    def _response(self, outs: dict, requested: set[str]):
        tensors = [self.pb.Tensor(name, arr) for name, (arr, _) in outs.items() if not requested or name in requested]
        return self.pb.InferenceResponse(output_tensors=tensors)

    async def _serve(self, request, inputs: dict, sender) -> None:
        from dsflash.serve.api import tensors
        from dsflash.serve.api.kserve_http import collect_jobs, start_jobs
        from dsflash.serve.api.security import APIError
        final = self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        requested = set(request.requested_output_names() or ())
        try:
            jobs = tensors.parse_jobs(self.fe, inputs)
            streams = await start_jobs(self.fe, jobs, None)
            if not jobs[0].streaming:
                results = await collect_jobs(streams)
                sender.send(self._response(tensors.outputs_for(jobs, results), requested), flags=final)
                return
            s = streams[0]
            try:
                async for o in s:
                    if sender.is_cancelled():
                        break
                    lp = [e["logprob"] for e in o.logprobs or []]
                    outs = tensors.outputs_for(jobs, [(o.new_token_ids, o.text, lp)], streamed=True)
                    sender.send(self._response(outs, requested), flags=final if o.finished else 0)
                    if o.finished:
                        return
            finally:
                await s.aclose()  # aborts the request when the client cancelled
            sender.send(flags=final)
        except Exception as e:  # noqa: BLE001 - every request gets its final response, error or not
            msg = e.message if isinstance(e, APIError) else f"internal error: {type(e).__name__}: {e}"
            sender.send(self.pb.InferenceResponse(output_tensors=[], error=self.pb.TritonError(msg)), flags=final)

    def finalize(self):
        fut = asyncio.run_coroutine_threadsafe(self.engine.drain(timeout=10), self.loop)
        try:
            fut.result(timeout=20)
        finally:
            self.engine.shutdown()
            self.loop.call_soon_threadsafe(self.loop.stop)


class TritonBLSModel:
    """Unary front of the decoupled model (parameter `target_model`)."""

    def initialize(self, args):
        import triton_python_backend_utils as pb_utils
        self.pb = pb_utils
        self.target = _params(json.loads(args["model_config"])).get("target_model")
        if not self.target:
            raise ValueError(f"model {args['model_name']!r}: parameter 'target_model' is missing from config.pbtxt")

    def execute(self, requests):
        pb = self.pb
        responses = []
        for request in requests:
            inputs = request.inputs()
            streaming = [t for t in inputs if t.name() in ("streaming", "stream") and t.as_numpy().any()]
            if streaming:
                responses.append(pb.InferenceResponse(output_tensors=[], error=pb.TritonError(
                    f"streaming needs the decoupled model '{self.target}' (gRPC ModelStreamInfer or generate_stream)")))
                continue
            inner = pb.InferenceRequest(model_name=self.target, inputs=inputs,
                                        requested_output_names=list(request.requested_output_names()))
            outputs, error = None, None
            for resp in inner.exec(decoupled=True):
                if resp.has_error():
                    error = resp.error().message()
                    break
                if resp.output_tensors():
                    outputs = resp.output_tensors()
            responses.append(pb.InferenceResponse(output_tensors=outputs or [],
                                                  error=pb.TritonError(error) if error else None))
        return responses
