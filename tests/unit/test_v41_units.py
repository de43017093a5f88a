"""DeepSeek-V4.1 name table against the released checkpoint's inventory (architecture.md §3.3), model/table parity,
and tensor-parallel local shapes."""
import math

import pytest

from dsflash.model_def import build_model
from dsflash.model_def.config import get_preset
from dsflash.model_def.mapping import Mapping, split_rows
from dsflash.model_def.v41 import tensor_table

GIB = 2 ** 30


@pytest.fixture(scope="module")
def full_table():
    return {e.name: e for e in tensor_table(get_preset("v41", "full"))}


def _disk_bytes(entry) -> int:
    return sum(math.prod(shape) * {"BF16": 2, "F32": 4, "I64": 8, "I8": 1, "F8_E4M3": 1, "F8_E8M0": 1}[dt]
               for shape, dt in entry.stored(32).values())


def test_full_table_matches_the_released_inventory(full_table):
    t = full_table
    experts = [e for e in t.values() if e.role == "mxfp4"]
    assert len(experts) == 47232                      # 40 x 384 x 3 + 3 x 128 x 3 routed expert weights
    dense = sum(_disk_bytes(e) for e in t.values() if e.role == "fp8_block") / GIB
    assert abs(dense - 6.9) < 0.01                    # "DENSE ... 6.9 GiB" (main_proj FP8 included)
    big = sum(_disk_bytes(e) for e in t.values() if e.role in ("mxfp4", "fp8_rows32")) / GIB
    assert abs(big - 464.5) < 0.05                    # "with Engram: 464.5 GiB"
    assert sum(len(e.stored(32)) for e in t.values()) == 95819  # + vision/aligner/image_* = 96,085 on disk
    for bad in ("ape", "hc_head", "tid2eid", "e_proj", "h_proj", "vision.", "aligner."):
        assert not [n for n in t if bad in n], bad
    assert "layers.20.attn.compressor.wgate.weight" not in t
    assert sorted({int(n.split(".")[1]) for n in t if ".attn.compressor." in n}) == [2, 8, 14, 20]
    assert sorted({int(n.split(".")[1]) for n in t if ".indexer.wk." in n}) == [2, 8, 14, 20]
    assert sorted({int(n.split(".")[1]) for n in t if ".indexer.wq_b." in n}) == [2, 8, 14, 20, 24, 28, 32, 36]
    assert sorted({int(n.split(".")[1]) for n in t if ".engram." in n and n.startswith("layers.")}) == [1, 14]


@pytest.mark.parametrize("name,shape,role", [
    ("embed.weight", (129280, 5120), "bf16"),
    ("head.weight", (129280, 5120), "bf16"),
    ("layers.5.attn.wq_a.weight", (1280, 5120), "fp8_block"),
    ("layers.5.attn.wq_b.weight", (32768, 1280), "fp8_block"),
    ("layers.5.attn.wkv.weight", (512, 5120), "fp8_block"),
    ("layers.5.attn.wo_a.weight", (8192, 4096), "fp8_block"),
    ("layers.5.attn.wo_b.weight", (5120, 8192), "fp8_block"),
    ("layers.5.attn.attn_sink", (64,), "f32"),
    ("layers.5.hc_attn_fn", (24, 20480), "f32"),
    ("layers.5.hc_ffn_scale", (3,), "f32"),
    ("layers.8.attn.compressor.wkv.weight", (512, 5120), "bf16"),
    ("layers.8.attn.compressor.wgate.weight", (512, 5120), "bf16"),
    ("layers.20.attn.compressor.norm.weight", (512,), "bf16"),
    ("layers.24.attn.indexer.wq_b.weight", (4096, 1280), "fp8_block"),
    ("layers.24.attn.indexer.weights_proj.weight", (32, 5120), "bf16"),
    ("layers.20.attn.indexer.wk.weight", (128, 512), "bf16"),
    ("layers.20.attn.indexer.k_norm.weight", (128,), "bf16"),
    ("layers.7.ffn.gate.weight", (384, 5120), "bf16"),
    ("layers.7.ffn.gate.bias", (384,), "f32"),
    ("layers.7.ffn.gate.bias_vl", (384,), "f32"),
    ("layers.7.ffn.experts.383.w1.weight", (2304, 5120), "mxfp4"),
    ("layers.7.ffn.experts.0.w2.weight", (5120, 2304), "mxfp4"),
    ("layers.7.ffn.shared_experts.w2.weight", (5120, 2304), "fp8_block"),
    ("layers.14.engram.wkv.weight", (25600, 6144), "fp8_block"),
    ("layers.14.engram.q_weight", (4, 5120), "bf16"),
    ("layers.1.engram.embed.weight", (384006168, 256), "fp8_rows32"),
    ("mtp.0.main_proj.weight", (5120, 15360), "fp8_block"),
    ("mtp.0.main_norm.weight", (5120,), "bf16"),
    ("mtp.1.ffn.experts.127.w3.weight", (2304, 5120), "mxfp4"),
    ("mtp.2.norm.weight", (5120,), "bf16"),
    ("mtp.2.markov_head.embed.weight", (129280, 256), "bf16"),
    ("mtp.2.markov_head.head.weight", (129280, 256), "bf16"),
    ("mtp.2.confidence_head.proj.weight", (1, 5376), "bf16"),
])
def test_full_table_names_shapes_roles(full_table, name, shape, role):
    e = full_table[name]
    assert (e.shape, e.role) == (shape, role)


