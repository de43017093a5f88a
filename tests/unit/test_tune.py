"""Build-time tuning: best config recorded with its measurements; lookups fall back visibly, once; the FP8 GEMM's
shapes, skips on machines without the engine's GPU, and the serve-side table."""
import dataclasses
import json
import logging

import pytest
import torch

from dsflash.build import tune as tune_mod
from dsflash.build.gemm_shapes import dense_gemm_shapes
from dsflash.build.engine import default_plugins
from dsflash.build.plan import BuildConfig, expert_widths
from dsflash.build.tune import (FP8_GEMM, MOE, TUNABLE_OPS, TunableOp, gemm_table, m_bucket,
                                moe_table, tune)
from dsflash.model_def.config import get_preset
from dsflash.model_def.mapping import Mapping
from dsflash.model_def.names import tensor_table
from dsflash.plugins import moe_config, tuning

# a CPU-timed op of these tests' own (engines tune only GPU ops)
TOY = TunableOp("toy", lambda eng: [{"m": 1}], lambda b: [{"delay": 1}, {"delay": 2}],
                lambda b, c: (lambda: sum(range(c["delay"] * 100))), {"delay": 1})


def test_tune_records_the_fastest_candidate():
    slow = {"delay": 3000}
    op = TunableOp("toy", lambda eng: [{"m": 1}], lambda b: [slow, {"delay": 1}],
                   lambda b, c: (lambda: sum(range(c["delay"] * 100))), {"delay": 1})
    data = tune({"model": {}}, "cpu", [op])
    (entry,) = data["entries"]
    assert entry["config"] == {"delay": 1} and len(entry["candidates"]) == 2
    assert entry["time_us"] == min(entry["candidates"].values())
    assert data["arch"] == "cpu" and "torch" in data["versions"]


def test_tuned_json_is_checked_when_read(tmp_path, monkeypatch, caplog):
    """read_tuned: absent -> None; not JSON, no entries list, or an entry without op/bucket/config -> EngineError
    naming the file; timings from another GPU model are used with one warning."""
    from dsflash.build.engine import EngineError
    assert tune_mod.read_tuned(tmp_path) is None
    f = tmp_path / tune_mod.TUNED_FILE
    entry = {"op": "toy", "bucket": {"m": 1}, "config": {"delay": 2}}
    for text, why in [("{", "not valid JSON"), ("[]", "an \"entries\" list"), ('{"entries": {}}', "an \"entries\" list"),
                      (json.dumps({"entries": [entry, {"op": "toy", "bucket": {}}]}), "entries\\[1\\] lacks 'config'")]:
        f.write_text(text)
        with pytest.raises(EngineError, match=f"tuned.json: .*{why}"):
            tune_mod.read_tuned(tmp_path)
    f.write_text(json.dumps({"gpu": "NVIDIA H100 80GB HBM3", "entries": [entry]}))
    monkeypatch.setattr(tune_mod, "_this_gpu", lambda: "NVIDIA H200")
    with caplog.at_level(logging.WARNING, logger="dsflash.tune"):
        assert tune_mod.read_tuned(tmp_path)["entries"] == [entry]
    assert "timed on NVIDIA H100 80GB HBM3, this GPU is NVIDIA H200" in caplog.text
    caplog.clear()
    monkeypatch.setattr(tune_mod, "_this_gpu", lambda: "NVIDIA H100 80GB HBM3")
    with caplog.at_level(logging.WARNING, logger="dsflash.tune"):
        tune_mod.read_tuned(tmp_path)
    assert "timed on" not in caplog.text


def test_m_buckets():
    assert [m_bucket(m) for m in (1, 2, 8, 9, 5000)] == [1, 8, 8, 64, 4096]


# -- fp8_gemm: shapes, skip on machines without the target GPU, failures, the serve table --------------------------
def _engine(family="v41", tp=1, arch="sm90", layout="hopper", ep=1, disable=(), preset="tiny", **build) -> dict:
    """An engine.json dict as build/engine.py writes it (no weights needed)."""
    args, mapping = get_preset(family, preset), Mapping(world_size=tp, tp_size=tp, moe_ep_size=ep)
    return {"model": args.to_hf_dict(), "mapping": mapping.to_dict(),
            "build_config": BuildConfig(**build).__dict__, "arch": arch, "layout": layout,
            "expert_dtype": "fp4", **expert_widths(args, mapping, arch),
            "plugins": default_plugins(arch, tuple(disable), family)}


