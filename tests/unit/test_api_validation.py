"""Front-door building blocks without a server: wire compatibility of the KServe gRPC messages with tritonclient,
tensor codecs and Triton's binary HTTP layout, tensorrtllm-backend tensor semantics, request validation, API key,
metrics exposition, the thinking split."""
from __future__ import annotations

import json
import struct
from types import SimpleNamespace

import numpy as np
import pytest

from dsflash.serve.api import kserve_proto as pb
from dsflash.serve.api import tensors
from dsflash.serve.api.core import field
from dsflash.serve.api.security import APIError, Limits, bearer_ok, check_json_object


# -- gRPC messages == tritonclient's ------------------------------------------------------------------------------
def _shape(desc):
    fields = {f.name: (f.number, f.type, f.is_repeated, f.message_type.full_name if f.message_type else None,
                       f.containing_oneof.name if f.containing_oneof else None) for f in desc.fields}
    nested = {n.name: _shape(n) for n in desc.nested_types}
    return fields, nested


@pytest.mark.parametrize("name", sorted({*(m for m in pb.MESSAGES if "." not in m)}))
def test_messages_match_tritonclient(name):
    from tritonclient.grpc import service_pb2
    ours = pb.POOL.FindMessageTypeByName(f"inference.{name}")
    theirs = service_pb2.DESCRIPTOR.message_types_by_name[name]
    assert _shape(ours) == _shape(theirs)


def test_service_methods_match_tritonclient():
    from tritonclient.grpc import service_pb2
    theirs = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    ours = pb.FILE_DESCRIPTOR.services_by_name["GRPCInferenceService"]
    for m in ours.methods:
        t = theirs.methods_by_name[m.name]
        assert (m.input_type.name, m.output_type.name, m.client_streaming, m.server_streaming) == \
            (t.input_type.name, t.output_type.name, t.client_streaming, t.server_streaming)


def test_infer_request_round_trips_through_tritonclient_bytes():
    from tritonclient.grpc import service_pb2
    theirs = service_pb2.ModelInferRequest(model_name="m", id="7")
    theirs.parameters["triton_enable_empty_final_response"].bool_param = True
    t = theirs.inputs.add(name="input_ids", datatype="INT32", shape=[1, 3])
    theirs.raw_input_contents.append(np.array([5, 6, 7], np.int32).tobytes())
    ours = pb.ModelInferRequest.FromString(theirs.SerializeToString())
    assert ours.inputs[0].name == t.name and list(ours.inputs[0].shape) == [1, 3]
    assert ours.parameters["triton_enable_empty_final_response"].bool_param
    from dsflash.serve.api.kserve_grpc import infer_response, request_inputs
    assert request_inputs(ours)["input_ids"].tolist() == [[5, 6, 7]]
    resp = infer_response("m", "7", {"output_ids": (np.array([[[1, 2]]], np.int32), "INT32")}, final=True)
    back = service_pb2.ModelInferResponse.FromString(resp.SerializeToString())
    assert back.parameters["triton_final_response"].bool_param and back.outputs[0].name == "output_ids"
    assert np.frombuffer(back.raw_output_contents[0], np.int32).tolist() == [1, 2]


# -- tensors ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dt,arr", [("INT32", np.array([[1, -2, 3]], np.int32)), ("BOOL", np.array([[True, False]])),
                                    ("FP32", np.array([[0.5, -1.25]], np.float32)),
                                    ("UINT64", np.array([[2 ** 63 + 1]], np.uint64)),
                                    ("BYTES", np.array([[b"ab", "é".encode(), b""]], dtype=object))])
def test_raw_round_trip(dt, arr):
    back = tensors.from_raw(tensors.to_raw(arr, dt), dt, list(arr.shape))
    assert back.shape == arr.shape and back.tolist() == arr.tolist()


def test_raw_errors():
    with pytest.raises(APIError, match="needs 12"):
        tensors.from_raw(b"\0" * 8, "INT32", [1, 3])
    with pytest.raises(APIError, match="runs past the end"):
        tensors.from_raw(struct.pack("<I", 10) + b"abc", "BYTES", [1])
    with pytest.raises(APIError, match="unsupported datatype"):
        tensors.from_raw(b"", "INT4", [0])
    with pytest.raises(APIError, match="does not match"):
        tensors.from_json([1, 2], "INT32", [1, 3])


