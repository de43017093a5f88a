"""A real Triton Inference Server (the tritonserver 2.51 binary in nvidia-pytriton, CPU) serving the repository
`dsflash triton-repo` writes, for tiny V4.1 and V4 engines; queried with tritonclient over HTTP and gRPC
(streaming included) on 127.0.0.1. Greedy outputs equal the reference model token for token.
"""
from __future__ import annotations

import importlib.util
import os
import queue
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

_spec = importlib.util.spec_from_file_location("_serving", Path(__file__).with_name("_serving.py"))
sv = sys.modules.setdefault("_serving", importlib.util.module_from_spec(_spec))
if not hasattr(sv, "Served"):
    _spec.loader.exec_module(sv)

pytestmark = pytest.mark.slow
FAMILIES = ("v41", "v4")
STUB_SITE = Path(sys.prefix) / "triton-site"   # numpy 1.26 for Triton's Python stub (the Makefile installs it)


def _inputs(mod, arrays):
    from tritonclient.utils import np_to_triton_dtype
    out = []
    for name, arr in arrays:
        t = mod.InferInput(name, list(arr.shape), "BYTES" if arr.dtype == object else np_to_triton_dtype(arr.dtype))
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


def token_inputs(mod, ids, n, streaming=False):
    return _inputs(mod, [("input_ids", np.array([ids], np.int32)), ("input_lengths", np.array([[len(ids)]], np.int32)),
                         ("request_output_len", np.array([[n]], np.int32)),
                         ("streaming", np.array([[streaming]], bool))])


def text_inputs(mod, text, n, stream=False):
    return _inputs(mod, [("text_input", np.array([[text]], dtype=object)), ("max_tokens", np.array([[n]], np.int32)),
                         ("stream", np.array([[stream]], bool))])


