"""numerics="hf" of the V4-Flash reference equals transformers 5.23 `DeepseekV4ForCausalLM` (the oracle).

Both models hold the same dequantized weights of a synthetic checkpoint written in the real HF format
(`convert.synth`); ours is loaded through `load_reference`, transformers' is built in float32 by the bridge. Sequence
lengths are not multiples of any ratio: 37 crosses the window-32 wrap and nine ratio-4 groups; 301 also wraps window 64
(tiny-b), makes the indexer choose 16 of up to 75 entries, and completes two ratio-128 groups.

Deliberate difference: at exactly tied indexer scores our top-k takes the lower entry index (so a chunked prefill picks
what a full forward picks); `Tensor.topk`'s tie order is implementation-defined, so the oracle runs with the same rule
(`_hf_v4_bridge.stable_topk_ties`). Ties are exact zeros — every index head's ReLU is 0 — common with 4 heads.
Not compared: the MTP block (`mtp.0`), which transformers does not implement.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from dsflash.convert.synth import synthesize
from dsflash.model_def import get_preset, load_reference, tensor_table


def _bridge():
    spec = importlib.util.spec_from_file_location("_hf_v4_bridge", Path(__file__).with_name("_hf_v4_bridge.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bridge = _bridge()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # two shared cores: OpenMP spinning costs more than it brings at these sizes
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


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
