"""Decode steps as piecewise graphs (serve/runtime/cuda_graphs.py), on the CPU through the stand-in backend: it
keeps a graph's buffer semantics (a replay reads only the captured input buffers and writes the captured output
buffers), so a new input that is not copied in, a wrongly chained piece or an output read after the next replay
changes the logits here as it would on the GPU. Real CUDA graphs: tests/kernels/test_engine_plugins.py."""
from __future__ import annotations

import logging

import pytest
import torch

from dsflash.convert.synth import synthesize
from dsflash.model_def import get_preset, load_reference
from dsflash.model_def.layers import Numerics, SimulatedComm
from dsflash.model_def.mapping import Mapping
from dsflash.model_def.ragged import Chunk
from dsflash.model_def.v41 import DeepseekV41Model
from dsflash.serve.runtime.cuda_graphs import CudaGraphConfig, DecodeGraphs, StandInBackend

CONTEXTS = [40, 3, 17]     # tiny presets: window 32; the requests sit at different positions and group phases
STEPS = 6


@pytest.fixture(scope="module", params=["v41", "v4"])
def model(request, tmp_path_factory):
    ckpt = synthesize(get_preset(request.param, "tiny"), tmp_path_factory.mktemp("graphs") / "ckpt", seed=4)
    return load_reference(ckpt, numerics="deploy", dtype=torch.float64)


def _decode(model, contexts: list[int], steps: int, seed: int = 0) -> list[list[torch.Tensor]]:
    """Prefill each request (one chunk each, one forward), then `steps` decode steps of all of them together,
    feeding back each one's argmax -> per step, the logits of every request."""
    g = torch.Generator().manual_seed(seed)
    states = [model.new_state(1) for _ in contexts]
    prompts = [torch.randint(3, 1000, (1, n), generator=g) for n in contexts]
    last = model.step_chunks([Chunk(p, s) for p, s in zip(prompts, states)])
    out = []
    for _ in range(steps):
        last = model.step_chunks([Chunk(lg.argmax(-1, keepdim=True), s) for lg, s in zip(last, states)])
        out.append(last)   # kept as returned: a forward must not hand out a buffer the next one rewrites
    return out


def _with_graphs(model, config: CudaGraphConfig, backend=None) -> DecodeGraphs:
    model.cuda_graphs = DecodeGraphs(model, config, backend or StandInBackend())
    return model.cuda_graphs


def test_graph_ladders_follow_trtllm():
    assert CudaGraphConfig().sizes() == [*range(1, 32), 32, 64, 128]
    assert CudaGraphConfig(enable_padding=True).sizes() == [1, 2, 4, *range(8, 129, 8)]
    assert CudaGraphConfig(max_batch_size=20).sizes() == [*range(1, 21)]
    assert CudaGraphConfig(max_batch_size=600, enable_padding=True).sizes()[-3:] == [256, 512, 600]
    assert CudaGraphConfig.parse("8,1,4").sizes() == [1, 4, 8]
    with pytest.raises(ValueError, match="batch-sizes"):
        CudaGraphConfig.parse("1,two")
    with pytest.raises(ValueError, match="positive"):
        CudaGraphConfig([0])
    g = DecodeGraphs.__new__(DecodeGraphs)
    g.sizes, g.padding = [1, 4, 8], False
    assert (g.size_for(4), g.size_for(3)) == (4, None)
    g.padding = True
    assert (g.size_for(3), g.size_for(5), g.size_for(9)) == (4, 8, None)


def test_replayed_decode_steps_equal_eager_steps(model):
    want = _decode(model, CONTEXTS, STEPS)
    graphs = _with_graphs(model, CudaGraphConfig([1, 3]))
    try:
        got = _decode(model, CONTEXTS, STEPS)
    finally:
        model.cuda_graphs = None
    pieces = len(model.layers) + 1
    # step 1 warms each piece up, step 2 captures it, the others replay; prefill forwards never take graphs
    assert graphs.counts == {"eager": pieces, "captured": pieces, "replayed": pieces * (STEPS - 1)}
    for step_got, step_want in zip(got, want):
        for a, b in zip(step_got, step_want):
            assert torch.equal(a, b)


