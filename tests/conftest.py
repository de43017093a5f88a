"""Shared test setup: fixed seeds, and `gpu`-marked tests skipped on machines without CUDA."""

from __future__ import annotations

import random

import pytest


@pytest.fixture
def seed() -> int:
    """Seed Python's and torch's RNGs with a fixed value; returns it."""
    import torch

    value = 0
    random.seed(value)
    torch.manual_seed(value)
    return value


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """Tiny models are op-overhead bound: extra intra-op threads only add contention on the 2-core CI machine."""
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
