"""numerics="hf" of the V4-Flash reference equals transformers 5.23 `DeepseekV4ForCausalLM` (the oracle).

Both models hold the same dequantized weights of a synthetic checkpoint written in the real HF format
(`convert.synth`); ours is loaded through `load_reference`, transformers' is built in float32 by the bridge. Sequence
lengths are not multiples of any ratio: 37 crosses the window-32 wrap and nine ratio-4 groups; 301 also wraps window 64
(tiny-b), makes the indexer choose 16 of up to 75 entries, and completes two ratio-128 groups.

Deliberate difference: at exactly tied indexer scores our top-k takes the lower entry index (so a chunked prefill picks
what a full forward picks); `Tensor.topk`'s tie order is implementation-defined, so the oracle runs with the same rule
(`_hf_v4_bridge.stable_topk_ties`). Ties are exact zeros — every index head's ReLU is 0 — common with 4 heads.
transformers' own incremental path (its V4 cache layers) is a second, independent oracle for our chunked `step`, and
the single-rank model is the oracle of a TP2 run (two ranks in threads; weights sliced by the table's shard rules).
Not compared: the MTP block (`mtp.0`), which transformers does not implement.
"""
from __future__ import annotations

import importlib.util
import threading
from pathlib import Path

import pytest
import torch

from dsflash.convert.synth import synthesize
from dsflash.model_def import Mapping, build_model, get_preset, load_reference, tensor_table
from dsflash.model_def.mapping import split_range


