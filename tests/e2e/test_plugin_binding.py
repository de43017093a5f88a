"""Plugins bound into a GPU (sm90) engine, exercised on the CPU through the ops' plain-PyTorch paths.

`torch.ops.dsflash.*` run their `*_ref` on CPU tensors, so the binding itself — which sites get a plugin, the
kernel-format tensors taken from the hopper layout (untiled FP8 + e8m0 scales, BF16-cache copies, Marlin-unpacked
and stacked MXFP4 experts with padded widths, split mHC weights) — is proven here; the kernels on the H200
(benchmarks/engine_plugins.py).
"""
import copy
import logging

import pytest
import torch

from dsflash.build.bind import resolve_plugins, site_parity
from dsflash.build.engine import OPT_IN_PLUGINS, default_plugins, load_engine_model, write_engine
from dsflash.build.plan import BuildConfig
from dsflash.build.tune import FP8_GEMM, MOE
from dsflash.convert.synth import synthesize
from dsflash.convert.writer import convert
from dsflash.model_def import get_preset
from dsflash.model_def.mapping import Mapping


def test_gpu_engines_select_plugins_and_bf16():
    assert default_plugins("cpu") == {op: "reference" for op in default_plugins("cpu")}
    sm90 = default_plugins("sm90")
    assert sm90["gemm"] == "fp8_gemm" and sm90["moe"] == "mxfp4_overlap" and sm90["mhc"] == "fused_overlap"
    assert sm90["wo_a"] == "fused" and sm90["kv_quant"] == "fused"
    assert sm90["rope"] == sm90["attention"] == sm90["index"] == "fused"   # the decode-slot kernels (session 40)
    assert OPT_IN_PLUGINS == ()                                            # proven on a GPU in session 42
    with pytest.raises(ValueError, match="--enable-plugin 'flash': not a plugin op"):
        BuildConfig(enable_plugins=["flash"])
    v4 = default_plugins("sm90", family="v4")   # V4: not wired
    assert v4["attention"] == v4["index"] == v4["rope"] == "reference"
    assert default_plugins("sm90", family="v4")["kv_quant"] == "reference"   # V4's window rows: not wired
    assert sm90["norm"] == "fused" and sm90["swiglu"] == "fused"
    assert default_plugins("sm90", ("gemm",))["gemm"] == "reference"
    with pytest.raises(ValueError, match="not a plugin op"):
        BuildConfig(disable_plugins=["lm_head"])
    with pytest.raises(ValueError, match="is not known"):
        resolve_plugins(sm90, {"moe": "cutlass"})


