"""`make bench-kernels --merge`: which rows and tuned entries of an earlier results file a partial run replaces, and
that the file is replaced whole (CPU)."""
import json

import pytest

from dsflash.plugins.bench import merged_results, replaced_by_run, write_results


def _row(op: str, shape: str, m: int) -> dict:
    return {"op": op, "shape": shape, "M": m}


def test_merge_replaces_only_the_sections_and_token_counts_run():
    moe, gemm = _row("moe_experts[tuned]", "tp8 E384 k6 5120x288(pad 320)", 3), _row("fp8_gemm[tuned]", "wq_b", 3)
    assert replaced_by_run(moe, ["moe"], [1, 3, 8])
    assert not replaced_by_run(moe, ["moe"], [1, 8])
    assert not replaced_by_run(gemm, ["moe"], [3])
    assert not replaced_by_run(_row("v4_moe_experts[tuned]", "tp8 E256 k6 4096x256", 3), ["moe"], [3])
    assert replaced_by_run(_row("v4_moe_experts[tuned]", "tp8 E256 k6 4096x256", 3), ["moe_v4"], [3])


def test_merge_with_moe_shapes_keeps_the_other_shapes_rows():
    ep8 = _row("moe_w13_gemv", "ep8 E384/48 k6 5120x2304", 8)
    tp1 = _row("moe(router+experts)", "tp1 E384 k6 5120x2304", 8)
    router = _row("moe_router", "E384xD5120 top6", 8)   # timed by the TP1 shape only
    failed = {"op": "moe", "shape": "tp8", "M": 8, "error": "skipped: time budget"}
    assert replaced_by_run(ep8, ["moe"], [8], {"ep8"})
    assert not replaced_by_run(tp1, ["moe"], [8], {"ep8"})
    assert not replaced_by_run(router, ["moe"], [8], {"ep8"})
    assert not replaced_by_run(failed, ["moe"], [8], {"ep8"})
    assert replaced_by_run(router, ["moe"], [8], {"tp1", "ep8"}) and replaced_by_run(failed, ["moe"], [8], {"tp8"})
    assert replaced_by_run(_row("v4_moe_experts[tuned]", "ep8 E256/32 k6 4096x2048", 8), ["moe_v4"], [8], {"ep8"})


def test_merge_with_gemm_shapes_keeps_the_other_shapes_rows():
    w13 = _row("fp8_gemm[tuned]", "shexp_w13[tp1] 4608x5120", 8)
    wq_b = _row("bf16_cache_gemm", "wq_b[tp8] 4096x1280", 8)
    skipped = {"op": "fp8_gemm", "shape": "shexp_w13[tp1] 4608x5120", "M": 8, "error": "skipped: time budget"}
    only = {"shexp_w13[tp1]", "wo_b[tp1]"}
    assert replaced_by_run(w13, ["gemm"], [8], gemm_only=only) and replaced_by_run(skipped, ["gemm"], [8], None, only)
    assert not replaced_by_run(wq_b, ["gemm"], [8], gemm_only=only)
    assert replaced_by_run(wq_b, ["gemm"], [8])
    assert not replaced_by_run(_row("v4_fp8_gemm[tuned]", "wq_b[tp8] 4096x1024", 8), ["gemm"], [8], None, only)
    assert replaced_by_run(_row("v4_fp8_gemm[tuned]", "shexp_w13[tp1] 4096x4096", 8), ["gemm_v4"], [8], None, only)


def test_merge_keeps_the_other_buckets_tuned_entries():
    """A partial run's `tuned` entries replace only their own NxK@bucket keys (a merge once replaced the whole section,
    so a decode-only run dropped the large-M choices)."""
    shape = "wq_b[tp8] 4096x1280"
    old = {"rows": [_row("fp8_gemm[tuned]", shape, 4096), _row("fp8_gemm[tuned]", shape, 1)],
           "tuned": {"4096x1280@4096": {"path": "fp8", "config": {"block_q": 256}},
                     "4096x1280@1": {"path": "fp8", "config": {"gemv": True}}},
           "merged_runs": [{"command": "first"}]}
    run = {"rows": [_row("fp8_gemm[tuned]", shape, 1)], "command": "second",
           "tuned": {"4096x1280@1": {"path": "bf16cache", "config": {}}}}
    doc = merged_results(old, run, ["gemm"], [1])
    assert doc["tuned"] == {"4096x1280@4096": {"path": "fp8", "config": {"block_q": 256}},
                            "4096x1280@1": {"path": "bf16cache", "config": {}}}
    assert [r["M"] for r in doc["rows"]] == [4096, 1] and doc["rows"][1] is run["rows"][0]
    assert [r["command"] for r in doc["merged_runs"]] == ["first", "second"]
    assert merged_results(old, run | {"tuned": {}}, ["moe"], [1])["tuned"] == old["tuned"]


def test_results_file_is_replaced_whole(tmp_path, monkeypatch):
    """A write that fails midway leaves the earlier results file as it was."""
    out = tmp_path / "kernels.json"
    write_results(str(out), {"rows": [1]})
    assert json.loads(out.read_text()) == {"rows": [1]} and not (tmp_path / "kernels.json.part").exists()

    def broken(*_a, **_k):
        raise OSError("disk full")
    monkeypatch.setattr(json, "dump", broken)
    with pytest.raises(OSError, match="disk full"):
        write_results(str(out), {"rows": [2]})
    assert json.loads(out.read_text()) == {"rows": [1]}
