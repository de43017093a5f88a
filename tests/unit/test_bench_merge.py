"""`make bench-kernels --merge`: which rows of an earlier results file a partial run replaces (CPU)."""
from dsflash.plugins.bench import replaced_by_run


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
