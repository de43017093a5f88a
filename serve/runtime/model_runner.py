"""Model runner: loads the rank's model from the engine dir and runs a step's segments.

Each request owns a batch-1 model state (`model.new_state(1)`). By default a step's segments (prompt chunks and
decode tokens of different requests, each at its own position) run as one forward (`model.step_chunks`, the
ragged layout of model_def/ragged.py): the linears, mHC, MoE and head read their weights once for all the step's
tokens, and only the attention walks each request's own caches. A token's arithmetic then depends on how many rows
share its GEMMs (the kernels and their summation order follow the row count), so its output can differ in the last
bits with its neighbours. `batch_invariant=True` runs each segment in a forward of its own instead: a request's
tokens are computed exactly as they would be alone, whatever else is scheduled (SGLang's deterministic inference;
slower). On a GPU it also makes the MoE plugin sum the experts' outputs in a fixed order
(`moe_config.set_deterministic`), so that a request's tokens are the same bits from run to run, not only
independent of its neighbours. GPU engines run through this same runner (their plugin kernels bound in the model);
a decode step of a captured batch size replays as one CUDA graph (`enable_cuda_graphs`, runtime/cuda_graphs.py),
its requests' caches in decode slots (model_def/decode_slots.py, given back when the plan releases the request, on
every rank at the same step); a step whose requests do not all fit the slots replays per-token pieces, the
attention's cache work eager between them.

On several ranks, rank 0 sends the plan (request id, token ids, reset flag) to the workers before running it, and
every rank makes the same forwards in the same order (the TP all-reduces inside the model pair up).

Speculative engines (single rank, `speculative=SpecConfig`): each request owns a batch-1 `SpeculativeDecoder`
(serve/spec_decode.py) whose state is the request's model state; its segments run one by one. Prompt / recompute
segments run the target forward that also yields the drafter's inputs and commit them to the drafter (the last
segment's rows wait for the sampled token: `finish_prefill`); a decode segment is one draft + verify + accept +
rollback iteration that returns several tokens (`SpecStep`).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import torch

from dsflash.model_def.ragged import Chunk
from dsflash.plugins.moe_config import set_deterministic
from dsflash.serve.runtime.cuda_graphs import DecodeGraphs
from dsflash.serve.runtime.sampling import SamplingParams, mask_top_k_top_p
from dsflash.serve.runtime.scheduler import Batch, Segment
from dsflash.serve.runtime.sequence import Sequence

log = logging.getLogger("dsflash.serve")


@dataclass
class SpecStep:
    """What one speculative decode produced: the new tokens (accepted drafts + one), the target logits [n,V] each
    was drawn from, and the verify's drafted / accepted counts."""
    tokens: list[int]
    logits: torch.Tensor
    drafted: int
    accepted: int


