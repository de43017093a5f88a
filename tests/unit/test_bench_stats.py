"""dsflash bench statistics: trtllm-bench's metric definitions on hand-made timings, and the report forms."""
import xml.etree.ElementTree as ET

import pytest

from dsflash.serve.bench.report import format_report, format_sweep, sweep_svg
from dsflash.serve.bench.stats import RequestRecord, decoding_stats, headline, percentiles, summarize

MS = 1_000_000


def rec(tid, n_in, start, first, end, n_out, spec=None):
    return RequestRecord(tid, n_in, start_ns=start * MS, first_token_ns=first * MS, end_ns=end * MS,
                         num_output_tokens=n_out, decode_iterations=n_out, finish_reason="length", spec=spec)


# two requests: A 0 -> first 100 -> end 1100 ms with 11 tokens, B 500 -> 700 -> 1700 ms with 5 tokens
RECORDS = [rec(0, 10, 0, 100, 1100, 11), rec(1, 30, 500, 700, 1700, 5)]


def test_percentiles_follow_trtllm_bench_indexing():
    p = percentiles([5, 1, 4, 2, 3])
    assert (p["p50"], p["p90"], p["p95"], p["p99"]) == (3, 5, 5, 5)       # sorted[int(n * q)]
    assert (p["minimum"], p["maximum"], p["average"]) == (1, 5, 3)
    assert percentiles([2.0, 4.0], scale=0.5)["average"] == 1.5


def test_summary_metrics_match_their_definitions():
    s = summarize(RECORDS, world_size=2, streaming=True)
    perf, info, st = s["performance"], s["request_info"], s["streaming_metrics"]
    assert perf["total_latency_ms"] == pytest.approx(1700)
    assert perf["request_throughput_req_s"] == pytest.approx(2 / 1.7)
    assert perf["system_output_throughput_tok_s"] == pytest.approx(16 / 1.7)
    assert perf["system_total_throughput_tok_s"] == pytest.approx(56 / 1.7)
    assert perf["output_throughput_per_gpu_tok_s"] == pytest.approx(16 / 1.7 / 2)
    assert perf["output_throughput_per_user_tok_s"] == pytest.approx((11 / 1.1 + 5 / 1.2) / 2)
    assert perf["avg_request_latency_ms"] == pytest.approx(1150)
    assert perf["request_latency_percentiles_ms"]["maximum"] == pytest.approx(1200)
    assert info == {"num_requests": 2, "avg_num_concurrent_requests": pytest.approx(2300 / 1700),
                    "avg_input_length": 20, "avg_output_length": 8}
    assert s["issue_rate"] == pytest.approx(2 / 0.5)
    assert st["avg_ttft_ms"] == pytest.approx(150)
    assert st["tpot_percentiles"]["minimum"] == pytest.approx(100)       # A: 1000 ms / 10
    assert st["tpot_percentiles"]["maximum"] == pytest.approx(250)       # B: 1000 ms / 4
    assert st["avg_tpot_ms"] == pytest.approx(175)
    assert st["token_output_speed_tok_s"] == pytest.approx((10 + 4) / 2)
    assert "streaming_metrics" not in summarize(RECORDS, 1, streaming=False)


def test_one_token_requests_have_no_tpot_and_empty_runs_are_refused():
    s = summarize([rec(0, 4, 0, 50, 50, 1)], 1, streaming=True)["streaming_metrics"]
    assert s["avg_tpot_ms"] == 0 and s["token_output_speed_tok_s"] == 0
    with pytest.raises(ValueError, match="no request completed"):
        summarize([], 1, streaming=False)


def test_decoding_stats_from_each_requests_acceptance():
    spec = [{"verify_steps": 4, "draft_tokens": 12, "accepted_draft_tokens": 6, "draft_acceptance_rate": 0.5,
             "acceptance_length": 2.5},
            {"verify_steps": 2, "draft_tokens": 6, "accepted_draft_tokens": 6, "draft_acceptance_rate": 1.0,
             "acceptance_length": 4.0, "simulated_acceptance": True}]
    d = decoding_stats([rec(0, 1, 0, 1, 9, 10, spec[0]), rec(1, 1, 0, 1, 9, 8, spec[1])], "dspark", 3)
    assert d["acceptance_length_percentiles"]["average"] == pytest.approx(3.25)
    assert d["draft_acceptance_rate_percentiles"]["minimum"] == 0.5
    assert d["simulated_acceptance"] is True and d["mode"] == "dspark"


def report(concurrency=4):
    s = summarize(RECORDS, 1, streaming=True)
    return {"engine": {"model": "DeepSeek-V4.1-Flash", "engine_dir": "/e", "version": "0", "arch": "cpu",
                       "dtype": "float32", "kv_cache_dtype": "auto", "quantization": "q", "max_sequence_length": 64},
            "machine": {"name": "cpu", "memory.total": 1.0},
            "world_info": {"tp_size": 1, "pp_size": 1, "ep_size": 1, "world_size": 1, "max_batch_size": 8,
                           "max_num_tokens": 64, "scheduling_policy": "fcfs", "kv_cache_percentage": None,
                           "issue_rate": s["issue_rate"], "concurrency": concurrency},
            "request_info": {**s["request_info"], "num_failed_requests": 0}, "performance": s["performance"],
            "streaming_metrics": s["streaming_metrics"], "dataset": {"num_requests": 2}}


def test_console_report_uses_trtllm_bench_labels():
    text = format_report(report())
    for label in ("= PERFORMANCE OVERVIEW", "Request Throughput (req/sec):", "Total Output Throughput (tokens/sec):",
                  "Per User Output Throughput [w/ ctx] (tps/user):", "Per GPU Output Throughput (tps/gpu):",
                  "Average time-to-first-token [TTFT] (ms):", "[TPOT] P50:", "[Latency] Maximum:",
                  "= WORLD + RUNTIME INFORMATION", "= DATASET DETAILS"):
        assert label in text, label
    assert "Total Latency (ms):" in text and "1700.0000" in text


def test_headline_table_and_plot():
    rows = [headline(report(1)), headline(report(8))]
    assert rows[0]["tok_s_per_user"] == pytest.approx(1000 / 250)     # p50 of (100, 250) is sorted[1]
    table = format_sweep(rows).splitlines()
    assert len(table) == 4 and "tok/s/user" in table[0] and table[2].split("|")[1].strip() == "1"
    svg = ET.fromstring(sweep_svg(rows, "t <&>"))
    ns = "{http://www.w3.org/2000/svg}"
    assert len(svg.findall(f"{ns}circle")) == 2 and len(svg.findall(f"{ns}polyline")) == 1
    assert {t.text for t in svg.findall(f"{ns}text")} >= {"c=1", "c=8", "t <&>"}
