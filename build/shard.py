"""Per-rank slicing of checkpoint tensors by the name table's shard rules (the only place tensors are split).

Rules (`TensorEntry.shard`): None = replicated; "col"/"head" = dim 0 split over TP; "row" = dim 1 split over TP;
"rows" = uneven dim-0 split of lookup tables (row ids are global, ranks answer for their own range); "expert" =
routed expert placed on the EP rank owning its id and sliced over MoE-TP along the intermediate dim (dim 0 of
w1/w3, dim 1 of w2). Quantized tensors are cut at block granularity together with their scales; a cut inside a
block is refused. Expert intermediates are padded after sharding, never before (design.md §1).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from dsflash.model_def.mapping import Mapping, split_range, split_rows
from dsflash.model_def.names import TensorEntry

_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<id>\d+)\.(?P<w>w[123])\.weight$")


class ShardError(ValueError):
    """A topology that does not divide the model's heads, groups, experts or quantization blocks."""


@dataclass(frozen=True)
class Cut:
    """The local piece of one logical tensor: `dim` sliced to [start, stop), then padded to `padded` on that dim."""
    dim: int | None
    start: int = 0
    stop: int = 0
    padded: int = 0

    def shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        if self.dim is None:
            return shape
        s = list(shape)
        s[self.dim] = self.padded
        return tuple(s)


def expert_id(name: str) -> tuple[str, int, str] | None:
    m = _EXPERT.match(name)
    return (m["prefix"], int(m["id"]), m["w"]) if m else None


def experts_per_prefix(table: list[TensorEntry]) -> dict[str, int]:
    counts: dict[str, set[int]] = {}
    for e in table:
        eid = expert_id(e.name)
        if eid:
            counts.setdefault(eid[0], set()).add(eid[1])
    return {k: len(v) for k, v in counts.items()}


def plan_cut(entry: TensorEntry, mapping: Mapping, n_experts: dict[str, int], weight_block: int,
             expert_pad: int = 1) -> Cut | None:
    """How this rank holds `entry` (None: not on this rank)."""
    tp, rank = mapping.tp_size, mapping.tp_rank
    rule = entry.shard
    try:
        if rule is None or (tp == 1 and rule != "expert"):
            return Cut(None)
        if rule in ("col", "head", "row"):
            dim = 1 if rule == "row" else 0
            start, stop = split_range(entry.shape[dim], tp, rank)
            return _check_block(entry, Cut(dim, start, stop, stop - start), weight_block)
        if rule == "rows":
            start, stop = split_rows(entry.shape[0], tp, rank)
            return Cut(0, start, stop, stop - start)
        if rule == "expert":
            prefix, eid, w = expert_id(entry.name) or (None, None, None)
            if prefix is None:
                raise ShardError(f"tensor '{entry.name}' has shard rule 'expert' but no expert id in its name")
            if eid not in mapping.ep_experts(n_experts[prefix]):
                return None
            dim = 1 if w == "w2" else 0
            start, stop = split_range(entry.shape[dim], mapping.moe_tp_size, mapping.moe_tp_rank)
            padded = -(-(stop - start) // expert_pad) * expert_pad
            if mapping.moe_tp_size == 1 and padded == stop - start:
                return Cut(None)
            return _check_block(entry, Cut(dim, start, stop, padded), weight_block)
    except ValueError as e:
        if isinstance(e, ShardError):
            raise
        raise ShardError(f"tensor '{entry.name}' {list(entry.shape)} (shard rule {rule!r}) cannot be split for "
                         f"tp={mapping.tp_size}, moe_tp={mapping.moe_tp_size}, moe_ep={mapping.moe_ep_size}: {e}") from None
    raise ShardError(f"tensor '{entry.name}': unknown shard rule {rule!r}")


def _check_block(entry: TensorEntry, cut: Cut, weight_block: int) -> Cut:
    gran = {"fp8_block": weight_block, "mxfp4": 32 if cut.dim == 1 else 1}.get(entry.role, 1)
    if cut.start % gran or (cut.stop - cut.start) % gran:
        raise ShardError(f"tensor '{entry.name}' {list(entry.shape)}: the slice [{cut.start}, {cut.stop}) of dim "
                         f"{cut.dim} cuts through its {gran}-wide quantization blocks; choose another tp/moe_tp")
    return cut


def _slice_pad(t: torch.Tensor, dim: int, start: int, stop: int, padded: int, fill_byte: int = 0) -> torch.Tensor:
    """Narrow `dim` to [start, stop) and pad it to `padded` (1-byte dtypes padded with `fill_byte`, others with 0)."""
    piece = t.narrow(dim, start, stop - start)
    if padded == stop - start:
        return piece.contiguous()
    shape = list(piece.shape)
    shape[dim] = padded
    if piece.element_size() == 1:
        out = torch.full(shape, fill_byte, dtype=torch.uint8).view(piece.dtype)
    else:
        out = torch.zeros(shape, dtype=piece.dtype)
    out.narrow(dim, 0, stop - start).copy_(piece)
    return out


E8M0_ONE = 127  # e8m0 byte of 1.0: padding scales stay finite; padded codes are zero so the values are zero


def cut_stored(entry: TensorEntry, stored: dict[str, torch.Tensor], cut: Cut, weight_block: int) -> dict[str, torch.Tensor]:
    """Apply a Cut to an entry's on-disk tensors (reference layout): weight and scale cut consistently."""
    if cut.dim is None:
        return dict(stored)
    w = stored[entry.name]
    d, s0, s1, pad = cut.dim, cut.start, cut.stop, cut.padded
    out = {}
    if entry.role in ("bf16", "f32", "i64"):
        out[entry.name] = _slice_pad(w, d, s0, s1, pad)
        return out
    scale = stored[entry.scale_name]
    if entry.role == "fp8_block":
        b = weight_block
        out[entry.name] = _slice_pad(w, d, s0, s1, pad)
        out[entry.scale_name] = _slice_pad(scale, d, s0 // b, -(-s1 // b), -(-pad // b), E8M0_ONE)
    elif entry.role == "mxfp4":
        if d == 0:
            out[entry.name] = _slice_pad(w, 0, s0, s1, pad)
            out[entry.scale_name] = _slice_pad(scale, 0, s0, s1, pad, E8M0_ONE)
        else:
            out[entry.name] = _slice_pad(w, 1, s0 // 2, s1 // 2, pad // 2)
            out[entry.scale_name] = _slice_pad(scale, 1, s0 // 32, s1 // 32, -(-pad // 32), E8M0_ONE)
    else:  # fp8_rows32 tables: rows only
        assert d == 0, entry.name
        out[entry.name] = _slice_pad(w, 0, s0, s1, pad)
        out[entry.scale_name] = _slice_pad(scale, 0, s0, s1, pad, E8M0_ONE)
    return out