class ModelRunner:
    def __init__(self, engine_dir: str, rank: int = 0, comm=None, model=None, control=None, speculative=None,
                 wrap_drafter=None, batch_invariant: bool = False):
        from dsflash.build.engine import load_engine_model, open_engine
        eng = open_engine(engine_dir)
        self.device = "cpu" if eng.meta["arch"] == "cpu" else f"cuda:{torch.cuda.current_device()}"
        if model is None:
            model, eng = load_engine_model(engine_dir, rank, comm=comm, device=self.device)
        self.model, self.engine, self.control = model, eng, control
        self.args = eng.args
        self.spec = speculative       # SpecConfig | None
        self.wrap_drafter = wrap_drafter   # (drafter, seq) -> drafter: tests substitute proposals
        self.batch_invariant = batch_invariant
        set_deterministic(batch_invariant)   # the MoE plugin's expert sum in a fixed order (its atomics' order varies)
        self._states: dict[str, object] = {}   # request id -> its model state (released with the plan's ids)

    def enable_cuda_graphs(self, config, max_batch_size: int, max_seq_len: int, warm_up: bool = False,
                           slots: bool | None = None) -> bool:
        """Decode steps as CUDA graphs (`CudaGraphConfig`, None: off) on a GPU; speculative engines stay eager
        (their verify forwards are not decode steps). The model also gets max_batch_size decode slots for
        positions below max_seq_len (model_def/decode_slots.py), so that its decode steps are one graph each,
        attention included: when they fit the free memory (`slots` None: rank 0 decides), or as rank 0 decided
        (`slots`: a worker, so that every rank takes the same paths). `warm_up`: capture the sizes up to
        max_batch_size now (a single process); else each size is captured on its second step. Returns whether
        graphs are on."""
        if config is None or self.device == "cpu" or self.spec is not None or not hasattr(self.model, "cuda_graphs"):
            return False
        if slots is None:
            enable_decode_slots(self.model, max_batch_size, max_seq_len, torch.cuda.mem_get_info()[0])
        elif slots:
            self.model.enable_decode_slots(max_batch_size, max_seq_len)
        self.model.cuda_graphs = graphs = DecodeGraphs(self.model, config)
        if warm_up:
            t = time.perf_counter()
            sizes = graphs.warm_up(self.model, max_batch_size)
            log.info("CUDA graphs: %d decode batch sizes captured (up to %s) in %.1f s", len(sizes),
                     max(sizes, default=0), time.perf_counter() - t)
        return True

    def release(self, state) -> None:
        """A request's state is done with (finished, aborted or reset): give back what it holds in the model."""
        if state is not None and hasattr(self.model, "release_state"):
            self.model.release_state(state)

    def run(self, batch: Batch, released: list[str]) -> dict[Sequence, torch.Tensor]:
        """Run every segment (after telling the workers, and which requests' states to drop); returns the
        next-token logits of the sequences whose segment reached their last token."""
        if self.control is not None:
            self.control.send_step(released, [(s.seq.request_id, s.ids, s.reset) for s in batch.segments])
        for rid in released:
            self.release(self._states.pop(rid, None))
        out = {}
        if self.spec is not None:
            for seg in batch.segments:
                res = self._run_spec(seg)
                if res is not None:
                    out[seg.seq] = res
            return out
        for seg in batch.segments:
            if seg.reset:
                self.release(seg.seq.state)
                seg.seq.state = self._states[seg.seq.request_id] = self.model.new_state(1)
        work = [(seg.seq.state, seg.ids) for seg in batch.segments]
        for seg, logits in zip(batch.segments, run_segments(self.model, self.device, work, self.batch_invariant)):
            seg.seq.num_computed = seg.end
            if seg.sample:
                out[seg.seq] = logits
        return out

    # -- speculative ---------------------------------------------------------------------------------------------
    def _decoder(self, seq: Sequence):
        from dsflash.serve.spec_decode import SpeculativeDecoder
        p = seq.params
        cfg = dataclasses.replace(self.spec, temperature=0.0 if p.greedy else float(p.temperature))
        wrap = (lambda d: self.wrap_drafter(d, seq)) if self.wrap_drafter is not None else None
        dec = SpeculativeDecoder(self.model, cfg, 1, wrap)
        dec.generator = seq.generator         # the request's own RNG (seeded requests are reproducible)
        dec.stats = [seq.spec_stats]
        if not p.greedy and (p.top_k > 0 or p.top_p < 1):
            dec.target_probs = lambda logits, p=p: _masked_probs(logits, p)
        seq.spec_simulated = dec.simulated
        return dec

    def _run_spec(self, seg: Segment):
        from dsflash.serve.spec_decode import target_forward
        seq = seg.seq
        if seg.reset:
            seq.spec = self._decoder(seq)
            seq.state, seq.spec_pending = seq.spec.state, None
        dec = seq.spec
        with torch.no_grad():
            if seg.draft is not None:                      # decode: draft + verify + accept + rollback
                before = seq.spec_stats.drafted
                new = dec.step(seg.draft + 1)[0].tolist()
                seq.num_computed = seg.start + len(new)    # the pending token + the accepted drafts
                return SpecStep(new, dec.last_logits[0].float(), seq.spec_stats.drafted - before, len(new) - 1)
            x = torch.tensor([seg.ids], dtype=torch.long, device=self.device)
            logits, hidden = target_forward(self.model, x, dec.state)
            seq.num_computed = seg.end
            if seg.sample:                                 # the drafter's last row needs the token sampled next
                seq.spec_pending = (hidden, seg.ids[1:])
                return logits[0, -1].float()
            nxt = torch.tensor([seq.token_ids[seg.start + 1:seg.end + 1]], dtype=torch.long, device=self.device)
            dec.drafter.commit(hidden, nxt)
        return None

    def finish_prefill(self, seq: Sequence, token: int) -> None:
        """The token sampled after a prompt / recompute: commit the waiting drafter rows; it is the next bonus."""
        hidden, ids = seq.spec_pending
        seq.spec_pending = None
        with torch.no_grad():
            seq.spec.drafter.commit(hidden, torch.tensor([ids + [token]], dtype=torch.long, device=self.device))
        seq.spec.bonus = torch.tensor([token], dtype=torch.long, device=self.device)


