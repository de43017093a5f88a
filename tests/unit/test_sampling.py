"""Sampling: greedy, seeded draws, top-k / top-p masks, distribution, logprobs, parameter validation, stop strings."""
import math

import pytest
import torch

from dsflash.serve.runtime.sampling import (SamplingParams, make_generator, mask_top_k_top_p, sample,
                                            token_logprobs)
from dsflash.serve.runtime.sequence import IncrementalText, Request, Sequence


def test_greedy_is_argmax():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    g = make_generator(0)
    assert sample(logits, SamplingParams(), g) == int(logits.argmax())
    assert sample(logits, SamplingParams(temperature=0.7, top_k=1), g) == int(logits.argmax())
    tie = torch.tensor([0.0, 3.0, 3.0, 1.0])
    assert sample(tie, SamplingParams(), g) == 1          # first maximum, as torch.argmax in generate_greedy


def draws(logits, params, n, seed):
    g = make_generator(seed)
    return [sample(logits, params, g) for _ in range(n)]


def test_seeded_draws_reproduce():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(1))
    p = SamplingParams(temperature=1.0, seed=7)
    assert draws(logits, p, 30, 7) == draws(logits, p, 30, 7)
    assert draws(logits, p, 30, 7) != draws(logits, p, 30, 8)
    assert draws(logits, p, 30, None) != draws(logits, p, 30, None)    # unseeded: fresh entropy


def test_top_k_top_p_masks():
    logits = torch.log(torch.tensor([0.05, 0.5, 0.15, 0.3]))
    keep = lambda x: torch.isfinite(x).nonzero().flatten().tolist()      # noqa: E731
    assert keep(mask_top_k_top_p(logits, 2, 1.0)) == [1, 3]
    assert keep(mask_top_k_top_p(logits, 0, 0.8)) == [1, 3]             # 0.5 + 0.3 reaches 0.8
    assert keep(mask_top_k_top_p(logits, 0, 0.81)) == [1, 2, 3]
    assert keep(mask_top_k_top_p(logits, 0, 0.1)) == [1]                # the best token always stays
    assert keep(mask_top_k_top_p(logits, 3, 0.85)) == [1, 2, 3]         # (0.5 + 0.3) / 0.95 < 0.85
    assert keep(mask_top_k_top_p(logits, 2, 0.95)) == [1, 3]            # top-p over the top-k renormalized
    assert mask_top_k_top_p(logits, 0, 1.0) is logits


def test_draws_follow_the_masked_distribution():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = torch.log(probs)
    n = 4000
    got = torch.bincount(torch.tensor(draws(logits, SamplingParams(temperature=1.0), n, 3)), minlength=4) / n
    assert (got - probs).abs().max() < 0.03
    got = torch.bincount(torch.tensor(draws(logits, SamplingParams(temperature=1.0, top_p=0.8), n, 4)),
                         minlength=4) / n
    assert got[0] == 0 and got[2] == 0 and abs(got[1] - 0.625) < 0.03    # 0.5 / 0.8
    hot = torch.bincount(torch.tensor(draws(logits, SamplingParams(temperature=0.25), n, 5)), minlength=4) / n
    sharp = probs ** 4 / (probs ** 4).sum()
    assert (hot - sharp).abs().max() < 0.03


def test_logprobs():
    logits = torch.tensor([1.0, 3.0, 2.0, -1.0])
    lp = torch.log_softmax(logits, -1)
    d = token_logprobs(logits, 2, 2)
    assert d["token_id"] == 2 and math.isclose(d["logprob"], lp[2].item(), rel_tol=1e-6)
    assert [t["token_id"] for t in d["top_logprobs"]] == [1, 2]
    assert math.isclose(d["top_logprobs"][0]["logprob"], lp[1].item(), rel_tol=1e-6)
    assert token_logprobs(logits, 0, 0)["top_logprobs"] == []


@pytest.mark.parametrize("kw,field", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"), ({"temperature": float("nan")},
                                                                              "temperature"),
    ({"top_k": -2}, "top_k"), ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"seed": -1}, "seed"),
    ({"stop_token_ids": [1, -3]}, "stop_token_ids"), ({"stop": [""]}, "stop"), ({"logprobs": 21}, "logprobs"),
    ({"ignore_eos": "yes"}, "ignore_eos"), ({"max_tokens": 2.5}, "max_tokens"),
])
def test_invalid_params_name_the_field(kw, field):
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**kw)


def test_param_normalization():
    p = SamplingParams(top_k=-1, stop="###")
    assert p.top_k == 0 and p.stop == ["###"] and p.greedy


class CharTokenizer:
    """One token per byte (ids 0..255) to test incremental detokenization with split UTF-8 characters."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def push_all(text: IncrementalText, data: bytes) -> tuple[str, bool]:
    streamed = ""
    for b in data:
        stopped = text.push(b)
        streamed += text.take(final=stopped)
        if stopped:
            return streamed, True
    return streamed + text.take(final=True), False


def test_stop_strings_and_multibyte_text():
    out, stopped = push_all(IncrementalText(CharTokenizer(), []), "héllo wörld".encode())
    assert out == "héllo wörld" and not stopped
    out, stopped = push_all(IncrementalText(CharTokenizer(), ["wö", "xyz"]), "héllo wörld".encode())
    assert out == "héllo " and stopped
    t = IncrementalText(CharTokenizer(), ["END"])
    for b in b"abcEN":
        t.push(b)
    assert t.take(final=False) == "abc"           # "EN" is held back: it may become the stop string


def test_stop_token_eos_and_length():
    def run(params, tokens):
        s = Sequence(Request("r", [5, 6], params), None, eos_token_id=1)
        for t in tokens:
            s.append(t, params.max_tokens, max_seq_len=8)
            if s.finish_reason:
                break
        return s.generated, s.finish_reason

    assert run(SamplingParams(max_tokens=5), [3, 1, 4]) == ([3, 1], "stop")
    assert run(SamplingParams(max_tokens=5, ignore_eos=True), [3, 1, 4, 4, 4, 4]) == ([3, 1, 4, 4, 4], "length")
    assert run(SamplingParams(max_tokens=5, stop_token_ids=[4]), [3, 4]) == ([3, 4], "stop")
    assert run(SamplingParams(max_tokens=50), [3, 3, 3, 3, 3, 3, 3]) == ([3] * 6, "length")   # max_seq_len 8
