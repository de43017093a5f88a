"""`dsflash serve --engine DIR`: OpenAI + KServe v2 (HTTP and gRPC) endpoints over the in-flight batching engine.

Rank 0 owns the network endpoints and the scheduler; an engine with several ranks relaunches this command under
`mpirun -n <world>` (or runs under an external mpirun), and ranks > 0 only run the engine's worker loop.
SIGTERM / SIGINT drain: the listeners close, requests in flight finish (up to --drain-timeout), then the engine and
its workers stop and the process exits 0. If the engine fails the server logs why and exits 1.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
from pathlib import Path

log = logging.getLogger("dsflash.serve")


def _int_in(lo: int, hi: int):
    """An argparse type: an integer in [lo, hi]."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"must be in [{lo}, {hi}], got {v}")
        return v
    return parse


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsflash serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", required=True, help="engine directory made by `dsflash build`")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=_int_in(0, 65535), default=8000,
                   help="HTTP port (OpenAI + KServe v2 + /metrics); 0 = any free")
    p.add_argument("--grpc-port", type=_int_in(-1, 65535), default=8001,
                   help="KServe v2 gRPC port; 0 = any free, -1 = no gRPC")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer <key>' (env DSFLASH_API_KEY)")
    p.add_argument("--served-model-name", default=None, help="model name in the APIs (default: engine dir name)")
    p.add_argument("--max-prompt-len", type=int, default=None, help="prompt tokens (default: max_seq_len - 1)")
    p.add_argument("--max-tokens-limit", type=int, default=None,
                   help="largest max_tokens a request may ask for (default: max_seq_len - 1)")
    p.add_argument("--max-body-bytes", type=int, default=None, help="request body size limit (default 8 MiB)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="waiting requests; past it new requests get 429 + Retry-After")
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--kv-cache-bytes", type=int, default=None, help="KV-cache pool size in bytes")
    kv.add_argument("--kv-cache-free-gpu-memory-fraction", type=float, default=0.9,
                    help="KV-cache pool as a fraction of free device memory (default 0.9)")
    p.add_argument("--max-batch-size", type=int, default=None, help="lower the engine's max_batch_size")
    p.add_argument("--max-num-tokens", type=int, default=None, help="lower the engine's max_num_tokens")
    p.add_argument("--max-seq-len", type=int, default=None, help="lower the engine's max_seq_len")
    p.add_argument("--batch-invariant", action="store_true",
                   help="run each request's step in a forward of its own: outputs never depend on the other requests "
                        "in flight (slower; default: one forward per step for all requests)")
    p.add_argument("--drain-timeout", type=_seconds, default=30.0,
                   help="seconds SIGTERM waits for requests in flight before aborting them")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    add_speculative_args(p)
    from dsflash.serve.runtime.cuda_graphs import add_cli_args
    add_cli_args(p)
    return p


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    """The `--speculative-*` flags (dsflash serve, dsflash bench); `speculative_config` reads them."""
    s = p.add_argument_group("speculative decoding (single-rank engines; greedy output unchanged, sampling lossless)")
    s.add_argument("--speculative-algorithm", choices=("dspark", "mtp"), default=None,
                   help="dspark: V4.1 DSpark drafter; mtp: V4 MTP block (chained for N > 1)")
    s.add_argument("--speculative-num-draft-tokens", type=int, default=None,
                   help="draft tokens verified per step (default: dspark_block_size for dspark, the number of "
                        "MTP layers for mtp)")
    s.add_argument("--speculative-confidence-threshold", type=float, default=0.0,
                   help="dspark: end a block before the first draft whose confidence is below this (default 0)")
    s.add_argument("--simulate-acceptance-length", type=float, default=None,
                   help="benchmark aid: accept drafts so that the mean acceptance length is L (outputs are NOT the "
                        "model's; responses say simulated_acceptance: true)")


def speculative_config(a, args):
    """The validated SpecConfig of the `--speculative-*` flags (None without --speculative-algorithm); ValueError
    naming the flag when they do not fit the model `args`."""
    if a.speculative_algorithm is None:
        if (a.speculative_num_draft_tokens is not None or a.simulate_acceptance_length is not None
                or a.speculative_confidence_threshold):
            raise ValueError("--speculative-num-draft-tokens / --speculative-confidence-threshold / "
                             "--simulate-acceptance-length need --speculative-algorithm")
        return None
    from dsflash.serve.spec_decode import SpecConfig
    n = a.speculative_num_draft_tokens
    if n is None:
        n = getattr(args, "dspark_block_size", 1) if a.speculative_algorithm == "dspark" else max(args.n_draft, 1)
    cfg = SpecConfig(a.speculative_algorithm, n, confidence_threshold=a.speculative_confidence_threshold,
                     simulate_acceptance_length=a.simulate_acceptance_length)
    cfg.validate(args)
    return cfg


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host, port))
    except OSError as e:
        s.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    s.listen(2048)
    s.set_inheritable(True)
    return s


