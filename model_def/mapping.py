"""Rank layout (TensorRT-LLM `Mapping` semantics, pp=1). Pure Python: no torch, no MPI.

TP is the fastest-varying rank dimension. Inside one TP group the MoE ranks are split as
`tp_rank = moe_tp_rank * moe_ep_size + moe_ep_rank` (EP varies fastest), and each EP rank owns a
contiguous block of experts. The same examples run in tests/unit/test_mapping.py.

Worked examples (V4.1-Flash: 384 routed experts):

TP8 with the default MoE split (moe_tp = tp, moe_ep = 1: every rank holds a slice of every expert):

>>> m = Mapping(world_size=8, rank=5, tp_size=8)
>>> m.moe_tp_size, m.moe_ep_size, m.tp_rank, m.moe_tp_rank, m.moe_ep_rank
(8, 1, 5, 5, 0)
>>> m.ep_experts(384)
range(0, 384)

TP8 with moe_ep=4, so moe_tp = 8 // 4 = 2:

>>> m = Mapping(world_size=8, rank=5, tp_size=8, moe_ep_size=4)
>>> m.moe_tp_size, m.tp_rank, m.moe_ep_rank, m.moe_tp_rank
(2, 5, 1, 1)
>>> m.tp_group, m.moe_ep_group, m.moe_tp_group
([0, 1, 2, 3, 4, 5, 6, 7], [4, 5, 6, 7], [1, 5])
>>> m.moe_ep_groups, m.moe_tp_groups
([[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]])
>>> m.ep_experts(384)
range(96, 192)

TP8 with pure EP (moe_ep=8, moe_tp=1): rank 5 owns experts 240..287 whole:

>>> Mapping(world_size=8, rank=5, tp_size=8, moe_ep_size=8).ep_experts(384)
range(240, 288)

Tensor-parallel slices of a 2304-wide expert intermediate at moe_tp=8 (pad after sharding, not before):

>>> split_range(2304, 8, 3)
(864, 1152)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["Mapping", "split_range", "split_rows"]


def split_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """Half-open `[start, stop)` of slice `index` when `total` is split into `parts` equal slices.

    Raises ValueError unless `total % parts == 0` and `0 <= index < parts` (no silent uneven shards).
    """
    if parts < 1:
        raise ValueError(f"split_range: parts must be >= 1, got {parts}")
    if not 0 <= index < parts:
        raise ValueError(f"split_range: index {index} out of range for {parts} parts")
    if total % parts != 0:
        raise ValueError(f"split_range: {total} is not divisible into {parts} equal parts")
    size = total // parts
    return index * size, (index + 1) * size


def split_rows(total: int, parts: int, index: int) -> tuple[int, int]:
    """Uneven `[start, stop)` split for lookup tables: the first `total % parts` slices get one more row
    (as `torch.tensor_split`); row ids stay global and each rank answers for its own range."""
    if not 0 <= index < parts:
        raise ValueError(f"split_rows: index {index} out of range for {parts} parts")
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, start + base + (index < extra)


def _unset(v: int | None) -> bool:
    # TRT-LLM's convert scripts use -1 for "not given"; accept it as well as None.
    return v is None or v == -1


@dataclass(frozen=True)
class Mapping:
    """World/rank layout with TP and MoE (moe_tp x moe_ep) splits; validated on construction.

    Defaults follow TensorRT-LLM: neither MoE size given -> moe_tp = tp, moe_ep = 1; one given ->
    the other is tp // given. Requires tp * pp == world_size, moe_tp * moe_ep == tp, pp == 1.
    """

    world_size: int = 1
    rank: int = 0
    tp_size: int = 1
    moe_tp_size: int | None = None
    moe_ep_size: int | None = None
    pp_size: int = 1
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        for name in ("world_size", "rank", "tp_size", "pp_size", "gpus_per_node"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"Mapping.{name} must be an int, got {v!r}")
        for name in ("world_size", "tp_size", "pp_size", "gpus_per_node"):
            if getattr(self, name) < 1:
                raise ValueError(f"Mapping.{name} must be >= 1, got {getattr(self, name)}")
        if self.pp_size != 1:
            raise ValueError(f"Mapping: pp_size={self.pp_size} is not supported (dsflash supports pp_size=1 only)")
        if self.tp_size * self.pp_size != self.world_size:
            raise ValueError(
                f"Mapping: tp_size * pp_size must equal world_size, got "
                f"{self.tp_size} * {self.pp_size} != {self.world_size}"
            )

        moe_tp, moe_ep = self.moe_tp_size, self.moe_ep_size
        for name, v in (("moe_tp_size", moe_tp), ("moe_ep_size", moe_ep)):
            if not _unset(v) and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"Mapping.{name} must be a positive int (or None/-1 for unset), got {v!r}")
        if _unset(moe_tp) and _unset(moe_ep):
            moe_tp, moe_ep = self.tp_size, 1
        elif _unset(moe_tp):
            if self.tp_size % moe_ep != 0:
                raise ValueError(f"Mapping: tp_size={self.tp_size} is not divisible by moe_ep_size={moe_ep}")
            moe_tp = self.tp_size // moe_ep
        elif _unset(moe_ep):
            if self.tp_size % moe_tp != 0:
                raise ValueError(f"Mapping: tp_size={self.tp_size} is not divisible by moe_tp_size={moe_tp}")
            moe_ep = self.tp_size // moe_tp
        if moe_tp * moe_ep != self.tp_size:
            raise ValueError(
                f"Mapping: moe_tp_size * moe_ep_size must equal tp_size, got {moe_tp} * {moe_ep} != {self.tp_size}"
            )
        object.__setattr__(self, "moe_tp_size", moe_tp)
        object.__setattr__(self, "moe_ep_size", moe_ep)

        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"Mapping: rank must be in [0, {self.world_size}), got {self.rank}")

    # ranks of this process
    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def moe_ep_rank(self) -> int:
        return self.tp_rank % self.moe_ep_size

    @property
    def moe_tp_rank(self) -> int:
        return self.tp_rank // self.moe_ep_size

    @property
    def local_rank(self) -> int:
        """GPU index on this node."""
        return self.rank % self.gpus_per_node

    @property
    def node_rank(self) -> int:
        return self.rank // self.gpus_per_node

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0

    # groups (global ranks); the *_groups forms list every group, in the order all ranks must create them
    @property
    def tp_groups(self) -> list[list[int]]:
        return [[p * self.tp_size + i for i in range(self.tp_size)] for p in range(self.pp_size)]

    @property
    def moe_ep_groups(self) -> list[list[int]]:
        # ranks sharing (pp_rank, moe_tp_rank); EP varies fastest
        return [
            [p * self.tp_size + t * self.moe_ep_size + e for e in range(self.moe_ep_size)]
            for p in range(self.pp_size)
            for t in range(self.moe_tp_size)
        ]

    @property
    def moe_tp_groups(self) -> list[list[int]]:
        # ranks sharing (pp_rank, moe_ep_rank)
        return [
            [p * self.tp_size + t * self.moe_ep_size + e for t in range(self.moe_tp_size)]
            for p in range(self.pp_size)
            for e in range(self.moe_ep_size)
        ]

    @property
    def tp_group(self) -> list[int]:
        return self.tp_groups[self.pp_rank]

    @property
    def moe_ep_group(self) -> list[int]:
        return self.moe_ep_groups[self.pp_rank * self.moe_tp_size + self.moe_tp_rank]

    @property
    def moe_tp_group(self) -> list[int]:
        return self.moe_tp_groups[self.pp_rank * self.moe_ep_size + self.moe_ep_rank]

    def ep_experts(self, num_experts: int) -> range:
        """Contiguous block of expert ids owned by this EP rank; requires num_experts % moe_ep_size == 0."""
        if num_experts % self.moe_ep_size != 0:
            raise ValueError(
                f"Mapping.ep_experts: {num_experts} experts are not divisible by moe_ep_size={self.moe_ep_size}"
            )
        return range(*split_range(num_experts, self.moe_ep_size, self.moe_ep_rank))

    split_range = staticmethod(split_range)

    def for_rank(self, rank: int) -> Mapping:
        """The same layout seen from another rank."""
        return dataclasses.replace(self, rank=rank)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Mapping:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"Mapping.from_dict: unknown keys {unknown}")
        return cls(**d)