@pytest.fixture(scope="module")
def triton(tmp_path_factory):
    from dsflash.serve.tokenization import DeepseekTokenizer
    from dsflash.serve.triton_repo import launch_env, pytriton_dir, write_backend_dir
    if not (STUB_SITE / "numpy").is_dir():
        pytest.fail(f"{STUB_SITE}: numpy 1.26 for Triton's Python stub is missing; run `make` (or `pip install "
                    f"--no-deps --target {STUB_SITE} numpy==1.26.4`)")
    work = tmp_path_factory.mktemp("triton")
    cases = {}
    for fam in FAMILIES:
        hf, engine = sv.tiny_engine(sv.engines_dir(tmp_path_factory), fam)
        tok = DeepseekTokenizer(engine)
        prompts, ref = sv.references(fam, hf, engine, tok)
        r = subprocess.run([sys.executable, "-m", "dsflash.serve.cli", "triton-repo", "--engine", str(engine),
                            "--out", str(work / "repo"), "--model-name", f"dsflash_{fam}",
                            "--kv-cache-bytes", str(64 * 2 ** 20), "--extra-site-dir", str(STUB_SITE)],
                           capture_output=True, text=True, env={**os.environ, "PYTHONSAFEPATH": "1"})
        assert r.returncode == 0, r.stderr
        cases[fam] = (tok, prompts, ref)
    backends = write_backend_dir(work / "backends")
    http, grpc = sv.free_port(), sv.free_port()
    log = open(work / "tritonserver.log", "w")
    proc = subprocess.Popen([str(pytriton_dir() / "bin" / "tritonserver"), f"--model-repository={work / 'repo'}",
                             f"--backend-directory={backends}", "--http-address=127.0.0.1", f"--http-port={http}",
                             "--grpc-address=127.0.0.1", f"--grpc-port={grpc}", "--allow-metrics=false",
                             "--exit-timeout-secs=20"],
                            stdout=log, stderr=subprocess.STDOUT, env=launch_env(), start_new_session=True)
    url = f"http://127.0.0.1:{http}"
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                if httpx.get(f"{url}/v2/health/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("tritonserver did not come up:\n" + (work / "tritonserver.log").read_text()[-4000:])
            time.sleep(0.5)
        yield {"url": url, "http": f"127.0.0.1:{http}", "grpc": f"127.0.0.1:{grpc}", "cases": cases, "proc": proc,
               "log": work / "tritonserver.log"}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
        log.close()


def test_repository_models_appear_whole_or_not_at_all(tmp_path_factory, tmp_path, monkeypatch):
    """A failure while writing the second (BLS) model leaves neither model nor a temp dir; existing models are
    refused, not overwritten."""
    from dsflash.build.engine import EngineError
    from dsflash.serve import triton_repo
    _, engine = sv.tiny_engine(sv.engines_dir(tmp_path_factory), "v41")
    repo = tmp_path / "repo"
    calls = []

    def failing_site_dirs(extra):
        calls.append(extra)
        if len(calls) == 2:
            raise OSError("disk full")
        return []
    monkeypatch.setattr(triton_repo, "site_dirs", failing_site_dirs)
    with pytest.raises(OSError, match="disk full"):
        triton_repo.write_repo(engine, repo)
    assert len(calls) == 2 and list(repo.iterdir()) == []
    monkeypatch.undo()
    triton_repo.write_repo(engine, repo)
    assert sorted(p.name for p in repo.iterdir()) == ["dsflash", "dsflash_bls"]
    assert (repo / "dsflash_bls" / "1" / "model.py").is_file()
    with pytest.raises(EngineError, match="dsflash: model directory already exists"):
        triton_repo.write_repo(engine, repo)


def test_batch_invariant_reaches_the_model_config(tmp_path_factory, tmp_path):
    from dsflash.serve import triton_repo
    from dsflash.serve.triton_model import bool_param
    _, engine = sv.tiny_engine(sv.engines_dir(tmp_path_factory), "v41")
    triton_repo.write_repo(engine, tmp_path / "a", batch_invariant=True)
    triton_repo.write_repo(engine, tmp_path / "b")
    on, off = ((tmp_path / d / "dsflash" / "config.pbtxt").read_text() for d in "ab")
    assert 'key: "batch_invariant" value: { string_value: "true" }' in on and "batch_invariant" not in off
    assert bool_param({"batch_invariant": "True"}, "batch_invariant") and not bool_param({}, "batch_invariant")
    with pytest.raises(ValueError, match="'batch_invariant' must be"):
        bool_param({"batch_invariant": "yes"}, "batch_invariant")


def test_repository_layout(triton):
    repo = Path(triton["log"]).parent / "repo"
    cfg = (repo / "dsflash_v41" / "config.pbtxt").read_text()
    assert 'backend: "python"' in cfg and "decoupled: true" in cfg and 'key: "engine_dir"' in cfg
    assert "decoupled: false" in (repo / "dsflash_v41_bls" / "config.pbtxt").read_text()
    model_py = (repo / "dsflash_v41" / "1" / "model.py").read_text()
    assert "dsflash.serve.triton_model import TritonPythonModel" in model_py and str(STUB_SITE) in model_py


@pytest.mark.parametrize("fam", FAMILIES)
def test_grpc_streaming_and_unary(triton, fam):
    import tritonclient.grpc as tg
    tok, prompts, ref = triton["cases"][fam]
    c = tg.InferenceServerClient(triton["grpc"])
    assert c.is_server_ready() and c.is_model_ready(f"dsflash_{fam}") and c.is_model_ready(f"dsflash_{fam}_bls")
    results: queue.Queue = queue.Queue()
    c.start_stream(callback=lambda result, error: results.put((result, error)))
    c.async_stream_infer(f"dsflash_{fam}", token_inputs(tg, prompts["ids"], sv.N_NEW, True), request_id="tok",
                         enable_empty_final_response=True)
    c.async_stream_infer(f"dsflash_{fam}", text_inputs(tg, sv.PROMPT_TEXT, sv.N_NEW, True), request_id="txt",
                         enable_empty_final_response=True)
    c.async_stream_infer(f"dsflash_{fam}", token_inputs(tg, prompts["chat"], sv.N_NEW, False), request_id="one",
                         enable_empty_final_response=True)
    got, finals, counts = {"tok": [], "txt": "", "one": []}, set(), {"tok": 0, "txt": 0, "one": 0}
    while finals != set(got):
        result, error = results.get(timeout=120)
        assert error is None, error
        resp = result.get_response()
        if resp.outputs:
            counts[resp.id] += 1
            if resp.id == "txt":
                got["txt"] += result.as_numpy("text_output")[0, 0].decode()
            else:
                got[resp.id] += result.as_numpy("output_ids").reshape(-1).tolist()
        if resp.parameters["triton_final_response"].bool_param:
            finals.add(resp.id)
    c.stop_stream()
    assert got["tok"] == ref["ids"] and counts["tok"] == sv.N_NEW          # one response per token
    assert got["txt"] == tok.decode(ref["text"]) and counts["txt"] == sv.N_NEW
    assert got["one"] == prompts["chat"] + ref["chat"] and counts["one"] == 1
    r = c.infer(f"dsflash_{fam}_bls", token_inputs(tg, prompts["ids"], sv.N_NEW))      # unary gRPC
    assert r.as_numpy("output_ids").tolist() == [[prompts["ids"] + ref["ids"]]]
    assert r.as_numpy("sequence_length").tolist() == [[len(prompts["ids"]) + sv.N_NEW]]
    c.close()


@pytest.mark.parametrize("fam", FAMILIES)
def test_http_infer_and_generate(triton, fam):
    import tritonclient.http as th
    tok, prompts, ref = triton["cases"][fam]
    c = th.InferenceServerClient(triton["http"])
    r = c.infer(f"dsflash_{fam}_bls", token_inputs(th, prompts["ids"], sv.N_NEW))
    assert r.as_numpy("output_ids").tolist() == [[prompts["ids"] + ref["ids"]]]
    r = c.infer(f"dsflash_{fam}_bls", text_inputs(th, sv.PROMPT_TEXT, sv.N_NEW),
                outputs=[th.InferRequestedOutput("text_output")])
    assert r.as_numpy("text_output")[0, 0].decode() == sv.PROMPT_TEXT + tok.decode(ref["text"])
    c.close()
    url = triton["url"]
    r = httpx.post(f"{url}/v2/models/dsflash_{fam}/generate", timeout=120,
                   json={"text_input": sv.PROMPT_TEXT, "max_tokens": sv.N_NEW})
    assert r.status_code == 200, r.text
    assert r.json()["text_output"] == sv.PROMPT_TEXT + tok.decode(ref["text"])
    with httpx.stream("POST", f"{url}/v2/models/dsflash_{fam}/generate_stream", timeout=120,
                      json={"text_input": sv.PROMPT_TEXT, "max_tokens": sv.N_NEW, "stream": True}) as r:
        events = sv.sse_events(r)
    assert "".join(e["text_output"] for e in events) == tok.decode(ref["text"])


def test_errors_reach_the_client(triton):
    import tritonclient.grpc as tg
    from tritonclient.utils import InferenceServerException
    c = tg.InferenceServerClient(triton["grpc"])
    bad = _inputs(tg, [("input_ids", np.array([[0, 1]], np.int32))])          # no request_output_len
    with pytest.raises(InferenceServerException, match="request_output_len"):
        c.infer("dsflash_v4_bls", bad)
    c.close()
    r = httpx.post(f"{triton['url']}/v2/models/dsflash_v4/generate", json={"text_input": "hi"}, timeout=60)
    assert r.status_code >= 400 and "request_output_len" in r.json()["error"]


def test_clean_shutdown(triton):
    """Last: SIGTERM unloads both models (engines drained and stopped) and tritonserver exits 0."""
    proc = triton["proc"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(90) == 0
    text = Path(triton["log"]).read_text()
    assert "successfully unloaded 'dsflash_v41'" in text and "successfully unloaded 'dsflash_v4'" in text
