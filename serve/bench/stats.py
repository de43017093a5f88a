"""Per-request timings -> trtllm-bench's report (conventions.md §3.4-3.5).

Timestamps are `time.perf_counter_ns()` taken by the runner: a request starts when it is handed to the engine, its
first token and its end are stamped when the engine step that produced them returns. Warm-up and failed requests
never reach these functions.
"""
from __future__ import annotations

from dataclasses import dataclass, field

PERCENTILES = (("p50", 0.50), ("p90", 0.90), ("p95", 0.95), ("p99", 0.99))


@dataclass
class RequestRecord:
    task_id: int | str
    num_input_tokens: int
    start_ns: int = 0
    first_token_ns: int | None = None
    end_ns: int | None = None
    num_output_tokens: int = 0
    decode_iterations: int = 0          # engine steps that gave this request tokens (prefill's first token included)
    finish_reason: str | None = None
    error: str | None = None
    output_ids: list[int] = field(default_factory=list)
    spec: dict | None = None            # speculative engines: the request's acceptance (`Output.spec`)

    @property
    def ttft_ns(self) -> int:
        return self.first_token_ns - self.start_ns

    @property
    def latency_ns(self) -> int:
        return self.end_ns - self.start_ns

    @property
    def tpot_ns(self) -> float:
        """Mean time per output token after the first (0 for a one-token request)."""
        n = self.num_output_tokens - 1
        return (self.end_ns - self.first_token_ns) / n if n > 0 else 0.0

    @property
    def gen_tps(self) -> float:
        """Generation tokens per second of this user, first token excluded (0 for a one-token request)."""
        t = self.end_ns - self.first_token_ns
        return (self.num_output_tokens - 1) / t * 1e9 if self.num_output_tokens > 1 and t > 0 else 0.0

    def to_json(self) -> dict:
        """A `--request-json` row."""
        return {"task_id": self.task_id, "num_input_tokens": self.num_input_tokens, "start_timestamp": self.start_ns,
                "first_token_timestamp": self.first_token_ns, "end_timestamp": self.end_ns,
                "output_tokens": self.num_output_tokens, "decode_iteration": self.decode_iterations,
                "finish_reason": self.finish_reason, "error": self.error, "output_ids": self.output_ids,
                **({"speculative": self.spec} if self.spec is not None else {})}


def percentiles(values: list[float], scale: float = 1.0) -> dict:
    """trtllm-bench's percentile set: pXX = sorted[int(n·q)], plus minimum, maximum, average; values × scale."""
    s = sorted(values)
    out = {k: s[min(int(len(s) * q), len(s) - 1)] * scale for k, q in PERCENTILES}
    out.update(minimum=s[0] * scale, maximum=s[-1] * scale, average=sum(s) / len(s) * scale)
    return out


def summarize(records: list[RequestRecord], world_size: int, streaming: bool) -> dict:
    """The `request_info`, `performance` and (streaming) `streaming_metrics` sections, and `issue_rate` (req/s)."""
    if not records:
        raise ValueError("no request completed: nothing to report")
    first_start = min(r.start_ns for r in records)
    last_start = max(r.start_ns for r in records)
    total_ns = max(r.end_ns for r in records) - first_start
    n = len(records)
    n_in = sum(r.num_input_tokens for r in records)
    n_out = sum(r.num_output_tokens for r in records)
    lat = [r.latency_ns for r in records]
    per_s = 1e9 / total_ns
    out = {
        "issue_rate": n / ((last_start - first_start) / 1e9) if last_start > first_start else None,
        "request_info": {"num_requests": n, "avg_num_concurrent_requests": sum(lat) / total_ns,
                         "avg_input_length": n_in / n, "avg_output_length": n_out / n},
        "performance": {
            "total_latency_ms": total_ns / 1e6,
            "avg_request_latency_ms": sum(lat) / n / 1e6,
            "request_throughput_req_s": n * per_s,
            "system_output_throughput_tok_s": n_out * per_s,
            "system_total_throughput_tok_s": (n_in + n_out) * per_s,
            # every request's output tokens over its whole latency (prefill included: "[w/ ctx]")
            "output_throughput_per_user_tok_s": sum(r.num_output_tokens / r.latency_ns * 1e9 for r in records) / n,
            "output_throughput_per_gpu_tok_s": n_out * per_s / world_size,
            "request_latency_percentiles_ms": percentiles(lat, 1e-6),
        },
    }
    if streaming:
        tpot = [r.tpot_ns for r in records]
        gen = [r.gen_tps for r in records]
        out["streaming_metrics"] = {
            "token_output_speed_tok_s": sum(gen) / n,
            "avg_ttft_ms": sum(r.ttft_ns for r in records) / n / 1e6,
            "avg_tpot_ms": sum(tpot) / n / 1e6,
            "tpot_percentiles": percentiles(tpot, 1e-6),
            "ttft_percentiles": percentiles([r.ttft_ns for r in records], 1e-6),
            "gen_tps_percentiles": percentiles(gen),
        }
    return out


