"""A tiny V4.1 engine built for sm90 on the GPU runs the plugin kernels: every bound site matches its fp32 reference
on the activations of a real forward, and GEMM shapes missing from tuned.json fall back visibly, once, to configs
that match the references too. On a trained synthetic checkpoint (decisive logits) the plugin engine and the reference
engine give the same greedy tokens.
(The mid-size engine and the end-to-end figures: benchmarks/engine_plugins.py.)"""
from __future__ import annotations

import json
import logging

import pytest
import torch

from dsflash.build.bind import site_parity
from dsflash.build.engine import load_engine_model, write_engine
from dsflash.build.plan import BuildConfig
from dsflash.convert.synth import synthesize
from dsflash.convert.writer import convert
from dsflash.model_def import get_preset
from dsflash.model_def.mapping import Mapping

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def hopper_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-eng")
    synthesize(get_preset("v41", "tiny"), root / "hf", seed=7)
    convert(root / "hf", root / "hop", "hopper", progress=False, log=lambda *a: None)
    return root / "hop"


@pytest.fixture(scope="module")
def engine(hopper_ckpt):
    return write_engine(hopper_ckpt, hopper_ckpt.parent / "eng", Mapping(world_size=1, tp_size=1), "sm90",
                        BuildConfig(max_num_tokens=8, tune_budget_s=20), progress=False)


def test_bound_sites_match_their_references(engine, v41_site_kinds):
    model, _ = load_engine_model(engine, dense_experts=True)
    assert next(model.parameters()).is_cuda and next(model.parameters()).dtype == torch.bfloat16
    ids = torch.randint(0, model.args.vocab_size, (1, 40), generator=torch.Generator().manual_seed(3)).cuda()
    rows = site_parity(model, ids)
    assert {r["kind"] for r in rows} == v41_site_kinds
    worst = max(rows, key=lambda r: r["rel"])
    assert worst["rel"] <= 1e-2, worst


def test_shared_expert_overlap_matches_inline(engine, tmp_path):
    """`mxfp4_overlap`: the shared expert on the second side stream while the router and routed-expert kernels run,
    its output added after them, computes the MoE output the in-line order does (the fp32 sums differ only in the
    order of the shared term), eagerly and replayed from a CUDA graph, and really runs the shared expert on another
    stream than the router (profiler kernel events)."""
    from dsflash.model_def import dispatch
    model, eng = load_engine_model(engine, dense_experts=True)
    assert eng.meta["plugins"]["moe"] == "mxfp4_overlap"
    moe = model.layers[0].ffn
    x = (torch.randn(1, 3, model.args.hidden_size, generator=torch.Generator().manual_seed(5)) * 2).to(
        torch.bfloat16).cuda()

    def run(overlap: bool):
        moe.plugin.overlap_shared = overlap
        return moe(x)

    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm())
    with torch.no_grad():
        inline = run(False).clone()
        eager = run(True).clone()
        assert dispatch.side_stream(x.device, 1) is not dispatch.side_stream(x.device, 0)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run(True)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run(True)
        graph.replay()
        torch.cuda.synchronize()
    assert rel(eager, inline) <= 5e-3 and rel(out, inline) <= 5e-3, (rel(eager, inline), rel(out, inline))
    # where the kernels ran: the shared expert's SwiGLU beside the router on another stream, and, as a control that
    # the check can fail, on the router's stream in line
    with torch.no_grad():
        assert _kernel_streams(lambda: run(False), tmp_path / "inline.json") == 1
        assert _kernel_streams(lambda: run(True), tmp_path / "overlap.json") == 2


