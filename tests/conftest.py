"""Shared test setup: fixed seeds, `gpu`-marked tests skipped on machines without CUDA (but for `interpret`-marked
ones under Triton's interpreter), and `--shard I/N`."""

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


class _PartialSums:
    """The comm of one TP rank on its own: reductions are left out, so a plugin and its reference see the same
    partial sums (`partial_sums` fixture)."""

    def __init__(self, tp: int, rank: int):
        self.tp_size, self.tp_rank = tp, rank

    def all_reduce(self, x):
        return x


@pytest.fixture
def v41_site_kinds() -> set[str]:
    """The site kinds `build.bind.site_parity` reports for a V4.1 sm90 engine with every plugin bound."""
    return {"gemm", "gemm_w13", "gemm_qkv_a", "moe", "mhc", "wo_a", "norm", "norm_pair", "swiglu"}


@pytest.fixture
def partial_sums() -> type:
    """`partial_sums(tp, rank)`: a comm for loading one rank of a TP engine without its peers."""
    return _PartialSums


@pytest.fixture(scope="module")
def hopper_ckpt(tmp_path_factory):
    """A tiny synthetic V4.1 checkpoint converted to the hopper layout."""
    from dsflash.convert.synth import synthesize
    from dsflash.convert.writer import convert
    from dsflash.model_def import get_preset
    root = tmp_path_factory.mktemp("plug")
    hf = synthesize(get_preset("v41", "tiny"), root / "hf", seed=5)
    convert(hf, root / "hop", "hopper", progress=False, log=lambda *a: None)
    return root / "hop"


@pytest.fixture(scope="module")
def sm90_engine(hopper_ckpt):
    """A tiny sm90 engine of `hopper_ckpt` with every plugin."""
    from dsflash.build.engine import write_engine
    from dsflash.build.plan import BuildConfig
    from dsflash.model_def.mapping import Mapping
    return write_engine(hopper_ckpt, hopper_ckpt.parent / "eng", Mapping(world_size=1, tp_size=1), "sm90",
                        BuildConfig(), progress=False)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--shard", default=None, metavar="I/N",
                     help="run only slice I of N (1-based) of the collected tests, dealt round robin in collection "
                          "order: `make test-gpu SHARD=1/4` and so on, so that each run fits a time-limited job")


def _shard(spec: str) -> tuple[int, int]:
    try:
        i, n = (int(v) for v in spec.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--shard expects I/N with integers, got {spec!r}") from None
    if not 1 <= i <= n:
        raise pytest.UsageError(f"--shard {spec}: I must be in 1..N")
    return i, n


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    spec = config.getoption("--shard")
    if spec:
        i, n = _shard(spec)
        keep, drop = items[i - 1::n], [item for k, item in enumerate(items) if k % n != i - 1]
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    from dsflash.plugins.kernel_device import interpreting
    if interpreting():
        # Triton's interpreter runs the `interpret`-marked (small) kernel cases on CPU tensors; the rest need a GPU
        gpu_items = [item for item in gpu_items if item.get_closest_marker("interpret") is None]
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