def _bridge():
    spec = importlib.util.spec_from_file_location("_hf_v4_bridge", Path(__file__).with_name("_hf_v4_bridge.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bridge = _bridge()


@pytest.fixture(scope="module", params=["tiny", "tiny-b"])
def models(request, tmp_path_factory):
    args = get_preset("v4", request.param)
    ckpt = synthesize(args, tmp_path_factory.mktemp(f"v4-{request.param}") / "ckpt", seed=7)
    ours = load_reference(ckpt, numerics="hf")
    return args, ours, bridge.build_hf_model(args, ours.state_dict())


def test_tensor_table_is_the_model(models):
    args, ours, _ = models
    table = tensor_table(args)
    sd = ours.state_dict()
    assert [e.name for e in table if e.name not in sd] == []
    assert sorted(sd) == sorted(e.name for e in table)
    for e in table:
        assert tuple(sd[e.name].shape) == e.shape, e.name
    roles = {e.name: e.role for e in table}
    E = args.n_routed_experts
    for i in range(args.n_layers):
        p, r = f"layers.{i}.", args.ratio(i)
        assert roles[p + "attn.wo_a.weight"] == "fp8_block" and roles[p + "ffn.shared_experts.w2.weight"] == "fp8_block"
        assert all(roles[f"{p}ffn.experts.{e}.w{k}.weight"] == "mxfp4" for e in range(E) for k in (1, 2, 3))
        assert (p + "ffn.gate.tid2eid" in roles) == (i < args.num_hash_layers) != (p + "ffn.gate.bias" in roles)
        assert (p + "attn.compressor.ape" in roles) == (r > 0)
        assert (p + "attn.indexer.compressor.ape" in roles) == (r == 4)
        if r:
            assert sd[p + "attn.compressor.ape"].shape == (r, (2 if r == 4 else 1) * args.head_dim)
    for name in ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight", "norm.weight", "hc_head_fn",
                 "attn.wq_a.weight", "ffn.gate.bias"):
        assert "mtp.0." + name in roles
    assert not any(n.startswith("mtp.0.attn.compressor") for n in roles)  # the MTP block is sliding-window only


def test_full_v4_table_matches_the_release():
    """Shapes and roles of architecture.md §3.1 and the published 284B total (MTP excluded)."""
    args = get_preset("v4", "full")
    t = {e.name: e for e in tensor_table(args)}
    expect = {
        "embed.weight": ((129280, 4096), "bf16"), "hc_head_fn": ((4, 16384), "f32"), "hc_head_scale": ((1,), "f32"),
        "layers.0.hc_attn_fn": ((24, 16384), "f32"), "layers.0.ffn.gate.tid2eid": ((129280, 6), "i64"),
        "layers.2.attn.wq_b.weight": ((32768, 1024), "fp8_block"),
        "layers.2.attn.wo_a.weight": ((8192, 4096), "fp8_block"),
        "layers.2.attn.wo_b.weight": ((4096, 8192), "fp8_block"), "layers.2.attn.compressor.ape": ((4, 1024), "f32"),
        "layers.2.attn.indexer.wq_b.weight": ((8192, 1024), "fp8_block"),
        "layers.2.attn.indexer.weights_proj.weight": ((64, 4096), "bf16"),
        "layers.2.attn.indexer.compressor.wkv.weight": ((256, 4096), "bf16"),
        "layers.3.attn.compressor.ape": ((128, 512), "f32"), "layers.3.ffn.gate.bias": ((256,), "f32"),
        "layers.42.ffn.experts.255.w2.weight": ((4096, 2048), "mxfp4"),
        "layers.42.ffn.shared_experts.w1.weight": ((2048, 4096), "fp8_block"),
        "mtp.0.e_proj.weight": ((4096, 4096), "fp8_block"), "mtp.0.hc_head_base": ((4,), "f32"),
    }
    for name, (shape, role) in expect.items():
        assert (t[name].shape, t[name].role) == (shape, role), name
    assert "layers.2.ffn.gate.tid2eid" in t and "layers.3.ffn.gate.tid2eid" not in t
    assert "layers.1.attn.compressor.ape" not in t and "layers.41.attn.indexer.wq_b.weight" not in t
    main = sum(torch.Size(e.shape).numel() for e in t.values() if not e.name.startswith("mtp."))
    assert abs(main / 284e9 - 1) < 0.005, main


@pytest.mark.parametrize("seq_len", [37, 301])
def test_logits_match_transformers(models, seq_len):
    args, ours, hf = models
    ids = torch.randint(0, args.vocab_size, (2, seq_len), generator=torch.Generator().manual_seed(seq_len))
    got, ref = ours.logits(ids), bridge.hf_logits(hf, ids)
    assert got.dtype == torch.float32 and got.shape == ref.shape == (2, seq_len, args.vocab_size)
    err = ((got - ref).norm() / ref.norm()).item()
    worst = ((got - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    assert err <= 1e-3 and worst <= 1e-3, (err, worst)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_chunked_step_matches_transformers_cache(models):
    args, ours, hf = models
    chunks = [37, 1, 64, 1, 1, 90, 3, 1, 100, 3]  # 301 tokens: prefill chunks and single decode steps
    ids = torch.randint(0, args.vocab_size, (2, sum(chunks)), generator=torch.Generator().manual_seed(11))
    state, outs, p = ours.new_state(2), [], 0
    for c in chunks:
        outs.append(ours.step(ids[:, p:p + c], state))
        p += c
    got, ref = torch.cat(outs, 1), bridge.hf_chunked_logits(hf, ids, chunks)
    worst = ((got - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    assert worst <= 1e-3, worst


class _ThreadComm:
    """All-reduce between ranks running in threads of this process; sums in rank order in fp32."""

    def __init__(self, rank: int, bufs: list, barrier: threading.Barrier):
        self.tp_rank, self.tp_size, self.bufs, self.barrier = rank, len(bufs), bufs, barrier

    def all_reduce(self, x):
        self.bufs[self.tp_rank] = x.float()
        self.barrier.wait()
        y = sum(self.bufs[1:], self.bufs[0].clone())
        self.barrier.wait()
        return y.to(x.dtype)


def _shard(entry, v, m: Mapping):
    """The slice of logical tensor v that rank m holds, by the entry's shard rule."""
    if entry.shard in ("col", "head"):
        return v[slice(*split_range(v.shape[0], m.tp_size, m.tp_rank))]
    if entry.shard == "row":
        return v[:, slice(*split_range(v.shape[1], m.tp_size, m.tp_rank))]
    if entry.shard == "expert":  # the EP range decides presence; MoE-TP slices the intermediate dim
        dim = 1 if entry.name.endswith("w2.weight") else 0
        a, b = split_range(v.shape[dim], m.moe_tp_size, m.moe_tp_rank)
        return v.narrow(dim, a, b - a)
    return v


def test_tensor_parallel_matches_single_rank(models):
    args, ours, _ = models
    moe = {"moe_tp_size": 2} if args.n_routed_experts <= 8 else {"moe_ep_size": 2}  # tiny: MoE-TP; tiny-b: EP
    table, full = {e.name: e for e in tensor_table(args)}, ours.state_dict()
    bufs, barrier = [None, None], threading.Barrier(2, timeout=120)  # a failing rank breaks it
    ranks = []
    for r in range(2):
        m = Mapping(world_size=2, rank=r, tp_size=2, **moe)
        model = build_model(args, "hf", mapping=m, comm=_ThreadComm(r, bufs, barrier))
        with torch.no_grad():
            for name, p in model.state_dict().items():
                p.copy_(_shard(table[name], full[name], m))
        ranks.append(model.eval())
    ids = torch.randint(0, args.vocab_size, (2, 150), generator=torch.Generator().manual_seed(5))
    out = [None, None]
    threads = [threading.Thread(target=lambda r=r: out.__setitem__(r, ranks[r].logits(ids))) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ref = ours.logits(ids)
    assert torch.equal(out[0], out[1])
    assert ((out[0] - ref).norm(dim=-1) / ref.norm(dim=-1)).max() <= 1e-4
