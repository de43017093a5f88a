"""DeepSeek-V4.1: incremental decoding == one full forward, for `hf` and `deploy` numerics and two presets.

Greedy decoding (one step() per token) must pick the argmax of the full-sequence logits at every position over 300
tokens, which crosses the sliding-window wrap (32 / 64), many ratio-2 group completions, the candidate-block stage
(6 blocks x 4 entries < 300 ratio-1 entries) and Engram look-back boundaries; arbitrary prefill chunks must give the
full logits; snapshot/restore must be exact. The model runs in fp64 so that rounding which depends on evaluation order
(gemv vs gemm, key-set length) stays far below the FP8/FP4 grids: grid flips are legitimately order-dependent and
would otherwise cascade through top-k and routing decisions.
"""
import pytest
import torch

from dsflash.convert.synth import synthesize
from dsflash.model_def import load_reference
from dsflash.model_def.config import get_preset

PROMPT, NEW = 9, 300
CHUNKS = (1, 2, 5, 3, 17, 1, 31, 64, 7, 33, 2, 40, 11, 92)  # sums to PROMPT + NEW
CASES = [("tiny", "hf", 2), ("tiny", "deploy", 1), ("tiny-wide", "hf", 1)]  # (preset, numerics, batch)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("v41")
    return {p: synthesize(get_preset("v41", p), root / p, seed=0) for p in ("tiny", "tiny-wide")}


@pytest.fixture(scope="module", params=CASES, ids=["-".join(map(str, c)) for c in CASES])
def generated(request, checkpoints):
    preset, numerics, batch = request.param
    model = load_reference(checkpoints[preset], numerics=numerics, dtype=torch.float64)
    a = model.args
    assert PROMPT + NEW > 2 * a.sliding_window and NEW > a.candidate_topk_blocks * a.candidate_block_size
    prompt = torch.randint(0, a.vocab_size, (batch, PROMPT), generator=torch.Generator().manual_seed(1))
    out = model.generate_greedy(prompt, NEW)
    return model, out, model.logits(out)


def check_close(got: torch.Tensor, full: torch.Tensor) -> None:
    d = (got - full).abs().amax(-1)
    assert d.max().item() < 1e-5, d.max().item()


def test_greedy_chain_is_argmax_of_full_logits(generated):
    _, out, full = generated
    assert len(set(out[0, PROMPT:].tolist())) > NEW // 3  # a real walk, not a loop on one token
    lg, chosen = full[:, PROMPT - 1:-1], out[:, PROMPT:]
    gap = lg.max(-1).values - lg.gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
    assert gap.max().item() <= 1e-9, f"decode picked a non-argmax token (gap {gap.max().item():.3g})"


def test_chunked_prefill_matches_full(generated):
    model, out, full = generated
    assert sum(CHUNKS) == out.shape[1]
    state, got, i = model.new_state(out.shape[0]), [], 0
    for c in CHUNKS:
        got.append(model.step(out[:, i:i + c], state))
        i += c
    assert state.pos == out.shape[1]
    check_close(torch.cat(got, 1), full)


@pytest.fixture(scope="module")
def hf_model(checkpoints):
    return load_reference(checkpoints["tiny"], numerics="hf", dtype=torch.float64)


def test_snapshot_restore_is_exact(hf_model):
    model = hf_model
    out = torch.randint(0, model.args.vocab_size, (2, 80), generator=torch.Generator().manual_seed(3))
    state = model.new_state(2)
    model.step(out[:, :37], state)          # odd: a ratio-2 group is open, the window has wrapped
    snap = state.snapshot()
    cont = [out[:, 37:38], out[:, 38:45], out[:, 45:80]]
    first = [model.step(c, state) for c in cont]
    for _ in range(2):                      # a snapshot can be restored more than once
        state.restore(snap)
        assert state.pos == 37
        again = [model.step(c, state) for c in cont]
        assert all(torch.equal(a, b) for a, b in zip(first, again))
    state.restore(snap)
    other = model.step(out[:, 50:53], state)   # a different continuation from the same point
    assert other.shape == (2, 3, model.args.vocab_size)


def test_image_tokens_route_with_bias_vl_and_block_engram(hf_model):
    model = hf_model
    a = model.args
    ids = torch.randint(0, a.vocab_size, (1, 24), generator=torch.Generator().manual_seed(2))
    mask = torch.zeros(1, 24, dtype=torch.bool)
    mask[0, 10:14] = True
    base, img = model.logits(ids), model.logits(ids, image_mask=mask)
    # causal: nothing before the image span changes (up to fp64 rounding: expert GEMMs batch other rows)
    assert torch.allclose(base[:, :10], img[:, :10], atol=1e-12, rtol=0)
    assert not torch.allclose(base[:, 10:], img[:, 10:])
    state, got = model.new_state(1), []
    for lo, hi in ((0, 7), (7, 12), (12, 13), (13, 24)):
        got.append(model.step(ids[:, lo:hi], state, image_mask=mask[:, lo:hi]))
    check_close(torch.cat(got, 1), img)