def test_every_site_is_bound_and_matches_its_reference(sm90_engine, caplog, v41_site_kinds):
    with caplog.at_level(logging.INFO, logger="dsflash.bind"):
        model, eng = load_engine_model(sm90_engine, check_arch=False, dense_experts=True)
    assert eng.meta["build_config"]["dtype"] == "" and next(model.parameters()).dtype == torch.bfloat16
    args = model.args
    layers = args.n_layers + args.n_draft
    bound = next(r for r in caplog.records if "plugins bound" in r.getMessage()).getMessage()
    assert f"'moe': {layers}" in bound and f"'mhc': {layers}" in bound and f"'wo_a': {layers}" in bound
    from dsflash.model_def.layers import RMSNorm
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert f"'norm': {len(norms)}" in bound and all(m.plugin is not None for m in norms)
    assert f"'swiglu': {layers}" in bound     # one shared expert per block
    assert all(m.hc_plugin.overlap for m in model.modules() if hasattr(m, "hc_plugin"))   # inline on the CPU
    ids = torch.randint(0, args.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    rows = site_parity(model, ids)
    kinds = {r["kind"] for r in rows}
    assert kinds == v41_site_kinds
    # a shared expert's w1 and w3 run as one GEMM over the stacked weight (their own linears keep no plugin)
    shexp = model.layers[0].ffn.shared_experts
    assert shexp.w13_plugin is not None and shexp.w1.plugin is None and shexp.w3.plugin is None
    assert shexp.w13_plugin.w_q.shape[0] == 2 * shexp.w1.out_features and shexp.w13_plugin.w_bf16 is not None
    # so do an attention's wq_a and wkv; their own plugins are views of its rows (a draft stage runs wkv alone); its
    # q_norm and kv_norm run in one launch
    assert all(b.attn.qkv_norm_plugin is not None for b in [*model.layers, *model.mtp])
    attn = model.mtp[0].attn
    both = attn.wqkv_a_plugin
    assert both.w_q.shape[0] == attn.wq_a.out_features + attn.wkv.out_features
    assert attn.wkv.plugin.w_q.data_ptr() == both.w_q[attn.wq_a.out_features:].data_ptr()
    assert attn.wq_a.plugin.w_s.data_ptr() == both.w_s.data_ptr()
    assert attn.wkv.plugin.w_q.shape == attn.wkv.weight.shape
    x = torch.randn(1, 3, args.hidden_size, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    with torch.no_grad():
        alone, stacked = attn.wkv(x).float(), both(x)[..., attn.wq_a.out_features:].float()
    assert (alone - stacked).norm() <= 1e-3 * stacked.norm()
    assert all(r["rel"] <= 1e-2 for r in rows), max(rows, key=lambda r: r["rel"])
    # FP8 linears with a BF16-cache copy in the hopper layout carry it (main layers, not the drafter)
    wq_b = model.layers[0].attn.wq_b.plugin
    assert wq_b.w_bf16 is not None and model.mtp[0].attn.wq_b.plugin.w_bf16 is None
    assert wq_b.w_q.dtype == torch.float8_e4m3fn and wq_b.w_s.dtype == torch.float8_e8m0fnu
    # the engine's MoE tiles were installed from its tuned.json (built on a CPU machine: no entries, so every
    # token count falls back to the default rule, said once per shape)
    from dsflash.plugins import moe_config
    try:
        with caplog.at_level(logging.WARNING, logger="dsflash.plugins.moe_config"):
            moe_config.lookup(1, args.num_experts_per_tok, args.n_routed_experts, 64, args.hidden_size)
        msg = next(r.getMessage() for r in caplog.records if "no tuned entry" in r.getMessage())
        assert "no table loaded" not in msg
    finally:
        moe_config.set_table(None)


def test_site_parity_catches_a_wrong_binding(sm90_engine):
    model, _ = load_engine_model(sm90_engine, check_arch=False, dense_experts=True)
    moe = model.layers[2].ffn.plugin
    moe.w2_q.copy_(moe.w2_q.roll(1, 0))             # experts' w2 shifted by one: a stacking bug
    lin = model.layers[3].attn.wo_b.plugin
    lin.w_s.view(torch.uint8)[0] += 1                # first 32 rows' scales doubled: a scale-layout bug
    w13 = model.layers[1].ffn.shared_experts.w13_plugin
    w13.w_q.copy_(w13.w_q.roll(32, 0))               # w1 and w3 rows misaligned at the seam
    qkv = model.layers[0].attn.wqkv_a_plugin
    qkv.w_q.copy_(qkv.w_q.roll(32, 0))               # wq_a and wkv rows misaligned at the seam
    ids = torch.randint(0, model.args.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
    bad = {r["site"] for r in site_parity(model, ids) if r["rel"] > 0.1}
    assert {"layers.2.ffn", "layers.3.attn.wo_b", "layers.1.ffn.shared_experts.w13", "layers.0.attn.wqkv_a"} <= bad


def test_bound_models_call_the_ops_without_the_dispatcher_unless_traced(sm90_engine, monkeypatch):
    """After binding, eager forwards call the plain op functions (`registry.eager_ops`); the logits equal those
    through torch.ops.dsflash, and a traced forward (torch.compile) is handed torch.ops."""
    from dsflash.model_def import dispatch
    from dsflash.plugins import registry
    model, _ = load_engine_model(sm90_engine, check_arch=False, dense_experts=True)
    assert dispatch.ops() is registry.eager_ops
    ids = torch.randint(0, model.args.vocab_size, (1, 8), generator=torch.Generator().manual_seed(4))
    eager = model.logits(ids)
    monkeypatch.setattr(dispatch, "_eager_ops", None)
    assert torch.equal(model.logits(ids), eager)
    monkeypatch.setattr(dispatch, "_eager_ops", registry.eager_ops)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert dispatch.ops() is torch.ops.dsflash


def test_window_rows_quantize_in_one_op_exactly_as_the_reference(sm90_engine):
    """kv_quant=fused: every V4.1 attention's window KV rows go through act_quant_dequant, bit-identical to the
    reference fake quantization (here the op's CPU path; its kernel equals that bit for bit: test_act_quant.py)."""
    from dsflash.model_def.csa2 import Attention, layer_inv_freq
    model, eng = load_engine_model(sm90_engine, check_arch=False, dense_experts=True)
    attns = [m for m in model.modules() if isinstance(m, Attention)]
    assert eng.meta["plugins"]["kv_quant"] == "fused" and attns and all(m.fused_kv_quant for m in attns)
    attn = attns[0]
    g = torch.Generator().manual_seed(6)
    kvn = (torch.randn(2, 7, attn.head_dim, generator=g) * 3).to(torch.bfloat16)
    pos = torch.arange(7).expand(2, -1) + 5
    inv = layer_inv_freq(model.args, attn.layer, kvn.device)
    attn.fused_rope = False   # (the rope plugin would take the rotation and the quantization: the test below)
    fused = attn._window_rows(kvn, pos, inv)
    attn.fused_kv_quant = False
    assert torch.equal(fused, attn._window_rows(kvn, pos, inv))
    from dsflash.model_def.layers import apply_rope
    assert not torch.equal(fused, apply_rope(kvn, pos, inv))   # the rows were quantized


def test_rotated_rows_go_through_one_op_exactly_as_the_reference(sm90_engine):
    """rope=fused: every V4.1 attention and indexer rotates (and quantizes) its rows through `rope_quant`: queries,
    window rows (FP8), index keys and queries (FP4, pow2 scales), compressed entries (FP4, e4m3 scales). The op's
    reference (its CPU path here; the kernel equals it bit for bit: tests/kernels/test_rope_quant.py) gives the
    model's own torch ops bit for bit, at exact rounding midpoints too, and so do the logits."""
    from dsflash.model_def import dispatch
    from dsflash.model_def.csa2 import Attention, Indexer, layer_inv_freq
    model, eng = load_engine_model(sm90_engine, check_arch=False, dense_experts=True)
    sites = [m for m in model.modules() if isinstance(m, (Attention, Indexer))]
    assert eng.meta["plugins"]["rope"] == "fused" and all(m.fused_rope for m in sites)
    assert any(isinstance(m, Indexer) for m in sites)
    g = torch.Generator().manual_seed(8)
    inv = layer_inv_freq(model.args, 2, torch.device("cpu"))
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 0.0])
    for shape, pos in (((2, 5, 4, 128), torch.arange(5).expand(2, -1) + 3), ((3, 64), torch.arange(3) * 7),
                       ((1, 1, 4, 64), torch.tensor([[4099]]))):
        x = torch.randn(*shape, generator=g) * 4
        x[..., :9] = mids * torch.where(torch.rand(9, generator=g) < 0.5, -1.0, 1.0)   # ties of the FP4 grid
        for dtype in (torch.bfloat16, torch.float32):
            for quant, block in (("none", 0), ("fp8", 32), ("fp4_pow2", 32), ("fp4_e4m3", 16)):
                got = dispatch.rope_rows(True, x.to(dtype), pos, inv, quant, block)
                want = dispatch.rope_rows(False, x.to(dtype), pos, inv, quant, block)
                assert got.dtype == dtype and torch.equal(got, want), (shape, dtype, quant)
    ids = torch.randint(0, model.args.vocab_size, (1, 9), generator=g)
    fused = model.logits(ids)
    for m in sites:
        m.fused_rope = False
    assert torch.equal(fused, model.logits(ids))


def test_slot_decode_attention_goes_through_two_ops_exactly_as_the_reference(sm90_engine, monkeypatch):
    """attention=fused, index=fused: a V4.1 decode step in decode slots attends through `slot_attention` on every
    layer (window ring, top-k entries, sink) and scores each index source's visible entries through
    `slot_index_scores`; their references (the ops' CPU paths; the kernels within ~1e-5 of them:
    tests/kernels/test_slot_attention.py, test_slot_index.py) give the model's own slot steps bit for bit."""
    from dsflash.model_def.csa2 import Attention
    from dsflash.model_def.ragged import Chunk
    from dsflash.plugins import registry
    model, eng = load_engine_model(sm90_engine, check_arch=False)
    attns = [m for m in model.modules() if isinstance(m, Attention)]
    indexers = [m.indexer for m in attns if m.indexer is not None]
    assert eng.meta["plugins"]["attention"] == eng.meta["plugins"]["index"] == "fused"
    assert all(m.fused_attention for m in attns) and indexers and all(i.fused_scores for i in indexers)
    calls = {"slot_attention": [], "slot_index_scores": []}
    for op, seen in calls.items():
        real = getattr(registry.eager_ops, op)
        monkeypatch.setattr(registry.eager_ops, op, lambda *a, real=real, seen=seen: seen.append(a[4] is not None)
                            or real(*a))

    def decode(fused: bool) -> list[torch.Tensor]:
        for m in attns:
            m.fused_attention = fused
        for i in indexers:
            i.fused_scores = fused
        model.enable_decode_slots(3, 96)
        try:
            g = torch.Generator().manual_seed(9)
            states = [model.new_state(1) for _ in range(3)]
            model.step_chunks([Chunk(torch.randint(3, 900, (1, n), generator=g), s)
                               for n, s in zip((40, 3, 17), states)])
            return [torch.cat(model.step_chunks([Chunk(torch.randint(3, 900, (1, 1), generator=g), s) for s in states]))
                    for _ in range(6)]
        finally:
            model.decode_slots = None
    want = decode(False)
    assert not any(calls.values())
    got = decode(True)
    atts = calls["slot_attention"]
    assert len(atts) == 6 * model.args.n_layers and any(atts) and not all(atts)   # ratio-0 layers: no entries
    assert len(calls["slot_index_scores"]) == 6 * len(indexers)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_reference_override_binds_nothing(sm90_engine):
    model, _ = load_engine_model(sm90_engine, check_arch=False, plugins="reference")
    assert all(getattr(m, "plugin", None) is None and getattr(m, "hc_plugin", None) is None
               for m in model.modules())
    ids = torch.randint(0, model.args.vocab_size, (1, 8), generator=torch.Generator().manual_seed(2))
    assert torch.isfinite(model.logits(ids)).all()


def test_moe_binding_takes_over_the_routed_experts(sm90_engine, monkeypatch):
    """A lean load keeps the routed experts only as stored; the MoE binder stacks them for its kernels and must take
    them out of the loader's table as it goes, so a rank never holds them twice (an 80 GB card ran out of memory at
    70.5 GiB on a rank planned at 47.8 GiB before this)."""
    from dsflash.build import bind as bind_mod
    seen = {}
    bind = bind_mod.bind_plugins

    def spy(model, args, chosen, kept, *rest):
        seen["before"] = sum(".experts." in k for k in kept)
        out = bind(model, args, chosen, kept, *rest)
        seen["after"] = sum(".experts." in k for k in kept)
        return out
    monkeypatch.setattr(bind_mod, "bind_plugins", spy)
    model, _ = load_engine_model(sm90_engine, check_arch=False)
    assert seen["before"] > 0 and seen["after"] == 0, seen
    assert all(m.plugin is not None for m in model.modules() if hasattr(m, "experts"))   # every MoE bound


def test_tp2_rank_with_padded_experts(hopper_ckpt, partial_sums, v41_site_kinds):
    """MoE-TP2 halves the tiny intermediate (64 -> 32), padded after sharding to the 64-wide sm90 tile."""
    eng = write_engine(hopper_ckpt, hopper_ckpt.parent / "eng-tp2", Mapping(world_size=2, tp_size=2), "sm90",
                       BuildConfig(), progress=False)
    for rank in (0, 1):
        model, meta = load_engine_model(eng, rank, comm=partial_sums(2, rank), check_arch=False, dense_experts=True)
        assert (meta.meta["expert_inter_local"], meta.meta["expert_inter_padded"]) == (32, 64)
        assert model.layers[0].ffn.plugin.w13_q.shape[1] == 2 * 64 and model.layers[0].ffn.plugin.inter == 32
        ids = torch.randint(0, model.args.vocab_size, (1, 12), generator=torch.Generator().manual_seed(rank))
        rows = site_parity(model, ids)
        assert {r["kind"] for r in rows} == v41_site_kinds
        assert all(r["rel"] <= 1e-2 for r in rows), max(rows, key=lambda r: r["rel"])


def test_ep2_ranks_bind_their_expert_blocks(hopper_ckpt, partial_sums):
    """MoE EP2 (TP2, moe_tp 1): each rank binds the MoE plugin over its own block of experts, which routes over all
    of them; every site matches its reference (the model's EP loop) on the rank's partial sums."""
    eng = write_engine(hopper_ckpt, hopper_ckpt.parent / "eng-ep2", Mapping(world_size=2, tp_size=2, moe_ep_size=2),
                       "sm90", BuildConfig(), progress=False)
    for rank in (0, 1):
        model, _ = load_engine_model(eng, rank, comm=partial_sums(2, rank), check_arch=False, dense_experts=True)
        n = model.args.n_routed_experts // 2
        plugin = model.layers[0].ffn.plugin
        assert plugin is not None and plugin.expert_start == rank * n and plugin.w13_q.shape[0] == n
        ids = torch.randint(0, model.args.vocab_size, (1, 12), generator=torch.Generator().manual_seed(rank))
        rows = site_parity(model, ids)
        assert "moe" in {r["kind"] for r in rows}
        assert all(r["rel"] <= 1e-2 for r in rows), max(rows, key=lambda r: r["rel"])


def test_overlapped_shared_expert_is_added_once(sm90_engine):
    """`mxfp4_overlap` (the V4.1 GPU default): the shared expert runs beside the MoE op (on the CPU in line) and its
    output joins the op's routed sum after it, instead of being the op's starting value: the same MoE output up to
    BF16 rounding, and not the routed sum alone."""
    model, eng = load_engine_model(sm90_engine, check_arch=False, dense_experts=True)
    assert eng.meta["plugins"]["moe"] == "mxfp4_overlap"
    moe = model.layers[0].ffn
    assert moe.plugin.overlap_shared
    x = torch.randn(1, 5, model.args.hidden_size, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)

    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm())
    with torch.no_grad():
        overlapped = moe(x)
        moe.plugin.overlap_shared = False
        inline = moe(x)
        routed = moe.comm.all_reduce(moe.plugin(x.view(5, -1), moe.gate.weight, moe.gate.selection_bias(None), None))
    assert rel(overlapped, inline) <= 5e-3
    assert rel(routed.to(x.dtype).view(x.shape), inline) > 0.05   # the shared expert contributes