def test_binary_http_layout_both_ways():
    """Triton's binary tensor extension: JSON header + raw tensors, as tritonclient.http writes and reads it."""
    import tritonclient.http as th
    from dsflash.serve.api.kserve_http import infer_response, parse_infer_body
    ids = np.array([[3, 4, 5]], np.int32)
    head = {"inputs": [{"name": "input_ids", "shape": [1, 3], "datatype": "INT32",
                        "parameters": {"binary_data_size": 12}},
                       {"name": "request_output_len", "shape": [1, 1], "datatype": "INT32", "data": [[2]]}],
            "parameters": {"binary_data_output": True}}
    raw = json.dumps(head).encode()
    _, inputs = parse_infer_body(raw + ids.tobytes(), str(len(raw)), 1 << 20)
    assert inputs["input_ids"].tolist() == [[3, 4, 5]] and inputs["request_output_len"].tolist() == [[2]]
    outs = {"output_ids": (np.array([[[3, 4, 5, 9]]], np.int32), "INT32"),
            "text_output": (np.array([[b"hi"]], dtype=object), "BYTES")}
    resp = infer_response("m", "id1", outs, head)
    n = int(resp.headers["inference-header-content-length"])
    result = th.InferResult.from_response_body(resp.body, header_length=n)
    assert result.as_numpy("output_ids").tolist() == [[[3, 4, 5, 9]]]
    assert result.as_numpy("text_output").tolist() == [[b"hi"]]
    assert result.get_response()["id"] == "id1"
    with pytest.raises(APIError, match="runs past the body"):
        parse_infer_body(raw, str(len(raw)), 1 << 20)


def _fe():
    """The few Frontend attributes the tensor parser reads (no engine: these are pure checks)."""
    from dsflash.serve.runtime.sampling import SamplingParams
    return SimpleNamespace(encode=lambda text, add_bos=True: [0] + [ord(c) for c in text], eos_token_id=1,
                           sampling=lambda **kw: SamplingParams(**{k: v for k, v in kw.items() if v is not None}))


def test_token_path_semantics():
    jobs = tensors.parse_jobs(_fe(), {"input_ids": np.array([[5, 6, 7], [8, 9, 0]], np.int32),
                                      "input_lengths": np.array([[3], [2]], np.int32),
                                      "request_output_len": np.array([[4], [4]], np.int32),
                                      "pad_id": np.array([[2]], np.int32)})
    assert [j.prompt_ids for j in jobs] == [[5, 6, 7], [8, 9]]
    assert jobs[0].params.ignore_eos and jobs[0].params.stop_token_ids == []   # no end_id: nothing stops early
    out = tensors.outputs_for(jobs, [([11, 12], "", []), ([13], "", [])])
    assert out["output_ids"][0].tolist() == [[[5, 6, 7, 11, 12]], [[8, 9, 13, 2, 2]]]    # padded with pad_id
    assert out["sequence_length"][0].tolist() == [[5], [3]]
    [j] = tensors.parse_jobs(_fe(), {"input_ids": np.array([[5, 6]], np.int32), "end_id": np.array([[7]], np.int32),
                                     "request_output_len": np.array([[4]], np.int32),
                                     "exclude_input_in_output": np.array([[True]])})
    assert j.params.stop_token_ids == [7] and j.pad_id == 7
    assert tensors.outputs_for([j], [([11], "", [])])["output_ids"][0].tolist() == [[[11]]]


def test_text_path_semantics():
    [j] = tensors.parse_jobs(_fe(), {"text_input": np.array([[b"hi"]], dtype=object),
                                     "max_tokens": np.array([[3]], np.int32), "stream": np.array([[True]]),
                                     "stop_words": np.array([[b"x, yz"]], dtype=object)})
    assert j.text_mode and j.streaming and j.prompt_ids == [0, ord("h"), ord("i")]
    assert j.params.stop_token_ids == [1] and j.params.stop == ["x", "yz"]     # end_id defaults to EOS
    assert tensors.outputs_for([j], [([5], " there", [])])["text_output"][0].tolist() == [[b"hi there"]]
    assert tensors.outputs_for([j], [([5], " there", [])], streamed=True)["text_output"][0].tolist() == [[b" there"]]


@pytest.mark.parametrize("inputs,needle", [
    ({}, "exactly one of 'input_ids'"),
    ({"input_ids": np.array([[1]], np.int32), "text_input": np.array([[b"x"]], dtype=object)}, "exactly one"),
    ({"input_ids": np.array([[1]], np.int32)}, "request_output_len"),
    ({"input_ids": np.array([[1.5]], np.float32), "request_output_len": np.array([[1]], np.int32)}, "integer tensor"),
    ({"input_ids": np.array([[1, 2]], np.int32), "input_lengths": np.array([[3]], np.int32),
      "request_output_len": np.array([[1]], np.int32)}, "input_lengths[0]=3"),
    ({"input_ids": np.array([[1], [2]], np.int32), "request_output_len": np.array([[1], [1], [1]], np.int32)},
     "one value per batch row"),
    ({"input_ids": np.array([[1], [2]], np.int32), "request_output_len": np.array([[1]], np.int32),
      "streaming": np.array([[True]])}, "batch size 1"),
    ({"input_ids": np.array([[1]], np.int32), "request_output_len": np.array([[1]], np.int32),
      "beam_width": np.array([[4]], np.int32)}, "beam_width"),
    ({"input_ids": np.array([[1]], np.int32), "request_output_len": np.array([[0]], np.int32)}, "max_tokens"),
    ({"input_ids": np.array([[1]], np.int32), "request_output_len": np.array([[1]], np.int32),
      "colour": np.array([[1]], np.int32)}, "unexpected input tensor"),
])
def test_tensor_errors(inputs, needle):
    with pytest.raises((APIError, ValueError), match=needle.replace("[", r"\[").replace("]", r"\]")):
        tensors.parse_jobs(_fe(), inputs)


