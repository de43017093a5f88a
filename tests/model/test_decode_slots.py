"""Decode steps in fixed slots (model_def/decode_slots.py), both families: the same logits and caches as the
per-request caches, at every transition between the two, and one CUDA-graph piece per decode step (CPU stand-in
backend)."""
from __future__ import annotations

import gc
import logging

import pytest
import torch

from dsflash.convert.synth import synthesize
from dsflash.model_def import get_preset, load_reference
from dsflash.model_def.ragged import Chunk
from dsflash.serve.runtime.cuda_graphs import CudaGraphConfig, DecodeGraphs, StandInBackend

# tiny presets: window 32; V4.1 ratio-2 sources (layers 2, 4), a ratio-1 source (6), candidate blocks at layer 6;
# V4 ratio-4 (overlapping, indexed) and ratio-128 layers
CONTEXTS = [40, 3, 17]


@pytest.fixture(scope="module", params=["v41", "v4"])
def model(request, tmp_path_factory):
    ckpt = synthesize(get_preset(request.param, "tiny"), tmp_path_factory.mktemp("slots") / "ckpt", seed=4)
    return load_reference(ckpt, numerics="deploy", dtype=torch.float64)


@pytest.fixture
def slots(model):
    """`n` slots on the module's model for one test (`slots(n, max_seq_len)`); off again after it."""
    def make(n: int = 4, max_seq_len: int = 200):
        return model.enable_decode_slots(n, max_seq_len)
    yield make
    model.decode_slots = model.cuda_graphs = None
    gc.collect()


def _prefill(model, contexts, seed=0):
    g = torch.Generator().manual_seed(seed)
    states = [model.new_state(1) for _ in contexts]
    last = model.step_chunks([Chunk(torch.randint(3, 1000, (1, n), generator=g), s) for n, s in zip(contexts, states)])
    return states, last


def _decode(model, contexts, steps, seed=0):
    """Prefill, then `steps` greedy decode steps of all requests together -> (per step [N, V] logits, states)."""
    states, last = _prefill(model, contexts, seed)
    out = []
    for _ in range(steps):
        last = model.step_chunks([Chunk(lg.argmax(-1, keepdim=True), s) for lg, s in zip(last, states)])
        out.append(torch.cat(last))
    return out, states


def _assert_same_caches(a, b):
    """Every cache a later step can read is equal (V4: a completed group's rows of the open-group buffer, which
    the per-request path keeps and the slots overwrite, are never read again)."""
    assert a.pos == b.pos
    if hasattr(a, "sources"):
        for wa, wb in zip(a.window, b.window, strict=True):
            assert torch.equal(wa, wb)
        for s in a.sources:
            for f in ("kv", "index_k", "buf_kv", "buf_gate"):
                assert torch.equal(getattr(a.sources[s], f), getattr(b.sources[s], f)), (s, f)
        return
    for la, lb in zip(a.layers, b.layers, strict=True):
        assert la.keys() == lb.keys()
        for key in la:
            if ".pend_" not in key:
                assert torch.equal(la[key], lb[key]), key


def _attention_class(model):
    return type(model.layers[0].attn)


class _Spy:
    """Counts the model's `Attention.slot_attend` calls (the slot path actually ran)."""

    def __init__(self, model):
        self.cls = _attention_class(model)

    def __enter__(self):
        self.calls, orig = 0, self.cls.slot_attend
        self.orig = orig

        def counted(attn, *a, **k):
            self.calls += 1
            return orig(attn, *a, **k)
        self.cls.slot_attend = counted
        return self

    def __exit__(self, *exc):
        self.cls.slot_attend = self.orig


def test_slot_steps_equal_the_list_caches(model, slots):
    """Steps past the window, through every group phase (V4: 150 steps, past a ratio-128 group's end): the logits
    are the per-request caches' bit for bit, and the caches moved back out of the slots are theirs."""
    steps = 40 if model.args.family == "v41" else 150
    want, want_states = _decode(model, CONTEXTS, steps)
    slots()
    with _Spy(model) as spy:
        got, got_states = _decode(model, CONTEXTS, steps)
    assert spy.calls == steps * len(model.layers)
    assert all(s.slot is not None for s in got_states) and model.decode_slots.free == 1
    # the slots hold the caches: the per-request copies are gone (not a second copy of every decoding request's)
    assert all(getattr(s, "_window", getattr(s, "_layers", 0)) is None for s in got_states)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    for a, b in zip(got_states, want_states):
        _assert_same_caches(a, b)     # moves a's caches out of its slot
    assert model.decode_slots.free == 4 and all(s.slot is None for s in got_states)


