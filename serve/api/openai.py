"""OpenAI-compatible door: `/v1/models`, `/v1/completions`, `/v1/chat/completions` (JSON or SSE, with `usage`).

Request fields follow the OpenAI API; extensions as in vLLM / trtllm-serve: `top_k`, `ignore_eos`,
`stop_token_ids`, `return_token_ids` (adds `prompt_token_ids` / `token_ids`), and for chat
`chat_template_kwargs: {"thinking": bool, "reasoning_effort": ...}` or DeepSeek's `thinking: {"type": "enabled"}`.
On a speculative server `usage` also holds the request's `acceptance_length` (AL, tokens per verify step),
`draft_acceptance_rate` (DAR), `verify_steps`, `draft_tokens`, `accepted_draft_tokens`, and
`simulated_acceptance: true` when `--simulate-acceptance-length` made the acceptance synthetic.
Chat prompts use the DeepSeek-V4.1 / V4 encoding (dsflash.serve.encoding); in thinking mode the reply is split
into `reasoning_content` and `content` at `</think>`. Completion prompts may be text or token ids.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from dsflash.serve.api.core import Frontend, Stream, field
from dsflash.serve.api.httputil import ClientGone, EventStream, openai_error, read_json, sse, until_disconnect
from dsflash.serve.api.security import APIError

THINK_END = "</think>"


def _refuse(body: dict, where: str = "") -> None:
    """Fields this server does not implement: refused with a 400 unless they hold their neutral value."""
    neutral = {"n": 1, "best_of": 1, "echo": False, "presence_penalty": 0, "frequency_penalty": 0,
               "suffix": None, "logit_bias": None, "tools": None, "tool_choice": None, "functions": None,
               "function_call": None, "parallel_tool_calls": None}
    for name, ok in neutral.items():
        v = body.get(name)
        if v is None or v == ok or (name in ("logit_bias", "tools") and v in ({}, [])) \
                or (name == "tool_choice" and v == "none"):
            continue
        raise APIError(400, f"field '{where}{name}'={v!r} is not supported by this server")
    rf = body.get("response_format")
    if rf is not None and rf != {"type": "text"}:
        raise APIError(400, "field 'response_format' is not supported by this server (only {'type': 'text'})")


def _sampling_fields(fe: Frontend, body: dict, max_tokens_default: int, logprobs) -> object:
    max_tokens = field(body, "max_completion_tokens", "int", None)
    max_tokens = field(body, "max_tokens", "int", max_tokens)
    return fe.sampling(
        max_tokens=max_tokens_default if max_tokens is None else max_tokens,
        temperature=field(body, "temperature", "number"),
        top_p=field(body, "top_p", "number"),
        top_k=field(body, "top_k", "int"),
        seed=field(body, "seed", "int"),
        stop=field(body, "stop", "strs"),
        stop_token_ids=field(body, "stop_token_ids", "ints"),
        ignore_eos=field(body, "ignore_eos", "bool"),
        logprobs=logprobs,
    )


def _usage(s: Stream) -> dict:
    out = {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.completion_tokens,
           "total_tokens": s.prompt_tokens + s.completion_tokens}
    if s.spec is not None:
        out.update(s.spec)
    return out


def _token_str(fe: Frontend, tid: int) -> str:
    return fe.tokenizer.decode([tid], skip_special_tokens=False) if fe.tokenizer is not None else str(tid)


def completion_logprobs(fe: Frontend, entries: list[dict], offset: int = 0) -> dict:
    """Legacy completions format: tokens, token_logprobs, top_logprobs ({token: logprob}), text_offset."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        tok = _token_str(fe, e["token_id"])
        out["tokens"].append(tok)
        out["token_logprobs"].append(e["logprob"])
        out["top_logprobs"].append({_token_str(fe, t["token_id"]): t["logprob"] for t in e["top_logprobs"]})
        out["text_offset"].append(offset)
        offset += len(tok)
    return out


def chat_logprobs(fe: Frontend, entries: list[dict]) -> dict:
    def one(tid, lp):
        tok = _token_str(fe, tid)
        return {"token": tok, "logprob": lp, "bytes": list(tok.encode())}
    return {"content": [{**one(e["token_id"], e["logprob"]),
                         "top_logprobs": [one(t["token_id"], t["logprob"]) for t in e["top_logprobs"]]}
                        for e in entries]}


