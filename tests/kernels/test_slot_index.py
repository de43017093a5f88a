"""GPU parity of the decode-slot index-score kernel against its plain-PyTorch (fp32) reference."""
from __future__ import annotations

import pytest
import torch

from dsflash.plugins import refs

pytestmark = pytest.mark.gpu
DEV = "cuda" if torch.cuda.is_available() else "cpu"   # "cpu": under TRITON_INTERPRET=1 (conftest)
INTERPRET = pytest.mark.interpret

# (requests, index heads, index head dim, entry rows E, slots, ratio): one TP8 rank of V4.1 (4 of 32 heads of 128)
# at ratio 2 and 1 with E sized for 9216 positions, TP1 (32 heads), the tiny / mid widths, awkward counts
# (all but the 64-request one, ~35 s there, also run under the interpreter)
CASES = [pytest.param(*c, marks=INTERPRET) for c in [(1, 4, 128, 4608, 2, 2), (3, 32, 128, 1000, 4, 2),
                                                    (5, 4, 64, 150, 7, 1), (8, 16, 128, 129, 9, 2),
                                                    (2, 3, 64, 33, 3, 1)]] + [(64, 4, 128, 9216, 65, 1)]


@pytest.mark.parametrize("n,h,di,e,slots,ratio", CASES)
def test_slot_index_scores_match_the_fp32_reference(n, h, di, e, slots, ratio):
    from dsflash.plugins.slot_index import slot_index_scores
    g = torch.Generator(device=DEV).manual_seed(n * 100 + h + e)
    q = torch.randn(n, h, di, device=DEV, generator=g).to(torch.bfloat16)
    w = torch.randn(n, h, device=DEV, generator=g)
    keys = torch.randn(slots, e, di, device=DEV, generator=g).to(torch.bfloat16)   # rows past a count: stale data
    slot_ids = torch.randperm(slots, device=DEV, generator=g)[:n]
    pos = torch.randint(0, e * ratio, (n,), device=DEV, generator=g)
    pos[0] = 0                                               # nothing visible yet (ratio 2) / one entry (ratio 1)
    scale = di ** -0.5
    out = slot_index_scores(q, w, keys, slot_ids, pos, ratio, scale)
    want = refs.slot_index_scores_ref(q, w, keys, slot_ids, pos, ratio, scale)
    assert out.dtype == torch.float32 and out.shape == (n, e)
    visible = torch.arange(e, device=DEV) < ((pos + 1) // ratio).unsqueeze(-1)
    assert torch.equal(out[~visible], torch.zeros_like(out[~visible]))
    assert refs.rel_err(out, want) <= 1e-5, refs.rel_err(out, want)


def test_slot_index_op_in_a_cuda_graph():
    """The registered op replays in a CUDA graph with new queries and positions (the visible counts are read on the
    device only)."""
    from dsflash.plugins import registry  # noqa: F401 (registers torch.ops.dsflash.*)
    g = torch.Generator(device=DEV).manual_seed(7)
    q = torch.randn(4, 4, 128, device=DEV, generator=g).to(torch.bfloat16)
    w = torch.randn(4, 4, device=DEV, generator=g)
    keys = torch.randn(5, 700, 128, device=DEV, generator=g).to(torch.bfloat16)
    slot_ids = torch.tensor([3, 0, 4, 1], device=DEV)
    pos = torch.tensor([10, 500, 1399, 2], device=DEV)
    op = torch.ops.dsflash.slot_index_scores
    op(q, w, keys, slot_ids, pos, 2, 0.1)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(q, w, keys, slot_ids, pos, 2, 0.1)
    q.copy_(torch.randn(4, 4, 128, device=DEV, generator=g))
    pos.copy_(torch.tensor([900, 3, 77, 1200], device=DEV))
    graph.replay()
    assert refs.rel_err(out, refs.slot_index_scores_ref(q, w, keys, slot_ids, pos, 2, 0.1)) <= 1e-5
