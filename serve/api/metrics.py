"""Prometheus metrics of the server (`GET /metrics`, text exposition format 0.0.4).

Names follow trtllm-serve's (`trtllm_` prefix; conventions.md §4.2) so existing dashboards and alerts work:
request counts, queue length, running requests, KV-cache usage, TTFT / TPOT / end-to-end latency histograms and
token counters, and the iterations (`iterations_total`, `scheduled_batch_size`: the last iteration's requests,
`iteration_latency_seconds`). Gauges of the engine (running, waiting, cache blocks, token totals, iterations) are
read from `AsyncLLMEngine.stats()` at scrape time; request-level series are recorded by the front doors.

Speculative engines add (conventions.md §4.2 / §6): `trtllm_spec_decode_acceptance_length` (histogram of the
tokens each verify step emitted, buckets 1 .. N+1), `trtllm_spec_decode_drafted_tokens_total`,
`trtllm_spec_decode_accepted_tokens_total`, `trtllm_spec_decode_num_verify_steps_total` (counters) and the gauges
`trtllm_spec_decode_mean_acceptance_length` (AL = emitted tokens / verify steps) and
`trtllm_spec_decode_draft_acceptance_rate` (DAR = accepted / drafted); `trtllm_spec_decode_simulated` is 1 when
`--simulate-acceptance-length` makes the acceptance synthetic.
"""
from __future__ import annotations

import bisect
import threading

PREFIX = "trtllm_"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
ITERATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
                     5.0, 10.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)   # last one is +Inf
        self.sum, self.count = 0.0, 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1

    def snapshot(self) -> dict:
        """Plain data (JSON-ready) for stats(): {"buckets", "counts" (the last is +Inf), "sum", "count"}."""
        return {"buckets": list(self.buckets), "counts": list(self.counts), "sum": self.sum, "count": self.count}

    @classmethod
    def from_snapshot(cls, snap: dict) -> "Histogram":
        h = cls(tuple(snap["buckets"]))
        h.counts, h.sum, h.count = list(snap["counts"]), float(snap["sum"]), int(snap["count"])
        return h

    def lines(self, name: str) -> list[str]:
        out, acc = [], 0
        for le, c in zip([*map(repr, self.buckets), "+Inf"], self.counts):
            acc += c
            out.append(f'{name}_bucket{{le="{le}"}} {acc}')
        return out + [f"{name}_sum {self.sum!r}", f"{name}_count {self.count}"]


# engine stats key -> (metric name, type, help)
ENGINE_SERIES = {
    "num_running": ("num_requests_running", "gauge", "Requests in the running batch."),
    "num_waiting": ("num_requests_waiting", "gauge", "Requests waiting in the queue."),
    "kv_cache_usage": ("kv_cache_utilization", "gauge", "Fraction of KV-cache blocks in use (0..1)."),
    "kv_cache_used_blocks": ("kv_cache_used_blocks", "gauge", "KV-cache blocks in use."),
    "kv_cache_total_blocks": ("kv_cache_max_blocks", "gauge", "KV-cache blocks in the pool."),
    "num_preemptions": ("num_preemptions_total", "counter", "Requests preempted (cache freed, recomputed later)."),
    "prompt_tokens_total": ("prompt_tokens_total", "counter", "Prompt tokens processed."),
    "generation_tokens_total": ("generation_tokens_total", "counter", "Tokens generated."),
    "num_iterations": ("iterations_total", "counter", "Scheduler iterations that ran the model."),
    "scheduled_batch_size": ("scheduled_batch_size", "gauge",
                             "Requests in the last iteration (one forward for all, unless --batch-invariant)."),
}


