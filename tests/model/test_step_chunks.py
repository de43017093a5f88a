"""`step_chunks`: several requests at different positions in one forward compute what each computes alone.

Requests in different phases share every forward: prompt chunks of different lengths beside decode tokens, a
request that starts while others are deep into their windows and compression groups, and a lockstep chunk of two
rows. Runs in deploy numerics in float64 (see test_v4_decode.py for why: a last-bit difference from another GEMM
row count must not flip an FP8/FP4 code), so tokens are compared exactly and logits to 1e-9.
"""
from __future__ import annotations

import pytest
import torch

from dsflash.convert.synth import synthesize
from dsflash.model_def import get_preset, load_reference
from dsflash.model_def.ragged import Chunk, Ragged

PROMPTS = [37, 5, 70, 12]     # tiny presets: window 32, so 37 and 70 wrap it and cross many compression groups
STARTS = [0, 0, 1, 3]         # the round in which each request joins
CHUNK = 24                    # prompt chunk (tokens per forward per request)
NEW = 5                       # greedy tokens per request


@pytest.fixture(scope="module", params=["v41", "v4"])
def model(request, tmp_path_factory):
    ckpt = synthesize(get_preset(request.param, "tiny"), tmp_path_factory.mktemp("chunks") / "ckpt", seed=11)
    return load_reference(ckpt, numerics="deploy", dtype=torch.float64)


def _prompt(i: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(50 + i)
    return [0] + torch.randint(3, 120000, (n - 1,), generator=g).tolist()


def _segments(prompt: list[int]):
    """Prompt chunks of up to CHUNK tokens (a request's sequence of forwards, alone or batched)."""
    return [prompt[i:i + CHUNK] for i in range(0, len(prompt), CHUNK)]


def _alone(model, prompt: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    state, logits = model.new_state(1), None
    for seg in _segments(prompt):
        logits = model.step(torch.tensor([seg]), state)[0, -1]
    tokens, seen = [], [logits]
    for _ in range(NEW):
        tokens.append(int(seen[-1].argmax()))
        if len(tokens) < NEW:
            seen.append(model.step(torch.tensor([[tokens[-1]]]), state)[0, -1])
    return tokens, seen


def test_mixed_chunks_equal_each_request_alone(model):
    prompts = [_prompt(i, n) for i, n in enumerate(PROMPTS)]
    want = [_alone(model, p) for p in prompts]
    todo = [_segments(p) for p in prompts]
    states = [model.new_state(1) for _ in prompts]
    tokens: list[list[int]] = [[] for _ in prompts]
    seen: list[list[torch.Tensor]] = [[] for _ in prompts]
    rnd = 0
    while any(len(t) < NEW for t in tokens):
        live = [i for i in range(len(prompts)) if rnd >= STARTS[i] and len(tokens[i]) < NEW]
        ids = [todo[i].pop(0) if todo[i] else [tokens[i][-1]] for i in live]
        out = model.step_chunks([Chunk(torch.tensor([s]), states[i]) for i, s in zip(live, ids)])
        for i, logits in zip(live, out):
            assert logits.shape == (1, model.args.vocab_size)
            if not todo[i]:                    # the prompt is in: this position is sampled
                seen[i].append(logits[0])
                tokens[i].append(int(logits[0].argmax()))
        rnd += 1
    assert len({len(s) for s in todo}) == 1 and rnd > 6   # phases really overlapped
    for i, (tok, logits) in enumerate(want):
        assert tokens[i] == tok, f"request {i}"
        for a, b in zip(seen[i], logits, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_lockstep_rows_and_a_single_request_in_one_forward(model):
    """A chunk of two rows at the same position beside a one-row chunk: every row's last logits as alone."""
    a, b, c = _prompt(7, 9), _prompt(8, 9), _prompt(9, 4)
    pair, single = model.new_state(2), model.new_state(1)
    out = model.step_chunks([Chunk(torch.tensor([a, b]), pair), Chunk(torch.tensor([c]), single)])
    assert [t.shape[0] for t in out] == [2, 1] and pair.pos == 9 and single.pos == 4
    for got, p in ((out[0][0], a), (out[0][1], b), (out[1][0], c)):
        torch.testing.assert_close(got, model.step(torch.tensor([p]), model.new_state(1))[0, -1], rtol=1e-9,
                                   atol=1e-9)


def test_ragged_layout():
    rag = Ragged([(2, 3), (1, 4)])
    x = torch.arange(10).view(1, 10)
    parts = rag.split(x)
    assert [p.tolist() for p in parts] == [[[0, 1, 2], [3, 4, 5]], [[6, 7, 8, 9]]]
    assert torch.equal(rag.join(parts), x)
    assert rag.last_rows("cpu").tolist() == [2, 5, 9]
    assert [r.tolist() for r in rag.split_rows(torch.tensor([2, 5, 9]))] == [[2, 5], [9]]
    with pytest.raises(ValueError, match=r"\[1, 10, \.\.\.\]"):
        rag.split(torch.zeros(2, 5))
    with pytest.raises(ValueError, match="at least one chunk"):
        Ragged([])
    state = object()
    with pytest.raises(ValueError, match="share a state"):
        Ragged.of([Chunk(torch.zeros(1, 2), state), Chunk(torch.zeros(1, 1), state)])


def test_many_decoding_requests_attend_as_one_batch(model, monkeypatch):
    """Eight requests whose caches differ in length (below and above the window, the top-k, the candidate blocks and
    V4's ratio-128 group, which one of them completes while batched)
    decode together for several steps: the single-token chunks attend as one batch and every request's logits
    equal what it computes alone."""
    lengths = [3, 17, 33, 41, 64, 90, 122, 200]
    steps = 6
    prompts = [_prompt(20 + i, n) for i, n in enumerate(lengths)]
    want = []
    for p in prompts:
        state = model.new_state(1)
        out = [model.step(torch.tensor([p]), state)[0, -1]]
        for _ in range(steps):
            out.append(model.step(torch.tensor([[int(out[-1].argmax())]]), state)[0, -1])
        want.append(out)
    batched = []
    if model.args.family == "v41":
        from dsflash.model_def.csa2 import Attention
    else:
        from dsflash.model_def.v4 import Attention
    real = Attention._attend_batch
    monkeypatch.setattr(Attention, "_attend_batch",
                        lambda self, b, *a: batched.append(len(b.members)) or real(self, b, *a))
    states = [model.new_state(1) for _ in prompts]
    got = [[model.step(torch.tensor([p]), s)[0, -1]] for p, s in zip(prompts, states)]
    for _ in range(steps):
        out = model.step_chunks([Chunk(torch.tensor([[int(g[-1].argmax())]]), s) for g, s in zip(got, states)])
        for g, logits in zip(got, out):
            g.append(logits[0])
    assert batched and set(batched) == {len(prompts)}
    for g, w in zip(got, want):
        assert [int(a.argmax()) for a in g] == [int(b.argmax()) for b in w]
        for a, b in zip(g, w, strict=True):
            # the logits are fp32 (V4 rounds its fp64 head to fp32): a 1e-17 difference from the GEMMs' row count
            # can fall on the other side of an fp32 rounding boundary, one ulp (measured once here: 2^-27)
            torch.testing.assert_close(a, b, rtol=2.5e-7, atol=1e-9)