# -- JSON requests, API key --------------------------------------------------------------------------------------------
def test_json_body_checks():
    assert check_json_object(b'{"a": 1}', 100) == {"a": 1}
    for body, status, needle in ((b'{"a": ', 400, "malformed JSON"), (b'"x"', 400, "JSON object"),
                                 (b'\xff\xfe', 400, "malformed JSON"), (b'{"a": "' + b"x" * 200 + b'"}', 413,
                                                                         "--max-body-bytes")):
        with pytest.raises(APIError, match=needle) as e:
            check_json_object(body, 100)
        assert e.value.status == status


def test_field_types():
    d = {"n": 3, "b": True, "x": 1.5, "s": "a", "l": ["a", "b"], "ids": [1, 2], "bad": "3", "flag": 1}
    assert field(d, "n", "int") == 3 and field(d, "x", "number") == 1.5 and field(d, "s", "strs") == ["a"]
    assert field(d, "missing", "int", 7) == 7 and field(d, "ids", "ints") == [1, 2]
    for name, kind in (("bad", "int"), ("flag", "bool"), ("b", "int"), ("l", "ints"), ("n", "str")):
        with pytest.raises(APIError, match=f"field '{name}' must be"):
            field(d, name, kind)
    with pytest.raises(APIError, match="must be a number"):
        field({"t": float("nan")}, "t", "number")


def test_bearer_and_errors():
    assert bearer_ok(None, None) and bearer_ok("anything", None)
    assert bearer_ok("Bearer k1", "k1") and bearer_ok("bearer  k1 ", "k1")
    assert not bearer_ok(None, "k1") and not bearer_ok("Bearer k2", "k1") and not bearer_ok("Basic k1", "k1")
    e = APIError(429, "busy", retry_after=2)
    assert e.kind == "RateLimitError" and e.headers() == {"Retry-After": "2"}
    assert APIError(401, "no").headers()["WWW-Authenticate"] == "Bearer"
    with pytest.raises(ValueError, match="max_prompt_len"):
        Limits(max_prompt_len=0, max_tokens_limit=1)


def test_openai_refuses_unsupported_fields():
    from dsflash.serve.api.openai import _refuse
    _refuse({"n": 1, "echo": False, "logit_bias": {}, "tools": [], "response_format": {"type": "text"}})
    for body in ({"n": 2}, {"best_of": 3}, {"echo": True}, {"tools": [{"type": "function"}]},
                 {"presence_penalty": 0.5}, {"response_format": {"type": "json_object"}}):
        with pytest.raises(APIError, match="not supported"):
            _refuse(body)


def test_generate_fields_to_tensors():
    from dsflash.serve.api.kserve_http import _generate_inputs
    t = _generate_inputs({"text_input": "hi", "max_tokens": 3, "parameters": {"temperature": 0.5, "stream": True}})
    assert t["text_input"].tolist() == [[b"hi"]] and t["max_tokens"].tolist() == [[3]]
    assert t["temperature"].dtype == np.float32 and t["stream"].tolist() == [[True]]
    for body, needle in (({"max_tokens": "3"}, "'max_tokens' must be INT32"), ({"stream": 1}, "'stream' must be BOOL"),
                         ({"input_ids": [1, "2"]}, "list of integers"), ({"wat": 1}, "unknown field")):
        with pytest.raises(APIError, match=needle):
            _generate_inputs(body)