def test_disabled_plugin_keeps_its_reference(hopper_ckpt, caplog, capsys):
    """`dsflash build --disable-plugin gemm`: recorded in engine.json, and the loader binds the other ops only."""
    from dsflash.build.cli import main as build_main
    out = hopper_ckpt.parent / "eng-nogemm"
    assert build_main(["--ckpt", str(hopper_ckpt), "--arch", "sm90", "--out", str(out), "--disable-plugin", "gemm",
                       "--tune-budget-s", "0"]) == 0
    with caplog.at_level(logging.INFO, logger="dsflash.bind"):
        model, eng = load_engine_model(out, check_arch=False, dense_experts=True)
    assert eng.meta["plugins"]["gemm"] == "reference" and eng.meta["plugins"]["moe"] == "mxfp4_overlap"
    assert eng.meta["build_config"]["disable_plugins"] == ["gemm"]
    assert FP8_GEMM.buckets(eng.meta) == [] and FP8_GEMM.buckets({**eng.meta, "plugins": default_plugins("sm90")})
    assert MOE.buckets(eng.meta)   # the MoE plugin stays on, so build tunes its tiles
    assert model.layers[0].attn.wq_b.plugin is None and model.layers[0].ffn.plugin is not None
    assert build_main(["--ckpt", str(hopper_ckpt), "--arch", "sm90", "--out", str(out) + "x",
                       "--disable-plugin", "lm_head"]) == 2
    assert "--disable-plugin 'lm_head': not a plugin op" in capsys.readouterr().err


