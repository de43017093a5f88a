"""Tensor/expert parallelism of the V4.1 reference: TP2 ranks (threads joined by an fp32 all-reduce), each holding
its slices of the TP1 weights as the name table's shard rules say, compute the TP1 logits."""
import threading

import pytest
import torch

from dsflash.convert.synth import synth_value
from dsflash.model_def.config import get_preset
from dsflash.model_def.layers import Numerics
from dsflash.model_def.mapping import Mapping, split_range, split_rows
from dsflash.model_def.v41 import DeepseekV41Model, tensor_table


class ThreadComm:
    """All-reduce across the threads of one process; every rank sums the parts in rank order (same result)."""

    def __init__(self, parts: list, barrier: threading.Barrier, rank: int):
        self.parts, self.barrier, self.tp_rank, self.tp_size = parts, barrier, rank, len(parts)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.parts[self.tp_rank] = x.double()
        self.barrier.wait()
        total = sum(self.parts[1:], self.parts[0].clone())
        self.barrier.wait()
        return total.to(x.dtype)


def local_value(entry, full: torch.Tensor, m: Mapping, args) -> torch.Tensor | None:
    if entry.shard in ("col", "head"):
        return full[slice(*split_range(full.shape[0], m.tp_size, m.tp_rank))]
    if entry.shard == "row":
        return full[:, slice(*split_range(full.shape[1], m.tp_size, m.tp_rank))]
    if entry.shard == "rows":
        return full[slice(*split_rows(full.shape[0], m.tp_size, m.tp_rank))]
    if entry.shard == "expert":
        n = args.dspark_n_routed_experts if entry.name.startswith("mtp.") else args.n_routed_experts
        if int(entry.name.split(".experts.")[1].split(".")[0]) not in m.ep_experts(n):
            return None
        dim = 1 if entry.name.endswith("w2.weight") else 0
        return full.narrow(dim, *_start_len(full.shape[dim], m.moe_tp_size, m.moe_tp_rank))
    return full


def _start_len(total, parts, index):
    a, b = split_range(total, parts, index)
    return a, b - a


@pytest.mark.parametrize("moe_ep", [1, 2])
def test_tp2_ranks_compute_the_tp1_logits(moe_ep):
    args = get_preset("v41", "tiny-wide")
    values = {e.name: synth_value(e, args, 11) for e in tensor_table(args)}
    ref = DeepseekV41Model(args, Numerics("hf", args.act_block), dtype=torch.float64)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.copy_(values[n])
    ids = torch.randint(0, args.vocab_size, (1, 12), generator=torch.Generator().manual_seed(3))
    want = ref.logits(ids)

    tp, parts, barrier = 2, [None, None], threading.Barrier(2)
    ranks, got, errors = [], [None, None], []
    for r in range(tp):
        m = Mapping(world_size=tp, rank=r, tp_size=tp, moe_ep_size=moe_ep)
        model = DeepseekV41Model(args, Numerics("hf", args.act_block), mapping=m,
                                 comm=ThreadComm(parts, barrier, r), dtype=torch.float64)
        model._engram_lookup = ref.engram_lookup()
        params = dict(model.named_parameters())
        with torch.no_grad():
            for e in tensor_table(args):
                v = local_value(e, values[e.name], m, args)
                if v is not None:
                    params.pop(e.name).copy_(v)
        assert not params  # every local parameter got its slice
        ranks.append(model)

    def run(r):
        try:
            got[r] = ranks[r].logits(ids)
        except BaseException as exc:  # surface thread failures in the test
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert torch.equal(got[0], got[1])
    assert torch.allclose(got[0], want, atol=1e-6, rtol=0), (got[0] - want).abs().max().item()