# -- metrics, thinking split ---------------------------------------------------------------------------------------
def test_metrics_exposition():
    from dsflash.serve.api.metrics import Metrics, parse
    m = Metrics("tiny")
    m.record_finished("length", ttft=0.02, e2e=0.5, completion_tokens=5)
    m.record_finished("stop", ttft=None, e2e=0.1, completion_tokens=0)
    m.record_error(429)
    from dsflash.serve.api.metrics import ITERATION_BUCKETS, Histogram
    iterations = Histogram(ITERATION_BUCKETS)
    for t in (0.004, 0.04, 0.04):
        iterations.observe(t)
    text = m.render({"num_running": 2, "num_waiting": 1, "kv_cache_usage": 0.25, "kv_cache_used_blocks": 4,
                     "kv_cache_total_blocks": 16, "prompt_tokens_total": 9, "generation_tokens_total": 5,
                     "num_preemptions": 0, "num_iterations": 3, "scheduled_batch_size": 7,
                     "iteration_latency": iterations.snapshot()})
    assert "# TYPE trtllm_time_to_first_token_seconds histogram" in text
    v = parse(text)
    assert v['trtllm_request_success_total{finished_reason="length"}'] == 1
    assert v['trtllm_request_errors_total{code="429"}'] == 1
    assert v["trtllm_kv_cache_utilization"] == 0.25 and v["trtllm_kv_cache_free_blocks"] == 12
    assert v["trtllm_num_requests_running"] == 2 and v["trtllm_num_requests_waiting"] == 1
    assert v['trtllm_time_to_first_token_seconds_bucket{le="0.02"}'] == 1      # cumulative: 0.02 <= 0.02
    assert v['trtllm_time_to_first_token_seconds_bucket{le="0.01"}'] == 0
    assert v['trtllm_time_to_first_token_seconds_bucket{le="0.04"}'] == 1
    assert v['trtllm_time_to_first_token_seconds_bucket{le="+Inf"}'] == 1
    assert v["trtllm_time_per_output_token_seconds_sum"] == pytest.approx((0.5 - 0.02) / 4)
    assert v["trtllm_e2e_request_latency_seconds_count"] == 2
    assert v["trtllm_iterations_total"] == 3 and v["trtllm_scheduled_batch_size"] == 7
    assert v['trtllm_iteration_latency_seconds_bucket{le="0.005"}'] == 1
    assert v['trtllm_iteration_latency_seconds_bucket{le="0.05"}'] == 3
    assert v["trtllm_iteration_latency_seconds_count"] == 3


def test_thinking_split_by_token():
    from dsflash.convert.synth import tokenizer_source_dir
    from dsflash.serve.api.openai import ThinkingSplit
    from dsflash.serve.tokenization import DeepseekTokenizer
    tok = DeepseekTokenizer(tokenizer_source_dir())
    fe = SimpleNamespace(tokenizer=tok, decode=tok.decode)
    reasoning = tok.encode("Let me think.", add_bos=False)
    content = tok.encode(" The answer.", add_bos=False)
    ids = reasoning + [tok.token_id("</think>")] + content
    split = ThinkingSplit(fe, thinking=True)
    got_r = got_c = ""
    for i, t in enumerate(ids):        # as the engine streams it (the tokenizer keeps "</think>" in the text)
        text = tok.decode(ids[: i + 1])[len(tok.decode(ids[:i])):]
        r, c = split.push([t], text)
        got_r, got_c = got_r + r, got_c + c
    assert (got_r, got_c) == ("Let me think.", " The answer.")
    assert ThinkingSplit(fe, thinking=False).push(ids, "all of it") == ("", "all of it")


def _sse_events(stream_response) -> list:
    import asyncio

    async def drain():
        return [e async for e in stream_response.events]
    out = []
    for e in asyncio.run(drain()):
        assert e.startswith("data: ") and e.endswith("\n\n")
        body = e[len("data: "):-2]
        out.append(body if body == "[DONE]" else json.loads(body))
    return out


@pytest.mark.parametrize("fail_after", [None, 1])
def test_openai_event_stream_framing(fail_after):
    """Both OpenAI endpoints stream through one framing: chunks, the usage chunk when asked, [DONE] last; a request
    that fails after its 200 went out ends with an error event (and is counted) instead of a usage chunk."""
    from dsflash.serve.api.openai import _event_stream
    errors = []
    fe = SimpleNamespace(metrics=SimpleNamespace(record_error=errors.append))
    s = SimpleNamespace(prompt_tokens=3, completion_tokens=2, spec=None, aclose=None)
    base = {"id": "cmpl-1", "object": "text_completion"}

    async def chunks():
        for i in range(2):
            if i == fail_after:
                raise APIError(503, "engine stopped")
            yield {**base, "choices": [{"index": 0, "text": str(i)}]}
    got = _sse_events(_event_stream(fe, s, chunks(), base, include_usage=True))
    assert got[-1] == "[DONE]"
    if fail_after is None:
        assert [c["choices"][0]["text"] for c in got[:2]] == ["0", "1"] and errors == []
        assert got[2] == {**base, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2,
                                                         "total_tokens": 5}}
    else:
        assert got[0]["choices"][0]["text"] == "0" and errors == [503]
        assert got[1] == {"error": {"message": "engine stopped", "type": APIError(503, "x").kind, "code": 503}}
        assert len(got) == 3
