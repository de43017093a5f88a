"""DeepSeek-V4.1 `tiny-wide` (8 heads in 4 output groups, window 64, 16 experts top-4), `hf` numerics: incremental
decoding == one full forward over 300 tokens. See test_v41_decode.py for the method and the fp64 rationale."""
import pytest
import torch

from dsflash.convert.synth import synthesize
from dsflash.model_def import layers, load_reference
from dsflash.model_def.config import get_preset

PROMPT, NEW = 9, 300
CHUNKS = (1, 2, 5, 3, 17, 1, 31, 64, 7, 33, 2, 40, 11, 92)


def layers_keep_fp64() -> bool:
    x = torch.ones(1, 1, 1, 4, dtype=torch.float64)
    allowed = torch.ones(1, 1, 1, dtype=torch.bool)
    return (layers.rms_norm(x, 1e-6).dtype == torch.float64
            and layers.sink_attention(x, x[:, 0], allowed, torch.zeros(1), 1.0).dtype == torch.float64
            and layers.hc_mix(x.flatten(-2), torch.ones(24, 4), torch.zeros(24), torch.ones(3), 4, 2, 1e-6,
                              1e-6)[0].dtype == torch.float64)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


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
    if layers_keep_fp64():
        assert gap.max().item() <= 1e-9
    else:
        assert (gap <= 1e-9).float().mean().item() >= 0.95


def test_chunked_prefill_matches_full(generated):
    model, out, full = generated
    state, got, i = model.new_state(1), [], 0
    for c in CHUNKS:
        got.append(model.step(out[:, i:i + c], state))
        i += c
    d = (torch.cat(got, 1) - full).abs().amax(-1)
    if layers_keep_fp64():
        assert d.max().item() < 1e-5
    else:
        assert d.median().item() < 0.05 and (d < 0.1).float().mean().item() >= 0.8, d.max().item()
