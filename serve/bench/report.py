"""Printing a benchmark report the way trtllm-bench does, the sweep table, and the sweep plot (SVG, no plotting
dependency)."""
from __future__ import annotations

import math
from html import escape

RULE = "=" * 59


def _section(title: str, rows: list[tuple[str, object]]) -> str:
    width = max(len(k) for k, _ in rows) + 2
    body = "\n".join(f"{k + ':':<{width}}{_fmt(v)}" for k, v in rows)
    return f"{RULE}\n= {title}\n{RULE}\n{body}\n"


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4f}"
    return "n/a" if v is None else str(v)


def format_report(rep: dict) -> str:
    """The console form of one run's report (the sections and labels of trtllm-bench)."""
    e, m, w, r, p = rep["engine"], rep["machine"], rep["world_info"], rep["request_info"], rep["performance"]
    out = [_section("DSFLASH ENGINE DETAILS", [
        ("Model", e["model"]), ("Engine Directory", e["engine_dir"]), ("dsflash Version", e["version"]),
        ("Arch", e["arch"]), ("Dtype", e["dtype"]), ("KV Cache Dtype", e["kv_cache_dtype"]),
        ("Quantization", e["quantization"]), ("Max Sequence Length", e["max_sequence_length"])]),
        _section("MACHINE DETAILS", [("Name", m["name"]), ("Memory (GiB)", m["memory.total"])]),
        _section("REQUEST DETAILS", [
            ("Number of requests", r["num_requests"]), ("Failed requests (not counted)", r["num_failed_requests"]),
            ("Number of concurrent requests", r["avg_num_concurrent_requests"]),
            ("Average Input Length (tokens)", r["avg_input_length"]),
            ("Average Output Length (tokens)", r["avg_output_length"])]),
        _section("WORLD + RUNTIME INFORMATION", [
            ("TP Size", w["tp_size"]), ("PP Size", w["pp_size"]), ("EP Size", w["ep_size"]),
            ("Max Runtime Batch Size", w["max_batch_size"]), ("Max Runtime Tokens", w["max_num_tokens"]),
            ("Scheduling Policy", w["scheduling_policy"]), ("KV Memory Percentage", w["kv_cache_percentage"]),
            ("Issue Rate (req/sec)", w["issue_rate"]), ("Concurrency", w["concurrency"])])]
    perf = [("Request Throughput (req/sec)", p["request_throughput_req_s"]),
            ("Total Output Throughput (tokens/sec)", p["system_output_throughput_tok_s"]),
            ("Total Token Throughput (tokens/sec)", p["system_total_throughput_tok_s"]),
            ("Total Latency (ms)", p["total_latency_ms"]),
            ("Average request latency (ms)", p["avg_request_latency_ms"]),
            ("Per User Output Throughput [w/ ctx] (tps/user)", p["output_throughput_per_user_tok_s"]),
            ("Per GPU Output Throughput (tps/gpu)", p["output_throughput_per_gpu_tok_s"])]
    s = rep.get("streaming_metrics")
    if s:
        perf += [("Average time-to-first-token [TTFT] (ms)", s["avg_ttft_ms"]),
                 ("Average time-per-output-token [TPOT] (ms)", s["avg_tpot_ms"]),
                 ("Per User Output Speed (tps/user)", s["token_output_speed_tok_s"])]
        for label, key in (("TPOT", "tpot_percentiles"), ("TTFT", "ttft_percentiles"), ("GTPS", "gen_tps_percentiles")):
            perf += [(f"[{label}] {k.upper() if k[0] == 'p' else k.capitalize()}", v) for k, v in s[key].items()]
    perf += [(f"[Latency] {k.upper() if k[0] == 'p' else k.capitalize()}", v)
             for k, v in p["request_latency_percentiles_ms"].items()]
    out.append(_section("PERFORMANCE OVERVIEW", perf))
    d = rep.get("decoding_stats")
    if d and "acceptance_length_percentiles" in d:
        rows = [("Draft tokens per step", d["num_draft_tokens"])]
        for label, key in (("DT", "num_draft_tokens_percentiles"), ("ADT", "num_accepted_draft_tokens_percentiles"),
                           ("DAR", "draft_acceptance_rate_percentiles"), ("AL", "acceptance_length_percentiles")):
            rows += [(f"[{label}] {k.upper() if k[0] == 'p' else k.capitalize()}", v) for k, v in d[key].items()]
        if d.get("simulated_acceptance"):
            rows.append(("NOTE", "SIMULATED acceptance: outputs are not the model's"))
        out.append(_section(f"DECODING STATISTICS ({d['mode']})", rows))
    ds = rep["dataset"]
    out.append(_section("DATASET DETAILS", [(k, v) for k, v in ds.items()]))
    sim = rep.get("simulation")
    if sim:
        out.insert(0, _section("TP-RANK SIMULATION: SIMULATED FIGURES", [
            ("Simulated rank", f"{sim['simulated_rank']} of {sim['world_size']} (the other ranks assumed in step)"),
            ("Collectives", sim["collectives"]),
            ("Collective cost from", (sim["collective_cost"] or {}).get("source"))]))
    col = rep.get("collectives")
    if col:
        out.insert(-1, _section("COLLECTIVES (TP all-reduce, fp32)", [
            ("All-reduce calls", col["all_reduce_calls"]), ("All-reduce bytes", col["all_reduce_bytes"]),
            ("Added collective time (ms)", col["added_collective_ms"])]))
    return "\n".join(out)


