"""`dsflash demo` (`make demo`): the main job on the embedded default, a tiny synthetic V4.1-Flash checkpoint.

synth (real HF format) -> convert (reference layout) -> build (cpu engine) -> greedy generation from a real tokenized
prompt -> `dsflash serve` on 127.0.0.1 with one OpenAI request (printed with the curl that makes it) -> clean
shutdown (SIGTERM drains). Each stage runs through the same CLI a user would type; outputs are kept in --workdir and
reused on the next run.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

DEFAULT_PROMPT = "The three primary colors are"


def _stage(title: str, argv: list[str]) -> None:
    from dsflash.serve.cli import main as cli
    print(f"\n[demo] {title}\n[demo] $ dsflash " + " ".join(repr(a) if " " in a else a for a in argv), flush=True)
    rc = cli(argv)
    if rc:
        raise SystemExit(rc)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dsflash demo", description=__doc__)
    p.add_argument("--workdir", default="out/demo", help="where checkpoint and engine are kept (reused if present)")
    p.add_argument("--family", choices=("v41", "v4"), default="v41")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=16)
    a = p.parse_args(argv)
    from dsflash.build.engine import is_current_engine

    base = Path(a.workdir) / f"{a.family}-{a.preset}"
    hf, ckpt, engine = base / "hf", base / "ckpt-reference", base / "engine-cpu-tp1"
    if not (hf / "config.json").is_file():
        _stage("synthesize a tiny checkpoint in the real HF format",
               ["synth", "--family", a.family, "--preset", a.preset, "--out", str(hf)])
    if not (ckpt / "manifest.json").is_file():
        _stage("convert to the canonical reference layout", ["convert", "--hf", str(hf), "--out", str(ckpt),
                                                              "--layout", "reference"])
    if not is_current_engine(engine):
        if engine.exists():
            print(f"\n[demo] {engine} was built by another dsflash version (engine format): rebuilding it", flush=True)
            shutil.rmtree(engine)
        _stage("build a CPU engine (TP1)", ["build", "--ckpt", str(ckpt), "--out", str(engine), "--arch", "cpu"])
    _stage("greedy generation from the engine", ["generate", "--engine", str(engine), "--prompt", a.prompt,
                                                  "--max-new-tokens", str(a.max_new_tokens)])
    return serve_one_request(engine, a.prompt, a.max_new_tokens)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_one_request(engine: Path, prompt: str, max_tokens: int, timeout_s: float = 180.0) -> int:
    """Start `dsflash serve` on 127.0.0.1, send one /v1/completions request, print it as curl, then SIGTERM."""
    port = _free_port()
    cmd = [sys.executable, "-m", "dsflash.serve.cli", "serve", "--engine", str(engine), "--port", str(port),
           "--grpc-port", "-1", "--served-model-name", "dsflash-demo"]
    print(f"\n[demo] serve the engine on 127.0.0.1:{port}\n[demo] $ dsflash serve --engine {engine} --port {port}",
          flush=True)
    server = subprocess.Popen(cmd, env={**os.environ, "PYTHONSAFEPATH": "1"})
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                print("[demo] the server did not become ready", file=sys.stderr)
                return 1
            time.sleep(0.5)
        body = {"model": "dsflash-demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        print(f"\n[demo] one request\n[demo] $ curl -s http://127.0.0.1:{port}/v1/completions "
              f"-H 'Content-Type: application/json' -d '{json.dumps(body)}'", flush=True)
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            print(json.dumps(json.loads(r.read()), indent=2, ensure_ascii=False))
    finally:
        if server.poll() is None:
            print("\n[demo] SIGTERM: the server drains and exits", flush=True)
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
    print(f"[demo] server exited with status {server.returncode}")
    return 0 if server.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
