"""What every front door shares: request validation, admission into the engine, per-request streams, metrics.

`Frontend.start(prompt_ids, params)` validates against the server limits, admits the request into the
`AsyncLLMEngine` (APIError 400 / 429 / 503 at once, before any response byte is sent) and returns a `Stream` of its
`Output`s. Closing a stream before it finishes (client gone, cancelled RPC) aborts the request, which frees its
cache pages.
"""
from __future__ import annotations

import asyncio
import itertools
import math
import os
import time

from dsflash.serve.api.metrics import Metrics
from dsflash.serve.api.security import APIError, Limits

_ids = itertools.count()


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{os.getpid():x}{next(_ids):08x}{int(time.time() * 1000) & 0xffffff:06x}"


class Frontend:
    """The served model as the front doors see it (one per server process)."""

    def __init__(self, engine, limits: Limits, metrics: Metrics | None = None, served_name: str | None = None,
                 aliases: tuple[str, ...] = ()):
        from dsflash.serve.llm_engine import SamplingParams
        self.engine = engine                      # AsyncLLMEngine
        core = engine.engine                      # LLMEngine
        self.SamplingParams = SamplingParams
        self.tokenizer = core.tokenizer
        self.args = core.args
        self.family = self.args.family
        self.vocab_size = self.args.vocab_size
        self.eos_token_id = self.args.eos_token_id
        self.max_seq_len = core.max_seq_len
        self.model_name = served_name or core.model_name
        self.names = frozenset((self.model_name, *aliases))
        self.limits = limits
        self.metrics = metrics or Metrics(self.model_name)
        self.draining = False
        self.created = int(time.time())

    # -- validation ----------------------------------------------------------------------------------------------
    def check_model(self, name) -> None:
        if name is not None and name not in self.names:
            raise APIError(404, f"model {name!r} not found; this server serves {self.model_name!r}")

    def check_prompt(self, ids) -> list[int]:
        if not isinstance(ids, list) or not ids:
            raise APIError(400, "prompt is empty")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size for t in ids):
            raise APIError(400, f"prompt token ids must be integers in [0, {self.vocab_size})")
        if len(ids) > self.limits.max_prompt_len:
            raise APIError(400, f"prompt has {len(ids)} tokens; the limit is {self.limits.max_prompt_len} "
                                f"(--max-prompt-len)")
        if len(ids) >= self.max_seq_len:
            raise APIError(400, f"prompt has {len(ids)} tokens; this engine's max_seq_len is {self.max_seq_len} "
                                f"(prompt + at least one new token)")
        return ids

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise APIError(400, "this engine has no tokenizer (tokenizer.json); send token ids instead of text")
        return self.tokenizer.encode(text, add_bos=add_bos)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def default_max_tokens(self, prompt_len: int) -> int:
        return max(1, min(self.limits.max_tokens_limit, self.max_seq_len - prompt_len))

    def sampling(self, **kw):
        """SamplingParams from already type-checked fields; APIError 400 on a bad value or a value over a limit."""
        mt = kw.get("max_tokens")
        if isinstance(mt, int) and mt > self.limits.max_tokens_limit:
            raise APIError(400, f"max_tokens={mt} exceeds this server's limit of {self.limits.max_tokens_limit} "
                                f"(--max-tokens-limit)")
        try:
            return self.SamplingParams(**{k: v for k, v in kw.items() if v is not None})
        except (TypeError, ValueError) as e:
            raise APIError(400, str(e)) from None

    # -- admission -----------------------------------------------------------------------------------------------
    def api_error(self, e: BaseException) -> APIError:
        """The status an engine exception maps to (APIError passes through; unknown ones are 500)."""
        from dsflash.serve.llm_engine import EngineDeadError, QueueFullError
        retry = self.limits.retry_after_s
        if isinstance(e, APIError):
            return e
        if isinstance(e, QueueFullError):
            if self.draining or not self.engine.ready:
                return APIError(503, str(e), retry_after=retry)
            return APIError(429, f"server overloaded: {e}", retry_after=retry)
        if isinstance(e, EngineDeadError):
            return APIError(503, str(e), retry_after=retry)
        if isinstance(e, ValueError):
            return APIError(400, str(e))
        return APIError(500, f"generation failed: {type(e).__name__}: {e}")

    async def start(self, prompt_ids: list[int], params, prefix: str = "req", request_id: str | None = None):
        """Admit a request; returns its Stream. APIError: 400 invalid, 429 queue full, 503 draining / engine down."""
        from dsflash.serve.llm_engine import Request
        if self.draining:
            raise APIError(503, "server is shutting down; retry on another replica",
                           retry_after=self.limits.retry_after_s)
        self.check_prompt(prompt_ids)
        req = Request(request_id or new_request_id(prefix), prompt_ids, params)
        agen = self.engine.generate(req)
        first = asyncio.ensure_future(agen.__anext__())
        await asyncio.sleep(0)  # the generator admits the request synchronously on its first step
        if first.done() and first.exception() is not None:
            raise self.api_error(first.exception())
        return Stream(self, req, agen, first)