def test_start_up_capture_serves_the_first_steps(model):
    """Sizes captured at start-up (largest first, dummy requests) are replayed from a batch's first decode step, and
    give the eager logits; sizes above the cap stay uncaptured."""
    want = _decode(model, CONTEXTS, 3, seed=3)
    graphs = _with_graphs(model, CudaGraphConfig([1, 3, 8]))
    try:
        assert graphs.warm_up(model, max_batch_size=4) == [1, 3]
        pieces = len(model.layers) + 1
        assert graphs.counts == {"eager": 2 * pieces, "captured": 2 * pieces, "replayed": 2 * 2 * pieces}
        got = _decode(model, CONTEXTS, 3, seed=3)
    finally:
        model.cuda_graphs = None
    assert graphs.counts["eager"] == 2 * pieces and graphs.counts["replayed"] == 2 * 2 * pieces + 3 * pieces
    for step_got, step_want in zip(got, want):
        for a, b in zip(step_got, step_want):
            assert torch.equal(a, b)


def test_padded_batches_run_in_the_next_size_up(model):
    want = _decode(model, CONTEXTS, 4, seed=1)
    graphs = _with_graphs(model, CudaGraphConfig([4], enable_padding=True))
    try:
        got = _decode(model, CONTEXTS, 4, seed=1)
    finally:
        model.cuda_graphs = None
    assert graphs.counts["replayed"] == (len(model.layers) + 1) * 3
    for step_got, step_want in zip(got, want):
        for a, b in zip(step_got, step_want):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=0, atol=1e-9)   # 4 GEMM rows instead of 3: last bits only


def test_other_steps_stay_eager(model):
    graphs = _with_graphs(model, CudaGraphConfig([2]))
    try:
        _decode(model, CONTEXTS, 2)                      # 3 decode rows: not a captured size
        s = model.new_state(1)
        model.step_chunks([Chunk(torch.tensor([[5, 6]]), s)])   # a prompt chunk
    finally:
        model.cuda_graphs = None
    assert graphs.counts == {"eager": 0, "captured": 0, "replayed": 0}


class _FailingCapture(StandInBackend):
    def capture(self, fn):
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_failed_capture_turns_graphs_off_and_the_step_goes_on(model, caplog):
    want = _decode(model, CONTEXTS, 3, seed=2)
    graphs = _with_graphs(model, CudaGraphConfig([3]), _FailingCapture())
    try:
        with caplog.at_level(logging.WARNING, logger="dsflash.serve"):
            got = _decode(model, CONTEXTS, 3, seed=2)
    finally:
        model.cuda_graphs = None
    assert graphs.disabled is not None and "piece 0 at batch size 3" in graphs.disabled
    assert sum("CUDA graphs off" in r.message for r in caplog.records) == 1
    assert graphs.counts["captured"] == 0 and graphs.counts["replayed"] == 0
    for step_got, step_want in zip(got, want):
        for a, b in zip(step_got, step_want):
            assert torch.equal(a, b)


def test_a_simulated_rank_counts_the_replayed_collectives():
    """A TP2 rank alone (SimulatedComm): its all-reduces and the head's gather are counted in Python, which a
    replay does not run; the runner counts them per replay as the eager steps do, with the per-request caches and
    with decode slots (model_def/decode_slots.py: the same collectives; the indexer's scores span every entry row
    there, so their sizes differ)."""
    args = get_preset("v41", "tiny")
    counts = {}
    for mode in ("eager", "graphs", "slots", "slots+graphs"):
        m = Mapping(world_size=2, tp_size=2, rank=1)
        comm = SimulatedComm(m)
        model = DeepseekV41Model(args, Numerics("deploy", args.act_block), mapping=m, comm=comm,
                                 dtype=torch.float64).eval()
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.05 + (p.dim() == 1))
        if "slots" in mode:
            model.enable_decode_slots(2, 64)
        if "graphs" in mode:
            _with_graphs(model, CudaGraphConfig([2]))
        _decode(model, [9, 30], 4)
        counts[mode] = (comm.counts.calls, comm.gathers.calls, dict(comm.gathers.by_size), dict(comm.counts.by_size))
        assert "graphs" not in mode or model.cuda_graphs.counts["replayed"] > 0
    assert counts["eager"] == counts["graphs"] and counts["slots"] == counts["slots+graphs"]
    assert counts["eager"][:3] == counts["slots"][:3] and counts["eager"][0] > 0 and counts["eager"][1] > 0
