"""Mapping: the worked examples of model_def/mapping.py's docstring, plus the error cases."""

from __future__ import annotations

import doctest

import pytest

import dsflash.model_def.mapping as mapping_module
from dsflash.model_def.mapping import Mapping, split_range


def test_docstring_examples_run():
    result = doctest.testmod(mapping_module, verbose=False)
    assert result.attempted > 0
    assert result.failed == 0


def test_tp8_default_moe_split():
    m = Mapping(world_size=8, rank=5, tp_size=8)
    assert (m.moe_tp_size, m.moe_ep_size) == (8, 1)
    assert (m.tp_rank, m.moe_tp_rank, m.moe_ep_rank) == (5, 5, 0)
    assert m.ep_experts(384) == range(0, 384)
    assert m.moe_ep_group == [5]
    assert m.moe_tp_group == list(range(8))


def test_tp8_moe_ep4():
    m = Mapping(world_size=8, rank=5, tp_size=8, moe_ep_size=4)
    assert m.moe_tp_size == 2
    assert (m.tp_rank, m.moe_ep_rank, m.moe_tp_rank) == (5, 1, 1)
    assert m.tp_group == [0, 1, 2, 3, 4, 5, 6, 7]
    assert m.moe_ep_group == [4, 5, 6, 7]
    assert m.moe_tp_group == [1, 5]
    # TRT-LLM Mapping docstring: EP groups [0..3],[4..7]; moe_tp groups [0,4],[1,5],[2,6],[3,7]
    assert m.moe_ep_groups == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert m.moe_tp_groups == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert m.ep_experts(384) == range(96, 192)
    assert [m.for_rank(r).ep_experts(384).start for r in range(8)] == [0, 96, 192, 288] * 2


def test_tp8_pure_ep():
    m = Mapping(world_size=8, rank=5, tp_size=8, moe_ep_size=8)
    assert m.moe_tp_size == 1
    assert m.ep_experts(384) == range(240, 288)


def test_moe_tp_given_derives_moe_ep():
    m = Mapping(world_size=8, rank=0, tp_size=8, moe_tp_size=2)
    assert m.moe_ep_size == 4


def test_trtllm_minus_one_means_unset():
    m = Mapping(world_size=4, rank=0, tp_size=4, moe_tp_size=-1, moe_ep_size=-1)
    assert (m.moe_tp_size, m.moe_ep_size) == (4, 1)


def test_groups_are_consistent_over_all_ranks():
    base = Mapping(world_size=8, tp_size=8, moe_ep_size=4)
    for r in range(8):
        m = base.for_rank(r)
        assert m.rank == r and m.moe_ep_size == 4
        assert r in m.tp_group and r in m.moe_ep_group and r in m.moe_tp_group
        assert m.moe_ep_group.index(r) == m.moe_ep_rank
        assert m.moe_tp_group.index(r) == m.moe_tp_rank
        assert m.tp_rank == m.moe_tp_rank * m.moe_ep_size + m.moe_ep_rank
    # every expert is owned by exactly one EP rank of a moe_tp slice
    owned = sorted(e for r in base.moe_ep_groups[0] for e in base.for_rank(r).ep_experts(384))
    assert owned == list(range(384))


def test_single_rank_defaults():
    m = Mapping()
    assert (m.world_size, m.rank, m.tp_size, m.moe_tp_size, m.moe_ep_size) == (1, 0, 1, 1, 1)
    assert m.is_first_rank and m.tp_group == [0] and m.ep_experts(7) == range(0, 7)


def test_local_and_node_rank():
    m = Mapping(world_size=16, rank=11, tp_size=16)
    assert (m.local_rank, m.node_rank) == (3, 1)
    assert not m.is_first_rank


def test_dict_round_trip():
    m = Mapping(world_size=8, rank=3, tp_size=8, moe_ep_size=4)
    d = m.to_dict()
    assert d == {
        "world_size": 8, "rank": 3, "tp_size": 8, "moe_tp_size": 2, "moe_ep_size": 4,
        "pp_size": 1, "gpus_per_node": 8,
    }
    assert Mapping.from_dict(d) == m
    with pytest.raises(ValueError, match="unknown keys"):
        Mapping.from_dict({**d, "cp_size": 1})


def test_split_range():
    assert split_range(2304, 8, 0) == (0, 288)
    assert split_range(2304, 8, 3) == (864, 1152)
    assert Mapping.split_range(10, 2, 1) == (5, 10)
    with pytest.raises(ValueError, match="not divisible"):
        split_range(10, 3, 0)
    with pytest.raises(ValueError, match="out of range"):
        split_range(10, 2, 2)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(world_size=8, tp_size=4), "tp_size \\* pp_size must equal world_size"),
        (dict(world_size=8, tp_size=8, moe_tp_size=2, moe_ep_size=2), "moe_tp_size \\* moe_ep_size must equal tp_size"),
        (dict(world_size=8, tp_size=8, moe_ep_size=3), "not divisible by moe_ep_size=3"),
        (dict(world_size=8, tp_size=8, moe_tp_size=3), "not divisible by moe_tp_size=3"),
        (dict(world_size=8, rank=8, tp_size=8), "rank must be in \\[0, 8\\)"),
        (dict(world_size=8, rank=-1, tp_size=8), "rank must be in"),
        (dict(world_size=8, tp_size=4, pp_size=2), "pp_size=2 is not supported"),
        (dict(world_size=0, tp_size=0), "world_size must be >= 1"),
        (dict(world_size=2, tp_size=2, moe_ep_size=0), "moe_ep_size must be a positive int"),
    ],
)
def test_invalid_mappings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Mapping(**kwargs)


def test_ep_experts_not_divisible():
    with pytest.raises(ValueError, match="not divisible by moe_ep_size=4"):
        Mapping(world_size=8, rank=0, tp_size=8, moe_ep_size=4).ep_experts(10)


def test_is_pure_python():
    import ast
    from pathlib import Path

    tree = ast.parse(Path(mapping_module.__file__).read_text())
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")])
    }
    assert not imported & {"torch", "mpi4py", "numpy", "triton"}
