"""The TP-rank simulation's parts: the counted no-op all-reduce and the measured-cost table."""
import json
import math
import time

import pytest
import torch

from dsflash.model_def.layers import SimulatedComm
from dsflash.model_def.mapping import Mapping
from dsflash.serve.bench.collectives import CollectiveCost, CostTableError


def test_simulated_all_reduce_is_a_counted_no_op_on_the_fp32_message():
    waited = []
    comm = SimulatedComm(Mapping(world_size=8, rank=3, tp_size=8), wait=waited.append)
    x = torch.randn(3, 5, dtype=torch.bfloat16)
    y = comm.all_reduce(x)
    assert y.dtype == torch.bfloat16 and torch.equal(y, x)
    comm.all_reduce(torch.randn(7))
    assert (comm.tp_size, comm.tp_rank) == (8, 3)
    assert comm.counts.calls == 2 and comm.counts.by_size == {60: 1, 28: 1} and comm.counts.bytes == 88
    assert waited == [60, 28]
    one = SimulatedComm(Mapping())
    assert one.all_reduce(x) is x and one.counts.calls == 0


def test_cost_is_interpolated_in_log_log_and_extrapolated_by_bandwidth():
    c = CollectiveCost([(4096, 20.0), (1024, 10.0), (65536, 80.0)])
    assert c.us(512) == 10.0 and c.us(1024) == 10.0 and c.us(4096) == pytest.approx(20.0)
    assert c.us(2048) == pytest.approx(math.sqrt(10.0 * 20.0))           # halfway in log size
    assert c.us(131072) == pytest.approx(160.0)                         # the largest size's bandwidth
    t0 = time.perf_counter()
    c.wait(1024)
    assert time.perf_counter() - t0 >= 10e-6 and c.waited_us == 10.0


@pytest.mark.parametrize("text, msg", [
    (None, "collective-cost file not found"),
    ("{", "not valid JSON"),
    ('{"points": []}', "expected an object with all_reduce_us"),
    ('{"all_reduce_us": [[1024]]}', r"\[bytes, µs\] pairs"),
    ('{"all_reduce_us": [[1024, 0]]}', "bytes > 0, µs > 0"),
    ('{"all_reduce_us": []}', "bytes > 0, µs > 0"),
])
def test_bad_cost_files_name_the_file(tmp_path, text, msg):
    path = tmp_path / "cost.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(CostTableError, match=msg) as e:
        CollectiveCost.load(path)
    assert str(path) in str(e.value)


def test_cost_file_round_trip(tmp_path):
    path = tmp_path / "cost.json"
    path.write_text(json.dumps({"backend": "nccl", "world_size": 2, "all_reduce_us": [[1024, 12.5], [1 << 20, 30]]}))
    c = CollectiveCost.load(path)
    assert c.meta == {"backend": "nccl", "world_size": 2} and c.source == str(path) and c.us(1 << 20) == 30.0
