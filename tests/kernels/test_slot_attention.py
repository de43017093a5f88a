"""GPU parity of the decode-slot attention kernel against its plain-PyTorch (fp32) reference."""
from __future__ import annotations

import pytest
import torch

from dsflash.plugins import refs

pytestmark = pytest.mark.gpu
DEV = "cuda" if torch.cuda.is_available() else "cpu"   # "cpu": under TRITON_INTERPRET=1 (conftest)
INTERPRET = pytest.mark.interpret


def _case(n, h, d, w, e, k, slots, g, entries=True):
    """Random slots (every row random: the kernel must mask rows before position 0 and empty picks itself), positions
    from the first window through past it, and top-k picks with −1 holes (and a row of only holes)."""
    bf = torch.bfloat16
    q = (torch.randn(n, h, d, device=DEV, generator=g) * 2).to(bf)
    ring = torch.randn(slots, w, d, device=DEV, generator=g).to(bf)
    slot_ids = torch.randperm(slots, device=DEV, generator=g)[:n]
    pos = torch.randint(0, 3 * w, (n,), device=DEV, generator=g)
    pos[0] = 0
    sink = torch.randn(h, device=DEV, generator=g)
    if not entries:
        return q, ring, slot_ids, pos, None, None, sink
    kv = torch.randn(slots, e + 1, d, device=DEV, generator=g).to(bf)
    kv[:, e] = 0
    sel = torch.randint(0, e, (n, k), device=DEV, generator=g)
    sel[torch.rand(n, k, device=DEV, generator=g) < 0.3] = -1
    sel[-1] = -1
    return q, ring, slot_ids, pos, kv, sel, sink


# (requests, heads, head dim, window, entries, top-k, slots): one TP8 rank of V4.1 (8 heads of 512, window 128,
# top-512), its TP1 width (64 heads), the tiny and mid presets' widths, awkward counts
CASES = [(1, 8, 512, 128, 4608, 512, 2), (3, 8, 512, 128, 257, 512, 5), (64, 8, 512, 128, 1000, 512, 65),
         (2, 64, 512, 128, 300, 512, 3), (5, 4, 128, 32, 50, 16, 9), (8, 16, 128, 128, 130, 64, 9),
         (3, 3, 128, 32, 20, 24, 4)]


@INTERPRET
@pytest.mark.parametrize("n,h,d,w,e,k,slots", CASES)
@pytest.mark.parametrize("entries", [True, False])
def test_slot_attention_matches_the_fp32_reference(n, h, d, w, e, k, slots, entries):
    from dsflash.plugins.slot_attention import slot_attention
    g = torch.Generator(device=DEV).manual_seed(n * 1000 + h + d)
    args = _case(n, h, d, w, e, k, slots, g, entries)
    q, ring, slot_ids, pos, kv, sel, sink = args
    scale = d ** -0.5
    out = slot_attention(*args, scale)
    want = refs.slot_attention_ref(q.float(), ring.float(), slot_ids, pos, None if kv is None else kv.float(), sel,
                                   sink, scale)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    # the BF16 output's own rounding is ~2^-9 per element: within that of the fp32 result, and its BF16 rounding
    err, rounding = refs.rel_err(out, want), refs.rel_err(want.to(torch.bfloat16), want)
    assert err <= rounding * 1.1 + 1e-5, (err, rounding)
    assert refs.rel_err(out, refs.slot_attention_ref(*args, scale)) <= 1e-2


@INTERPRET
@pytest.mark.parametrize("n,h,w,k", [(1, 8, 128, 512), (3, 3, 32, 24), (2, 20, 64, 0)])
def test_slot_attention_splits_agree(n, h, w, k):
    """One launch (split 1), the default split, and splits beyond the key blocks (programs without a block) give the
    fp32 reference's result within BF16 rounding; a split whose blocks are all masked (positions before the window
    fills, empty picks) adds nothing."""
    from dsflash.plugins.slot_attention import slot_attention
    g = torch.Generator(device=DEV).manual_seed(n + h + w)
    q, ring, slot_ids, pos, kv, sel, sink = _case(n, h, 128, w, 40, max(k, 1), n + 2, g, entries=k > 0)
    pos[:] = torch.arange(n, device=DEV) * 3                          # early positions: most window rows masked
    scale = 128 ** -0.5
    want = refs.slot_attention_ref(q.float(), ring.float(), slot_ids, pos, None if kv is None else kv.float(), sel,
                                   sink, scale)
    rounding = refs.rel_err(want.to(torch.bfloat16), want)
    for split in (1, None, 3, 64):
        out = slot_attention(q, ring, slot_ids, pos, kv, sel, sink, scale, split=split)
        assert refs.rel_err(out, want) <= rounding * 1.1 + 1e-5, (split, refs.rel_err(out, want), rounding)


def test_slot_attention_op_in_a_cuda_graph():
    """The registered op replays in a CUDA graph with new queries, positions and picks (nothing read on the host)."""
    from dsflash.plugins import registry  # noqa: F401 (registers torch.ops.dsflash.*)
    g = torch.Generator(device=DEV).manual_seed(5)
    args = list(_case(4, 8, 512, 128, 600, 512, 6, g))
    scale = 512 ** -0.5
    op = torch.ops.dsflash.slot_attention
    op(*args, scale)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(*args, scale)
    new = _case(4, 8, 512, 128, 600, 512, 6, g)
    for t, v in zip(args, new):
        t.copy_(v)
    graph.replay()
    assert refs.rel_err(out, refs.slot_attention_ref(*args, scale)) <= 1e-2