class Metrics:
    """Request-level series; thread-safe (the Triton model records from its own threads)."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.lock = threading.Lock()
        self.success: dict[str, int] = {}     # finish reason -> count
        self.errors: dict[int, int] = {}      # HTTP status of a rejected or failed request -> count
        self.ttft, self.tpot, self.e2e = Histogram(TTFT_BUCKETS), Histogram(TPOT_BUCKETS), Histogram(E2E_BUCKETS)

    def record_finished(self, reason: str, ttft: float | None, e2e: float, completion_tokens: int) -> None:
        with self.lock:
            self.success[reason] = self.success.get(reason, 0) + 1
            self.e2e.observe(e2e)
            if ttft is not None:
                self.ttft.observe(ttft)
                if completion_tokens > 1:
                    self.tpot.observe((e2e - ttft) / (completion_tokens - 1))

    def record_error(self, status: int) -> None:
        with self.lock:
            self.errors[status] = self.errors.get(status, 0) + 1

    def render(self, stats: dict | None) -> str:
        """The exposition text; `stats` is the engine's `stats()` (None while it is not up)."""
        lines: list[str] = []

        def family(name: str, kind: str, text: str) -> str:
            full = PREFIX + name
            lines.extend([f"# HELP {full} {text}", f"# TYPE {full} {kind}"])
            return full

        with self.lock:
            n = family("request_success_total", "counter", "Requests finished, by finish reason.")
            lines += [f'{n}{{finished_reason="{r}"}} {c}' for r, c in sorted(self.success.items())] or [f"{n} 0"]
            n = family("request_errors_total", "counter", "Requests rejected or failed, by HTTP status.")
            lines += [f'{n}{{code="{s}"}} {c}' for s, c in sorted(self.errors.items())] or [f"{n} 0"]
            for name, h, text in (("time_to_first_token_seconds", self.ttft, "Time to first token."),
                                  ("time_per_output_token_seconds", self.tpot, "Time per output token after the 1st."),
                                  ("e2e_request_latency_seconds", self.e2e, "End-to-end request latency.")):
                lines += h.lines(family(name, "histogram", text))
        stats = stats or {}
        for key, (name, kind, text) in ENGINE_SERIES.items():
            if key in stats:
                lines.append(f"{family(name, kind, text)} {float(stats[key])!r}")
        if "kv_cache_total_blocks" in stats and "kv_cache_used_blocks" in stats:
            free = stats["kv_cache_total_blocks"] - stats["kv_cache_used_blocks"]
            lines.append(f"{family('kv_cache_free_blocks', 'gauge', 'KV-cache blocks free.')} {float(free)!r}")
        if "iteration_latency" in stats:
            hist = Histogram.from_snapshot(stats["iteration_latency"])
            lines += hist.lines(family("iteration_latency_seconds", "histogram",
                                       "Time of an iteration that ran the model."))
        if stats.get("spec_decode"):
            spec_lines(stats["spec_decode"], family, lines)
        return "\n".join(lines) + "\n"


def spec_lines(sd: dict, family, out: list[str]) -> None:
    """Append the speculative-decoding series of `LLMEngine.stats()["spec_decode"]` to out (`family(name, type,
    help)` appends a family's header to out and returns its full name)."""
    n = family("spec_decode_acceptance_length", "histogram",
               "Tokens emitted per speculative verify step (accepted drafts + 1).")
    hist = {int(k): v for k, v in sd["acceptance_length_histogram"].items()}
    acc = 0
    for le in range(1, int(sd["num_draft_tokens"]) + 2):
        acc += hist.get(le, 0)
        out.append(f'{n}_bucket{{le="{le}"}} {acc}')
    total = sum(hist.values())
    out += [f'{n}_bucket{{le="+Inf"}} {total}', f"{n}_sum {float(sum(k * v for k, v in hist.items()))!r}",
            f"{n}_count {total}"]
    for key, name, kind, text in (
            ("draft_tokens", "spec_decode_drafted_tokens_total", "counter", "Draft tokens proposed for verification."),
            ("accepted_draft_tokens", "spec_decode_accepted_tokens_total", "counter", "Draft tokens accepted."),
            ("verify_steps", "spec_decode_num_verify_steps_total", "counter", "Speculative verify steps."),
            ("acceptance_length", "spec_decode_mean_acceptance_length", "gauge",
             "Mean acceptance length (tokens per verify step)."),
            ("draft_acceptance_rate", "spec_decode_draft_acceptance_rate", "gauge",
             "Draft acceptance rate (accepted / drafted tokens)."),
            ("simulated", "spec_decode_simulated", "gauge",
             "1 when the acceptance is simulated (--simulate-acceptance-length), not the model's.")):
        full = family(name, kind, text)
        out.append(f"{full} {float(sd[key])!r}")


def parse(text: str) -> dict[str, float]:
    """Sample name (with labels) -> value, for tests and tools."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out
