"""Helpers of the serving e2e tests: tiny engines built once per session, a `dsflash serve` process, SSE reading.

Loaded by the test modules with importlib (tests are not a package); everything talks to 127.0.0.1 only.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

READY = re.compile(r"ready on http://([\d.]+):(\d+)(?: and grpc://[\d.]+:(\d+))?")
PROMPT_IDS = [0, 671, 6102, 294, 8760, 344]
PROMPT_TEXT = "The three primary colors are"
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]
N_NEW = 6


def engines_dir(tmp_path_factory) -> Path:
    """One folder per test session for the engines and their reference outputs (shared by the test modules)."""
    d = tmp_path_factory.getbasetemp() / "serve-engines"
    d.mkdir(exist_ok=True)
    return d


def tiny_engine(base: Path, family: str, tp: int = 1) -> tuple[Path, Path]:
    """(hf dir, engine dir) of the tiny synthetic `family` model, built once under `base`."""
    from dsflash.build.engine import write_engine
    from dsflash.build.plan import BuildConfig
    from dsflash.convert.synth import synthesize
    from dsflash.model_def import get_preset
    from dsflash.model_def.mapping import Mapping
    hf, eng = base / f"{family}-hf", base / f"{family}-engine-tp{tp}"
    if not (hf / "config.json").is_file():
        synthesize(get_preset(family, "tiny"), hf, seed=5)
    if not (eng / "engine.json").is_file():
        write_engine(hf, eng, Mapping(world_size=tp, tp_size=tp), "cpu", BuildConfig(), progress=False)
    return hf, eng


def references(family: str, hf: Path, engine: Path, tok) -> tuple[dict, dict]:
    """Prompts (ids) and their greedy continuations, where the reference model (`load_reference(...)
    .generate_greedy`) and the engine's model (what `dsflash generate --engine` runs) agree; cached per session."""
    cache = engine.parent / f"refs-{engine.name}.json"
    if cache.is_file():
        data = json.loads(cache.read_text())
        return data["prompts"], data["ref"]
    import torch
    from dsflash.build.engine import load_engine_model
    from dsflash.model_def import load_reference
    from dsflash.serve.encoding import encode_messages
    prompts = {"ids": PROMPT_IDS, "text": tok.encode(PROMPT_TEXT),
               "chat": tok.encode(encode_messages(CHAT, family), add_bos=False),
               "think": tok.encode(encode_messages(CHAT, family, thinking=True), add_bos=False)}
    reference = load_reference(hf, numerics="deploy")
    built, _ = load_engine_model(engine)
    ref = {}
    with torch.no_grad():
        for name, ids in prompts.items():
            a = reference.generate_greedy(torch.tensor([ids]), N_NEW)[0, len(ids):].tolist()
            b = built.generate_greedy(torch.tensor([ids]), N_NEW)[0, len(ids):].tolist()
            assert a == b, f"{family} {name}: engine {b} != reference {a}"
            ref[name] = a
    cache.write_text(json.dumps({"prompts": prompts, "ref": ref}))
    return prompts, ref


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """`dsflash serve --engine E --port 0 --grpc-port 0 ...` in a subprocess; `with Served(...) as s:`."""

    def __init__(self, engine: Path, *args: str, timeout: float = 180):
        env = {**os.environ, "PYTHONSAFEPATH": "1", "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "dsflash.serve.cli", "serve", "--engine", str(engine), "--port", "0",
               "--grpc-port", "0", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     start_new_session=True)
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.host = self.port = self.grpc_port = None
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + timeout
        while not self.ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError("dsflash serve did not come up:\n" + self.log)
        self.url = f"http://{self.host}:{self.port}"
        self.grpc = f"{self.host}:{self.grpc_port}"

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            m = READY.search(line)
            if m and not self.ready.is_set():
                self.host, self.port, self.grpc_port = m.group(1), int(m.group(2)), m.group(3)
                self.ready.set()

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def terminate(self, timeout: float = 90) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        try:
            self.terminate()
        finally:
            self.kill()


def sse_events(response) -> list:
    """The JSON payloads of an SSE response (httpx streaming response), stopping at [DONE]."""
    out = []
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            break
        out.append(json.loads(data))
    return out


def metrics(client, url: str, **headers) -> dict[str, float]:
    from dsflash.serve.api.metrics import parse
    r = client.get(f"{url}/metrics", headers=headers)
    r.raise_for_status()
    return parse(r.text)


def _poll_metrics(client, url: str, done, timeout: float, interval: float, **headers) -> dict[str, float]:
    """Poll /metrics until done(sample) or the timeout; returns the last sample."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(client, url, **headers)
        if done(m) or time.monotonic() > deadline:
            return m
        time.sleep(interval)


def wait_metric(client, url: str, key: str, at_least: float, timeout: float = 10, **headers) -> dict[str, float]:
    """Poll /metrics until `key` reaches `at_least` (an abort frees its pages at once, but is counted as finished
    by the engine's next step, a moment later); returns the last sample."""
    return _poll_metrics(client, url, lambda m: m.get(key, 0) >= at_least, timeout, 0.05, **headers)


def wait_idle(client, url: str, timeout: float = 20, **headers) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits and no KV-cache block is in use; returns the last sample."""
    return _poll_metrics(client, url, lambda m: (m["trtllm_kv_cache_used_blocks"] == 0
                                                 and m["trtllm_num_requests_running"] == 0
                                                 and m["trtllm_num_requests_waiting"] == 0), timeout, 0.1, **headers)
