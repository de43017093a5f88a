"""Build-time tuning: best config recorded with its measurements; lookups fall back visibly, once."""
import logging

import torch

from dsflash.build.tune import LM_HEAD, TunableOp, TunedTable, m_bucket, tune
from dsflash.plugins.lm_head import chunked_lm_head, lm_head_ref


def test_chunked_lm_head_matches_reference():
    x, w = torch.randn(3, 40), torch.randn(1001, 40)
    for chunk in (7, 256, 5000):
        assert torch.allclose(chunked_lm_head(x, w, chunk), lm_head_ref(x, w), atol=1e-5)


def test_tune_records_the_fastest_candidate():
    slow = {"delay": 3000}
    op = TunableOp("toy", lambda eng: [{"m": 1}], lambda b: [slow, {"delay": 1}],
                   lambda b, c: (lambda: sum(range(c["delay"] * 100))), {"delay": 1})
    data = tune({"model": {}}, "cpu", [op])
    (entry,) = data["entries"]
    assert entry["config"] == {"delay": 1} and len(entry["candidates"]) == 2
    assert entry["time_us"] == min(entry["candidates"].values())
    assert data["arch"] == "cpu" and "torch" in data["versions"]


def test_lookup_falls_back_and_logs_once(caplog):
    table = TunedTable({"entries": [{"op": "lm_head", "bucket": {"m": 1, "v": 10, "d": 4}, "config": {"chunk": 8192}}]})
    assert table.lookup("lm_head", {"m": 1, "v": 10, "d": 4}) == {"chunk": 8192}
    with caplog.at_level(logging.WARNING, logger="dsflash.tune"):
        for _ in range(3):
            assert table.lookup("lm_head", {"m": 64, "v": 10, "d": 4}) == LM_HEAD.fallback
    assert len([r for r in caplog.records if "no entry for lm_head" in r.getMessage()]) == 1


def test_m_buckets():
    assert [m_bucket(m) for m in (1, 2, 8, 9, 5000)] == [1, 8, 8, 64, 4096]
