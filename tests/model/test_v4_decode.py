"""Incremental decoding of the V4-Flash reference: decode = prefill, in both numerics modes.

The state (window ring, compressor pending and overlap rows, compressed and index caches) must make any split of a
sequence into `step` chunks compute what one full forward computes. Sequences run to 301 tokens on the tiny preset
(window 32, ratios 4 and 128), so decoding crosses window wraps, ratio-4 group ends with overlap and indexer top-k,
and ratio-128 completions (positions 127 and 255).

`hf` (float32) is compared strictly. `deploy` fake-quantizes (BF16 then FP8 activations and KV, FP4 index keys and
queries), and a chunk of another length runs the same math in another summation order (CPU GEMMs pick other kernels
for few rows; softmax sums run over other lengths). A last-bit difference on a rounding boundary flips a code; every
quantized layer turns an input perturbation ε into ~sqrt(ε·step), so one flip grows into percent-level differences a
few layers and tokens later (an FP4 flip can swap an indexer pick). So deploy runs in float64, where such flips are
~1e-9 events and the comparison is strict (layers.py keeps float64 in its "fp32 math"). The deploy-specific state,
the quantized caches, is checked directly.
"""
from __future__ import annotations

import pytest
import torch

from dsflash.convert.synth import synthesize
from dsflash.model_def import get_preset, load_reference
from dsflash.model_def.quant import fake_quant_fp4_pow2, fake_quant_fp8

CHUNKS = [37, 1, 64, 1, 1, 90, 3, 1, 100, 3]  # 301 tokens
PROMPT, TOTAL = 200, 301  # the 101 decode steps cross window wraps and the ratio-128 completion at 255


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return synthesize(get_preset("v4", "tiny"), tmp_path_factory.mktemp("v4-decode") / "ckpt", seed=3)


@pytest.fixture(scope="module", params=["hf", "deploy"])
def model(request, ckpt):
    dtype = torch.float64 if request.param == "deploy" else torch.float32
    return load_reference(ckpt, numerics=request.param, dtype=dtype)


def _ids(model, batch, n, seed):
    return torch.randint(0, model.args.vocab_size, (batch, n), generator=torch.Generator().manual_seed(seed))


def _rel(a, b):
    return (a - b).norm(dim=-1) / b.norm(dim=-1)


def test_chunked_step_matches_full_forward(model):
    ids = _ids(model, 2, TOTAL, 1)
    full = model.logits(ids)
    state, outs, p = model.new_state(2), [], 0
    for c in CHUNKS:
        outs.append(model.step(ids[:, p:p + c], state))
        p += c
    assert state.pos == TOTAL
    err = _rel(torch.cat(outs, 1), full)  # [B,S] per position
    assert err.max() <= 1e-4, err.max()


def test_greedy_chain_is_full_forward_argmax(model):
    gen = model.generate_greedy(_ids(model, 2, PROMPT, 2), TOTAL - PROMPT)
    assert gen.shape == (2, TOTAL) and len(set(gen[0, PROMPT:].tolist())) > 30  # a real walk, not a loop
    full = model.logits(gen)[:, PROMPT - 1:-1]  # predicts gen[:, PROMPT:]
    chosen = gen[:, PROMPT:]
    assert torch.equal(full.argmax(-1), chosen)


def test_snapshot_restore_is_exact(model):
    ids = _ids(model, 2, 140, 4)
    state = model.new_state(2)
    model.step(ids[:, :125], state)  # mid-group for both ratios
    snap = state.snapshot()
    a = [model.step(ids[:, p:p + 1], state) for p in range(125, 131)]  # crosses the 128 completion
    model.step(ids[:, 131:140], state)
    state.restore(snap)
    assert state.pos == 125
    b = [model.step(ids[:, p:p + 1], state) for p in range(125, 131)]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    state.restore(snap)  # the snapshot survives a restore and later steps
    assert torch.equal(model.step(ids[:, 125:126], state), a[0])


def test_deploy_caches_hold_quantized_values(ckpt):
    """Deploy: window ring and compressed KV hold FP8 nope channels (pow2 scale per 64), index keys hold FP4 values
    (pow2 scale per 32, after the Hadamard rotation). hf holds unquantized values."""
    for mode in ("deploy", "hf"):
        m = load_reference(ckpt, numerics=mode)
        state = m.new_state(1)
        m.step(_ids(m, 1, 260, 5), state)
        nope = m.args.head_dim - m.args.rope_dim
        for i, st in enumerate(state.layers):
            rows = [st["win"][..., :nope]] + ([st["kv.cache"][..., :nope]] if "kv.cache" in st else [])
            for t in rows:
                pad = torch.nn.functional.pad(t, (0, -nope % 64))
                on_grid = torch.equal(fake_quant_fp8(pad, 64), pad)
                assert on_grid == (mode == "deploy"), (mode, i)
            if "idx.cache" in st:
                k = st["idx.cache"]
                assert k.shape[1] == 260 // 4
                assert torch.equal(fake_quant_fp4_pow2(k, 32), k) == (mode == "deploy"), (mode, i)
            if "kv.cache" in st:
                assert st["kv.cache"].shape[1] == 260 // m.layers[i].attn.ratio


def test_deploy_differs_from_hf_by_quantization_only(ckpt):
    hf, dep = load_reference(ckpt, numerics="hf"), load_reference(ckpt, numerics="deploy")
    ids = _ids(hf, 1, 64, 6)
    err = _rel(dep.logits(ids), hf.logits(ids))
    assert 1e-3 <= err.mean() <= 0.3, err.mean()


def test_mtp_block_chunked_matches_full(ckpt):
    m = load_reference(ckpt, numerics="hf")
    ids = _ids(m, 2, 121, 8)
    X = m.streams(ids[:, :-1], m.new_state(2))  # main final streams at positions 0..119
    full = m.mtp_logits(X, ids[:, 1:])  # draft for positions 2..121
    assert full.shape == (2, 120, m.args.vocab_size) and full.isfinite().all()
    state, outs = m.new_state(2), []
    for a, b in ((0, 50), (50, 51), (51, 120)):
        outs.append(m.mtp_logits(X[:, a:b], ids[:, a + 1:b + 1], state))
    assert state.mtp_pos == [120]
    assert _rel(torch.cat(outs, 1), full).max() <= 1e-4
