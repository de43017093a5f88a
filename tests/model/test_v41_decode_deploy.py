"""DeepSeek-V4.1 tiny model, `deploy` numerics (FP8 1x32 activations before FP8/FP4 linears): incremental decoding
== one full forward over 300 tokens (window wrap, ratio-2 groups, candidate blocks, Engram look-back).

See test_v41_decode.py for why the model runs in fp64. Deploy adds a BF16 + FP8 rounding of every quantized linear's
input, so while layers.py still rounds its reductions in fp32 the comparison can only be statistical."""
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
    if layers_keep_fp64():
        assert gap.max().item() <= 1e-9
    else:
        assert (gap <= 1e-9).float().mean().item() >= 0.8
        rank = (lg > picked.unsqueeze(-1)).sum(-1)
        assert rank.float().median().item() == 0 and rank.max().item() < 200  # among the full forward's best


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
        assert (d < 1e-3).float().mean().item() >= 0.5, d.max().item()