PIDFILE_ENV = "DSFLASH_SERVE_RANK0_PIDFILE"


def _relaunch(world: int, argv: list[str], relaunch) -> int:
    """Run this command under mpirun; SIGTERM / SIGINT to this process go to rank 0 only, which drains and then
    stops the workers (mpirun itself would kill every rank at once, cutting requests in flight)."""
    import tempfile
    with tempfile.TemporaryDirectory(prefix="dsflash-serve-") as d:
        pidfile = Path(d) / "rank0.pid"
        os.environ[PIDFILE_ENV] = str(pidfile)

        def forward(sig, frame):
            try:
                targets = [int(pidfile.read_text())]
            except (OSError, ValueError):  # rank 0 not started yet: stop the whole job
                me = os.getpid()
                targets = [int(p) for p in Path(f"/proc/{me}/task/{me}/children").read_text().split()]
            for pid in targets:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass

        old = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            return relaunch(world, "dsflash.serve.server", argv)
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)
            os.environ.pop(PIDFILE_ENV, None)


def _mpi_rank() -> int:
    from mpi4py import MPI
    return MPI.COMM_WORLD.Get_rank()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="[dsflash serve] %(levelname)s %(message)s")
    from dsflash.build.engine import EngineError, open_engine
    from dsflash.serve.mpi_launch import relaunch, under_mpi
    try:
        eng = open_engine(a.engine)
    except EngineError as e:
        print(f"dsflash serve: {e}", file=sys.stderr)
        return 2
    built = eng.meta["build_config"]
    if a.speculative_algorithm is None and built.get("speculative_algorithm"):  # the engine's recorded default
        a.speculative_algorithm = built["speculative_algorithm"]
        a.speculative_num_draft_tokens = a.speculative_num_draft_tokens or built.get("speculative_num_draft_tokens") or None
    try:
        from dsflash.serve.runtime.cuda_graphs import config_from_cli
        config_from_cli(a)   # a bad --cuda-graph-* flag fails here, before any rank loads weights
        spec = speculative_config(a, eng.args)
        if spec is not None and eng.world_size != 1:
            raise ValueError(f"speculative decoding (--speculative-algorithm) runs on single-rank engines only; "
                             f"{a.engine} has {eng.world_size} ranks")
    except ValueError as e:
        print(f"dsflash serve: {e}", file=sys.stderr)
        return 2
    if eng.world_size > 1 and not under_mpi():
        log.info("engine has %d ranks: relaunching under mpirun -n %d", eng.world_size, eng.world_size)
        rc = _relaunch(eng.world_size, argv, relaunch)
        if rc != 0:
            print(f"dsflash serve: the MPI job exited with status {rc} (a rank failed or was killed; see the rank "
                  f"logs above)", file=sys.stderr)
        return rc
    if under_mpi() and _mpi_rank() > 0:
        from dsflash.serve.llm_engine import worker_loop
        return worker_loop(a.engine) or 0
    if os.environ.get(PIDFILE_ENV):
        Path(os.environ[PIDFILE_ENV]).write_text(str(os.getpid()))
    api_key = a.api_key or os.environ.get("DSFLASH_API_KEY") or None
    try:
        http_sock = _bind(a.host, a.port)
        if a.grpc_port > 0:
            _bind(a.host, a.grpc_port).close()  # fail before the (slow) engine load when the port is taken
    except OSError as e:
        print(f"dsflash serve: {e}", file=sys.stderr)
        if under_mpi():
            from mpi4py import MPI
            MPI.COMM_WORLD.Abort(2)
        return 2
    try:
        server = Server(a, http_sock, api_key, spec)
    except (ValueError, OSError, EngineError) as e:
        print(f"dsflash serve: {e}", file=sys.stderr)
        if under_mpi():
            from mpi4py import MPI
            MPI.COMM_WORLD.Abort(2)
        return 2
    return asyncio.run(server.run())


