"""GPU: the mHC plugin's `fused_overlap` (coefficients on a side stream while the attention / MoE runs) computes
exactly what the serial `fused` order does, eagerly and replayed from a CUDA graph, with the side stream really
running concurrently (the stand-in attention and FFN are long chains of small kernels)."""
from __future__ import annotations

import pytest
import torch

from dsflash.model_def import get_preset
from dsflash.model_def.layers import LocalComm, Numerics
from dsflash.model_def.v41 import Block

pytestmark = pytest.mark.gpu
DEV = "cuda" if torch.cuda.is_available() else "cpu"   # "cpu": under TRITON_INTERPRET=1 (conftest)


class _Chain(torch.nn.Module):
    """A deterministic stand-in for the attention or the FFN: `steps` small dependent matmuls, [.., D] -> [.., D]."""

    def __init__(self, d: int, steps: int, seed: int):
        super().__init__()
        g = torch.Generator(device=DEV).manual_seed(seed)
        self.w = torch.randn(d, d, device=DEV, generator=g) * d ** -0.5
        self.steps = steps

    def forward(self, x, *_):
        y = x.float()
        for _ in range(self.steps):
            y = torch.tanh(y @ self.w)
        return y.to(x.dtype)


def _block(overlap: bool) -> Block:
    import dsflash.plugins.registry  # noqa: F401  (registers torch.ops.dsflash.*)
    from dsflash.build.bind import fused_hc
    from dsflash.plugins.bench import randomize_mhc
    args = get_preset("v41", "tiny")
    with torch.device(DEV):
        blk = Block(args, 0, Numerics("deploy"), None, LocalComm(), torch.bfloat16, args.n_routed_experts,
                    args.num_experts_per_tok)
    g = torch.Generator(device=DEV).manual_seed(0)
    randomize_mhc(blk, g)
    blk.hc_plugin = fused_hc(blk, overlap)
    with torch.no_grad():
        for norm in (blk.attn_norm, blk.ffn_norm):
            norm.weight.copy_(torch.rand(norm.weight.shape, device=DEV, generator=g) + 0.5)
    blk.ffn = _Chain(args.hidden_size, 40, 1)
    return blk


def _inputs(t: int, d: int, seed: int):
    g = torch.Generator(device=DEV).manual_seed(seed)
    X = (torch.randn(1, t, 4, d, device=DEV, generator=g) * 2).to(torch.bfloat16)
    pre = torch.rand(1, t, 4, device=DEV, generator=g) + 0.1
    return X, pre


@pytest.mark.parametrize("t", [1, 5, 64])
def test_overlap_equals_serial(t):
    serial, overlapped = _block(False), _block(True)
    attend = _Chain(serial.attn_norm.weight.shape[0], 40, 2)
    X, pre = _inputs(t, serial.attn_norm.weight.shape[0], t)
    with torch.no_grad():
        want = serial(X, pre, attend, None)
        got = overlapped(X, pre, attend, None)
        torch.cuda.synchronize()
    for g, w in zip(got, want):
        assert g.shape == w.shape and torch.equal(g, w)
    # chained: the second block reads the first one's side-stream outputs (its `pre`)
    with torch.no_grad():
        want2 = serial(want[0], want[1], attend, None)
        got2 = overlapped(got[0], got[1], attend, None)
    assert all(torch.equal(g, w) for g, w in zip(got2, want2))


def test_overlap_under_cuda_graph_replay():
    blk = _block(True)
    d = blk.attn_norm.weight.shape[0]
    attend = _Chain(d, 40, 2)
    X, pre = _inputs(8, d, 0)
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):                  # warm-up off the capture stream (Triton compiles here)
            blk(X, pre, attend, None)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            Y1, p1 = blk(X, pre, attend, None)
            Y, p = blk(Y1, p1, attend, None)            # two blocks: the second forks behind the first's join
    serial = _block(False)
    for seed in (1, 2, 3):
        Xn, pn = _inputs(8, d, seed)
        X.copy_(Xn)
        pre.copy_(pn)
        graph.replay()
        with torch.no_grad():
            want = serial(*serial(Xn, pn, attend, None), attend, None)
        torch.cuda.synchronize()
        assert torch.equal(Y, want[0]) and torch.equal(p, want[1]), seed
