"""Values a forward would otherwise recompute, kept: `layers.wide_weight` (the fp32 copy of a BF16 weight that fp32
math reads is made once, equals `wide(w)`, and is rebuilt when the weight changes in place; under autograd none is
kept) and `layers.rope_cos_sin` (a forward's angles, per positions tensor and table)."""
import torch
from torch import nn

from dsflash.convert.synth import synthesize
from dsflash.model_def import get_preset, load_reference
from dsflash.model_def.layers import rope_cos_sin, rope_inv_freq, wide, wide_weight


def test_kept_once_and_rebuilt_after_an_in_place_change():
    w = nn.Parameter(torch.randn(7, 5).to(torch.bfloat16), requires_grad=False)
    with torch.no_grad():
        first = wide_weight(w)
        assert first.dtype == torch.float32 and torch.equal(first, wide(w))
        assert wide_weight(w) is first
        w.mul_(2)
        again = wide_weight(w)
        assert again is not first and torch.equal(again, wide(w))


def test_wide_weights_pass_through_and_autograd_gets_a_fresh_cast():
    w32 = torch.randn(3, 4)
    assert wide_weight(w32) is w32 and wide_weight(w32.double()).dtype == torch.float64
    w = nn.Parameter(torch.randn(3, 4).to(torch.bfloat16))
    a = wide_weight(w)
    assert a.requires_grad and a is not wide_weight(w)
    a.sum().backward()
    assert w.grad is not None and not hasattr(w, "_dsflash_wide")


def test_a_bf16_model_head_reads_its_kept_copy(tmp_path):
    """The V4.1 vocabulary head in a BF16 model: logits are unchanged and the fp32 head is cast once, not per step."""
    hf = synthesize(get_preset("v41", "tiny"), tmp_path / "hf", seed=3)
    model = load_reference(hf, numerics="deploy", dtype=torch.bfloat16)
    ids = torch.randint(3, 1000, (1, 6), generator=torch.Generator().manual_seed(0))
    first = model.logits(ids)
    kept = model.head.weight._dsflash_wide[1]
    assert kept.dtype == torch.float32 and torch.equal(kept, model.head.weight.float())
    assert torch.equal(model.logits(ids), first) and model.head.weight._dsflash_wide[1] is kept


def test_rope_angles_are_taken_once_per_positions_and_table():
    """`rope_cos_sin` keeps a forward's angles on its positions tensor: the same (table, dtype) is not recomputed,
    another table or dtype is, and an in-place change of the positions drops what was kept."""
    pos = torch.arange(7).unsqueeze(0)
    a, b = rope_inv_freq(8, 10000.0), rope_inv_freq(8, 160000.0)
    first = rope_cos_sin(pos, a, torch.float32)
    assert rope_cos_sin(pos, a, torch.float32)[0] is first[0]
    ang = pos.double().unsqueeze(-1) * a.double()
    assert torch.equal(first[0], ang.cos().float()) and torch.equal(first[1], ang.sin().float())
    assert not torch.equal(rope_cos_sin(pos, b, torch.float32)[0], first[0])
    assert rope_cos_sin(pos, a)[0].dtype == torch.float64
    pos.add_(1)
    assert torch.equal(rope_cos_sin(pos, a, torch.float32)[0], (pos.double().unsqueeze(-1) * a.double()).cos().float())
