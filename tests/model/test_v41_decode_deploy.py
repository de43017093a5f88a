"""DeepSeek-V4.1 tiny model, `deploy` numerics (FP8 1x32 activations before FP8/FP4 linears): incremental decoding
== one full forward over 300 tokens (window wrap, ratio-2 groups, candidate blocks, Engram look-back).

See test_v41_decode.py for why the model runs in fp64 (where the quantizers' rounding boundaries are not hit by
summation-order noise, so decode and prefill agree exactly)."""
import pytest
import torch

from dsflash.convert.synth import synthesize
from dsflash.model_def import load_reference
from dsflash.model_def.config import get_preset

PROMPT, NEW = 9, 300
CHUNKS = (1, 2, 5, 3, 17, 1, 31, 64, 7, 33, 2, 40, 11, 92)


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    ckpt = synthesize(get_preset("v41", "tiny"), tmp_path_factory.mktemp("v41d") / "tiny", seed=0)
    model = load_reference(ckpt, numerics="deploy", dtype=torch.float64)
    prompt = torch.randint(0, model.args.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    out = model.generate_greedy(prompt, NEW)
    return model, out, model.logits(out)


def test_greedy_chain_is_argmax_of_full_logits(generated):
    _, out, full = generated
    lg, chosen = full[:, PROMPT - 1:-1], out[:, PROMPT:]
    picked = lg.gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
    gap = lg.max(-1).values - picked
    assert gap.max().item() <= 1e-9


def test_chunked_prefill_matches_full(generated):
    model, out, full = generated
    state, got, i = model.new_state(1), [], 0
    for c in CHUNKS:
        got.append(model.step(out[:, i:i + c], state))
        i += c
    d = (torch.cat(got, 1) - full).abs().amax(-1)
    assert d.max().item() < 1e-5
