"""`run_segments`: how a step's segments become forwards (fused: one; batch_invariant: one per segment)."""
import torch

from dsflash.serve.runtime.model_runner import run_segments


class _Recorder:
    """Stands in for a model: records each forward's chunks; a chunk's logits are [its length, its first id]."""

    def __init__(self):
        self.calls: list[list[tuple[object, list[int]]]] = []

    def step_chunks(self, chunks):
        self.calls.append([(c.state, c.ids[0].tolist()) for c in chunks])
        return [torch.tensor([[float(c.ids.shape[1]), float(c.ids[0, 0])]]) for c in chunks]


def test_fused_step_is_one_forward_and_joins_a_requests_consecutive_segments():
    a, b, c = object(), object(), object()
    work = [(a, [1, 2]), (a, [3]), (b, [4]), (a, [5]), (c, [6, 7, 8])]   # a: recompute chunks + a token
    m = _Recorder()
    out = run_segments(m, "cpu", work, batch_invariant=False)
    assert m.calls == [[(a, [1, 2, 3, 5]), (b, [4]), (c, [6, 7, 8])]]
    assert out[0] is None and out[1] is None                     # continued by a's last segment
    assert [t.tolist() for t in out[2:]] == [[1.0, 4.0], [4.0, 1.0], [3.0, 6.0]]
    assert all(t.dtype == torch.float32 for t in out[2:])


def test_batch_invariant_step_is_a_forward_per_segment():
    a, b = object(), object()
    work = [(a, [1, 2]), (a, [3]), (b, [4])]
    m = _Recorder()
    out = run_segments(m, "cpu", work, batch_invariant=True)
    assert m.calls == [[(a, [1, 2])], [(a, [3])], [(b, [4])]]
    assert [t.tolist() for t in out] == [[2.0, 1.0], [1.0, 3.0], [1.0, 4.0]]


def test_an_empty_step_runs_nothing():
    m = _Recorder()
    assert run_segments(m, "cpu", [], batch_invariant=False) == [] and m.calls == []