class Server:
    """Rank 0: the engine, the HTTP app on a pre-bound socket, the gRPC server, signals and shutdown."""

    def __init__(self, a, http_sock: socket.socket, api_key: str | None, speculative=None):
        from dsflash.serve.api.core import Frontend
        from dsflash.serve.api.kserve_http import TRTLLM_NAMES
        from dsflash.serve.api.security import DEFAULT_MAX_BODY_BYTES, Limits
        from dsflash.serve.llm_engine import AsyncLLMEngine, LLMEngine
        from dsflash.serve.runtime.cuda_graphs import config_from_cli
        self.a, self.sock, self.api_key = a, http_sock, api_key
        fraction = a.kv_cache_free_gpu_memory_fraction
        if not 0 < fraction <= 1:
            raise ValueError(f"--kv-cache-free-gpu-memory-fraction must be in (0, 1], got {fraction}")
        core = LLMEngine(a.engine, kv_cache_bytes=a.kv_cache_bytes, kv_cache_free_gpu_memory_fraction=fraction,
                         max_queue=a.max_queue, max_batch_size=a.max_batch_size, max_num_tokens=a.max_num_tokens,
                         max_seq_len=a.max_seq_len, speculative=speculative, batch_invariant=a.batch_invariant,
                         cuda_graph=config_from_cli(a))
        if speculative is not None:
            sim = (f", SIMULATED acceptance length {speculative.simulate_acceptance_length}"
                   if speculative.simulate_acceptance_length is not None else "")
            log.info("speculative decoding: %s, %d draft tokens%s", speculative.algorithm,
                     speculative.num_draft_tokens, sim)
        top = core.max_seq_len - 1
        # an explicit 0 is a value (refused by Limits), not "unset"
        limits = Limits(max_prompt_len=top if a.max_prompt_len is None else min(a.max_prompt_len, top),
                        max_tokens_limit=top if a.max_tokens_limit is None else a.max_tokens_limit,
                        max_body_bytes=DEFAULT_MAX_BODY_BYTES if a.max_body_bytes is None else a.max_body_bytes)
        self.engine = AsyncLLMEngine(core)
        self.fe = Frontend(self.engine, limits, served_name=a.served_model_name, aliases=TRTLLM_NAMES)
        self.exit_code = 0
        self.http = None
        self.grpc, self.grpc_port = None, None
        self.grpc_stopping = None

    def _stop(self, why: str) -> None:
        if self.fe.draining:
            if self.http is not None:
                self.http.force_exit = True  # a second signal: stop waiting for requests in flight
            return
        log.info("%s: draining (no new requests; up to %.0f s for those in flight)", why, self.a.drain_timeout)
        self.fe.draining = True
        if self.http is not None:
            self.http.should_exit = True
        if self.grpc is not None:
            self.grpc_stopping = asyncio.ensure_future(self.grpc.stop(grace=self.a.drain_timeout))

    async def _watch_engine(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            if self.engine.error is not None:
                log.error("engine failed (%s: %s); stopping the server", type(self.engine.error).__name__,
                          self.engine.error)
                self.exit_code = 1
                self._stop("engine failure")
                return

    async def run(self) -> int:
        import uvicorn
        from dsflash.serve.api.app import build_app
        from dsflash.serve.api.kserve_grpc import make_server

        class _Uvicorn(uvicorn.Server):
            def capture_signals(self):  # signals are ours (see _stop); uvicorn must not re-raise them at exit
                import contextlib
                return contextlib.nullcontext()

        a = self.a
        config = uvicorn.Config(build_app(self.fe, self.api_key), log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=a.drain_timeout, timeout_keep_alive=5, backlog=2048)
        self.http = _Uvicorn(config)
        if a.grpc_port >= 0:
            self.grpc, self.grpc_port = make_server(self.fe, a.host, a.grpc_port, self.api_key)
            await self.grpc.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop, signal.Signals(sig).name)
        watch = asyncio.ensure_future(self._watch_engine())
        host, port = self.sock.getsockname()[:2]
        print(f"dsflash serve: model '{self.fe.model_name}' ready on http://{host}:{port}"
              + (f" and grpc://{host}:{self.grpc_port}" if self.grpc is not None else ""), flush=True)
        try:
            await self.http.serve(sockets=[self.sock])
        finally:
            watch.cancel()
            self.fe.draining = True
            if self.grpc is not None:
                await (self.grpc_stopping or self.grpc.stop(grace=a.drain_timeout))
            clean = await self.engine.drain(timeout=a.drain_timeout if self.exit_code == 0 else 0)
            if not clean:
                log.warning("drain timeout: requests still running were aborted")
            self.engine.shutdown()
            log.info("stopped")
        return self.exit_code


if __name__ == "__main__":
    sys.exit(main())
