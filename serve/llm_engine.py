"""The serving engine: requests in, per-step outputs out (`LLMEngine`), and its asyncio front (`AsyncLLMEngine`).

Shape of nano-vllm's engine (style-anchors §1.1): `Sequence` -> `BlockManager` (paged KV accounting) ->
`Scheduler` (FCFS, chunked prefill, preemption by recompute) -> `ModelRunner` -> this loop, under
`dsflash.serve.runtime`. On a multi-rank engine rank 0 builds the `LLMEngine` (it owns scheduling and sampling and
sends each step's plan to the workers); ranks > 0 run `worker_loop(engine_dir)`.

Thread safety: `add_request`, `abort` and `stats` may be called from any thread while another thread runs `step`
(the model runs outside the lock; a request aborted meanwhile is dropped when the step completes).

Speculative serving (`speculative=SpecConfig(...)`, single-rank engines): a running request's decode step is one
draft + verify + accept + rollback iteration of its own batch-1 `SpeculativeDecoder` (runtime/model_runner.py); the
scheduler counts draft + 1 tokens for it, its Output may carry several tokens (cut at a stop token / stop string /
max_tokens exactly where one-token decoding would stop) and its pages shrink back to the committed tokens. Greedy
output is the non-speculative output; sampling is rejection sampling (lossless). Outputs carry the request's
acceptance (`Output.spec`); `stats()["spec_decode"]` holds the engine totals for /metrics.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

from dsflash.serve.api.metrics import ITERATION_BUCKETS, Histogram
from dsflash.serve.runtime.block_manager import BlockManager, cache_layout, kv_cache_capacity
from dsflash.serve.runtime.cuda_graphs import CudaGraphConfig
from dsflash.serve.runtime.model_runner import ModelRunner, SpecStep
from dsflash.serve.runtime.sampling import SamplingParams, sample, token_logprobs
from dsflash.serve.runtime.scheduler import QueueFullError, Scheduler
from dsflash.serve.runtime.sequence import Output, Request, Sequence, Status
from dsflash.serve.runtime.worker import ControlPlane, abort_job, connect, worker_loop
from dsflash.serve.speculative import SpecStats

__all__ = ["AsyncLLMEngine", "EngineDeadError", "LLMEngine", "Output", "QueueFullError", "Request", "SamplingParams",
           "worker_loop"]
log = logging.getLogger("dsflash.serve")


class EngineDeadError(RuntimeError):
    """The engine loop failed or was shut down; no request can be served any more."""


class LLMEngine:
    """Rank 0's engine over an engine dir. Limits default to the engine's build_config (overrides may only lower
    them); the KV-cache pool is `kv_cache_bytes`, else `kv_cache_free_gpu_memory_fraction` of free device memory.
    `speculative`: a SpecConfig (single-rank engines); `wrap_drafter(drafter, seq) -> drafter` lets tests substitute
    a request's draft proposals. `simulate_rank`: run that rank of a multi-rank engine alone in this process (the
    TP-rank simulation: its all-reduces are counted local no-ops, each calling `comm_wait(nbytes)` when given), so
    its outputs are not the model's; `self.comm` holds the counts (rank 0's on a real multi-rank engine).
    `batch_invariant`: run each request's segment in its own forward (runtime/model_runner.py), not all of a
    step's segments in one. `cuda_graph`: TRT-LLM's `cuda_graph_config` (runtime/cuda_graphs.py; None: off), decode
    steps of GPU engines replayed piece by piece."""

    def __init__(self, engine_dir: str, *, kv_cache_bytes: int | None = None, max_queue: int = 256,
                 kv_cache_free_gpu_memory_fraction: float = 0.9, max_batch_size: int | None = None,
                 max_num_tokens: int | None = None, max_seq_len: int | None = None, block_size: int = 64,
                 model=None, speculative=None, wrap_drafter=None, simulate_rank: int | None = None,
                 comm_wait=None, batch_invariant: bool = False,
                 cuda_graph: CudaGraphConfig | None = CudaGraphConfig()):
        if speculative is not None:
            from dsflash.build.engine import open_engine
            n = open_engine(engine_dir).world_size
            if n != 1:
                raise ValueError(f"{engine_dir}: speculative decoding (--speculative-algorithm) runs on single-rank "
                                 f"engines only; this engine has {n} ranks")
        if simulate_rank is None:
            rank, self.world, mpi, comm = connect(engine_dir)
        else:
            rank, mpi, comm = simulate_rank, None, _simulated_comm(engine_dir, simulate_rank, comm_wait)
            self.world = 1
        self.comm = comm
        if rank != 0 and simulate_rank is None:
            raise RuntimeError(f"LLMEngine runs on rank 0; rank {rank} must run worker_loop(engine_dir)")
        self._control = ControlPlane(mpi) if self.world > 1 else None
        try:
            if speculative is not None:
                from dsflash.build.engine import open_engine
                speculative.validate(open_engine(engine_dir).args)   # fail before loading the weights
            self.runner = ModelRunner(engine_dir, rank, comm, model=model, control=self._control,
                                      speculative=speculative, wrap_drafter=wrap_drafter,
                                      batch_invariant=batch_invariant)
            # one process captures its graphs before measuring the memory left for the caches; several ranks
            # capture as the steps come (their warm-up steps would have to run in step)
            built = self.runner.engine.meta["build_config"]
            self.max_batch_size = _limit("max_batch_size", max_batch_size, built)
            self.max_seq_len = _limit("max_seq_len", max_seq_len, built)
            self.cuda_graphs = self.runner.enable_cuda_graphs(cuda_graph, self.max_batch_size, self.max_seq_len,
                                                              warm_up=self.world == 1)
            local = kv_cache_capacity(kv_cache_bytes, kv_cache_free_gpu_memory_fraction, self.runner.device)
            cfg = {"kv_cache_bytes": kv_cache_bytes, "free_fraction": kv_cache_free_gpu_memory_fraction,
                   "batch_invariant": batch_invariant, "max_batch_size": self.max_batch_size,
                   "max_seq_len": self.max_seq_len,
                   "decode_slots": getattr(self.runner.model, "decode_slots", None) is not None,
                   "cuda_graph": None if cuda_graph is None else dataclasses.asdict(cuda_graph)}
            capacity = self._control.agree_capacity(cfg, local) if self._control else local
        except Exception as e:
            if self.world > 1:
                abort_job(0, "engine start failed", e)
            raise
        self.max_num_tokens = _limit("max_num_tokens", max_num_tokens, built)
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.args = self.runner.args
        self.cache = BlockManager(cache_layout(self.args, block_size), capacity)
        self.speculative = speculative
        self.spec_stats = SpecStats()     # every verify step of the engine (for /metrics)
        self.scheduler = Scheduler(self.cache, self.max_num_tokens, self.max_batch_size, max_queue,
                                   num_draft_tokens=speculative.num_draft_tokens if speculative else 0,
                                   max_seq_len=self.max_seq_len)
        self.tokenizer = _tokenizer(engine_dir, self.args.bos_token_id)
        self.model_name = Path(engine_dir).resolve().name
        self._seqs: dict[str, Sequence] = {}
        self._released: list[str] = []      # request ids whose worker states are dropped with the next plan
        self._aborted: list[Output] = []
        self._lock = threading.RLock()
        self._closed = False
        self.prompt_tokens_total = self.generation_tokens_total = 0
        self.num_iterations = self.scheduled_batch_size = 0   # iterations that ran the model; the last one's requests
        self.iteration_latency = Histogram(ITERATION_BUCKETS)   # seconds per such iteration (forward + sampling)

    # -- requests ----------------------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queue a request. ValueError: it is malformed or can never be served (prompt >= max_seq_len, or its
        longest possible sequence cannot fit the cache pool); QueueFullError: overload. Generation stops with
        "length" at max_tokens or at max_seq_len, whichever comes first."""
        if not isinstance(req.params, SamplingParams):
            raise ValueError("params must be a SamplingParams")
        ids, vocab = req.prompt_ids, self.args.vocab_size
        if not isinstance(req.request_id, str) or not req.request_id:
            raise ValueError("request_id must be a non-empty string")
        if not isinstance(ids, list) or not ids:
            raise ValueError("prompt token ids must be a non-empty list")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(ids) >= self.max_seq_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_seq_len of this engine is {self.max_seq_len} "
                             f"(prompt + at least one new token)")
        if req.params.stop and self.tokenizer is None:
            raise ValueError("stop strings need the engine's tokenizer (tokenizer.json missing from the engine)")
        with self._lock:
            if self._closed:
                raise EngineDeadError("engine is shut down")
            if req.request_id in self._seqs:
                raise ValueError(f"request_id {req.request_id!r} is already in use")
            seq = Sequence(req, self.tokenizer, self.args.eos_token_id)
            self.scheduler.check_fits(seq, self.max_seq_len)
            self.scheduler.add(seq)
            self._seqs[req.request_id] = seq

    def abort(self, request_id: str) -> None:
        """Stop a request and free its cache pages; the next step() reports it finished with reason "abort"."""
        with self._lock:
            seq = self._seqs.pop(request_id, None)
            if seq is None:
                return
            self.scheduler.remove(seq)
            self._released.append(request_id)
            seq.finish_reason = "abort"
            self._aborted.append(Output(request_id, [], True, "abort", None, seq.num_prompt, seq.num_generated,
                                        seq.text.take(final=True),
                                        seq.spec_report() if self.speculative is not None else None))

    def abort_all(self) -> None:
        with self._lock:
            for rid in list(self._seqs):
                self.abort(rid)

    def has_work(self) -> bool:
        with self._lock:
            return self.scheduler.has_work() or bool(self._aborted)

    # -- the loop ----------------------------------------------------------------------------------------------
    def step(self) -> list[Output]:
        """One scheduler iteration: prompt chunks and decodes of the scheduled requests; one Output per request
        that got a token (plus those aborted since the last step)."""
        with self._lock:
            outputs, self._aborted = self._aborted, []
            batch = self.scheduler.schedule()
            released = self._released + [s.request_id for s in batch.preempted]
            self._released = []
        start = time.perf_counter()
        logits = {}
        if batch.segments or (released and self._control is not None):
            try:
                logits = self.runner.run(batch, released)
            except Exception as e:
                if self._control is not None:
                    abort_job(0, "model step failed", e)
                raise
        with self._lock:
            for seq, lg in logits.items():
                if seq.status is Status.RUNNING:
                    outputs.append(self._emit(seq, lg))
            if batch.segments:
                self.num_iterations += 1
                self.scheduled_batch_size = len({s.seq.request_id for s in batch.segments})
                self.iteration_latency.observe(time.perf_counter() - start)
        return outputs

    def _emit(self, seq: Sequence, result) -> Output:
        p = seq.params
        if isinstance(result, SpecStep):                  # speculative decode: several tokens
            tokens, rows = result.tokens, list(result.logits)
            self.spec_stats.observe(result.accepted, result.drafted)
        else:
            tokens, rows = [sample(result, p, seq.generator)], [result]
            if seq.spec is not None:
                self.runner.finish_prefill(seq, tokens[0])
        if seq.num_generated == 0:
            self.prompt_tokens_total += seq.num_prompt
        new, lp = [], [] if p.logprobs is not None else None
        for token, logits in zip(tokens, rows):            # stop exactly where one-token decoding would
            new.append(token)
            if lp is not None:
                lp.append(token_logprobs(logits, token, p.logprobs))
            seq.append(token, p.max_tokens, self.max_seq_len)
            if seq.finish_reason is not None:
                break
        self.generation_tokens_total += len(new)
        done = seq.finish_reason is not None
        out = Output(seq.request_id, new, done, seq.finish_reason, lp, seq.num_prompt, seq.num_generated,
                     seq.text.take(final=done), seq.spec_report() if self.speculative is not None else None)
        if not done and self.speculative is not None:
            self.cache.trim(seq.request_id, seq.num_computed)   # pages of the rejected drafts go back
        if done:
            self.scheduler.remove(seq)
            self._seqs.pop(seq.request_id, None)
            self._released.append(seq.request_id)
        return out

    def stats(self) -> dict:
        with self._lock:
            c = self.cache
            return {"num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
                    "kv_cache_usage": c.usage, "kv_cache_used_blocks": c.num_used,
                    "kv_cache_total_blocks": c.total_blocks, "kv_cache_free_blocks": c.num_free,
                    "kv_cache_block_bytes": c.layout.bytes_per_block, "kv_cache_block_tokens": c.layout.block_size,
                    "num_preemptions": self.scheduler.num_preemptions,
                    "prompt_tokens_total": self.prompt_tokens_total,
                    "generation_tokens_total": self.generation_tokens_total,
                    "num_iterations": self.num_iterations, "scheduled_batch_size": self.scheduled_batch_size,
                    "iteration_latency": self.iteration_latency.snapshot(),
                    **({"spec_decode": self._spec_totals()} if self.speculative is not None else {})}

    def _spec_totals(self) -> dict:
        t = self.spec_stats
        return {"algorithm": self.speculative.algorithm, "num_draft_tokens": self.speculative.num_draft_tokens,
                "simulated": self.speculative.simulate_acceptance_length is not None,
                "verify_steps": t.steps, "draft_tokens": t.drafted, "accepted_draft_tokens": t.accepted,
                "acceptance_length": t.mean_al, "draft_acceptance_rate": t.dar,
                "acceptance_length_histogram": t.histogram()}

    def shutdown(self) -> None:
        """Abort what is left, stop the workers (multi-rank) and refuse new requests. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self.abort_all()
            self._closed = True
        if self._control is not None:
            self._control.shutdown()
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()


def _simulated_comm(engine_dir: str, rank: int, wait):
    """The SimulatedComm of one rank of a multi-rank engine run alone in this process."""
    from dsflash.build.engine import open_engine
    from dsflash.model_def.layers import SimulatedComm
    eng = open_engine(engine_dir)
    if eng.world_size == 1:
        raise ValueError(f"{engine_dir}: a rank simulation needs a multi-rank engine (this one has one rank)")
    if not 0 <= rank < eng.world_size:
        raise ValueError(f"simulated rank must be in [0, {eng.world_size}), got {rank}")
    return SimulatedComm(eng.mapping(rank), wait)


def _limit(name: str, value: int | None, built: dict) -> int:
    cap = int(built[name])
    if value is None:
        return cap
    if not 1 <= value <= cap:
        raise ValueError(f"{name} must be in [1, {cap}] (the engine was built with {name}={cap}), got {value}")
    return value


def _tokenizer(engine_dir: str, bos: int):
    from dsflash.serve.tokenization import DeepseekTokenizer, TokenizerError
    try:
        return DeepseekTokenizer(engine_dir, bos_token_id=bos)
    except TokenizerError as e:
        log.warning("%s: stop strings and text output are disabled", e)
        return None


class AsyncLLMEngine:
    """Runs `LLMEngine.step()` in a background thread; each `generate()` call streams its request's Outputs."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stop = self._draining = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="dsflash-engine", daemon=True)
        self._thread.start()

    @property
    def ready(self) -> bool:
        return self._thread.is_alive() and not self._draining and self.error is None

    async def generate(self, req: Request) -> AsyncIterator[Output]:
        """Stream the request's Outputs until one is finished. Leaving early (client gone) aborts it."""
        if self.error is not None or self._stop:
            raise EngineDeadError(f"engine is not running ({self.error or 'shut down'})")
        if self._draining:
            raise QueueFullError("server is shutting down")
        rid = req.request_id
        if rid in self._queues:
            raise ValueError(f"request_id {rid!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = (asyncio.get_running_loop(), queue)
        try:
            self.engine.add_request(req)
        except BaseException:
            self._queues.pop(rid, None)
            raise
        self._wake.set()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(rid, None)
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._wake.set()

    def stats(self) -> dict:
        return self.engine.stats()

    async def drain(self, timeout: float) -> bool:
        """Stop taking requests, let the running ones finish for up to `timeout` s, then abort the rest.
        True when everything finished in time."""
        self._draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.engine.has_work() and loop.time() < deadline and self.error is None:
            await asyncio.sleep(0.02)
        clean = not self.engine.has_work()
        if not clean:
            self.engine.abort_all()
            self._wake.set()
            while self.engine.has_work() and self._thread.is_alive() and loop.time() < deadline + 5:
                await asyncio.sleep(0.02)
        return clean

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=60)
        self.engine.shutdown()

    def _deliver(self, rid: str, item) -> None:
        entry = self._queues.get(rid)
        if entry is not None:
            loop, queue = entry
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # its event loop is closed: nobody listens any more
                pass

    def _loop(self) -> None:
        while not self._stop:
            if not self.engine.has_work():
                self._wake.wait(timeout=0.1)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # noqa: BLE001 - fail every waiting client instead of hanging them
                log.exception("engine step failed; the engine is stopped")
                self.error = e
                for rid in list(self._queues):
                    self._deliver(rid, EngineDeadError(f"engine step failed: {type(e).__name__}: {e}"))
                return
            for out in outputs:
                self._deliver(out.request_id, out)