@pytest.mark.parametrize("tp", [1, 2])
def test_dense_gemm_shapes_v41(tp):
    a = get_preset("v41", "tiny")
    D, q, H, d, ih, hd, I = (a.hidden_size, a.q_lora_rank, a.num_attention_heads, a.head_dim, a.index_n_heads,
                             a.index_head_dim, a.moe_intermediate_size)
    table = {e.name: e.shape for e in tensor_table(a)}
    engram, main = table["layers.1.engram.wkv.weight"], table["mtp.0.main_proj.weight"]  # replicated
    layers = {(q + d, D), (H * d // tp, q), (d, D), (D, a.o_groups * a.o_lora_rank // tp), (2 * I // tp, D),
              (D, I // tp), (ih * hd // tp, q), engram}  # [wq_a; wkv], wq_b, wkv (a draft stage's window rows),
    # wo_b, shared [w1; w3], w2, indexer wq_b, engram wkv
    shapes = dense_gemm_shapes(_engine(tp=tp))
    assert {(s["n"], s["k"]) for s in shapes} == layers | {main}
    assert len(shapes) == len(layers | {main})  # distinct
    # every layers.* shape has BF16 copies; the DSpark main_proj (mtp.* only) has none
    assert {(s["n"], s["k"]) for s in shapes if s["bf16_cache"]} == layers
    names = {n for s in shapes for n in s["names"]}
    assert "layers.0.attn.wq_b.weight" in names and "mtp.0.attn.wq_b.weight" in names
    assert not any(n.endswith("attn.wo_a.weight") for n in names)  # run by the WO-A plugin, not as a linear
    assert not any(n.endswith("shared_experts.w3.weight") for n in names)   # stacked under w1's name
    # wq_a runs only stacked with wkv
    assert all(s["n"] == q + d for s in shapes if any(n.endswith("attn.wq_a.weight") for n in s["names"]))
    (wq_b,) = [s for s in shapes if "layers.0.attn.wq_b.weight" in s["names"]]
    assert (wq_b["n"], wq_b["k"]) == (H // tp * d, q)


def test_dense_gemm_shapes_other_layouts_and_families():
    v4 = dense_gemm_shapes(_engine(family="v4"))   # 1×128 / 128×128 groups, read in the kernels' 32×32 format
    a = get_preset("v4", "tiny")
    assert v4 and {s["group"] for s in v4} == {128} and not any(s["bf16_cache"] for s in v4)
    assert (a.q_lora_rank, a.hidden_size) in {(s["n"], s["k"]) for s in v4}   # wq_a (64 rows: no 128-row block)
    full = {(s["n"], s["k"]) for s in dense_gemm_shapes(_engine(family="v4", preset="full"))}
    f = get_preset("v4", "full")
    assert (f.q_lora_rank + f.head_dim, f.hidden_size) in full and (f.q_lora_rank, f.hidden_size) not in full
    assert not any(n.endswith("attn.wo_a.weight") for s in v4 for n in s["names"])   # a BF16 einsum in V4
    # its shared expert (64 wide) is no whole 128-row block: w1 and w3 run apart, one shape
    assert (a.moe_intermediate_size, a.hidden_size) in {(s["n"], s["k"]) for s in v4}
    buckets = FP8_GEMM.buckets(_engine(family="v4"))
    assert buckets and all(b["group"] == 128 for b in buckets)
    assert any(c["config"]["kgroups"] == 4 and not c["config"]["dequant_bf16"]
               for c in FP8_GEMM.candidates(buckets[-1]) if c["path"] == "fp8")
    assert all("group" not in b for b in FP8_GEMM.buckets(_engine()))   # V4.1 buckets keep their form
    ref = dense_gemm_shapes(_engine(arch="cpu", layout="reference"))
    assert ref and not any(s["bf16_cache"] for s in ref)  # only hopper engines hold BF16 copies


def test_fp8_gemm_buckets_and_candidates():
    assert FP8_GEMM in TUNABLE_OPS["sm90"] and FP8_GEMM not in TUNABLE_OPS["cpu"]
    eng = _engine(max_num_tokens=100)
    shapes = dense_gemm_shapes(eng)
    buckets = FP8_GEMM.buckets(eng)
    assert len(buckets) == 3 * len(shapes) and {b["m"] for b in buckets} == {1, 8, 64}
    assert {b["m"] for b in FP8_GEMM.buckets(_engine(max_num_tokens=1))} == {1}
    for b in buckets[:len(shapes)]:
        cands = FP8_GEMM.candidates(b)
        fp8 = [c for c in cands if c["path"] == "fp8"]
        # every candidate an engine can run: not the `tiled_w` ones (engines hold the plain [N, K] weight)
        want = [c for c in tuning.candidates(b["n"], b["k"], b["m"]) if not c.tiled_w]
        assert [tuning.GemmConfig.from_dict(c["config"]) for c in fp8] == want and want
        assert ({"path": "bf16cache"} in cands) == b["bf16_cache"]


def test_sm90_engine_on_cpu_machine_skips_fp8_gemm_and_logs_once(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="dsflash.tune"):
        data = tune(_engine(), "sm90", TUNABLE_OPS["sm90"] + [TOY])
    assert [s["op"] for s in data["skipped"]] == ["fp8_gemm", "moe"]
    assert all("without an sm90 GPU" in s["reason"] and set(s) == {"op", "reason"} for s in data["skipped"])
    assert {e["op"] for e in data["entries"]} == {"toy"}  # CPU-timed ops still tune
    for op in ("fp8_gemm", "moe"):
        msgs = [r.getMessage() for r in caplog.records if f"{op} not tuned" in r.getMessage()]
        assert len(msgs) == 1 and "serve will use the default configs" in msgs[0]
    # serve: every shape falls back to the default, logged by tuning.lookup / moe_config.lookup
    assert gemm_table(data) == {} and moe_table(data) == {}


def test_wrong_gpu_arch_is_not_tuned(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (8, 0))
    assert "sm80" in tune_mod._cannot_measure(FP8_GEMM, "sm90")
    assert tune_mod._cannot_measure(TOY, "sm90") is None


def _raise(msg):
    raise RuntimeError(msg)


def test_tune_records_failed_candidates_without_crashing(caplog):
    def make(bucket, cfg):
        if cfg["c"] == "bad-make":
            _raise("compile error")
        if cfg["c"] == "bad-run" or bucket["m"] == 2:
            return lambda: _raise("launch error")
        return lambda: None
    op = TunableOp("toy", lambda eng: [{"m": 1}, {"m": 2}],
                   lambda b: [{"c": "bad-make"}, {"c": "bad-run"}, {"c": "ok"}], make, {"c": "ok"})
    with caplog.at_level(logging.WARNING, logger="dsflash.tune"):
        data = tune({"model": {}}, "cpu", [op])
    (entry,) = data["entries"]
    assert entry["bucket"] == {"m": 1} and entry["config"] == {"c": "ok"} and list(entry["candidates"]) == ['{"c": "ok"}']
    assert set(entry["failed"]) == {'{"c": "bad-make"}', '{"c": "bad-run"}'}
    assert "compile error" in entry["failed"]['{"c": "bad-make"}']
    assert data["skipped"] == [{"op": "toy", "reason": "every candidate failed", "buckets": [{"m": 2}]}]


def test_gpu_candidates_are_timed_together_and_a_failing_one_is_isolated(monkeypatch):
    """A GPU bucket's candidates are all made first, then timed in one interleaved call (`_cuda_times_us`: the card's
    clock falls within ~50 ms of full load, so candidates timed one after another would meet different clocks); if
    that call fails, each is timed alone and only the failing one is recorded."""
    batches = []

    def times_of(fns):
        batches.append(len(fns))
        return [fn() for fn in fns]   # a runnable here returns its own "time"

    monkeypatch.setattr(tune_mod, "_cuda_times_us", times_of)

    def make(bucket, cfg):
        return (lambda: _raise("launch error")) if cfg["c"] == "bad-run" else (lambda: float(cfg["c"]))
    op = TunableOp("toy", lambda eng: [{"m": 1}], lambda b: [{"c": 3}, {"c": 1}, {"c": 2}], make, {"c": 1},
                   device="cuda")
    entry, failed = tune_mod._tune_bucket(op, {"m": 1})
    assert batches == [3] and entry["config"] == {"c": 1} and entry["time_us"] == 1.0 and not failed
    batches.clear()
    op = dataclasses.replace(op, candidates=lambda b: [{"c": 3}, {"c": "bad-run"}, {"c": 2}])
    entry, failed = tune_mod._tune_bucket(op, {"m": 1})
    assert batches == [3, 1, 1, 1] and entry["config"] == {"c": 2}
    assert list(failed) == ['{"c": "bad-run"}'] and "launch error" in failed['{"c": "bad-run"}']


def test_time_budget_skips_the_remaining_buckets(caplog):
    op = TunableOp("toy", lambda eng: [{"m": 1}, {"m": 8}], lambda b: [{"c": 1}], lambda b, c: (lambda: None), {"c": 1})
    with caplog.at_level(logging.WARNING, logger="dsflash.tune"):
        data = tune({"model": {}, "build_config": {"tune_budget_s": 0}}, "cpu", [op])
    assert data["entries"] == []
    assert data["skipped"] == [{"op": "toy", "reason": "time budget spent", "buckets": [{"m": 1}, {"m": 8}]}]
    assert any("budget" in r.getMessage() and "'m': 8" in r.getMessage() for r in caplog.records)


def _gemm_entry(n, k, m, won, timed):
    """A tuned.json fp8_gemm entry; timed: [(candidate, time_us)]."""
    return {"op": "fp8_gemm", "bucket": {"n": n, "k": k, "m": m, "bf16_cache": True}, "config": won,
            "time_us": min(t for _, t in timed), "candidates": {tune_mod._key(c): t for c, t in timed}}


def test_serve_lookups_derive_a_default_once_per_call_shape(monkeypatch, caplog):
    """A default config is derived once per (shape, M, arch, group) and kept until a table is installed; the
    fallback is still logged once per bucket."""
    calls = []
    real = tuning.default_config
    monkeypatch.setattr(tuning, "default_config", lambda *a: calls.append(a) or real(*a))
    tuning.set_table({})
    try:
        with caplog.at_level(logging.WARNING, logger=tuning.log.name):
            first = [tuning.lookup(512, 256, m, "sm90") for m in (1, 1, 3, 3, 1)]
        assert calls == [(512, 256, 1, "sm90", 32), (512, 256, 3, "sm90", 32)]
        assert first[0] is first[1] is first[4] and first[0] == ("fp8", real(512, 256, 1, "sm90"))
        msgs = [r.getMessage() for r in caplog.records]
        assert [sum("512x256@1:" in m for m in msgs), sum("512x256@4:" in m for m in msgs)] == [1, 1]
        tuned = tuning.GemmConfig(64, 16, 2, 4, 6, swap_ab=True)
        tuning.set_table({"512x256@4": {"path": "fp8", "config": tuned.to_dict()}})
        assert tuning.lookup(512, 256, 3, "sm90") == ("fp8", tuned)     # the install dropped the kept answers
    finally:
        tuning.set_table(None)


def test_gemm_table_expands_tuned_buckets_to_pow2():
    fast, slow = tuning.GemmConfig(64, 16, 2, 4, 6, swap_ab=True), tuning.default_config(512, 64, 1)
    f8_fast, f8_slow = {"path": "fp8", "config": fast.to_dict()}, {"path": "fp8", "config": slow.to_dict()}
    bf = {"path": "bf16cache"}
    tuned = {"entries": [
        _gemm_entry(512, 64, 1, f8_fast, [(f8_fast, 3.0), (f8_slow, 4.0), (bf, 5.0)]),
        _gemm_entry(512, 64, 8, f8_slow, [(f8_slow, 3.0), (bf, 5.0)]),
        _gemm_entry(512, 64, 64, bf, [(f8_slow, 9.0), (f8_fast, 8.0), (bf, 5.0)]),
        {"op": "toy", "bucket": {"m": 1}, "config": {"delay": 2}}]}
    table = gemm_table(tuned)
    covered_by = {1: 1, 2: 8, 4: 8, 8: 8, 16: 64, 32: 64, 64: 64}
    # buckets above the largest tuned M are left to the default config (logged): a small-M config may not run them
    assert set(table) == {f"512x64@{b}" for b in covered_by}
    for b, m in covered_by.items():
        assert table[f"512x64@{b}"] == table[f"512x64@{m}"]
    assert table["512x64@1"] == {"path": "fp8", "config": fast.to_dict()}
    assert table["512x64@4"] == {"path": "fp8", "config": slow.to_dict()}
    # a BF16-cache winner carries the fastest FP8 config, for same-shape linears without a BF16 copy
    assert table["512x64@64"] == {"path": "bf16cache", "config": fast.to_dict()}
    try:
        tuning.set_table(table)
        assert tuning.lookup(512, 64, 3) == ("fp8", slow)
        assert tuning.lookup(512, 64, 40) == ("bf16cache", fast)
        assert tuning.lookup(512, 64, 5000) == ("fp8", tuning.default_config(512, 64, 5000))
    finally:
        tuning.set_table(None)


def test_missing_decode_entry_falls_back_to_the_gluon_kernel_on_sm90(caplog):
    """A shape build did not tune falls back (logged once) to the arch's default: on sm90, M <= 8 and K % 128 == 0,
    the Gluon decode kernel with PDL, the fewest K slices and the ring its tile count calls for; elsewhere (another
    arch, K % 128 != 0, larger M) the Triton default."""
    tp8_w13 = tuning.default_config(576, 5120, 4, "sm90")       # 9 row tiles: K is split, deep stages
    assert tp8_w13 == tuning.gluon_decode_default(576, 5120) and tp8_w13.tag() == "LT64x8b4s10st2_pdl"
    assert tuning.default_config(32768, 1280, 1, "sm90").tag() == "LT64x8b1s1st3_pdl"   # 512 tiles: no split
    for n, k in ((5120, 8192), (4096, 1280), (1056, 2304)):
        d = tuning.default_config(n, k, 8, "sm90")
        assert d in tuning.candidates(n, k, 8) and d.pdl and not d.quant_in_kernel
    for args in ((576, 5120, 4, "sm100"), (576, 5120, 4, None), (576, 5120, 16, "sm90"), (5120, 288, 8, "sm90")):
        assert not tuning.default_config(*args).gluon, args
    with caplog.at_level(logging.INFO, logger="dsflash.plugins.tuning"):
        tuning.set_table({})
        try:
            assert tuning.lookup(576, 5120, 3, "sm90") == ("fp8", tuning.gluon_decode_default(576, 5120))
            assert tuning.lookup(576, 5120, 4, "sm90")[1].gluon
        finally:
            tuning.set_table(None)
    assert sum("576" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.gpu
def test_fp8_gemm_tunes_on_the_gpu():
    """On an sm90 GPU: every bucket gets an entry whose winner ran and verified, and the serve table covers it."""
    eng, data = _tuned_on_gpu(FP8_GEMM)
    table = gemm_table(data)
    # buckets 1, 2, 4, ..., 64 (max_num_tokens): gemm_table never extends a tuned bucket upward
    assert len(table) == 7 * len(dense_gemm_shapes(eng))


# -- moe: the MXFP4 expert kernels' tiles -------------------------------------------------------------------------------
def test_moe_buckets_and_candidates():
    assert MOE in TUNABLE_OPS["sm90"] and MOE not in TUNABLE_OPS["cpu"]
    a = get_preset("v41", "tiny")
    eng = _engine(tp=2, max_num_tokens=100)
    buckets = MOE.buckets(eng)
    assert [b["m"] for b in buckets] == [1, 8, 64]
    local = a.moe_intermediate_size // 2
    for b in buckets:
        assert (b["e"], b["d"], b["topk"], b["inter_valid"]) == (a.n_routed_experts, a.hidden_size,
                                                                  a.num_experts_per_tok, local)
        assert b["inter"] == eng["expert_inter_padded"] >= local and b["inter"] % 32 == 0
        cands = MOE.candidates(b)
        want = moe_config.moe_candidates(b["m"], b["topk"], b["e"], b["inter"], b["d"], arch="sm90")
        assert [moe_config.MoeConfig.from_dict(c) for c in cands] == want
        assert cands[0] == moe_config.default_moe_config(b["m"], b["topk"], b["e"], b["inter"], b["d"],
                                                         arch="sm90").to_dict()
    # every decode candidate's w2 K step fits the intermediate (one TP8 rank: 320; TP1: 2304)
    for inter in (320, 2304):
        assert all(c.gemv and c.bk2 <= inter for c in moe_config.moe_candidates(8, 6, 384, inter, 5120))
    # expert parallelism: one rank's block of experts, its share of the routing (the GEMV splits size for it)
    ep_buckets = MOE.buckets(_engine(ep=2, tp=2))
    assert [b["m"] for b in ep_buckets] == [b["m"] for b in MOE.buckets(_engine(tp=2))]
    for b in ep_buckets:
        assert (b["e"], b["ep"], b["inter_valid"]) == (a.n_routed_experts // 2, 2, a.moe_intermediate_size)
        cands = [moe_config.MoeConfig.from_dict(c) for c in MOE.candidates(b)]
        assert cands == moe_config.moe_candidates(b["m"], b["topk"], b["e"], b["inter"], b["d"], 2, arch="sm90")
    # at EP8 a decode step runs ~1/8 of the pairs: GEMV up to 2 pairs per expert of all 384, split-K for the share
    ep8 = moe_config.default_moe_config(64, 6, 48, 2304, 5120, ep=8)
    assert ep8.gemv and ep8 == moe_config.default_moe_config(8, 6, 384, 2304, 5120)
    assert not moe_config.default_moe_config(257, 6, 48, 2304, 5120, ep=8).gemv
    assert moe_config.key_str(48, 2304, 5120, 6, 8, ep=8) == "E48xI2304xD5120k6ep8@8"
    assert moe_config.key_str(384, 2304, 5120, 6, 8) == "E384xI2304xD5120k6@8"
    # where the engine does not bind the MoE plugin there is nothing to tune
    assert MOE.buckets(_engine(disable=("moe",))) == []
    assert MOE.buckets(_engine(arch="cpu")) == []
    no_norm = _engine()
    no_norm["model"]["text_config"]["norm_topk_prob"] = False
    assert MOE.buckets(no_norm) == []


def test_moe_decode_configs_take_no_pdl():
    """PDL on the MoE GEMVs costs 1-3 µs per layer inside a decode step (benchmarks/README.md, session 15), which
    build's timing (a launch chained to its own twin) does not see: neither the default rule nor a candidate takes it,
    at one TP8 rank (the Gluon w2), TP1, an EP8 rank and V4's 1×128 activations."""
    for t in (1, 3, 8, 64):
        for shape in [(384, 320, 5120, 1), (384, 2304, 5120, 1), (48, 2304, 5120, 8)]:
            e, inter, d, ep = shape
            assert not moe_config.default_moe_config(t, 6, e, inter, d, ep).pdl
            assert not any(c.pdl for c in moe_config.moe_candidates(t, 6, e, inter, d, ep))
        assert not any(c.pdl for c in moe_config.moe_candidates(t, 6, 256, 256, 4096, qblock=128))
    assert moe_config.default_moe_config(3, 6, 384, 320, 5120).rows2


def test_moe_tensor_core_w13_is_opt_in():
    """The tensor-core w13 (`moe_tc`: session 20 1.05-1.3x slower than the GEMV on the H200; session 46's TMA ring
    matches it at one TP8 rank's M = 3, 1.10x slower at M = 8) is reachable only through an explicit config: its flag
    shows in the tag and survives tuned.json, old entries read as off, fp32 sums drop it, and neither the default rule
    nor a candidate takes it."""
    c = dataclasses.replace(moe_config.default_moe_config(3, 6, 384, 320, 5120), tc13=True, split13=3)
    assert c.tag().endswith("_rows_tc13") and moe_config.MoeConfig.from_dict(c.to_dict()) == c
    old = {k: v for k, v in c.to_dict().items() if k != "tc13"}
    assert not moe_config.MoeConfig.from_dict(old).tc13
    assert not moe_config.fp32_sums(c).tc13
    for t in (1, 3, 8, 64, 257):
        for e, inter, d, ep in [(384, 320, 5120, 1), (384, 2304, 5120, 1), (48, 2304, 5120, 8)]:
            assert not moe_config.default_moe_config(t, 6, e, inter, d, ep).tc13
            assert not any(c.tc13 for c in moe_config.moe_candidates(t, 6, e, inter, d, ep))


def test_moe_unrolled_w13_is_a_short_slice_candidate():
    """The w13 GEMV with its K slices unrolled (`unroll13`, session 21: up to 5 % faster at one EP8 rank's M = 1 and
    one TP8 rank's M = 3, 1.5x slower with 20 steps in a slice) is a build candidate only where a slice holds at most
    UNROLL_MAX_STEPS whole steps; the kernel keeps its loop for any other config with the flag; no default takes it."""
    c = dataclasses.replace(moe_config.default_moe_config(3, 6, 384, 320, 5120), unroll13=True, split13=4)
    assert c.tag().endswith("_rows_u13") and moe_config.MoeConfig.from_dict(c.to_dict()) == c
    assert not moe_config.MoeConfig.from_dict({k: v for k, v in c.to_dict().items() if k != "unroll13"}).unroll13
    steps = moe_config.unrolled_steps
    split = {s: dataclasses.replace(c, split13=s) for s in (2, 3, 4)}
    assert steps(split[4], 5120, 320) == 5 and steps(split[2], 5120, 320) == 0    # 10 steps: the loop
    assert steps(split[3], 5120, 320) == 0 and steps(split[4], 5120, 300) == 0    # uneven slices, masked tiles
    assert steps(dataclasses.replace(c, unroll13=False), 5120, 320) == 0
    assert steps(dataclasses.replace(c, acc16=False), 5120, 320) == 0
    for t in (1, 3, 8, 64, 257):
        for e, inter, d, ep in [(384, 320, 5120, 1), (384, 2304, 5120, 1), (48, 2304, 5120, 8)]:
            assert not moe_config.default_moe_config(t, 6, e, inter, d, ep).unroll13
            for cand in moe_config.moe_candidates(t, 6, e, inter, d, ep):
                if cand.unroll13:
                    assert 0 < steps(cand, d, inter) <= 8, cand.tag()
    tagged = {t: [c.tag() for c in moe_config.moe_candidates(t, 6, 384, 320, 5120) if c.unroll13] for t in (3, 8)}
    assert tagged[3] == ["gemv16_13n32k256w4x4_2n256k128w4x1_s3/1_rows_u13"] and tagged[8] == []


def test_moe_narrow_experts_sum_in_fp32():
    """f16 in-block sums (`acc16`) only where a token's h has at least ACC16_MIN_H values (top-k × intermediate): the
    tiny engines' experts (2 × 64, V4 tiny 2 × 128, tiny-wide 4 × 128) get the fp32 GEMV in the default and in every
    candidate, with the flags that need f16 sums off; V4.1 (one TP8 rank 6 × 320, TP1 6 × 2304) and the mid engine
    (6 × 512) keep the f16 default."""
    for t, topk, e, inter, d, qb in [(1, 2, 8, 64, 128, 32), (5, 2, 8, 64, 128, 32), (8, 4, 16, 128, 256, 32),
                                     (1, 2, 8, 128, 128, 128), (3, 2, 8, 64, 128, 32)]:
        cands = moe_config.moe_candidates(t, topk, e, inter, d, qblock=qb)
        assert cands[0] == moe_config.default_moe_config(t, topk, e, inter, d, qblock=qb)
        assert cands[0].gemv and not any(c.acc16 or c.rows2 or c.unroll13 or c.tc13 for c in cands), (t, topk, inter)
    for t, topk, e, inter, d in [(3, 6, 384, 320, 5120), (1, 6, 384, 2304, 5120), (1, 6, 32, 512, 1024)]:
        assert moe_config.default_moe_config(t, topk, e, inter, d).acc16
        assert any(c.acc16 for c in moe_config.moe_candidates(t, topk, e, inter, d))
    wide = moe_config.default_moe_config(3, 6, 384, 320, 5120)
    assert moe_config.sums_for_width(wide, 6, 320) == wide
    assert moe_config.sums_for_width(wide, 2, 320) == dataclasses.replace(wide, acc16=False, rows2=False)


def test_moe_w2_alone_with_pdl_is_opt_in():
    """w2 alone launched with PDL (`pdl2`, session 22): the op alone up to 6 % faster, but in a decode step, with the
    shared expert on its side stream, nothing gained at T = 1 / 3 and 2.4 µs per layer lost at T = 8. So it is reached
    only through an explicit config: its flag shows in the tag and survives tuned.json, old entries read as off, and
    neither the default rule nor a candidate takes it (nor `pdl`, which launches both GEMVs so)."""
    c = dataclasses.replace(moe_config.default_moe_config(3, 6, 384, 320, 5120), pdl2=True)
    assert c.tag().endswith("_pdl2_rows") and moe_config.MoeConfig.from_dict(c.to_dict()) == c
    assert not moe_config.MoeConfig.from_dict({k: v for k, v in c.to_dict().items() if k != "pdl2"}).pdl2
    for t in (1, 3, 8, 64, 257):
        for e, inter, d, ep in [(384, 320, 5120, 1), (384, 2304, 5120, 1), (48, 2304, 5120, 8)]:
            assert not moe_config.default_moe_config(t, 6, e, inter, d, ep).pdl2
            assert not any(x.pdl2 or x.pdl for x in moe_config.moe_candidates(t, 6, e, inter, d, ep))


def test_moe_gemv_split_counts():
    """The decode GEMVs' K-slice counts are the ones they launch: no slice of cdiv(k_iters, split) steps left empty
    (6 of 20 steps -> 5 slices); an EP8 rank's few pairs split w2 too (session 19: x3 / x3 / x2 at M = 1 / 3 / 8,
    the pass 1.9-6.8 % faster than with one slice, benchmarks/moe_split_ab_s19_h200.json), TP1 and a TP8 rank do
    not."""
    for k_iters in range(1, 41):
        for tiles in (1, 7, 60, 480, 5000):
            for target in (400, 1000):
                s = moe_config._gemv_split(tiles, k_iters, target, 16)
                per = -(-k_iters // s)
                assert 1 <= s <= max(1, k_iters // 2) and (s - 1) * per < k_iters, (k_iters, tiles, target, s)
    assert moe_config._gemv_split(60, 20) == 5
    ep8 = [moe_config.default_moe_config(t, 6, 48, 2304, 5120, ep=8) for t in (1, 3, 8)]
    assert [(c.split13, c.split2) for c in ep8] == [(5, 3), (4, 3), (2, 2)]
    assert all(moe_config.default_moe_config(t, 6, 384, 2304, 5120).split2 == 1 for t in (1, 3, 8))
    assert all(moe_config.default_moe_config(t, 6, 384, 320, 5120).rows2 for t in (1, 3, 8))


def test_moe_table_covers_buckets_and_lookup_falls_back_once(caplog):
    shape = {"e": 16, "inter": 64, "inter_valid": 48, "d": 256, "topk": 2, "swiglu_limit": 10.0}
    c1 = moe_config.default_moe_config(1, 2, 16, 64, 256)
    c8 = dataclasses.replace(c1, split13=3, pdl=True)
    tuned = {"entries": [{"op": "moe", "bucket": {**shape, "m": 1}, "config": c1.to_dict()},
                         {"op": "moe", "bucket": {**shape, "m": 8}, "config": c8.to_dict()},
                         {"op": "toy", "bucket": {"m": 1}, "config": {"delay": 2}}]}
    table = moe_table(tuned)
    assert set(table) == {moe_config.key_str(16, 64, 256, 2, b) for b in (1, 2, 4, 8)}
    try:
        moe_config.set_table(table)
        assert moe_config.lookup(1, 2, 16, 64, 256) == c1
        assert moe_config.lookup(3, 2, 16, 64, 256) == c8
        with caplog.at_level(logging.WARNING, logger="dsflash.plugins.moe_config"):
            for _ in range(3):   # 20 tokens: bucket 32 was not tuned -> the default rule, said once
                assert moe_config.lookup(20, 2, 16, 64, 256) == moe_config.default_moe_config(20, 2, 16, 64, 256)
        assert len([r for r in caplog.records if "no tuned entry" in r.getMessage()]) == 1
        # an EP engine's entries are its own keys: the same local shape without EP is another table row
        c_ep = dataclasses.replace(c1, split13=5)
        moe_config.set_table(moe_table({"entries": [{"op": "moe", "bucket": {**shape, "m": 1, "ep": 4},
                                                     "config": c_ep.to_dict()}]}))
        assert moe_config.lookup(1, 2, 16, 64, 256, ep=4) == c_ep
        assert moe_config.lookup(1, 2, 16, 64, 256) == moe_config.default_moe_config(1, 2, 16, 64, 256)
    finally:
        moe_config.set_table(None)


@pytest.mark.gpu
def test_moe_tunes_on_the_gpu():
    """On an sm90 GPU: every MoE bucket gets a verified winner, and the serve table covers the tuned buckets."""
    _, data = _tuned_on_gpu(MOE)
    assert all("failed" not in e for e in data["entries"])
    assert len(moe_table(data)) == 7   # token buckets 1, 2, 4, ..., 64


@pytest.mark.gpu
def test_moe_tunes_an_ep_rank_on_the_gpu():
    """An EP2 rank's block of experts, routed over all of them: verified winners under the EP keys."""
    _, data = _tuned_on_gpu(MOE, tp=2, ep=2)
    assert all("failed" not in e and e["bucket"]["ep"] == 2 for e in data["entries"])
    assert all("ep2@" in k for k in moe_table(data))


def _tuned_on_gpu(op: TunableOp, **mapping) -> tuple[dict, dict]:
    """Tune `op` for a tiny sm90 engine (max_num_tokens 64) on this GPU (skip without one): every bucket must get an
    entry whose recorded time is its fastest candidate's. -> (engine, tuned.json data)."""
    eng = _engine(max_num_tokens=64, **mapping)
    if tune_mod._cannot_measure(op, "sm90"):
        pytest.skip(tune_mod._cannot_measure(op, "sm90"))
    data = tune(eng, "sm90", [op])
    assert data["skipped"] == [] and [e["bucket"] for e in data["entries"]] == op.buckets(eng)
    for e in data["entries"]:
        assert 0 < e["time_us"] < float("inf") and e["time_us"] == min(e["candidates"].values())
    return eng, data


def test_gluon_gemm_configs_validate_and_enter_large_m_candidates():
    cfg = tuning.GemmConfig(64, 128, 1, 4, 3, gluon=True, maxnreg=168)
    assert cfg.tag() == "L64x128w4st3r168" and tuning.GemmConfig.from_dict(cfg.to_dict()) == cfg
    for bad in (dict(block_p=256), dict(num_warps=8), dict(split_k=2), dict(swap_ab=True), dict(dequant_bf16=True),
                dict(maxnreg=300), dict(block_q=256)):
        with pytest.raises(AssertionError):
            dataclasses.replace(cfg, **bad)
    for bad in (dict(maxnreg=128), dict(pdl=True), dict(quant_in_kernel=True)):
        with pytest.raises(AssertionError, match="maxnreg, pdl and quant_in_kernel are gluon fields"):
            tuning.GemmConfig(128, 64, **bad)
    for bad in (dict(pdl=True), dict(quant_in_kernel=True)):
        with pytest.raises(AssertionError, match="pdl, quant_in_kernel: the gluon decode kernel only"):
            dataclasses.replace(cfg, **bad)
    # large M with K % 128 == 0 only; the decode kernel (swap-AB, 64x8) only at M <= 8
    assert set(tuning.GLUON_SPACE) <= set(tuning.candidates(5120, 8192, 4096))
    assert not any(c.gluon for c in tuning.candidates(5120, 8192, 64) + tuning.candidates(5120, 288, 4096)
                   + tuning.candidates(5120, 288, 8))
    dec = [c for c in tuning.candidates(5120, 8192, 8) if c.gluon]
    assert dec == tuning.gluon_decode_candidates(5120, 8192) and all(c.swap_ab and c.block_q == 8 for c in dec)
    assert dec[0].tag() == "LT64x8b1s4st3" and tuning.GemmConfig.from_dict(dec[0].to_dict()) == dec[0]
    assert dec[1] == dataclasses.replace(dec[0], pdl=True) and dec[1].tag() == "LT64x8b1s4st3_pdl"
    old_entry = {k: v for k, v in dec[1].to_dict().items() if k not in ("pdl", "quant_in_kernel")}   # older tuned.json
    assert tuning.GemmConfig.from_dict(old_entry) == dec[0]
    qa = [c for c in dec if c.quant_in_kernel]
    # each in-kernel-quantizing config has its two-launch twin (its larger ring may keep fewer split counts)
    assert qa and {dataclasses.replace(c, quant_in_kernel=False) for c in qa} <= set(dec)
    assert qa[0].tag() == "LT64x8b1s4st3_qa" and tuning.GemmConfig.from_dict(qa[0].to_dict()) == qa[0]
    for bad in (dict(block_p=128), dict(block_q=16), dict(kgroups=3), dict(maxnreg=168), dict(num_stages=1)):
        with pytest.raises(AssertionError):
            dataclasses.replace(dec[0], **bad)


def test_sm90_gemm_configs_validate_enter_large_m_candidates_and_the_sm90_default():
    cfg = tuning.SM90_DEFAULT
    assert cfg.tag() == "C64x128st4g8c2h2" and tuning.GemmConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.promotes_every == 32
    assert dataclasses.replace(cfg, block_q=96, mma_split=1).tag() == "C64x96st4g8c2"
    # an old tuned.json entry (no mma_split) reads as the unsplit kernel
    old = {k: v for k, v in dataclasses.replace(cfg, mma_split=1).to_dict().items() if k != "mma_split"}
    assert tuning.GemmConfig.from_dict(old).tag() == "C64x128st4g8c2"
    for bad in (dict(block_q=64), dict(block_p=256), dict(num_warps=12), dict(split_k=2), dict(num_stages=5),
                dict(swap_ab=True), dict(gluon=True), dict(dequant_bf16=True), dict(kgroups=2), dict(ctas_per_sm=3),
                dict(block_p=128, num_warps=12),   # (two CTAs per SM take a 64-row tile)
                dict(mma_split=3), dict(block_q=96)):   # (MMA units span whole 32-column scale blocks)
        with pytest.raises(AssertionError):
            dataclasses.replace(cfg, **bad)
    # 192 / 256 wide: 128 rows, one CTA, a ring that fits, MMAs narrow enough that two partials fit beside the
    # accumulator (sm90_depth)
    wide = tuning.GemmConfig(128, 256, 1, 12, 4, sm90=True, mma_split=4)
    assert wide.tag() == "C128x256st4g8h4" and tuning.sm90_depth(256, 4) == 2 and tuning.sm90_depth(192, 3) == 3
    assert [tuning.sm90_depth(*q) for q in ((96, 1), (128, 1), (128, 2), (192, 2))] == [3, 2, 4, 2]
    for bad in (dict(mma_split=2), dict(num_stages=5), dict(block_p=64, num_warps=8, ctas_per_sm=2),
                dict(block_q=192, mma_split=1), dict(block_q=160, mma_split=1)):
        with pytest.raises(AssertionError):
            dataclasses.replace(wide, **bad)
    one = tuning.GemmConfig(128, 128, 1, 12, 6, sm90=True)
    assert one.tag() == "C128x128st6g8" and one.ctas_per_sm == 1 and one.mma_split == 1
    for field in ("ctas_per_sm", "mma_split"):
        with pytest.raises(AssertionError, match="ctas_per_sm and mma_split are sm90 fields"):
            tuning.GemmConfig(128, 64, **{field: 2})
    # large M (any K) with N % 8 == 0; never at M <= 64
    assert set(tuning.SM90_SPACE) <= set(tuning.candidates(5120, 288, 4096))
    assert set(tuning.SM90_SPACE) <= set(tuning.candidates(576, 5120, 65, 128))
    assert not any(c.sm90 for c in tuning.candidates(5120, 8192, 64) + tuning.candidates(5124, 8192, 4096))
    # the sm90 default for large M with 32-groups; V4's 128-groups and other GPUs keep theirs
    assert tuning.default_config(5120, 8192, 65, "sm90") == cfg
    assert not tuning.default_config(5120, 8192, 64, "sm90").sm90
    assert not tuning.default_config(5120, 8192, 4096, "sm90", 128).sm90
    assert not tuning.default_config(5120, 8192, 4096, "sm100").sm90
    assert not tuning.default_config(5124, 8192, 4096, "sm90").sm90


@pytest.mark.parametrize("n,k", [(4608, 5120), (5120, 8192), (32768, 1280), (576, 5120), (4096, 1280), (1056, 2304)])
def test_gluon_decode_candidates_are_one_resident_wave(n, k):
    """Every decode candidate's programs are resident at once (shared memory per SM), its split is one the launcher
    keeps (no empty K slice), and the shallow rings come with split counts near 2.5-4 programs per SM."""
    tiles = -(-n // 64)
    cands = tuning.gluon_decode_candidates(n, k)
    assert cands and len(set(cands)) == len(cands)
    for c in cands:
        n_st = -(-k // (tuning.GLUON_BLOCK_K * c.kgroups))
        assert -(-n_st // -(-n_st // c.split_k)) == c.split_k                      # tuning.k_slices keeps it
        per_sm = tuning.SMEM_PER_SM // (tuning.gluon_decode_smem(c.kgroups, c.num_stages, c.quant_in_kernel) + 1024)
        assert tiles * c.split_k <= per_sm * tuning.NUM_SMS, c.tag()
    ring = [c for c in cands if (c.kgroups, c.num_stages) == (1, 3) and not (c.pdl or c.quant_in_kernel)]
    per_sm = [tiles * c.split_k / tuning.NUM_SMS for c in ring]
    if tiles >= 2 * tuning.NUM_SMS:                                                # enough row tiles: no split
        assert [c.split_k for c in ring] == [1]
    else:   # up to ~4 programs per SM, at least 2 unless every K stage already has its own program
        assert max(per_sm) <= 4.5 and (max(per_sm) >= 2.0 or max(c.split_k for c in ring) == k // 128), per_sm


def test_moe_sorted_path_on_fp8_tensor_cores_by_arch():
    """The sorted path's default is `moe_f8` (Gluon wgmma) on sm90 where V4.1's shapes fit, the BF16-MMA path
    elsewhere: off CUDA (arch None: the interpreter), on sm100 (no wgmma), for V4's 1×128 blocks of h. The FP8 tiles
    are build candidates on sm90 only; the decode path never changes."""
    f8 = moe_config.F8_SORTED
    for t, e, inter in ((257, 384, 320), (1024, 384, 2304), (4096, 48, 2304)):
        assert moe_config.default_moe_config(t, 6, e, inter, 5120, arch="sm90") == f8
        for arch in (None, "sm100"):
            assert not moe_config.default_moe_config(t, 6, e, inter, 5120, arch=arch).f8
        assert not moe_config.default_moe_config(t, 6, e, inter, 4096, qblock=128, arch="sm90").f8
        sm90 = moe_config.moe_candidates(t, 6, e, inter, 5120, arch="sm90")
        assert sm90[0] == f8 and sum(c.f8 for c in sm90) >= 5 and len(set(sm90)) == len(sm90)
        assert not any(c.f8 for c in moe_config.moe_candidates(t, 6, e, inter, 5120, arch="sm100"))
        assert not any(c.f8 for c in moe_config.moe_candidates(t, 6, e, inter, 4096, qblock=128, arch="sm90"))
    assert not moe_config.default_moe_config(257, 6, 384, 304, 5120, arch="sm90").f8   # I_pad % 32: no fit
    for t in (1, 8, 64):
        assert moe_config.default_moe_config(t, 6, 384, 320, 5120, arch="sm90").gemv
