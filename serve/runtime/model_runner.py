"""Model runner: loads the rank's model from the engine dir and runs a step's segments through `model.step`.

The reference runner calls `model.step(ids [1,S], state)` once per scheduled segment, each request with its own
model state (`model.new_state(1)`): a request's tokens are computed exactly as they would be alone (batch
invariance by construction). The GPU runner batches the same segments through the paged attention / MoE kernels
into the pages the block manager hands out; the plan it receives is the same.

On several ranks, rank 0 sends the plan (request id, token ids, reset flag) to the workers before running it, and
every rank makes the same `step` calls in the same order (the TP all-reduces inside the model pair up).
"""
from __future__ import annotations

import torch

from dsflash.serve.runtime.scheduler import Batch
from dsflash.serve.runtime.sequence import Sequence


class ModelRunner:
    def __init__(self, engine_dir: str, rank: int = 0, comm=None, model=None, control=None):
        from dsflash.build.engine import load_engine_model, open_engine
        eng = open_engine(engine_dir)
        self.device = "cpu" if eng.meta["arch"] == "cpu" else f"cuda:{torch.cuda.current_device()}"
        if model is None:
            model, eng = load_engine_model(engine_dir, rank, comm=comm, device=self.device)
        self.model, self.engine, self.control = model, eng, control
        self.args = eng.args

    def forward(self, state, ids: list[int]) -> torch.Tensor:
        """Feed ids to one request's state; -> logits of the last position [V] fp32."""
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        with torch.no_grad():
            return self.model.step(x, state)[0, -1].float()

    def run(self, batch: Batch, released: list[str]) -> dict[Sequence, torch.Tensor]:
        """Run every segment (after telling the workers, and which requests' states to drop); returns the
        next-token logits of the sequences whose segment reached their last token."""
        if self.control is not None:
            self.control.send_step(released, [(s.seq.request_id, s.ids, s.reset) for s in batch.segments])
        out = {}
        for seg in batch.segments:
            if seg.reset:
                seg.seq.state = self.model.new_state(1)
            logits = self.forward(seg.seq.state, seg.ids)
            seg.seq.num_computed = seg.end
            if seg.sample:
                out[seg.seq] = logits
        return out