class Stream:
    """One admitted request: `async for out in stream` yields its Outputs; accumulates ids, text, counts."""

    def __init__(self, fe: Frontend, req, agen, first: asyncio.Future):
        self.fe, self.req, self.agen, self.first = fe, req, agen, first
        self.request_id = req.request_id
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: list[dict] = []
        self.finish_reason: str | None = None
        self.prompt_tokens, self.completion_tokens = len(req.prompt_ids), 0
        self.t0 = time.monotonic()
        self.ttft: float | None = None
        self.done = False
        self.spec: dict | None = None      # speculative engines: the request's acceptance (Output.spec)

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.done:
            raise StopAsyncIteration
        try:
            if self.first is not None:
                fut, self.first = self.first, None
                out = await fut
            else:
                out = await self.agen.__anext__()
        except StopAsyncIteration:
            self.done = True
            raise
        except Exception as e:
            self.done = True
            raise self.fe.api_error(e) from e
        if out.new_token_ids and self.ttft is None:
            self.ttft = time.monotonic() - self.t0
        self.token_ids += out.new_token_ids
        self.text += out.text
        self.logprobs += out.logprobs or []
        self.prompt_tokens, self.completion_tokens = out.prompt_tokens, out.completion_tokens
        if getattr(out, "spec", None) is not None:
            self.spec = out.spec
        if out.finished:
            self.done = True
            self.finish_reason = out.finish_reason
            self.fe.metrics.record_finished(out.finish_reason or "stop", self.ttft, time.monotonic() - self.t0,
                                            out.completion_tokens)
        return out

    async def collect(self) -> "Stream":
        async for _ in self:
            pass
        return self

    async def aclose(self) -> None:
        """Abort the request if it is still running (frees its cache pages); safe to call more than once."""
        if self.first is not None and not self.first.done():
            self.first.cancel()
            try:
                await self.first
            except BaseException:  # noqa: BLE001 - the cancellation we asked for
                pass
        self.first = None
        await self.agen.aclose()
        if not self.done:
            self.done = True
            self.fe.engine.abort(self.request_id)
            self.fe.metrics.record_finished("abort", self.ttft, time.monotonic() - self.t0, self.completion_tokens)


# -- typed field access for JSON request bodies (APIError 400 naming the field) -------------------------------------
def field(d: dict, name: str, kind: str, default=None, where: str = ""):
    """d[name] checked as kind: "int", "number", "bool", "str", "strs" (str or list of str), "ints" (list of int)."""
    v = d.get(name, default)
    if v is None:
        return default
    label = f"{where}{name}"
    ok = {
        "int": lambda x: isinstance(x, int) and not isinstance(x, bool),
        "number": lambda x: isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x),
        "bool": lambda x: isinstance(x, bool),
        "str": lambda x: isinstance(x, str),
        "strs": lambda x: isinstance(x, str) or (isinstance(x, list) and all(isinstance(s, str) for s in x)),
        "ints": lambda x: isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x),
        "object": lambda x: isinstance(x, dict),
    }[kind]
    if not ok(v):
        want = {"int": "an integer", "number": "a number", "bool": "a boolean", "str": "a string",
                "strs": "a string or a list of strings", "ints": "a list of integers", "object": "an object"}[kind]
        raise APIError(400, f"field '{label}' must be {want}, got {v!r}"[:300])
    if kind == "strs" and isinstance(v, str):
        return [v]
    return v