def test_mixed_steps_and_transitions(model, slots):
    """A prompt chunk of a new request beside slot decode tokens; a slot request that continues with a chunk of two
    tokens (its caches move out) and decodes again (back in); a snapshot taken and restored while in a slot."""
    def script(model):
        states, last = _prefill(model, [40, 17])
        out = []
        for step in range(12):
            ids = [lg.argmax(-1, keepdim=True) for lg in last]
            chunks = [Chunk(i, s) for i, s in zip(ids, states)]
            if step == 3:                                    # a newcomer's prompt joins the step
                states.append(model.new_state(1))
                chunks.append(Chunk(torch.arange(5, 14).view(1, 9), states[-1]))
            if step == 6:                                    # request 0 feeds two tokens at once
                chunks[0] = Chunk(torch.cat([ids[0], ids[0]], 1), states[0])
            if step == 8:
                snap = states[1].snapshot()
            if step == 10:
                states[1].restore(snap)
            last = model.step_chunks(chunks)
            out.append(torch.cat(last))
        return out, states

    want, want_states = script(model)
    slots()
    got, got_states = script(model)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(got_states, want_states, strict=True):
        _assert_same_caches(a, b)


def test_requests_beyond_the_slots_or_max_seq_len_take_the_list_path(model, slots):
    want, _ = _decode(model, CONTEXTS, 6)
    held = slots(n=2)
    got, states = _decode(model, CONTEXTS, 6)         # three requests, two slots: every step stays on the lists
    assert held.free == 2 and all(s.slot is None for s in states)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    slots(n=4, max_seq_len=42)                        # the 40-token request reaches position 42 after two steps
    with _Spy(model) as spy:
        got, states = _decode(model, CONTEXTS, 6)
    assert spy.calls == 2 * len(model.layers)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_slots_come_back_when_states_go(model, slots):
    held = slots(n=3)
    _, states = _decode(model, CONTEXTS, 2)
    assert held.free == 0
    model.release_state(states[0])                    # a finished request, at a known step of the plan
    assert held.free == 1 and states[0].slot is None
    del states
    gc.collect()
    assert held.free == 3                             # dropped states give their slots back


def test_a_decode_step_in_slots_is_one_graph(model, slots):
    """With slots the whole decode step, attention included, is one piece: warmed up once, captured once, then
    replayed; the logits equal the list path's, and a padded batch (3 rows in a graph of 4) within 1e-9."""
    want, _ = _decode(model, CONTEXTS, 8)
    slots()
    model.cuda_graphs = graphs = DecodeGraphs(model, CudaGraphConfig([3]), StandInBackend())
    got, states = _decode(model, CONTEXTS, 8)
    assert graphs.counts == {"eager": 1, "captured": 1, "replayed": 7}
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    del states
    model.cuda_graphs = graphs = DecodeGraphs(model, CudaGraphConfig([4], enable_padding=True), StandInBackend())
    got, _ = _decode(model, CONTEXTS, 8)
    assert graphs.counts == {"eager": 1, "captured": 1, "replayed": 7}
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-9)


def test_slot_arguments_are_checked(model):
    with pytest.raises(ValueError, match="n >= 1"):
        model.enable_decode_slots(0, 100)


def test_slots_that_do_not_fit_are_not_taken(model, caplog):
    """The runtime sizes the slots first (on the meta device): past half the free memory it logs why and leaves
    the model without them; else it gives them."""
    from dsflash.serve.runtime.model_runner import enable_decode_slots
    need = model.enable_decode_slots(8, 1000, device="meta").nbytes
    assert model.decode_slots is None and need > 0
    try:
        with caplog.at_level(logging.WARNING, logger="dsflash.serve"):
            assert not enable_decode_slots(model, 8, 1000, free_bytes=2 * need - 1)
        assert model.decode_slots is None
        assert any("lower --max-batch-size or --max-seq-len" in r.message for r in caplog.records)
        assert enable_decode_slots(model, 8, 1000, free_bytes=2 * need)
        assert model.decode_slots.nbytes == need and model.decode_slots.free == 8
    finally:
        model.decode_slots = None