def test_expert_on_disk_layout(full_table):
    st = full_table["layers.3.ffn.experts.9.w1.weight"].stored(32)
    assert st == {"layers.3.ffn.experts.9.w1.weight": ((2304, 2560), "I8"),
                  "layers.3.ffn.experts.9.w1.scale": ((2304, 160), "F8_E8M0")}
    st = full_table["layers.3.ffn.experts.9.w2.weight"].stored(32)
    assert st["layers.3.ffn.experts.9.w2.scale"] == ((5120, 72), "F8_E8M0")
    assert "mtp.0.ffn.experts.128.w1.weight" not in full_table and "mtp.1.main_proj.weight" not in full_table
    assert "mtp.0.markov_head.embed.weight" not in full_table


@pytest.mark.parametrize("preset", ["tiny", "tiny-wide"])
def test_model_parameters_are_the_table(preset):
    args = get_preset("v41", preset)
    model = build_model(args, device="meta")
    params = {n: tuple(p.shape) for n, p in model.named_parameters()}
    table = {e.name: e.shape for e in tensor_table(args)}
    assert params == table


class _FakeComm:
    def __init__(self, tp, rank):
        self.tp_size, self.tp_rank = tp, rank

    def all_reduce(self, x):
        return x


def _local_shape(entry, m: Mapping, n_experts_total: int):
    s = list(entry.shape)
    if entry.shard in ("col", "head"):
        s[0] //= m.tp_size
    elif entry.shard == "row":
        s[1] //= m.tp_size
    elif entry.shard == "rows":
        start, stop = split_rows(s[0], m.tp_size, m.tp_rank)
        s[0] = stop - start
    elif entry.shard == "expert":
        e = int(entry.name.split(".experts.")[1].split(".")[0])
        if e not in m.ep_experts(n_experts_total):
            return None
        s[1 if entry.name.endswith("w2.weight") else 0] //= m.moe_tp_size
    return tuple(s)


@pytest.mark.parametrize("tp,moe_ep", [(2, 1), (2, 2), (4, 2)])
def test_tensor_parallel_local_shapes(tp, moe_ep):
    args = get_preset("v41", "tiny-wide").replace(index_n_heads=8, dspark_n_routed_experts=4)
    for rank in range(tp):
        m = Mapping(world_size=tp, rank=rank, tp_size=tp, moe_ep_size=moe_ep)
        model = build_model(args, mapping=m, comm=_FakeComm(tp, rank), device="meta")
        params = {n: tuple(p.shape) for n, p in model.named_parameters()}
        expect = {}
        for e in tensor_table(args):
            n_exp = args.dspark_n_routed_experts if e.name.startswith("mtp.") else args.n_routed_experts
            shape = _local_shape(e, m, n_exp)
            if shape is not None:
                expect[e.name] = shape
        assert params == expect, (tp, moe_ep, rank)