def decoding_stats(records: list[RequestRecord], mode: str, num_draft_tokens: int) -> dict:
    """trtllm-bench's `decoding_stats` of a speculative run, from each request's verify steps."""
    spec = [r.spec for r in records if r.spec is not None and r.spec.get("verify_steps")]
    if not spec:
        return {"mode": mode, "num_draft_tokens": num_draft_tokens}
    return {"mode": mode, "num_draft_tokens": num_draft_tokens,
            "num_draft_tokens_percentiles": percentiles([s["draft_tokens"] for s in spec]),
            "num_accepted_draft_tokens_percentiles": percentiles([s["accepted_draft_tokens"] for s in spec]),
            "draft_acceptance_rate_percentiles": percentiles([s["draft_acceptance_rate"] for s in spec]),
            "acceptance_length_percentiles": percentiles([s["acceptance_length"] for s in spec]),
            "simulated_acceptance": any(s.get("simulated_acceptance") for s in spec)}


def headline(report: dict) -> dict:
    """The seed post's two figures (design.md §5): tok/s/user = 1000 / median TPOT (ms), tok/s/GPU = output
    throughput (prefill included) / GPUs."""
    sm = report.get("streaming_metrics")
    p50 = sm["tpot_percentiles"]["p50"] if sm else None
    return {"concurrency": report["world_info"]["concurrency"],
            "tok_s_per_user": 1000.0 / p50 if p50 else None,
            "tok_s_per_gpu": report["performance"]["output_throughput_per_gpu_tok_s"],
            "ttft_ms_avg": sm["avg_ttft_ms"] if sm else None, "tpot_ms_p50": p50,
            "request_throughput_req_s": report["performance"]["request_throughput_req_s"]}


def serving_result(done: list[RequestRecord], failed: list[RequestRecord], itl_ns: list[int], concurrency: int
                   ) -> dict:
    """benchmark_serving's result keys (conventions.md §3.6): counts, duration, throughputs, and mean / median / p99
    of TTFT, TPOT, ITL (every gap between token-carrying chunks) and E2EL in ms; medians and p99 interpolate as
    numpy's percentile does. TPOT per request is (E2E − TTFT) / (output tokens − 1)."""
    import numpy as np
    if not done:
        raise ValueError("no request completed: nothing to report")
    t0 = min(r.start_ns for r in done + failed)
    duration_s = (max(r.end_ns for r in done + failed) - t0) / 1e9
    n_in = sum(r.num_input_tokens for r in done)
    n_out = sum(r.num_output_tokens for r in done)
    out = {"backend": "openai", "max_concurrency": concurrency, "completed": len(done), "failed": len(failed),
           "duration": duration_s, "total_input_tokens": n_in, "total_output_tokens": n_out,
           "request_throughput": len(done) / duration_s, "output_throughput": n_out / duration_s,
           "total_token_throughput": (n_in + n_out) / duration_s}
    series = {"ttft": [r.ttft_ns for r in done], "tpot": [r.tpot_ns for r in done if r.num_output_tokens > 1],
              "itl": list(itl_ns), "e2el": [r.latency_ns for r in done]}
    for name, values in series.items():
        v = np.asarray(values or [0], dtype=np.float64) / 1e6
        out.update({f"mean_{name}_ms": float(v.mean()), f"median_{name}_ms": float(np.median(v)),
                    f"p99_{name}_ms": float(np.percentile(v, 99))})
    return out
