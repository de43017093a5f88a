"""`dsflash serve` end to end on tiny V4.1 and V4 engines, over 127.0.0.1 only.

Greedy outputs through every front door (OpenAI completions and chat, JSON and SSE; KServe generate and
generate_stream; tritonclient HTTP and gRPC infer, gRPC streaming) equal the reference model's `generate_greedy`
and the engine's (what `dsflash generate --engine` runs) token for token. Then a bounded loopback load test, and
each robustness case: API key, limits, malformed requests, overload (429 + Retry-After), client disconnect
(pages freed), SIGTERM drain, a dead rank under mpirun.
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import queue
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

_spec = importlib.util.spec_from_file_location("_serving", Path(__file__).with_name("_serving.py"))
sv = sys.modules.setdefault("_serving", importlib.util.module_from_spec(_spec))
if not hasattr(sv, "Served"):
    _spec.loader.exec_module(sv)

pytestmark = pytest.mark.slow
KEY = "s3cret-key"


@dataclass
class Case:
    family: str
    hf: Path
    engine: Path
    server: "sv.Served"
    tok: object
    prompts: dict          # name -> prompt ids
    ref: dict              # name -> greedy new ids (N_NEW)


@pytest.fixture(scope="module", params=["v41", "v4"])
def case(request, tmp_path_factory):
    from dsflash.serve.tokenization import DeepseekTokenizer
    hf, engine = sv.tiny_engine(sv.engines_dir(tmp_path_factory), request.param)
    tok = DeepseekTokenizer(engine)
    prompts, ref = sv.references(request.param, hf, engine, tok)
    with sv.Served(engine, "--served-model-name", f"tiny-{request.param}") as server:
        yield Case(request.param, hf, engine, server, tok, prompts, ref)


# -- greedy parity through every door -----------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["v4"], indirect=True)  # one CLI run ties `dsflash generate` in (~10 s a run)
def test_cli_generate_matches(case):
    r = subprocess.run([sys.executable, "-m", "dsflash.serve.cli", "generate", "--engine", str(case.engine),
                        "--input-ids", ",".join(map(str, case.prompts["ids"])), "--max-new-tokens", str(sv.N_NEW),
                        "--json"], capture_output=True, text=True, env={**os.environ, "PYTHONSAFEPATH": "1"})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["output_ids"] == case.ref["ids"]


def test_openai_completions(case):
    url, dec = case.server.url, case.tok.decode
    with httpx.Client(timeout=60) as c:
        models = c.get(f"{url}/v1/models").json()
        assert models["data"][0]["id"] == f"tiny-{case.family}"
        for name, prompt in (("ids", case.prompts["ids"]), ("text", sv.PROMPT_TEXT)):
            r = c.post(f"{url}/v1/completions", json={"model": f"tiny-{case.family}", "prompt": prompt,
                                                      "max_tokens": sv.N_NEW, "return_token_ids": True})
            assert r.status_code == 200, r.text
            body = r.json()
            ch = body["choices"][0]
            assert ch["token_ids"] == case.ref[name] and ch["text"] == dec(case.ref[name])
            assert body["prompt_token_ids"] == case.prompts[name] and ch["finish_reason"] == "length"
            assert body["usage"] == {"prompt_tokens": len(case.prompts[name]), "completion_tokens": sv.N_NEW,
                                     "total_tokens": len(case.prompts[name]) + sv.N_NEW}
        lp = c.post(f"{url}/v1/completions", json={"prompt": case.prompts["ids"], "max_tokens": sv.N_NEW,
                                                   "logprobs": 3}).json()["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == sv.N_NEW and all(len(t) == 3 for t in lp["top_logprobs"])
        for chosen, top in zip(lp["token_logprobs"], lp["top_logprobs"]):   # greedy: the chosen token is the best
            assert chosen == pytest.approx(max(top.values())) and chosen < 0
        with c.stream("POST", f"{url}/v1/completions", json={
                "prompt": case.prompts["ids"], "max_tokens": sv.N_NEW, "stream": True, "return_token_ids": True,
                "stream_options": {"include_usage": True}}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            events = sv.sse_events(r)
        chunks = [e for e in events if e["choices"]]
        assert sum((e["choices"][0]["token_ids"] for e in chunks), []) == case.ref["ids"]
        assert "".join(e["choices"][0]["text"] for e in chunks) == dec(case.ref["ids"])
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert events[-1]["usage"]["completion_tokens"] == sv.N_NEW


def test_openai_chat(case):
    url, dec = case.server.url, case.tok.decode
    with httpx.Client(timeout=60) as c:
        r = c.post(f"{url}/v1/chat/completions", json={"messages": sv.CHAT, "max_tokens": sv.N_NEW,
                                                       "return_token_ids": True})
        assert r.status_code == 200, r.text
        body = r.json()
        msg = body["choices"][0]["message"]
        assert body["prompt_token_ids"] == case.prompts["chat"]
        assert body["choices"][0]["token_ids"] == case.ref["chat"]
        assert msg == {"role": "assistant", "content": dec(case.ref["chat"]), "reasoning_content": None}
        with c.stream("POST", f"{url}/v1/chat/completions", json={
                "messages": sv.CHAT, "max_tokens": sv.N_NEW, "stream": True, "return_token_ids": True}) as r:
            events = sv.sse_events(r)
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        assert sum((e["choices"][0].get("token_ids", []) for e in events), []) == case.ref["chat"]
        assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == dec(case.ref["chat"])
        # thinking on: the prompt ends with <think>; everything before a `</think>` is reasoning
        r = c.post(f"{url}/v1/chat/completions", json={"messages": sv.CHAT, "max_tokens": sv.N_NEW,
                                                       "return_token_ids": True,
                                                       "chat_template_kwargs": {"thinking": True}})
        body = r.json()
        assert body["prompt_token_ids"] == case.prompts["think"]
        assert body["choices"][0]["token_ids"] == case.ref["think"]
        end = case.tok.token_id("</think>")
        ids = case.ref["think"]
        k = ids.index(end) if end in ids else len(ids)
        msg = body["choices"][0]["message"]
        assert msg["reasoning_content"] == dec(ids[:k]) and msg["content"] == dec(ids[k + 1:])


def test_kserve_generate(case):
    url, dec = case.server.url, case.tok.decode
    want = dec(case.ref["text"])
    with httpx.Client(timeout=60) as c:
        for model in (f"tiny-{case.family}", "ensemble"):
            r = c.post(f"{url}/v2/models/{model}/generate", json={"text_input": sv.PROMPT_TEXT,
                                                                  "max_tokens": sv.N_NEW})
            assert r.status_code == 200, r.text
            assert r.json()["text_output"] == sv.PROMPT_TEXT + want and r.json()["model_name"] == model
        r = c.post(f"{url}/v2/models/ensemble/generate",
                   json={"text_input": sv.PROMPT_TEXT, "parameters": {"max_tokens": sv.N_NEW,
                                                                      "exclude_input_in_output": True}})
        assert r.json()["text_output"] == want
        with c.stream("POST", f"{url}/v2/models/ensemble/generate_stream",
                      json={"text_input": sv.PROMPT_TEXT, "max_tokens": sv.N_NEW, "stream": True}) as r:
            events = sv.sse_events(r)
        assert len(events) == sv.N_NEW and "".join(e["text_output"] for e in events) == want
        r = c.post(f"{url}/v2/models/tensorrt_llm/generate", json={"input_ids": case.prompts["ids"],
                                                                   "request_output_len": sv.N_NEW})
        assert r.json()["output_ids"] == case.prompts["ids"] + case.ref["ids"]


def _token_inputs(mod, ids, n, streaming=None):
    from tritonclient.utils import np_to_triton_dtype
    arrays = [("input_ids", np.array([ids], np.int32)), ("input_lengths", np.array([[len(ids)]], np.int32)),
              ("request_output_len", np.array([[n]], np.int32))]
    if streaming is not None:
        arrays.append(("streaming", np.array([[streaming]], bool)))
    out = []
    for name, arr in arrays:
        t = mod.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


def _text_inputs(mod, text, n):
    t = mod.InferInput("text_input", [1, 1], "BYTES")
    t.set_data_from_numpy(np.array([[text]], dtype=object))
    m = mod.InferInput("max_tokens", [1, 1], "INT32")
    m.set_data_from_numpy(np.array([[n]], np.int32))
    return [t, m]


def test_tritonclient_http(case):
    import tritonclient.http as th
    c = th.InferenceServerClient(f"{case.server.host}:{case.server.port}")
    assert c.is_server_live() and c.is_server_ready() and c.is_model_ready("tensorrt_llm")
    names = {t["name"] for t in c.get_model_metadata("tensorrt_llm")["inputs"]}
    assert {"input_ids", "input_lengths", "request_output_len", "end_id", "pad_id", "streaming"} <= names
    ids = case.prompts["ids"]
    r = c.infer("tensorrt_llm", _token_inputs(th, ids, sv.N_NEW))        # binary tensors both ways
    assert r.as_numpy("output_ids").tolist() == [[ids + case.ref["ids"]]]
    assert r.as_numpy("sequence_length").tolist() == [[len(ids) + sv.N_NEW]]
    r = c.infer("tensorrt_llm", _token_inputs(th, ids, sv.N_NEW),
                outputs=[th.InferRequestedOutput("output_ids", binary_data=False)])
    assert r.as_numpy("output_ids").tolist() == [[ids + case.ref["ids"]]]
    r = c.infer("ensemble", _text_inputs(th, sv.PROMPT_TEXT, sv.N_NEW))
    assert r.as_numpy("text_output")[0, 0].decode() == sv.PROMPT_TEXT + case.tok.decode(case.ref["text"])
    # a batch of two ragged prompts: rows run as independent requests, outputs padded with pad_id
    a, b = case.prompts["ids"], case.prompts["chat"]
    width = max(len(a), len(b))
    batch = np.full((2, width), 7, np.int32)
    batch[0, :len(a)], batch[1, :len(b)] = a, b
    from tritonclient.utils import np_to_triton_dtype
    arrays = [("input_ids", batch), ("input_lengths", np.array([[len(a)], [len(b)]], np.int32)),
              ("request_output_len", np.array([[sv.N_NEW], [sv.N_NEW]], np.int32)),
              ("pad_id", np.array([[2], [2]], np.int32))]
    inputs = []
    for name, arr in arrays:
        t = th.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
        t.set_data_from_numpy(arr)
        inputs.append(t)
    r = c.infer("tensorrt_llm", inputs)
    rows = [a + case.ref["ids"], b + case.ref["chat"]]
    n = max(map(len, rows))
    assert r.as_numpy("output_ids").tolist() == [[row + [2] * (n - len(row))] for row in rows]
    assert r.as_numpy("sequence_length").tolist() == [[len(rows[0])], [len(rows[1])]]
    c.close()


def test_tritonclient_grpc(case):
    import tritonclient.grpc as tg
    c = tg.InferenceServerClient(case.server.grpc)
    assert c.is_server_live() and c.is_server_ready() and c.is_model_ready("tensorrt_llm")
    assert c.get_model_metadata("tensorrt_llm").inputs[0].name == "input_ids"
    ids = case.prompts["ids"]
    r = c.infer("tensorrt_llm", _token_inputs(tg, ids, sv.N_NEW))
    assert r.as_numpy("output_ids").tolist() == [[ids + case.ref["ids"]]]
    r = c.infer("ensemble", _text_inputs(tg, sv.PROMPT_TEXT, sv.N_NEW))
    assert r.as_numpy("text_output")[0, 0].decode() == sv.PROMPT_TEXT + case.tok.decode(case.ref["text"])
    # decoupled streaming: two requests in flight on one stream, one response per token, then the final flag
    results: queue.Queue = queue.Queue()
    c.start_stream(callback=lambda result, error: results.put((result, error)))
    c.async_stream_infer("tensorrt_llm", _token_inputs(tg, ids, sv.N_NEW, True), request_id="a")
    c.async_stream_infer("tensorrt_llm", _token_inputs(tg, case.prompts["chat"], sv.N_NEW, True), request_id="b",
                         enable_empty_final_response=True)
    got, finals = {"a": [], "b": []}, set()
    while finals != {"a", "b"}:
        result, error = results.get(timeout=60)
        assert error is None, error
        resp = result.get_response()
        if resp.outputs:
            got[resp.id] += result.as_numpy("output_ids").reshape(-1).tolist()
        if resp.parameters["triton_final_response"].bool_param:
            finals.add(resp.id)
    c.stop_stream()
    assert got == {"a": case.ref["ids"], "b": case.ref["chat"]}
    c.close()


# -- load ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["v4"], indirect=True)
def test_loopback_load(case):
    """200 requests, 64 at a time, half streamed, over 127.0.0.1 only: no errors, KV cache back to empty.
    (Short prompts and 1-2 new tokens: the CPU runtime steps each request's tiny model separately.)"""
    url, n_req, conc = case.server.url, 200, 64
    prompts = [case.prompts["ids"][: 2 + i % 3] for i in range(n_req)]
    errors, done = [], []

    async def one(client, i, sem):
        async with sem:
            body = {"prompt": prompts[i], "max_tokens": 1 + (i % 4 == 0), "return_token_ids": True}
            try:
                if i % 2:
                    async with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
                        n = 0
                        async for line in r.aiter_lines():
                            if line.startswith("data: {"):
                                n += len(json.loads(line[6:])["choices"][0]["token_ids"])
                        ok = r.status_code == 200 and n == body["max_tokens"]
                else:
                    r = await client.post(f"{url}/v1/completions", json=body)
                    ok = r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == body["max_tokens"]
                (done if ok else errors).append(i)
            except httpx.HTTPError as e:
                errors.append((i, repr(e)))

    async def run():
        sem = asyncio.Semaphore(conc)
        limits = httpx.Limits(max_connections=conc, max_keepalive_connections=conc)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            await asyncio.wait_for(asyncio.gather(*(one(client, i, sem) for i in range(n_req))), timeout=180)

    t0 = time.monotonic()
    asyncio.run(run())
    elapsed = time.monotonic() - t0
    assert not errors and len(done) == n_req, errors[:5]
    with httpx.Client(timeout=30) as c:
        m = sv.wait_idle(c, url)
    assert m["trtllm_kv_cache_utilization"] == 0 and m["trtllm_kv_cache_used_blocks"] == 0
    assert m['trtllm_request_success_total{finished_reason="length"}'] >= n_req
    print(f"load: {n_req} requests, concurrency {conc}, {elapsed:.1f} s")


# -- robustness ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """A V4 server with an API key, tight limits and room for one running + one waiting request."""
    _, engine = sv.tiny_engine(sv.engines_dir(tmp_path_factory), "v4")
    with sv.Served(engine, "--api-key", KEY, "--max-prompt-len", "64", "--max-tokens-limit", "400",
                   "--max-body-bytes", "4096", "--max-batch-size", "1", "--max-queue", "1",
                   "--drain-timeout", "60") as s:
        yield s


@pytest.mark.parametrize("flags,needle", [
    (["--port", "99999"], "argument --port: must be in [0, 65535], got 99999"),
    (["--grpc-port", "70000"], "argument --grpc-port: must be in [-1, 65535], got 70000"),
    (["--drain-timeout", "-1"], "argument --drain-timeout: must be >= 0, got -1"),
    (["--max-tokens-limit", "0"], "max_tokens_limit must be >= 1, got 0"),   # 0 is a value, not "unset"
    (["--max-body-bytes", "0"], "max_body_bytes must be >= 1, got 0"),
])
def test_bad_server_flags_are_refused(tmp_path_factory, flags, needle):
    _, engine = sv.tiny_engine(sv.engines_dir(tmp_path_factory), "v4")
    r = subprocess.run([sys.executable, "-m", "dsflash.serve.cli", "serve", "--engine", str(engine), "--port", "0",
                        "--grpc-port", "-1", *flags], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and needle in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


AUTH = {"Authorization": f"Bearer {KEY}"}
GRPC_AUTH = {"authorization": f"Bearer {KEY}"}  # gRPC metadata keys are lower case


def test_api_key(guarded):
    import tritonclient.grpc as tg
    from tritonclient.utils import InferenceServerException
    url = guarded.url
    with httpx.Client(timeout=30) as c:
        r = c.get(f"{url}/v1/models")
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert "API key" in r.json()["error"]["message"]
        assert c.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.post(f"{url}/v2/models/ensemble/generate", json={}).status_code == 401
        assert c.get(f"{url}/metrics").status_code == 401
        assert c.get(f"{url}/v1/models", headers=AUTH).status_code == 200
        assert c.get(f"{url}/v2/health/live").status_code == 200     # probes stay open
        assert c.get(f"{url}/v2/health/ready").status_code == 200
    g = tg.InferenceServerClient(guarded.grpc)
    with pytest.raises(InferenceServerException, match="UNAUTHENTICATED"):
        g.get_model_metadata("tensorrt_llm")
    assert g.get_model_metadata("tensorrt_llm", headers=GRPC_AUTH).name == "tensorrt_llm"
    r = g.infer("tensorrt_llm", _token_inputs(tg, [0, 1, 2], 2), headers=GRPC_AUTH)
    assert r.as_numpy("sequence_length").tolist() == [[5]]
    g.close()


@pytest.mark.parametrize("path,body,status,needle", [
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 2', 400, "malformed JSON"),
    ("/v1/completions", b'[1, 2]', 400, "must be a JSON object"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": "2"}', 400, "'max_tokens' must be an integer"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 401}', 400, "--max-tokens-limit"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 0}', 400, "max_tokens"),
    ("/v1/completions", json.dumps({"prompt": list(range(65))}).encode(), 400, "--max-prompt-len"),
    ("/v1/completions", json.dumps({"prompt": [0, 10 ** 9]}).encode(), 400, "token ids must be integers"),
    ("/v1/completions", json.dumps({"prompt": "x" * 5000}).encode(), 413, "--max-body-bytes"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": -1}', 400, "temperature"),
    ("/v1/completions", b'{"prompt": "hi", "n": 3}', 400, "'n'=3 is not supported"),
    ("/v1/completions", b'{"prompt": "hi", "model": "gpt-4"}', 404, "not found"),
    ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "x"}]}', 400, "role must be one of"),
    ("/v1/chat/completions", b'{"messages": []}', 400, "non-empty list"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "thinking": "yes"}', 400,
     "'thinking'"),
    ("/v2/models/ensemble/generate", b'{"text_input": "hi"}', 400, "request_output_len"),
    ("/v2/models/ensemble/generate", b'{"text_input": "hi", "max_tokens": 2, "colour": 1}', 400, "unknown field"),
    ("/v2/models/ensemble/generate", b'{"text_input": 3, "max_tokens": 2}', 400, "'text_input'"),
    ("/v2/models/nope/generate", b'{"text_input": "hi", "max_tokens": 2}', 404, "not found"),
    ("/v2/models/tensorrt_llm/infer", b'{"inputs": []}', 400, "'inputs'"),
    ("/v2/models/tensorrt_llm/infer", json.dumps({"inputs": [{"name": "input_ids", "shape": [1, 3],
     "datatype": "INT32", "data": [1, 2]}]}).encode(), 400, "shape [1, 3]"),
    ("/v2/models/tensorrt_llm/infer", json.dumps({"inputs": [{"name": "input_ids", "shape": [1, 2],
     "datatype": "INT32", "data": [1, 2]}, {"name": "request_output_len", "shape": [1, 1], "datatype": "INT32",
     "data": [2]}, {"name": "streaming", "shape": [1, 1], "datatype": "BOOL", "data": [True]}]}).encode(),
     400, "streaming"),
])
def test_rejected_requests(guarded, path, body, status, needle):
    with httpx.Client(timeout=30) as c:
        r = c.post(guarded.url + path, content=body, headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    payload = r.json()
    msg = payload["error"]["message"] if path.startswith("/v1") else payload["error"]
    assert needle in msg, msg


def test_rejected_grpc(guarded):
    import tritonclient.grpc as tg
    from tritonclient.utils import InferenceServerException
    g = tg.InferenceServerClient(guarded.grpc)
    with pytest.raises(InferenceServerException, match="INVALID_ARGUMENT.*max-prompt-len"):
        g.infer("tensorrt_llm", _token_inputs(tg, list(range(65)), 2), headers=GRPC_AUTH)
    with pytest.raises(InferenceServerException, match="NOT_FOUND"):
        g.infer("nope", _token_inputs(tg, [0, 1], 2), headers=GRPC_AUTH)
    g.close()


def _stream(client, url, max_tokens):
    """A long streamed completion (ignore_eos: it must not end early on a random model's EOS)."""
    return client.stream("POST", f"{url}/v1/completions", headers=AUTH, json={
        "prompt": [0, 671, 6102], "max_tokens": max_tokens, "stream": True, "ignore_eos": True})


def test_overload_gets_429_with_retry_after(guarded):
    import tritonclient.grpc as tg
    from tritonclient.utils import InferenceServerException
    url = guarded.url
    with httpx.Client(timeout=60) as c1, httpx.Client(timeout=60) as c2, httpx.Client(timeout=60) as c3:
        with _stream(c1, url, 300) as running:
            lines = running.iter_lines()                # keep it: dropping a half-read iterator closes the connection
            next(lines)                                 # first token out: this one holds the only batch slot
            with _stream(c2, url, 300) as waiting:       # admitted (headers sent) into the one-place queue
                assert waiting.status_code == 200
                r = c3.post(f"{url}/v1/completions", headers=AUTH, json={"prompt": "hi", "max_tokens": 2})
                assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
                assert "overloaded" in r.json()["error"]["message"]
                r = c3.post(f"{url}/v2/models/ensemble/generate", headers=AUTH,
                            json={"text_input": "hi", "max_tokens": 2})
                assert r.status_code == 429 and "retry-after" in r.headers
                g = tg.InferenceServerClient(guarded.grpc)
                with pytest.raises(InferenceServerException, match="RESOURCE_EXHAUSTED"):
                    g.infer("tensorrt_llm", _token_inputs(tg, [0, 1], 2), headers=GRPC_AUTH)
                g.close()
        m = sv.wait_idle(c3, url, **AUTH)
    assert m["trtllm_kv_cache_used_blocks"] == 0 and m['trtllm_request_errors_total{code="429"}'] >= 3


def test_disconnect_aborts_and_frees_pages(guarded):
    url = guarded.url
    with httpx.Client(timeout=60) as c:
        before = sv.metrics(c, url, **AUTH).get('trtllm_request_success_total{finished_reason="abort"}', 0)
        with _stream(c, url, 400) as r:                  # streamed: drop the connection after two chunks
            lines = r.iter_lines()
            next(lines), next(lines)
            busy = sv.metrics(c, url, **AUTH)
            assert busy["trtllm_kv_cache_used_blocks"] > 0 and busy["trtllm_num_requests_running"] == 1
        m = sv.wait_idle(c, url, timeout=10, **AUTH)
        assert m["trtllm_kv_cache_used_blocks"] == 0 and m["trtllm_num_requests_running"] == 0
        with pytest.raises(httpx.ReadTimeout):           # not streamed: the client gives up mid-generation
            c.post(f"{url}/v1/completions", headers=AUTH, timeout=1.0,
                   json={"prompt": [0, 671, 6102], "max_tokens": 400, "ignore_eos": True})
        m = sv.wait_idle(c, url, timeout=10, **AUTH)
        assert m["trtllm_kv_cache_used_blocks"] == 0 and m["trtllm_num_requests_running"] == 0
        aborts = 'trtllm_request_success_total{finished_reason="abort"}'
        m = sv.wait_metric(c, url, aborts, before + 2, **AUTH)
        assert m[aborts] >= before + 2


def test_grpc_cancel_aborts_and_frees_pages(guarded):
    import tritonclient.grpc as tg
    results: queue.Queue = queue.Queue()
    g = tg.InferenceServerClient(guarded.grpc)
    g.start_stream(callback=lambda result, error: results.put((result, error)), headers=GRPC_AUTH)
    inputs = _token_inputs(tg, [0, 671, 6102], 400, True)
    inputs.append(tg.InferInput("end_id", [1, 1], "INT32"))
    inputs[-1].set_data_from_numpy(np.array([[-1]], np.int32))       # nothing stops it early
    g.async_stream_infer("tensorrt_llm", inputs, request_id="long")
    result, error = results.get(timeout=60)
    assert error is None and result.as_numpy("output_ids").size == 1
    with httpx.Client(timeout=30) as c:
        assert sv.metrics(c, guarded.url, **AUTH)["trtllm_num_requests_running"] == 1
        g.stop_stream(cancel_requests=True)                           # the client cancels the call
        m = sv.wait_idle(c, guarded.url, timeout=10, **AUTH)
    assert m["trtllm_kv_cache_used_blocks"] == 0 and m["trtllm_num_requests_running"] == 0
    g.close()


def test_sigterm_drains_in_flight_requests(guarded):
    """Last of the guarded tests: SIGTERM lets the running stream finish, refuses new work, exits 0."""
    url = guarded.url
    with httpx.Client(timeout=120) as c:
        with _stream(c, url, 40) as r:
            lines = r.iter_lines()
            first = next(lines)
            guarded.proc.send_signal(signal.SIGTERM)
            rest = [ln for ln in lines if ln.startswith("data: {")]
        texts = [json.loads(first[6:])] + [json.loads(ln[6:]) for ln in rest]
        assert texts[-1]["choices"][0]["finish_reason"] == "length"     # ran to the end, not aborted
        assert len(texts) == 40
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/v2/health/live", timeout=5)                  # the listener is closed
    assert guarded.proc.wait(60) == 0
    assert "SIGTERM: draining" in guarded.log


# -- multi-rank: relaunch under mpirun, then a dead rank --------------------------------------------------------------
def _rank_pids(root_pid: int) -> dict[int, int]:
    """MPI rank -> pid among the descendants of root_pid."""
    out, todo = {}, [root_pid]
    while todo:
        pid = todo.pop()
        try:
            kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            continue
        for k in map(int, kids):
            todo.append(k)
            try:
                env = Path(f"/proc/{k}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            for item in env:
                if item.startswith(b"OMPI_COMM_WORLD_RANK="):
                    out[int(item.split(b"=")[1])] = k
    return out


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    """A TP2 V4.1 engine and the TP1 engine's greedy tokens for PROMPT_IDS."""
    base = sv.engines_dir(tmp_path_factory)
    _, tp1 = sv.tiny_engine(base, "v41")
    _, tp2 = sv.tiny_engine(base, "v41", tp=2)    # (tiny V4's 128-wide FP8 blocks do not split in two)
    from dsflash.build.engine import load_engine_model
    model, _ = load_engine_model(tp1)
    with torch.no_grad():
        want = model.generate_greedy(torch.tensor([sv.PROMPT_IDS]), sv.N_NEW)[0, len(sv.PROMPT_IDS):].tolist()
    return tp2, want


def _long_stream(client, url):
    return client.stream("POST", f"{url}/v1/completions", json={"prompt": sv.PROMPT_IDS, "max_tokens": 24,
                                                                "stream": True, "ignore_eos": True})


@pytest.mark.mpi
def test_tp2_relaunches_under_mpirun_and_drains(tp2):
    """`dsflash serve` on a 2-rank engine runs itself under mpirun; same tokens as TP1; SIGTERM to it reaches rank 0,
    which finishes the request in flight, stops the worker, and the whole job exits 0."""
    engine, want = tp2
    s = sv.Served(engine)
    try:
        with httpx.Client(timeout=60) as c:
            r = c.post(f"{s.url}/v1/completions", json={"prompt": sv.PROMPT_IDS, "max_tokens": sv.N_NEW,
                                                        "return_token_ids": True})
            assert r.json()["choices"][0]["token_ids"] == want
            ranks = _rank_pids(s.proc.pid)
            assert set(ranks) == {0, 1}, ranks
            with _long_stream(c, s.url) as r:
                lines = r.iter_lines()
                next(lines)
                s.proc.send_signal(signal.SIGTERM)
                events = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
        assert len(events) == 23 and events[-1]["choices"][0]["finish_reason"] == "length"
        assert s.proc.wait(60) == 0
        for pid in ranks.values():
            assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
    finally:
        s.kill()


@pytest.mark.mpi
def test_tp2_dead_rank_stops_server(tp2):
    engine, _ = tp2
    s = sv.Served(engine)
    try:
        ranks = _rank_pids(s.proc.pid)
        assert set(ranks) == {0, 1}, ranks
        with httpx.Client(timeout=60) as c, _long_stream(c, s.url) as r:
            lines = r.iter_lines()
            next(lines)
            os.kill(ranks[1], signal.SIGKILL)                                # a rank dies mid-request
            try:
                events = [ln for ln in lines if ln.startswith("data: {")]
            except httpx.HTTPError:                                          # connection cut: expected
                events = []
            assert len(events) < 23                                          # never a complete answer
        rc = s.proc.wait(90)
        assert rc != 0
        # whichever notices first reports it: mpirun ("rank 1 ... Killed") or rank 0, whose all-reduce with the dead
        # rank fails ("[dsflash rank 0] model step failed ... aborting the MPI job")
        assert "the MPI job exited with status" in s.log, s.log[-2000:]
        assert "rank 1" in s.log or "[dsflash rank 0] model step failed" in s.log, s.log[-2000:]
    finally:
        s.kill()