SWEEP_COLUMNS = (("concurrency", "concurrency", "{}"), ("req/s", "request_throughput_req_s", "{:.3f}"),
                 ("tok/s/GPU", "tok_s_per_gpu", "{:.2f}"), ("tok/s/user", "tok_s_per_user", "{:.2f}"),
                 ("TTFT avg ms", "ttft_ms_avg", "{:.1f}"), ("TPOT p50 ms", "tpot_ms_p50", "{:.2f}"))


def format_sweep(rows: list[dict]) -> str:
    """One line per concurrency: the seed post's figures (tok/s/user = 1000 / median TPOT)."""
    head = [c for c, _, _ in SWEEP_COLUMNS]
    body = [[("n/a" if row[k] is None else f.format(row[k])) for _, k, f in SWEEP_COLUMNS] for row in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    line = lambda cells: "| " + " | ".join(c.rjust(wd) for c, wd in zip(cells, widths)) + " |"   # noqa: E731
    return "\n".join([line(head), "|" + "|".join("-" * (wd + 2) for wd in widths) + "|", *map(line, body)])


def _ticks(hi: float, n: int = 5) -> list[float]:
    """Round tick values from 0 to at least hi."""
    hi = hi if hi > 0 else 1.0
    raw = hi / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    return [i * step for i in range(int(math.ceil(hi / step)) + 1)]


def sweep_svg(rows: list[dict], title: str) -> str:
    """tok/s/GPU against tok/s/user, one labelled point per concurrency, joined in concurrency order."""
    pts = [(r["tok_s_per_user"], r["tok_s_per_gpu"], r["concurrency"]) for r in rows if r["tok_s_per_user"]]
    W, H, L, R, T, B = 640, 420, 70, 20, 40, 50
    xt = _ticks(max((x for x, _, _ in pts), default=1.0))
    yt = _ticks(max((y for _, y, _ in pts), default=1.0))
    sx = lambda x: L + (W - L - R) * x / xt[-1]            # noqa: E731
    sy = lambda y: H - B - (H - T - B) * y / yt[-1]        # noqa: E731
    el = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
          f'<rect width="{W}" height="{H}" fill="white"/>',
          f'<text x="{W / 2}" y="22" text-anchor="middle" font-size="14">{escape(title)}</text>']
    for x in xt:
        el.append(f'<line x1="{sx(x):.1f}" y1="{T}" x2="{sx(x):.1f}" y2="{H - B}" stroke="#ddd"/>'
                  f'<text x="{sx(x):.1f}" y="{H - B + 16}" text-anchor="middle">{x:g}</text>')
    for y in yt:
        el.append(f'<line x1="{L}" y1="{sy(y):.1f}" x2="{W - R}" y2="{sy(y):.1f}" stroke="#ddd"/>'
                  f'<text x="{L - 6}" y="{sy(y) + 4:.1f}" text-anchor="end">{y:g}</text>')
    el.append(f'<text x="{(L + W - R) / 2}" y="{H - 12}" text-anchor="middle">tok/s/user (1000 / median TPOT)</text>')
    el.append(f'<text transform="translate(16 {(T + H - B) / 2}) rotate(-90)" text-anchor="middle">'
              f'tok/s/GPU (output, prefill included)</text>')
    if len(pts) > 1:
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y, _ in pts)
        el.append(f'<polyline points="{path}" fill="none" stroke="#1f77b4" stroke-width="2"/>')
    for x, y, c in pts:
        el.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="4" fill="#1f77b4"/>'
                  f'<text x="{sx(x) + 6:.1f}" y="{sy(y) - 6:.1f}">c={c}</text>')
    el.append("</svg>\n")
    return "\n".join(el)


def format_serving(res: dict) -> str:
    """benchmark_serving's console block."""
    rows = [("Successful requests", res["completed"]), ("Failed requests", res["failed"]),
            ("Maximum request concurrency", res["max_concurrency"]), ("Benchmark duration (s)", res["duration"]),
            ("Total input tokens", res["total_input_tokens"]), ("Total generated tokens", res["total_output_tokens"]),
            ("Request throughput (req/s)", res["request_throughput"]),
            ("Output token throughput (tok/s)", res["output_throughput"]),
            ("Total Token throughput (tok/s)", res["total_token_throughput"])]
    lines = [f"{' Serving Benchmark Result ':=^50}", *(f"{k + ':':<40}{_fmt(v)}" for k, v in rows)]
    for key, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                       ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append(f"{title:-^50}")
        label = key.upper()
        lines += [f"{f'{s} {label} (ms):':<40}{res[f'{p}_{key}_ms']:.2f}"
                  for s, p in (("Mean", "mean"), ("Median", "median"), ("P99", "p99"))]
    lines.append("=" * 50)
    return "\n".join(lines)
