"""Drive an `LLMEngine` with a benchmark dataset at a fixed concurrency and time every request.

The loop is the serving loop without the network: at most `concurrency` requests are in the engine (a finished one
is replaced by the next after the step that finished it; concurrency <= 0 hands them all over at once, trtllm-bench's
"offline mode"), and each engine step's outputs are stamped when the step returns.
"""
from __future__ import annotations

import time
from collections import deque

from tqdm import tqdm

from dsflash.serve.bench.dataset import BenchRequest, warmup_requests
from dsflash.serve.bench.stats import RequestRecord
from dsflash.serve.runtime.sampling import SamplingParams
from dsflash.serve.runtime.scheduler import QueueFullError
from dsflash.serve.runtime.sequence import Request


def sampling_params(req: BenchRequest, eos_id: int) -> SamplingParams:
    """Greedy, exactly `output_tokens` long when eos_id < 0 (trtllm-bench's --eos_id -1), else also stopping at
    eos_id."""
    if eos_id < 0:
        return SamplingParams(max_tokens=req.output_tokens, ignore_eos=True)
    return SamplingParams(max_tokens=req.output_tokens, ignore_eos=True, stop_token_ids=[eos_id])


def run_requests(engine, requests: list[BenchRequest], concurrency: int, eos_id: int = -1, tag: str = "bench",
                 progress: bool = True) -> tuple[list[RequestRecord], list[RequestRecord]]:
    """Run every request to the end; -> (completed records, failed records). A request fails when the engine
    refuses it (malformed, or it can never fit) or aborts it."""
    pending = deque(requests)
    limit = len(requests) if concurrency <= 0 else concurrency
    inflight: dict[str, RequestRecord] = {}
    done: list[RequestRecord] = []
    failed: list[RequestRecord] = []
    bar = tqdm(total=len(requests), desc=f"{tag} (concurrency {concurrency if concurrency > 0 else 'all'})",
               unit="req", disable=not progress)

    def submit() -> None:
        while pending and len(inflight) < limit:
            req = pending.popleft()
            rid = f"{tag}-{req.task_id}"
            rec = RequestRecord(req.task_id, len(req.input_ids), start_ns=time.perf_counter_ns())
            try:
                engine.add_request(Request(rid, list(req.input_ids), sampling_params(req, eos_id)))
            except (ValueError, QueueFullError) as e:
                rec.error = f"{type(e).__name__}: {e}"
                failed.append(rec)
                bar.update()
                continue
            inflight[rid] = rec

    submit()
    while inflight:
        if not engine.has_work():
            raise RuntimeError(f"the engine stopped with {len(inflight)} benchmark requests unfinished")
        outputs = engine.step()
        now = time.perf_counter_ns()
        for out in outputs:
            rec = inflight.get(out.request_id)
            if rec is None:
                continue
            if out.new_token_ids:
                if rec.first_token_ns is None:
                    rec.first_token_ns = now
                rec.num_output_tokens += len(out.new_token_ids)
                rec.output_ids += out.new_token_ids
                rec.decode_iterations += 1
            rec.spec = out.spec if out.spec is not None else rec.spec
            if out.finished:
                rec.end_ns, rec.finish_reason = now, out.finish_reason
                del inflight[out.request_id]
                if out.finish_reason == "abort" or rec.first_token_ns is None:
                    rec.error = rec.error or f"finished with reason {out.finish_reason!r} and " \
                                             f"{rec.num_output_tokens} tokens"
                    failed.append(rec)
                else:
                    done.append(rec)
                bar.update()
        submit()
    bar.close()
    return done, failed


def warm_up(engine, requests: list[BenchRequest], n: int, concurrency: int, eos_id: int = -1) -> None:
    """Run `n` requests shaped like the dataset's first ones (cycled) through the engine, untimed."""
    if n <= 0:
        return
    _, failed = run_requests(engine, warmup_requests(requests, n), concurrency, eos_id, tag="warmup", progress=False)
    if failed:
        raise RuntimeError(f"warm-up request failed: {failed[0].error}")
