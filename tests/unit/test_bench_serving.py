"""benchmark_serving's result: counts, throughputs and numpy-percentile latencies from hand-made timings."""
import pytest

from dsflash.serve.bench.report import format_serving
from dsflash.serve.bench.stats import RequestRecord, serving_result

MS = 1_000_000


def rec(start, first, end, n_out, n_in=10, error=None):
    return RequestRecord(0, n_in, start_ns=start * MS, first_token_ns=first * MS, end_ns=end * MS,
                         num_output_tokens=n_out, error=error)


def test_serving_result_keys_and_values():
    done = [rec(0, 100, 1100, 11), rec(500, 700, 1700, 5, n_in=30)]
    failed = [rec(1800, 1800, 2000, 0, error="HTTP 400")]
    r = serving_result(done, failed, [100 * MS] * 10 + [250 * MS] * 4, concurrency=2)
    assert (r["completed"], r["failed"], r["max_concurrency"]) == (2, 1, 2)
    assert r["duration"] == pytest.approx(2.0)                # the failed request's end counts in the duration
    assert (r["total_input_tokens"], r["total_output_tokens"]) == (40, 16)
    assert r["request_throughput"] == pytest.approx(1.0) and r["output_throughput"] == pytest.approx(8.0)
    assert r["mean_ttft_ms"] == pytest.approx(150) and r["median_ttft_ms"] == pytest.approx(150)
    assert r["p99_ttft_ms"] == pytest.approx(100 + 0.99 * 100)          # numpy's linear interpolation
    assert r["mean_tpot_ms"] == pytest.approx(175)
    assert r["mean_itl_ms"] == pytest.approx((10 * 100 + 4 * 250) / 14) and r["median_itl_ms"] == pytest.approx(100)
    assert r["mean_e2el_ms"] == pytest.approx(1150)
    text = format_serving(r)
    for label in ("Successful requests:", "Benchmark duration (s):", "Output token throughput (tok/s):",
                  "Median TTFT (ms):", "P99 ITL (ms):", "Mean E2EL (ms):"):
        assert label in text, label
    with pytest.raises(ValueError, match="no request completed"):
        serving_result([], failed, [], 1)


def test_unreachable_or_malformed_base_url_is_named():
    """`bench serving`'s first request: a refused connection or a base URL that is not one fails as an OSError
    naming the URL (the CLI prints it and exits 1), not a bare urllib message."""
    import socket

    from dsflash.serve.bench.serving import server_model
    with socket.socket() as s:   # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(OSError, match=rf"cannot reach http://127.0.0.1:{port}/v1/models: .*refused"):
        server_model(f"http://127.0.0.1:{port}", None, timeout=5)
    with pytest.raises(OSError, match=r"notaurl/v1/models: .*--base-url takes http://HOST:PORT"):
        server_model("notaurl", None)
