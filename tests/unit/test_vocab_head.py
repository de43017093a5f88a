"""The vocabulary head split over TP ranks (`layers.VocabParallelHead`): each rank's slice of the logits, joined by
`gather_last` (a comm's own all-gather, or the all-reduce of slices placed among zeros), is the unsplit head's
logits; the rank simulation's gather keeps the output shape and counts and waits for what it would move."""
import torch

from dsflash.model_def.layers import Numerics, SimulatedComm, VocabParallelHead, gather_last
from dsflash.model_def.mapping import Mapping


class _SummingComm:
    """A rank of a TP group whose all-reduce sums what every rank contributed (filled in by the test)."""

    def __init__(self, tp: int, rank: int, contributions: dict):
        self.tp_size, self.tp_rank, self.contributions = tp, rank, contributions

    def all_reduce(self, x):
        self.contributions[self.tp_rank] = x
        return x


def test_split_head_logits_join_to_the_full_heads():
    numerics = Numerics("deploy")
    full = VocabParallelHead(16, 12, numerics, None, None, fp32=True, dtype=torch.bfloat16)
    # small integers: every product and partial sum is exact, so the comparison below cannot depend on the order in
    # which the BLAS kernel (chosen by the output width, 12 vs 6) sums over K
    g = torch.Generator().manual_seed(0)
    full.weight.data.copy_(torch.randint(-8, 9, full.weight.shape, generator=g))
    x = torch.randint(-4, 5, (3, 16), generator=g).float()
    want = full(x)
    assert want.shape == (3, 12) and want.dtype == torch.float32
    contributions: dict = {}
    for rank in range(2):
        m = Mapping(world_size=2, tp_size=2, rank=rank)
        head = VocabParallelHead(16, 12, numerics, m, _SummingComm(2, rank, contributions), fp32=True,
                                 dtype=torch.bfloat16)
        head.weight.data.copy_(full.weight.data[rank * 6:(rank + 1) * 6])
        head(x)
    assert torch.equal(contributions[0] + contributions[1], want)
    assert not torch.equal(contributions[0], want)   # each rank placed only its own slice


def test_native_gather_is_preferred_and_the_simulation_keeps_shape_and_counts():
    class Native:
        tp_size, tp_rank = 4, 1

        def all_gather_last(self, x):
            return torch.cat([x] * 4, -1)

        def all_reduce(self, x):
            raise AssertionError("a comm with a gather must not reduce")
    assert gather_last(Native(), torch.ones(2, 3), 12).shape == (2, 12)
    waited = []
    sim = SimulatedComm(Mapping(world_size=8, tp_size=8, rank=3), waited.append)
    out = sim.all_gather_last(torch.ones(2, 5))
    assert out.shape == (2, 40) and sim.gathers.calls == 1 and sim.gathers.bytes == 2 * 40 * 4
    assert waited == [2 * 40 * 4 // 2] and sim.counts.calls == 0
