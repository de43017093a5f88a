"""DeepSeek-V4.1 DSpark drafter (`mtp.0..2`): captures, context rings, block proposal shapes and determinism.

The speculative loop itself is a later piece; this checks the drafter as a function of (captured hidden states,
committed length, bonus token)."""
import pytest
import torch

from dsflash.convert.synth import synth_value
from dsflash.model_def.config import get_preset
from dsflash.model_def.layers import Numerics
from dsflash.model_def.v41 import DeepseekV41Model, tensor_table


@pytest.fixture(scope="module")
def model():
    args = get_preset("v41", "tiny")
    m = DeepseekV41Model(args, Numerics("hf", args.act_block), dtype=torch.float64)
    params = dict(m.named_parameters())
    with torch.no_grad():
        for e in tensor_table(args):
            params[e.name].copy_(synth_value(e, args, 3))
    return m.eval()


@pytest.fixture(scope="module")
def prefilled(model):
    ids = torch.randint(0, model.args.vocab_size, (2, 45), generator=torch.Generator().manual_seed(5))
    state = model.new_state(2)
    logits = model.step(ids, state)
    return ids, state, logits


def test_capture_is_the_mean_layer_entry_stream(model):
    a = model.args
    seen = {}
    for t in a.dspark_target_layer_ids:   # a forward enters a block at `open_attn` (X after Engram, pre)
        blk = model.layers[t]
        blk.open_attn = lambda X, pre, join=False, blk=blk, t=t: (seen.setdefault(t, X),
                                                                  type(blk).open_attn(blk, X, pre, join))[1]
    try:
        state = model.new_state(1)
        model.step(torch.randint(0, a.vocab_size, (1, 7)), state)
    finally:
        for t in a.dspark_target_layer_ids:
            del model.layers[t].open_attn
    assert state.capture.shape == (1, 7, len(a.dspark_target_layer_ids) * a.hidden_size)
    ref = torch.cat([seen[t].mean(-2) for t in a.dspark_target_layer_ids], -1)
    assert torch.allclose(state.capture, ref, atol=1e-12)


def test_draft_shapes_and_determinism(model, prefilled):
    a = model.args
    ids, state, logits = prefilled
    ds = model.new_draft_state(2)
    model.draft_context(ds, state.capture, 0)
    assert ds.ctx_len == 45
    bonus = logits[:, -1].argmax(-1)
    out = model.draft(ds, bonus)
    k = a.dspark_block_size
    assert out.tokens.shape == (2, k) and out.logits.shape == (2, k, a.vocab_size)
    assert out.confidence.shape == (2, k) and bool(((out.confidence > 0) & (out.confidence < 1)).all())
    assert torch.equal(out.tokens, out.logits.argmax(-1))        # greedy Markov refinement
    snap = ds.snapshot()
    again = model.draft(ds, bonus)                                # drafting reads the rings, never writes them
    assert torch.equal(again.tokens, out.tokens) and torch.equal(again.logits, out.logits)
    assert all(torch.equal(x, y) for x, y in zip(snap["rings"], ds.rings))
    # Markov head: position j's logits carry the bias of the token drafted at j-1 (the bonus for j = 0)
    mh = model.mtp[-1].markov_head
    prev = torch.cat([bonus[:, None], out.tokens[:, :-1]], 1)
    base = out.logits - torch.stack([mh.bias(prev[:, j]) for j in range(k)], 1)
    other = model.draft(ds, (bonus + 1) % a.vocab_size)
    other_base = other.logits - torch.stack(
        [mh.bias(torch.cat([(bonus[:, None] + 1) % a.vocab_size, other.tokens[:, :-1]], 1)[:, j]) for j in range(k)],
        1)
    assert not torch.allclose(base, other_base)                   # the bonus token is also the block's input 0


def test_context_rows_chunked_equal_one_shot(model, prefilled):
    _, state, logits = prefilled
    w = model.args.sliding_window
    one = model.new_draft_state(2)
    model.draft_context(one, state.capture, 0)                     # 45 > window: keeps the last 32 positions
    assert sorted(one.frames.tolist()) == list(range(45 - w + 1, 46))   # position p sits at frame p + 1
    parts = model.new_draft_state(2)
    for lo, hi in ((0, 10), (10, 11), (11, 45)):
        model.draft_context(parts, state.capture[:, lo:hi], lo)
    assert torch.equal(one.frames, parts.frames)
    assert all(torch.allclose(x, y, atol=1e-12) for x, y in zip(one.rings, parts.rings))
    bonus = logits[:, -1].argmax(-1)
    assert torch.equal(model.draft(one, bonus).tokens, model.draft(parts, bonus).tokens)
    with pytest.raises(ValueError, match="continue at position 45"):
        model.draft_context(parts, state.capture[:, :3], 40)


def test_block_attention_is_non_causal_and_reads_the_ring(model):
    a = model.args
    attn = model.mtp[0].attn
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1, a.dspark_block_size, a.hidden_size, generator=g, dtype=torch.float64)
    ring = torch.randn(1, a.sliding_window, a.head_dim, generator=g, dtype=torch.float64)
    valid = torch.zeros(1, a.sliding_window, dtype=torch.bool)
    valid[0, :5] = True
    frames = 10 + torch.arange(a.dspark_block_size).unsqueeze(0)
    y = attn.draft_forward(x, ring, valid, frames)
    x2 = x.clone()
    x2[0, -1] += 1.0                                                 # the last block position ...
    assert not torch.allclose(attn.draft_forward(x2, ring, valid, frames)[0, 0], y[0, 0])  # ... reaches position 0
    ring2 = ring.clone()
    ring2[0, 20] += 1.0                                              # an invalid slot: ignored
    assert torch.equal(attn.draft_forward(x, ring2, valid, frames), y)
    ring2[0, 2] += 1.0                                               # a valid slot: read
    assert not torch.allclose(attn.draft_forward(x, ring2, valid, frames), y)