class ThinkingSplit:
    """Route a reply's text into reasoning / content: reasoning runs up to the first `</think>` token.

    The boundary is found on the token ids: once `</think>` is generated, the reasoning is exactly the decoded text
    of the tokens before it, and the text that token itself decodes to (if the tokenizer keeps it) is dropped; the
    engine's text deltas are routed by their position relative to that boundary."""

    def __init__(self, fe: Frontend, thinking: bool):
        self.fe, self.thinking = fe, thinking
        self.end_id = fe.tokenizer.token_id(THINK_END) if (thinking and fe.tokenizer is not None) else None
        self.cut = None if thinking else (0, 0)   # (reasoning end, content start) as text positions
        self.ids: list[int] = []
        self.pos = 0

    def push(self, new_ids: list[int], text: str) -> tuple[str, str]:
        """(reasoning delta, content delta) for one Output."""
        if self.cut is None and self.end_id is not None:
            for t in new_ids:
                if t == self.end_id:
                    end = len(self.fe.decode(self.ids))
                    self.cut = (end, len(self.fe.decode(self.ids + [t])))
                    break
                self.ids.append(t)
        start, self.pos = self.pos, self.pos + len(text)
        if self.cut is None:
            return text, ""
        a, b = (min(max(c - start, 0), len(text)) for c in self.cut)
        return text[:a], text[b:]


def _whole_response(base: dict, choice: dict, s: Stream, prompt_ids: list[int], want_ids: bool) -> Response:
    """The non-streaming body of either endpoint: one choice, usage, and the token ids when asked for."""
    if want_ids:
        choice["token_ids"] = s.token_ids
    out = {**base, "choices": [choice], "usage": _usage(s)}
    if want_ids:
        out["prompt_token_ids"] = prompt_ids
    return JSONResponse(out)


def _event_stream(fe: Frontend, s: Stream, chunks: AsyncIterator[dict], base: dict,
                  include_usage: bool) -> EventStream:
    """SSE framing shared by both endpoints. A request that fails mid-stream (the status is already 200) ends with
    an error event, and every stream ends with `[DONE]`, as OpenAI's clients expect."""
    async def events():
        try:
            async for chunk in chunks:
                yield sse(chunk)
            if include_usage:
                yield sse({**base, "choices": [], "usage": _usage(s)})
        except APIError as e:
            fe.metrics.record_error(e.status)
            yield sse({"error": {"message": e.message, "type": e.kind, "code": e.status}})
        yield "data: [DONE]\n\n"
    return EventStream(events(), on_close=s.aclose)


async def _collect_whole(fe: Frontend, request: Request, s: Stream) -> Response | None:
    """Wait for the whole (non-streamed) answer; the error response if the client left or the request failed."""
    try:
        await until_disconnect(request, s.collect())
    except ClientGone:
        await s.aclose()
        return Response(status_code=499)
    except APIError as e:
        await s.aclose()
        fe.metrics.record_error(e.status)
        return openai_error(e)
    return None

async def list_models(fe: Frontend, request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [
        {"id": fe.model_name, "object": "model", "created": fe.created, "owned_by": "dsflash",
         "max_model_len": fe.max_seq_len}]})


def _prepare_completion(fe: Frontend, body: dict):
    _refuse(body)
    fe.check_model(field(body, "model", "str"))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = fe.encode(prompt, add_bos=True)
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = prompt
    elif isinstance(prompt, list) and prompt:
        raise APIError(400, "field 'prompt': only one prompt per request is supported")
    else:
        raise APIError(400, "field 'prompt' must be a string or a list of token ids")
    fe.check_prompt(ids)
    lp = field(body, "logprobs", "int")
    return ids, _sampling_fields(fe, body, 16, lp)


def _output_fields(body: dict) -> tuple[bool, bool, bool]:
    """(stream, stream_options.include_usage, return_token_ids) of a completions or chat request."""
    include_usage = bool(field(field(body, "stream_options", "object", {}), "include_usage", "bool", False))
    return field(body, "stream", "bool", False), include_usage, field(body, "return_token_ids", "bool", False)