def test_v4_gpu_engines_select_the_shared_kernels():
    """V4 shares the FP8 linears (1×128 / 128×128 groups), the norms, the shared expert's SwiGLU, WO-A, the mHC
    kernels (per-site coefficients: nothing to overlap) and the MoE kernels (1×128 expert activations, the shared
    expert beside them) with V4.1."""
    v4 = default_plugins("sm90", family="v4")
    assert {op: impl for op, impl in v4.items() if impl != "reference"} == {
        "gemm": "fp8_gemm", "norm": "fused", "swiglu": "fused", "mhc": "fused", "wo_a": "fused",
        "moe": "mxfp4_overlap"}
    assert default_plugins("sm90", ("mhc",), family="v4")["mhc"] == "reference"


@pytest.mark.parametrize("preset,inter", [("tiny", 128), ("tiny-b", None)])
def test_v4_engine_binds_fp8_linears_with_128_groups(tmp_path, preset, inter):
    """A V4 sm90 engine binds every FP8 linear (not WO-A's einsum weight) to the FP8 GEMM with 1×128 activation
    groups and its 128×128 scales expanded to the kernels' 32×32 format; each site matches the V4 reference, whose
    ragged widths (tiny-b: 96-wide inputs) quantize as one short group. A shared expert's w1 and w3 stack into one
    GEMM when its width is whole 128-row blocks (128), else run apart (96); so do an attention's wq_a and wkv (a
    128-wide q_lora in the first case, 64 and 96 apart). Every MoE binds the MoE plugin with 1×128
    expert activations, the hash-routed layers too (their picks: `tid2eid` of the tokens). A wrong 128×128 scale is
    caught."""
    import dataclasses
    from dsflash.model_def.layers import Linear
    args = get_preset("v4", preset)
    if inter:
        args = dataclasses.replace(args, moe_intermediate_size=inter, q_lora_rank=inter)
    stacked = args.moe_intermediate_size % 128 == 0
    qkv = args.q_lora_rank % 128 == 0
    hf = synthesize(args, tmp_path / "hf", seed=7)
    convert(hf, tmp_path / "hop", "hopper", progress=False, log=lambda *a: None)
    eng = write_engine(tmp_path / "hop", tmp_path / "eng", Mapping(world_size=1, tp_size=1), "sm90", BuildConfig(),
                       progress=False)
    model, meta = load_engine_model(eng, check_arch=False, dense_experts=True)
    assert meta.meta["plugins"]["gemm"] == "fp8_gemm" and meta.meta["plugins"]["moe"] == "mxfp4_overlap"
    assert all(b.ffn.plugin is not None and b.ffn.plugin.qblock == 128 and b.ffn.plugin.overlap_shared
               for b in [*model.layers, *model.mtp])
    assert model.layers[0].ffn.gate.hash and not model.layers[-1].ffn.gate.hash
    assert all(b.attn.fused_wo_a and b.attn.wo_a.weight.dtype == torch.bfloat16 for b in model.layers)
    lins = {n: m for n, m in model.named_modules() if isinstance(m, Linear) and m.quant == "fp8"}
    for name, lin in lins.items():
        shexp = ".shared_experts.w" in name and not name.endswith("w2") and stacked
        if name.endswith("attn.wo_a") or shexp:
            assert lin.plugin is None, name
        else:
            assert lin.plugin is not None and lin.plugin.act_block == 128, name
            n, k = lin.plugin.w_q.shape
            assert lin.plugin.w_s.shape == (-(-n // 32), k // 32), name
    w13 = model.layers[0].ffn.shared_experts.w13_plugin
    assert (w13 is not None and w13.act_block == 128) == stacked
    ids = torch.randint(0, model.args.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0))
    rows = site_parity(model, ids)
    kinds = ({"gemm", "norm", "norm_pair", "swiglu", "mhc_v4", "wo_a", "moe_v4"} | ({"gemm_w13"} if stacked else set())
             | ({"gemm_qkv_a"} if qkv else set()))
    assert all((b.attn.wqkv_a_plugin is not None) == qkv for b in [*model.layers, *model.mtp])
    assert {r["kind"] for r in rows} == kinds
    assert sum(r["kind"] == "moe_v4" for r in rows) == len(model.layers)
    assert all(b.hc_plugin is not None and not b.hc_plugin.overlap for b in [*model.layers, *model.mtp])
    assert sum(r["kind"] == "mhc_v4" for r in rows) == len(model.layers)
    assert all(r["rel"] <= 1e-2 for r in rows), max(rows, key=lambda r: r["rel"])
    x = torch.randn(1, 6, model.args.hidden_size, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    for ffn in (model.layers[0].ffn, model.layers[-1].ffn):   # a hash-routed and a scored layer: `mxfp4_overlap`
        with torch.no_grad():                                    # adds the shared expert after the op, the same sum
            overlapped = ffn(x, ids[:, :6]).float()
            ffn.plugin.overlap_shared = False
            inline = ffn(x, ids[:, :6]).float()
            ffn.plugin.overlap_shared = True
        assert (overlapped - inline).norm() / inline.norm() <= 5e-3
    wq_b = model.layers[1].attn.wq_b.plugin
    wq_b.w_s.view(torch.uint8)[:4, :4] += 1          # one 128×128 block's scale doubled (its 16 expanded copies)
    hash_ffn = model.layers[0].ffn
    hash_ffn.plugin.forward = _with_rolled_hash_ids(hash_ffn.plugin.forward)
    bad = {r["site"] for r in site_parity(model, ids) if r["rel"] > 0.05}
    assert {"layers.1.attn.wq_b", "layers.0.ffn"} <= bad and "layers.1.ffn" not in bad


def _with_rolled_hash_ids(forward):
    """A MoE plugin's forward that gives each token of a hash layer the picks of the token before (a wrong binding)."""
    def wrong(flat, gate_w, gate_bias, shared, hash_ids=None):
        return forward(flat, gate_w, gate_bias, shared, None if hash_ids is None else hash_ids.roll(1, 0))
    return wrong


class _TwoEqualRanks:
    """The comm of a TP2 rank whose peer holds the same partial sums: an all-reduce doubles. (With reductions left
    out, a shared expert added before the all-reduce or after it would give the same numbers.)"""

    def __init__(self, rank: int):
        self.tp_size, self.tp_rank = 2, rank

    def all_reduce(self, x):
        return 2 * x


def test_v4_moe_plugin_under_tp2_and_ep2(tmp_path):
    """A V4 MoE under TP2 (MoE-TP2, then EP2): each rank's plugin output is its partial sum, and the replicated
    shared expert joins after the all-reduce, as in the V4 reference; every MoE site matches its reference, hash-routed
    layers included."""
    import dataclasses
    args = dataclasses.replace(get_preset("v4", "tiny-b"), moe_intermediate_size=128)   # MoE-TP2: 64 per rank
    hf = synthesize(args, tmp_path / "hf", seed=9)
    convert(hf, tmp_path / "hop", "hopper", progress=False, log=lambda *a: None)
    for tag, mapping in (("tp2", Mapping(world_size=2, tp_size=2)),
                         ("ep2", Mapping(world_size=2, tp_size=2, moe_ep_size=2))):
        eng = write_engine(tmp_path / "hop", tmp_path / tag, mapping, "sm90", BuildConfig(), progress=False)
        for rank in (0, 1):
            model, _ = load_engine_model(eng, rank, comm=_TwoEqualRanks(rank), check_arch=False, dense_experts=True)
            plugin = model.layers[0].ffn.plugin
            n = model.args.n_routed_experts // mapping.moe_ep_size
            assert plugin is not None and plugin.w13_q.shape[0] == n
            assert plugin.expert_start == rank * n * (tag == "ep2")
            ids = torch.randint(0, model.args.vocab_size, (1, 12), generator=torch.Generator().manual_seed(rank))
            rows = [r for r in site_parity(model, ids) if r["kind"] == "moe_v4"]
            assert len(rows) == len(model.layers), (tag, rank)
            assert all(r["rel"] <= 1e-2 for r in rows), (tag, rank, max(rows, key=lambda r: r["rel"]))
            # the whole MoE, shared expert included (the site replay passes it through as 0), against the fp32 reference
            x = torch.randn(1, 12, model.args.hidden_size, generator=torch.Generator().manual_seed(rank))
            for ffn in (model.layers[0].ffn, model.layers[-1].ffn):   # a hash-routed layer, a scored one
                ref = copy.deepcopy(ffn).float()
                ref.plugin = None
                with torch.no_grad():
                    got, want = ffn(x.to(torch.bfloat16), ids).double(), ref(x, ids).double()
                assert float((got - want).norm() / want.norm()) <= 1e-2, (tag, rank)


def test_moe_plugin_routes_image_tokens_with_bias_vl(sm90_engine):
    """Image tokens select experts with `gate.bias_vl`: the MoE plugin takes a bias row per token, so on a mixed
    text/image batch each image row matches the reference MoE's image routing (up to the plugin's deploy-numerics
    difference, ~1e-2 here as for text) and is far from its text routing; text rows are unaffected."""
    model, _ = load_engine_model(sm90_engine, check_arch=False, dense_experts=True)
    ffn = model.layers[1].ffn
    x = (torch.randn(1, 10, model.args.hidden_size, generator=torch.Generator().manual_seed(3))).to(torch.bfloat16)
    mask = torch.zeros(1, 10, dtype=torch.bool)
    mask[0, 3:7] = True
    with torch.no_grad():   # image tokens: forced onto experts their text routing never picks
        text_ids = ffn.gate(x[0, 3:7])[1].unique()
        ffn.gate.bias_vl.fill_(-50.0).index_fill_(0, text_ids, -100.0)
        ffn.gate.bias_vl[[e for e in range(ffn.gate.bias_vl.numel()) if e not in text_ids.tolist()][:3]] = 50.0
    plugin = ffn.plugin
    got, got_text = ffn(x, mask)[0].float(), ffn(x)[0].float()
    try:
        ffn.plugin = None
        want, want_text = ffn(x, mask)[0].float(), ffn(x)[0].float()
    finally:
        ffn.plugin = plugin

    def rel(a, b):
        return ((a - b).norm(dim=-1) / b.norm(dim=-1))
    img = mask[0]
    assert (rel(got, want)[img] <= 2e-2).all(), rel(got, want)
    assert (rel(got, want_text)[img] >= 0.2).all(), rel(got, want_text)      # the routing did change
    assert torch.allclose(got[~img], got_text[~img], rtol=1e-3, atol=1e-3)
    assert (rel(want_text, want)[~img] == 0).all()
