"""DeepSeek-V4.1 `tiny-wide` (8 heads in 4 output groups, window 64, 16 experts top-4), `hf` numerics: incremental
decoding == one full forward over 300 tokens. See test_v41_decode.py for the method and the fp64 rationale."""
import pytest
import torch

from dsflash.convert.synth import synthesize
from dsflash.model_def import load_reference
from dsflash.model_def.config import get_preset

PROMPT, NEW = 9, 300
CHUNKS = (1, 2, 5, 3, 17, 1, 31, 64, 7, 33, 2, 40, 11, 92)


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    args = get_preset("v41", "tiny-wide")
    assert PROMPT + NEW > 2 * args.sliding_window and NEW > args.candidate_topk_blocks * args.candidate_block_size
    ckpt = synthesize(args, tmp_path_factory.mktemp("v41w") / "tiny-wide", seed=0)
    model = load_reference(ckpt, numerics="hf", dtype=torch.float64)
    prompt = torch.randint(0, args.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    out = model.generate_greedy(prompt, NEW)
    return model, out, model.logits(out)


def test_greedy_chain_is_argmax_of_full_logits(generated):
    _, out, full = generated
    lg, chosen = full[:, PROMPT - 1:-1], out[:, PROMPT:]
    gap = lg.max(-1).values - lg.gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
    assert gap.max().item() <= 1e-9


def test_chunked_prefill_matches_full(generated):
    model, out, full = generated
    state, got, i = model.new_state(1), [], 0
    for c in CHUNKS:
        got.append(model.step(out[:, i:i + c], state))
        i += c
    d = (torch.cat(got, 1) - full).abs().amax(-1)
    assert d.max().item() < 1e-5