async def completions(fe: Frontend, request: Request) -> Response:
    try:
        body = await read_json(request, fe.limits.max_body_bytes)
        ids, params = _prepare_completion(fe, body)
        stream_mode, include_usage, want_ids = _output_fields(body)
        s = await fe.start(ids, params, "cmpl")
    except APIError as e:
        fe.metrics.record_error(e.status)
        return openai_error(e)
    created, model = int(time.time()), fe.model_name
    base = {"id": s.request_id, "object": "text_completion", "created": created, "model": model}
    if not stream_mode:
        failed = await _collect_whole(fe, request, s)
        if failed is not None:
            return failed
        choice = {"index": 0, "text": s.text, "logprobs": completion_logprobs(fe, s.logprobs) if params.logprobs
                  is not None else None, "finish_reason": s.finish_reason}
        return _whole_response(base, choice, s, ids, want_ids)

    async def chunks():
        offset = 0
        async for o in s:
            choice = {"index": 0, "text": o.text, "logprobs": None, "finish_reason": o.finish_reason}
            if params.logprobs is not None and o.logprobs:
                choice["logprobs"] = completion_logprobs(fe, o.logprobs, offset)
            if want_ids:
                choice["token_ids"] = o.new_token_ids
            offset += len(o.text)
            chunk = {**base, "choices": [choice]}
            if include_usage:
                chunk["usage"] = None
            yield chunk
    return _event_stream(fe, s, chunks(), base, include_usage)


def _thinking_options(body: dict) -> tuple[bool, object]:
    kwargs = field(body, "chat_template_kwargs", "object", {})
    thinking = field(kwargs, "thinking", "bool", None, "chat_template_kwargs.")
    if thinking is None:
        thinking = field(kwargs, "enable_thinking", "bool", None, "chat_template_kwargs.")
    t = body.get("thinking")
    if thinking is None and t is not None:
        kind = t.get("type") if isinstance(t, dict) else None
        if kind not in ("enabled", "disabled"):
            raise APIError(400, "field 'thinking' must be {'type': 'enabled'} or {'type': 'disabled'}")
        thinking = kind == "enabled"
    effort = body.get("reasoning_effort", kwargs.get("reasoning_effort"))
    return bool(thinking), effort


async def chat_completions(fe: Frontend, request: Request) -> Response:
    from dsflash.serve.encoding import encode_messages
    try:
        body = await read_json(request, fe.limits.max_body_bytes)
        _refuse(body)
        fe.check_model(field(body, "model", "str"))
        thinking, effort = _thinking_options(body)
        try:
            prompt = encode_messages(body.get("messages"), family=fe.family, thinking=thinking,
                                     reasoning_effort=effort)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        ids = fe.check_prompt(fe.encode(prompt, add_bos=False))
        lp = field(body, "top_logprobs", "int", 0) if field(body, "logprobs", "bool", False) else None
        params = _sampling_fields(fe, body, fe.default_max_tokens(len(ids)), lp)
        stream_mode, include_usage, want_ids = _output_fields(body)
        s = await fe.start(ids, params, "chatcmpl")
    except APIError as e:
        fe.metrics.record_error(e.status)
        return openai_error(e)
    base = {"id": s.request_id, "object": "chat.completion", "created": int(time.time()), "model": fe.model_name}
    split = ThinkingSplit(fe, thinking)
    if not stream_mode:
        failed = await _collect_whole(fe, request, s)
        if failed is not None:
            return failed
        reasoning, content = split.push(s.token_ids, s.text)
        msg = {"role": "assistant", "content": content, "reasoning_content": reasoning if thinking else None}
        choice = {"index": 0, "message": msg, "logprobs": chat_logprobs(fe, s.logprobs) if lp is not None else None,
                  "finish_reason": s.finish_reason}
        return _whole_response(base, choice, s, ids, want_ids)

    chunk_base = {**base, "object": "chat.completion.chunk"}

    async def chunks():
        yield {**chunk_base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                          "finish_reason": None}]}
        async for o in s:
            reasoning, content = split.push(o.new_token_ids, o.text)
            delta = {}
            if reasoning:
                delta["reasoning_content"] = reasoning
            if content or not reasoning:
                delta["content"] = content
            choice = {"index": 0, "delta": delta, "logprobs": chat_logprobs(fe, o.logprobs)
                      if lp is not None and o.logprobs else None, "finish_reason": o.finish_reason}
            if want_ids:
                choice["token_ids"] = o.new_token_ids
            yield {**chunk_base, "choices": [choice]}
    return _event_stream(fe, s, chunks(), chunk_base, include_usage)
