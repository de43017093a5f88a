"""Several requests' chunks in one forward: their tokens laid end to end on one token axis.

Chunk i is a block of B_i rows × S_i tokens (one request's prefill chunk or decode token, or a lockstep batch of
B_i requests at the same position); it occupies rows offsets[i] .. offsets[i] + B_i·S_i of a [1, T, ...] tensor.
Everything per token (linears, norms, mHC, MoE, the head) runs once over all T rows; only what reads a request's
own cache (the attention core, the compressor's pooling, Engram's hashing) runs chunk by chunk.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass
class Chunk:
    """One request batch's new tokens in a forward: ids [B,S] at state.pos (the model's state of those B rows;
    image_mask [B,S] bool or None, V4.1 only)."""
    ids: torch.Tensor
    state: object
    image_mask: torch.Tensor | None = None


class Ragged:
    """The layout of a forward's chunks: their [B_i, S_i] shapes and, for a model forward, the position each starts
    at (`starts`) and the device of its tensors (for `positions`)."""

    def __init__(self, shapes: list[tuple[int, int]], starts: list[int] | None = None, device=None):
        if not shapes:
            raise ValueError("a ragged batch needs at least one chunk")
        self.shapes = [(int(b), int(s)) for b, s in shapes]
        self.sizes = [b * s for b, s in self.shapes]
        self.total = sum(self.sizes)
        self.starts, self.device = starts, device

    @classmethod
    def of(cls, chunks: list[Chunk]) -> "Ragged":
        """The layout of a forward's chunks; each must have a state of its own (the attention of all chunks runs
        layer by layer, so two chunks of one state would both start at its old position)."""
        if len({id(c.state) for c in chunks}) != len(chunks):
            raise ValueError("two chunks of one forward share a state: join a request's consecutive tokens into one "
                             "chunk")
        return cls([tuple(c.ids.shape) for c in chunks], [c.state.pos for c in chunks], chunks[0].ids.device)

    @cached_property
    def positions(self) -> torch.Tensor:
        """[1, T] position of every row (chunk i: starts[i] + 0 .. S_i − 1 on each of its B_i rows), made once per
        forward for all its layers."""
        if self.starts is None:
            raise ValueError("this layout has no start positions")
        return self.join([(p0 + torch.arange(s, device=self.device)).expand(b, s)
                          for p0, (b, s) in zip(self.starts, self.shapes, strict=True)])

    def join(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """[B_i, S_i, ...] per chunk -> [1, T, ...]."""
        flat = [p.reshape(1, b * s, *p.shape[2:]) for p, (b, s) in zip(parts, self.shapes, strict=True)]
        return flat[0] if len(flat) == 1 else torch.cat(flat, 1)

    def split(self, x: torch.Tensor) -> list[torch.Tensor]:
        """[1, T, ...] -> [B_i, S_i, ...] per chunk."""
        if x.shape[:2] != (1, self.total):
            raise ValueError(f"ragged tensor must be [1, {self.total}, ...], got {list(x.shape)}")
        return [t.reshape(b, s, *t.shape[2:]) for t, (b, s) in zip(x.split(self.sizes, 1), self.shapes)]

    def last_rows(self, device) -> torch.Tensor:
        """Row index (on the T axis) of every sequence's last token, chunk by chunk, batch row by batch row."""
        rows, off = [], 0
        for (b, s), n in zip(self.shapes, self.sizes):
            rows.extend(off + r * s + s - 1 for r in range(b))
            off += n
        return torch.tensor(rows, dtype=torch.long, device=device)

    def split_rows(self, x: torch.Tensor) -> list[torch.Tensor]:
        """[N, ...] with one row per sequence (as `last_rows` orders them) -> [B_i, ...] per chunk."""
        return list(x.split([b for b, _ in self.shapes], 0))


