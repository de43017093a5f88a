"""Benchmark a running OpenAI-compatible server the way trtllm-serve's `benchmark_serving` does (conventions.md §3.6).

Each request is one streamed `/v1/completions` call with the dataset's token ids as the prompt, greedy,
`ignore_eos`, `max_tokens` = its output_tokens and `return_token_ids` (dsflash, vLLM and trtllm-serve extension), so
every SSE chunk says exactly which tokens it carries. A request's clock starts before it is sent; its first token and
its end are stamped as the chunks arrive. At most `concurrency` requests are open at once (client threads), as
`--max-concurrency` does there. The timings become the same `RequestRecord`s as the in-process runner's.
"""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections import deque

from tqdm import tqdm

from dsflash.serve.bench.dataset import BenchRequest
from dsflash.serve.bench.stats import RequestRecord


def server_model(base_url: str, api_key: str | None, timeout: float = 30.0) -> str:
    """The model id the server lists first (`GET /v1/models`)."""
    url = f"{base_url}/v1/models"
    try:
        with urllib.request.urlopen(_request(url, None, api_key), timeout=timeout) as r:
            models = json.loads(r.read()).get("data") or []
    except ValueError as e:   # not a URL (urllib), or not JSON
        raise OSError(f"{url}: {e} (--base-url takes http://HOST:PORT)") from None
    except urllib.error.HTTPError as e:
        raise OSError(f"{url}: HTTP {e.code} {e.reason}") from None
    except urllib.error.URLError as e:
        raise OSError(f"cannot reach {url}: {e.reason}") from None
    if not models:
        raise OSError(f"{base_url}/v1/models lists no model")
    return models[0]["id"]


def _request(url: str, body: dict | None, api_key: str | None) -> urllib.request.Request:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(), headers=headers)


def stream_one(base_url: str, model: str, req: BenchRequest, api_key: str | None, timeout: float
               ) -> tuple[RequestRecord, list[int]]:
    """One streamed completion; -> (its record, the gaps in ns between its token-carrying chunks). A transport or
    HTTP error, or an error event, is recorded in `error`."""
    body = {"model": model, "prompt": req.input_ids, "max_tokens": req.output_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    rec = RequestRecord(req.task_id, len(req.input_ids), start_ns=time.perf_counter_ns())
    gaps, last = [], None
    try:
        with urllib.request.urlopen(_request(f"{base_url}/v1/completions", body, api_key), timeout=timeout) as r:
            for raw in r:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg:
                    rec.error = f"error event: {msg['error'].get('message')}"
                    break
                for choice in msg.get("choices", []):
                    tokens = choice.get("token_ids") or []
                    if tokens:
                        now = time.perf_counter_ns()
                        if last is not None:
                            gaps.append(now - last)
                        last = now
                        rec.first_token_ns = rec.first_token_ns or now
                        rec.num_output_tokens += len(tokens)
                        rec.output_ids += tokens
                        rec.decode_iterations += 1
                    rec.finish_reason = choice.get("finish_reason") or rec.finish_reason
    except urllib.error.HTTPError as e:
        rec.error = f"HTTP {e.code}: {e.read().decode('utf-8', 'replace')[:300]}"
    except (urllib.error.URLError, OSError, ValueError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    rec.end_ns = time.perf_counter_ns()
    if rec.error is None and rec.first_token_ns is None:
        rec.error = f"the stream ended with no token (finish_reason {rec.finish_reason!r})"
    return rec, gaps


def run_serving(base_url: str, model: str, requests: list[BenchRequest], concurrency: int, api_key: str | None = None,
                timeout: float = 600.0, tag: str = "serving", progress: bool = True
                ) -> tuple[list[RequestRecord], list[RequestRecord], list[int]]:
    """All requests through `concurrency` client threads (<= 0: one per request); -> (completed, failed, the
    inter-token gaps in ns of the completed ones)."""
    pending = deque(requests)
    lock = threading.Lock()
    done, failed, gaps = [], [], []
    bar = tqdm(total=len(requests), desc=f"{tag} (concurrency {concurrency if concurrency > 0 else 'all'})",
               unit="req", disable=not progress)

    def client() -> None:
        while True:
            with lock:
                if not pending:
                    return
                req = pending.popleft()
            rec, g = stream_one(base_url, model, req, api_key, timeout)
            with lock:
                (failed if rec.error else done).append(rec)
                if not rec.error:
                    gaps.extend(g)
                bar.update()

    threads = [threading.Thread(target=client, daemon=True)
               for _ in range(len(requests) if concurrency <= 0 else min(concurrency, len(requests)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bar.close()
    return done, failed, gaps