SLOT_SHARE = 0.5   # the most of the free device memory the decode slots may take (the rest: KV pool, activations)


def enable_decode_slots(model, n: int, max_seq_len: int, free_bytes: int) -> bool:
    """Give `model` n decode slots for positions < max_seq_len when they fit in SLOT_SHARE of free_bytes; else log
    why not (its decode steps then replay as pieces, the attention eager between them). Returns whether it did."""
    if not hasattr(model, "enable_decode_slots"):
        return False
    need = model.enable_decode_slots(n, max_seq_len, device="meta").nbytes
    if need > SLOT_SHARE * free_bytes:
        log.warning("decode slots for %d requests × %d positions need %.1f GiB, more than %d%% of the %.1f GiB "
                    "free: decode steps replay as pieces, their attention eager between them (lower "
                    "--max-batch-size or --max-seq-len to get one graph per step)", n, max_seq_len, need / 2**30,
                    SLOT_SHARE * 100, free_bytes / 2**30)
        return False
    model.enable_decode_slots(n, max_seq_len)
    log.info("decode slots: %d requests × %d positions, %.2f GiB", n, max_seq_len, need / 2**30)
    return True


def run_segments(model, device, work: list[tuple[object, list[int]]],
                 batch_invariant: bool) -> list[torch.Tensor | None]:
    """Advance each (batch-1 state, new token ids) by its tokens -> the logits [V] fp32 after each one's last token.

    Fused: one forward over them all, where the consecutive segments of one state (a recomputation's prompt chunks
    and generated tokens) join one chunk; an entry that a later entry of its state continues gets None.
    batch_invariant: one forward per entry, the calls the request makes alone."""
    if batch_invariant:
        groups = [[i] for i in range(len(work))]
    else:
        by_state: dict[int, list[int]] = {}
        for i, (state, _) in enumerate(work):
            by_state.setdefault(id(state), []).append(i)
        groups = [list(g) for g in by_state.values()]
    chunks = [Chunk(torch.tensor([sum((work[i][1] for i in g), [])], dtype=torch.long, device=device), work[g[0]][0])
              for g in groups]
    out: list[torch.Tensor | None] = [None] * len(work)
    calls = [[c] for c in chunks] if batch_invariant else [chunks] if chunks else []
    with torch.no_grad():
        logits = [row[0].float() for call in calls for row in model.step_chunks(call)]
    for g, lg in zip(groups, logits):
        out[g[-1]] = lg
    return out


def _masked_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits [B,S,V] -> the request's sampling distribution (temperature, top-k, top-p) in float64."""
    x = logits.double() / p.temperature
    rows = [mask_top_k_top_p(r, p.top_k, p.top_p) for r in x.reshape(-1, x.shape[-1])]
    return torch.softmax(torch.stack(rows).reshape(x.shape), -1)