class DecodeRows:
    """A forward's single-token chunks (one request, one new token each: the decode steps), attended as one batch in
    every layer instead of one attention per request: their chunk indices (`members`), start positions, positions
    [N,1] on the device, and host ints copied to the device once per forward (`ints`). Families extend it with what
    their layers share (csa2.DecodeBatch)."""

    def __init__(self, rag: Ragged, members: list[int]):
        self.members, self.index = members, set(members)
        self._sizes = rag.sizes
        self.slots = self.slot_ids = self.rows = None   # `take_slots`
        self.starts = [rag.starts[i] for i in members]
        per_chunk = rag.split(rag.positions)
        self.positions = torch.cat([per_chunk[i] for i in members])                  # [N, 1]
        self._ints: dict[tuple[int, ...], torch.Tensor] = {}

    @classmethod
    def of(cls, rag: Ragged, *args, min_size: int = 2):
        """The forward's decode rows, or None when fewer than min_size chunks are single tokens."""
        members = [i for i, shape in enumerate(rag.shapes) if shape == (1, 1)]
        return cls(rag, members, *args) if len(members) >= min_size else None

    def take_slots(self, slots, states: list) -> None:
        """With decode slots (decode_slots.py) that can hold every member (`states`: theirs, in member order), move
        their caches there: `slots`, their slot ids [N] (`slot_ids`) and, when other chunks share the forward, the
        members' rows on the token axis (`rows`; None: every row is a member). Else `slots` stays None."""
        self.slots = self.slot_ids = self.rows = None
        if slots is None or not all(slots.fits(s) for s in states) \
                or len(states) > slots.free + sum(s.slot is not None for s in states):
            return
        self.slots, self.slot_ids = slots, slots.slot_tensor(states)
        if len(self.members) < len(self._sizes):
            offsets = [0, *itertools.accumulate(self._sizes)]
            self.rows = self.ints([offsets[i] for i in self.members])

    def padded_slot_ids(self, rows: int) -> torch.Tensor:
        """`slot_ids` [N] padded with the scratch slot up to `rows` (the padded rows of a CUDA-graph batch)."""
        if rows == len(self.slot_ids):
            return self.slot_ids
        return torch.cat([self.slot_ids, self.slot_ids.new_full((rows - len(self.slot_ids),), self.slots.scratch)])

    def member_rows(self, prepared: tuple) -> tuple:
        """An attention's `prepare` outputs [1, T, ...] -> the members' rows as [N, 1, ...] (`member_rows`)."""
        return member_rows(prepared if self.rows is None else tree_map(lambda t: t.index_select(1, self.rows), prepared))

    def ints(self, values) -> torch.Tensor:
        """Host ints (cache lengths, entry positions, row indices) as a device tensor, copied once per forward however
        many layers ask for the same values (they repeat from layer to layer); never written."""
        key = tuple(int(v) for v in values)
        if key not in self._ints:
            self._ints[key] = torch.tensor(key, dtype=torch.long, device=self.positions.device)
        return self._ints[key]

    def stack(self, parts: list) -> tuple[torch.Tensor, ...]:
        """The members' per-chunk tuples of [1,1,...] tensors -> one tuple of [N,1,...] tensors."""
        return tuple(torch.cat(t) for t in zip(*(parts[i] for i in self.members)))


def tree_map(fn, x):
    """fn over the tensors of a nested tuple (None passes): an attention's `prepare` outputs."""
    if x is None:
        return None
    if isinstance(x, tuple):
        return tuple(tree_map(fn, t) for t in x)
    return fn(x)


def member_rows(prepared: tuple) -> tuple:
    """`prepare` outputs [1, N, ...] as N single-token rows [N, 1, ...] (views)."""
    return tree_map(lambda t: t.transpose(0, 1), prepared)


def first_rows(t, n: int):
    """The first n token rows of a [1, T, ...] tensor (a decode step's padded CUDA-graph outputs); None passes, a
    tuple is taken member by member."""
    if t is None:
        return None
    if isinstance(t, tuple):
        return tuple(first_rows(u, n) for u in t)
    return t if t.shape[1] == n else t[:, :n]


def all_reduce_each(comm, parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Sum each tensor over the TP ranks with one collective for all of them (the chunks' partial sums)."""
    if len(parts) == 1:
        return [comm.all_reduce(parts[0])]
    flat = comm.all_reduce(torch.cat([p.reshape(-1) for p in parts]))
    return [t.view_as(p) for t, p in zip(flat.split([p.numel() for p in parts]), parts)]


@torch.no_grad()
def generate_greedy(model, input_ids: torch.Tensor, max_new_tokens: int,
                    image_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Prefill input_ids [B,S], then greedy decode one token per forward -> [B, S + max_new_tokens]. Each forward
    computes the vocabulary head on its last position only (`step_chunks`)."""
    state = model.new_state(input_ids.shape[0])
    out, chunk = [input_ids], Chunk(input_ids, state, image_mask)
    for _ in range(max_new_tokens):
        nxt = model.step_chunks([chunk])[0].argmax(-1, keepdim=True)    # [B, 1]
        out.append(nxt)
        chunk = Chunk(nxt, state)
    return torch.cat(out, 1)