def _kernel_streams(fn, trace_path) -> int:
    """How many distinct CUDA streams the shared expert's SwiGLU kernel and the MoE router's logits kernel ran on
    in one eager call of fn (from the profiler's kernel events)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(trace_path))
    events = json.loads(trace_path.read_text())["traceEvents"]
    streams = {}
    for ev in events:
        if ev.get("cat") != "kernel":
            continue
        for key in ("_clipped_swiglu_kernel", "_router_logits_kernel"):
            if key in ev["name"]:
                streams.setdefault(key, set()).add(ev["args"]["stream"])
    assert set(streams) == {"_clipped_swiglu_kernel", "_router_logits_kernel"}, streams
    assert all(len(v) == 1 for v in streams.values()), streams
    return len(set().union(*streams.values()))


def test_trained_engine_gives_the_reference_greedy_tokens(tmp_path):
    """A tiny V4.1 checkpoint fitted to a token permutation (convert/synth_train.py, trained here on the GPU), built
    for sm90: the engine with every plugin bound and the same engine on the references greedy-generate the same
    tokens, the task's answer, over 4 prompts × 32 tokens (prefill, then the decode kernels at M = 4)."""
    from dsflash.convert.synth_train import PermutationTask
    hf = synthesize(get_preset("v41", "tiny"), tmp_path / "hf", seed=7, train_steps=80, train_device="cuda")
    convert(hf, tmp_path / "hop", "hopper", progress=False, log=lambda *a: None)
    eng = write_engine(tmp_path / "hop", tmp_path / "eng", Mapping(world_size=1, tp_size=1), "sm90",
                       BuildConfig(max_num_tokens=64, tune_budget_s=20), progress=False)
    task, _ = PermutationTask.load(hf)
    prompts = task.prompts(4, 16, seed=5)
    expected = task.continuation(prompts[:, -1], 32)
    outs = {}
    for plugins in (None, "reference"):
        model, _ = load_engine_model(eng, plugins=plugins, dense_experts=True)
        outs[plugins] = model.generate_greedy(prompts.cuda(), 32)[:, 16:].cpu()
    assert torch.equal(outs[None], outs["reference"]), int((outs[None] == outs["reference"]).sum())
    assert torch.equal(outs["reference"], expected), int((outs["reference"] == expected).sum())
    # the served path: lean loading (routed experts in MXFP4 only), one fused forward per scheduler step, the decode
    # tokens of all requests through one batched attention; requests arrive two steps apart, so prompt chunks run
    # beside decode tokens
    from dsflash.serve.llm_engine import LLMEngine, Request, SamplingParams
    served = LLMEngine(str(eng), kv_cache_bytes=1 << 28)
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    pending = [Request(f"r{i}", p.tolist(), SamplingParams(max_tokens=32, ignore_eos=True))
               for i, p in enumerate(prompts)]
    while pending or served.has_work():
        if pending:
            served.add_request(pending.pop(0))
        for _ in range(2):
            for o in served.step():
                got[o.request_id] += o.new_token_ids
    for i in range(len(prompts)):
        assert got[f"r{i}"] == expected[i].tolist(), (i, got[f"r{i}"], expected[i].tolist())
    graphs = served.runner.model.cuda_graphs   # on by default: the decode steps of all 4 requests were replayed
    assert graphs.disabled is None and graphs.counts["replayed"] > 0, graphs.counts
    # the same engine served through decode slots, one CUDA graph per step (the decode-slot kernels of session 40:
    # RoPE + row quantization, the slot attention core, the slot index scores), all requests at once
    served = LLMEngine(str(eng), kv_cache_bytes=1 << 28)
    assert served.runner.model.decode_slots is not None
    outs = {f"r{i}": [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        served.add_request(Request(f"r{i}", p.tolist(), SamplingParams(max_tokens=32, ignore_eos=True)))
    while served.has_work():
        for o in served.step():
            outs[o.request_id] += o.new_token_ids
    for i in range(len(prompts)):
        assert outs[f"r{i}"] == expected[i].tolist(), (i, outs[f"r{i}"], expected[i].tolist())


def test_decode_graphs_replay_the_eager_steps(engine):
    """Decode steps whose pieces are real CUDA graphs (serve/runtime/cuda_graphs.py) give the eager steps' logits
    (same kernels, same row counts) across warm-up, capture and replay: bit for bit at one request; at three within
    1e-2 (the MoE adds its experts' outputs with fp32 atomics in arrival order, so two eager runs of several tokens
    differ in the last bits, which later FP8 roundings can widen; a stale or misplaced input is off by O(1))."""
    _graphs_replay_the_eager_steps(load_engine_model(engine)[0])


@pytest.fixture(scope="module")
def v4_engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-v4")
    synthesize(get_preset("v4", "tiny"), root / "hf", seed=7)
    convert(root / "hf", root / "hop", "hopper", progress=False, log=lambda *a: None)
    return write_engine(root / "hop", root / "eng", Mapping(world_size=1, tp_size=1), "sm90",
                        BuildConfig(max_num_tokens=64, tune_budget_s=0), progress=False)


def test_v4_decode_graphs_replay_the_eager_steps(v4_engine):
    """The same for a tiny V4 engine (its pieces: no lagged mHC, hash-routed MoE layers)."""
    _graphs_replay_the_eager_steps(load_engine_model(v4_engine)[0])


SLOT_KERNELS = ("rope", "attention", "index")


def test_decode_slot_graphs_replay_the_eager_slot_steps(engine):
    """V4.1 decode steps in decode slots (model_def/decode_slots.py) are one CUDA graph each, attention included:
    the graph steps give the eager slot steps' logits (bit for bit at one request, within 1e-2 at three), and the
    eager slot steps give the per-request caches' logits within 1e-2 (other GEMM shapes: every window row, every
    entry row). The slot glue runs its torch ops here (the decode-slot kernels on references), so the two paths
    differ by GEMM shapes only."""
    _slot_graphs_replay_the_eager_slot_steps(load_engine_model(engine, plugins=dict.fromkeys(SLOT_KERNELS,
                                                                                              "reference"))[0])


def test_slot_kernels_in_slot_graphs(engine, monkeypatch):
    """The same with the decode-slot kernels bound (the engine's default): the graph steps replay the eager slot
    steps, and every kernel call of the eager steps matches its reference on the same inputs (rope_quant bit for bit,
    the index scores to 1e-5, the attention within the BF16 rounding of its fp32 reference). Slot steps and list steps are not compared: in this tiny
    random model a 1e-3 change of an attention output moves the logits by 10-70 % (benchmarks/README.md, session 41)."""
    from dsflash.plugins import refs, registry
    model = load_engine_model(engine)[0]
    checks = {"rope_quant": refs.rope_quant_ref, "slot_index_scores": refs.slot_index_scores_ref,
              "slot_attention": lambda q, ring, ids, pos, kv, sel, sink, scale: refs.slot_attention_ref(
                  q.float(), ring.float(), ids, pos, None if kv is None else kv.float(), sel, sink, scale)}
    errs = {op: [] for op in checks}
    for op, ref in checks.items():
        kernel = getattr(registry.eager_ops, op)

        def run(*args, kernel=kernel, ref=ref, op=op):
            out = kernel(*args)
            if not torch.cuda.is_current_stream_capturing():
                want = ref(*args)
                # the attention's fp32 reference: within its own BF16 rounding (as its kernel test)
                slack = 1.1 * refs.rel_err(want.to(out.dtype), want) if op == "slot_attention" else 0.0
                errs[op].append(refs.rel_err(out, want) - slack)
            return out
        monkeypatch.setattr(registry.eager_ops, op, run)
    _slot_graphs_replay_the_eager_slot_steps(model, lists_bound=None)
    assert all(errs.values()), {op: len(v) for op, v in errs.items()}
    assert max(errs["rope_quant"]) == 0.0 and max(errs["slot_index_scores"]) <= 1e-5, errs
    assert max(errs["slot_attention"]) <= 1e-5, max(errs["slot_attention"])


def test_v4_decode_slot_graphs_replay_the_eager_slot_steps(v4_engine):
    """The same for a tiny V4 engine."""
    _slot_graphs_replay_the_eager_slot_steps(load_engine_model(v4_engine)[0])


def _slot_graphs_replay_the_eager_slot_steps(model, lists_bound: float | None = 1e-2) -> None:
    from dsflash.serve.runtime.cuda_graphs import CudaGraphConfig, DecodeGraphs
    for contexts in ([37], [37, 3, 20]):
        lists = _greedy_steps(model, contexts)
        model.enable_decode_slots(4, 256)
        try:
            eager = _greedy_steps(model, contexts)
            model.cuda_graphs = graphs = DecodeGraphs(model, CudaGraphConfig([len(contexts)]))
            got = _greedy_steps(model, contexts)
        finally:
            model.cuda_graphs = model.decode_slots = None
        assert graphs.disabled is None and graphs.counts == {"eager": 1, "captured": 1, "replayed": 4}
        for a, b, c in zip(got, eager, lists):
            if len(contexts) == 1:
                assert torch.equal(a, b), float((a - b).abs().max())
            assert float((a - b).norm() / b.norm()) <= 1e-2
            if lists_bound is not None:
                assert float((b - c).norm() / c.norm()) <= lists_bound


def _greedy_steps(model, contexts, steps=5):
    """Prefill each context (random ids), then `steps` greedy decode steps of all -> per step the [N, V] logits."""
    from dsflash.model_def.ragged import Chunk
    g = torch.Generator().manual_seed(1)
    states = [model.new_state(1) for _ in contexts]
    last = model.step_chunks([Chunk(torch.randint(3, 1000, (1, n), generator=g).cuda(), s)
                              for n, s in zip(contexts, states)])
    out = []
    for _ in range(steps):
        last = model.step_chunks([Chunk(lg.argmax(-1, keepdim=True), s) for lg, s in zip(last, states)])
        out.append(torch.cat(last))
    return out


def _graphs_replay_the_eager_steps(model) -> None:
    from dsflash.serve.runtime.cuda_graphs import CudaGraphConfig, DecodeGraphs

    def decode(contexts, steps=5):
        return _greedy_steps(model, contexts, steps)

    for contexts in ([37], [37, 3, 20]):
        want = decode(contexts)
        model.cuda_graphs = DecodeGraphs(model, CudaGraphConfig([len(contexts)]))
        try:
            got = decode(contexts)
        finally:
            graphs, model.cuda_graphs = model.cuda_graphs, None
        assert graphs.disabled is None and graphs.counts["replayed"] == (len(model.layers) + 1) * 4
        for a, b in zip(got, want):
            if len(contexts) == 1:
                assert torch.equal(a, b), float((a - b).abs().max())
            assert float((a - b).norm() / b.norm()) <= 1e-2


def test_missing_tuned_entries_are_logged_once(engine, caplog, v41_site_kinds):
    (engine / "tuned.json").unlink()
    model, _ = load_engine_model(engine, dense_experts=True)
    ids = torch.randint(0, model.args.vocab_size, (1, 5), generator=torch.Generator().manual_seed(4)).cuda()
    with caplog.at_level(logging.WARNING, logger="dsflash.plugins.tuning"):
        model.logits(ids)
        first = [r.getMessage() for r in caplog.records if "no tuned entry" in r.getMessage()]
        model.logits(ids)
        again = [r.getMessage() for r in caplog.records if "no tuned entry" in r.getMessage()]
    assert first and again == first
    # the fallback configs (on sm90 the Gluon decode default for M <= 8) compute what the references do; this
    # engine's narrow experts (2 × 64 values of h per token) take the fp32-summing MoE GEMV (`sums_for_width`: the f16
    # one reached 1.2e-2 here); the GEMM sites are at 1.5-1.9e-3
    rows = site_parity(model, ids)
    assert {r["kind"] for r in rows} == v41_site_kinds
    assert max(r["rel"] for r in rows) <= 1e-2, max(rows, key=lambda r: r["rel"])


def test_ep2_ranks_match_their_references(hopper_ckpt, partial_sums):
    """MoE EP2 (TP2): each rank's MoE plugin (its block of experts, routed over all, pairs listed by the router)
    matches the model's EP reference on that rank. (Tuning the EP buckets: tests/unit/test_tune.py.)"""
    eng = write_engine(hopper_ckpt, hopper_ckpt.parent / "eng-ep2", Mapping(world_size=2, tp_size=2, moe_ep_size=2),
                       "sm90", BuildConfig(max_num_tokens=8, tune_budget_s=0), progress=False)
    for rank in (0, 1):
        model, _ = load_engine_model(eng, rank, comm=partial_sums(2, rank), dense_experts=True)
        n = model.args.n_routed_experts // 2
        assert model.layers[0].ffn.plugin.expert_start == rank * n
        for t in (1, 40):   # decode (the pair-list GEMVs) and prefill (the sorted MMA path)
            ids = torch.randint(0, model.args.vocab_size, (1, t), generator=torch.Generator().manual_seed(rank)).cuda()
            rows = site_parity(model, ids)
            assert "moe" in {r["kind"] for r in rows}
            worst = max(rows, key=lambda r: r["rel"])
            assert worst["rel"] <= 1e-2, (rank, t, worst)


def test_v4_engine_sites_match_their_references(tmp_path):
    """A tiny V4 engine (1×128 / 128×128 groups; shared expert 128 wide, so w1|w3 stack) on the GPU: every FP8
    linear, norm, SwiGLU, WO-A, mHC block and MoE site (hash-routed layers too) matches the V4 reference, tuned
    (decode and prefill buckets) and untuned, at one token (the decode GEMVs) and at 40 (the sorted MMA path)."""
    import dataclasses
    args = dataclasses.replace(get_preset("v4", "tiny"), moe_intermediate_size=128)
    synthesize(args, tmp_path / "hf", seed=7)
    convert(tmp_path / "hf", tmp_path / "hop", "hopper", progress=False, log=lambda *a: None)
    eng = write_engine(tmp_path / "hop", tmp_path / "eng", Mapping(world_size=1, tp_size=1), "sm90",
                       BuildConfig(max_num_tokens=64, tune_budget_s=30), progress=False)
    for tuned in (True, False):
        if not tuned:
            (eng / "tuned.json").unlink()
        model, _ = load_engine_model(eng, dense_experts=True)
        for t in (1, 40):
            ids = torch.randint(0, model.args.vocab_size, (1, t), generator=torch.Generator().manual_seed(t)).cuda()
            rows = site_parity(model, ids)
            assert {r["kind"] for r in rows} == {"gemm", "gemm_w13", "norm", "norm_pair", "swiglu", "mhc_v4", "wo_a",
                                                 "moe_v4"}
            worst = max(rows, key=lambda r: r["rel"])
            print(f"V4 sites (tuned={tuned}, T={t}):",
                  {k: f"{max(r['rel'] for r in rows if r['kind'] == k):.1e}" for k in sorted({r['kind'] for r in rows})})
            assert worst["rel"] <= 1e-2, (tuned, t, worst)
