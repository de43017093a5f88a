"""Layout formats: each transform checked against its written definition, and every layout round-trips exactly."""
import pytest
import torch

from dsflash.convert import formats as F
from dsflash.convert import layouts as L
from dsflash.convert.synth import encode
from dsflash.model_def import quant as Q
from dsflash.model_def.config import get_preset
from dsflash.model_def.names import TensorEntry, tensor_table


def _bytes(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8) if x.element_size() == 1 else x


# -- Blackwell 128×4 scale swizzle -------------------------------------------------------------------------------------
@pytest.mark.parametrize("rows,cols", [(300, 9), (128, 4), (1, 1), (256, 160)])
def test_swizzle_matches_written_offsets(rows, cols):
    x = torch.randint(0, 255, (rows, cols), dtype=torch.uint8)
    sw = F.swizzle_mx_scales(x.view(Q.E8M0))
    rp, cp = F.swizzled_shape(rows, cols)
    assert tuple(sw.shape) == (rp, cp) and rp % 128 == 0 and cp % 4 == 0
    flat = sw.view(torch.uint8).reshape(-1)
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    off = ((r // 128) * (cp // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
    assert torch.equal(flat[off.reshape(-1)], x.reshape(-1))
    assert int(flat.sum()) == int(x.sum())  # padding bytes are zero
    assert torch.equal(F.unswizzle_mx_scales(sw, rows, cols).view(torch.uint8), x)


# -- block scales -> 1×32 ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape,block", [((96, 160), 32), ((100, 192), 32), ((200, 160), 128), ((64, 128), 128)])
def test_expand_block_scales_is_exact(shape, block):
    q, s = Q.quant_fp8_block(torch.randn(shape) * 0.05, block)
    mx = F.expand_block_scales(s, *shape, block)
    assert tuple(mx.shape) == (shape[0], shape[1] // 32)
    as_mx = q.float() * Q.e8m0_decode(mx).repeat_interleave(32, 1)
    assert torch.equal(as_mx, Q.dequant_fp8_block(q, s, block))
    assert torch.equal(F.collapse_mx_scales(mx, block).view(torch.uint8), s.view(torch.uint8))


# -- MXFP4 -> FP8 widening ---------------------------------------------------------------------------------------------
def test_widen_hand_example():
    # one 32x32 tile: row 0 has scale 2^0 and value 6, row 1 scale 2^-3 and value 0.5 -> S = 2^-6
    codes = torch.zeros(32, 32, dtype=torch.uint8)
    codes[0, 0], codes[1, 5] = 7, 1           # e2m1 6.0 and 0.5
    scale = torch.full((32, 1), 127 - 3, dtype=torch.uint8)
    scale[0, 0] = 127
    q, s = F.widen_mxfp4_to_fp8(Q.pack_fp4(codes), scale.view(Q.E8M0), 32)
    assert Q.e8m0_decode(s).tolist() == [[2.0 ** -6]]
    assert q.float()[0, 0] == 384.0 and q.float()[1, 5] == 0.5 * 2 ** 3
    assert torch.equal(Q.dequant_fp8_block(q, s, 32), Q.dequant_mxfp4(Q.pack_fp4(codes), scale.view(Q.E8M0)))


@pytest.mark.parametrize("shape,tile", [((96, 160), 32), ((64, 128), 128), ((200, 320), 128)])
def test_widen_random_is_exact(shape, tile):
    w = torch.randn(shape) * torch.logspace(-3, 0, shape[1])  # scales spread along K inside each tile
    p, s = Q.quant_mxfp4(w)
    q, ts = F.widen_mxfp4_to_fp8(p, s, tile)
    assert q.float().abs().max() <= 384
    assert torch.equal(Q.dequant_fp8_block(q, ts, tile), Q.dequant_mxfp4(p, s))


def test_widen_refuses_inexact_tile():
    codes = torch.ones(32, 32, dtype=torch.uint8)           # all 0.5
    scale = torch.full((32, 1), 127 - 20, dtype=torch.uint8)
    scale[0, 0] = 127                                       # spread 2^20 > 2^14
    with pytest.raises(F.FormatError, match="not exact"):
        F.widen_mxfp4_to_fp8(Q.pack_fp4(codes), scale.view(Q.E8M0), 32)


# -- Hopper tiles and Marlin packing -----------------------------------------------------------------------------------
def test_tile_blocks_definition_and_inverse():
    x = torch.arange(70 * 100, dtype=torch.float32).reshape(70, 100).to(torch.bfloat16)
    t = F.tile_blocks(x, 32)
    assert tuple(t.shape) == (3, 4, 32, 32)
    assert torch.equal(t[1, 2], x[32:64, 64:96]) and torch.equal(t[2, 3, :6, :4], x[64:70, 96:100])
    assert float(t[2, 3, 6:].float().abs().sum()) == 0.0
    assert torch.equal(F.untile_blocks(t, 70, 100), x)


def test_marlin_lane_fragments():
    """Lane t of tile (i, j) holds B[k, n] of the mma.m16n8k16 fragments; (word >> 4i) & 0x000F000F: pair (2i, 2i+1)."""
    n, k = 64, 96
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scale = torch.randint(100, 140, (n, k // 32), dtype=torch.uint8).view(Q.E8M0)
    words, sp = F.marlin_pack_mxfp4(Q.pack_fp4(codes), scale)
    assert tuple(words.shape) == (2, 3, 128) and words.dtype == torch.int32 and tuple(sp.shape) == (2, 3, 32)
    for ti, tj in [(0, 0), (1, 2)]:
        for lane in (0, 5, 31):
            g, q = divmod(lane, 4)
            frag = []  # the lane's values in mma order: k16 step, n8 block, then b0 b1 b2 b3
            for ks in range(2):
                for jb in range(4):
                    for kk in (2 * q, 2 * q + 1, 2 * q + 8, 2 * q + 9):
                        frag.append(int(codes[32 * ti + 8 * jb + g, 32 * tj + 16 * ks + kk]))
            got = []
            for w in range(4):
                word = int(words[ti, tj, 4 * lane + w]) & 0xFFFFFFFF
                for i in range(4):
                    pair = (word >> (4 * i)) & 0x000F000F
                    got += [pair & 0xF, pair >> 16]
            assert got == frag
        for g in range(8):
            for jb in range(4):
                assert sp.view(torch.uint8)[ti, tj, 4 * g + jb] == scale.view(torch.uint8)[32 * ti + 8 * jb + g, tj]
    p2, s2 = F.marlin_unpack_mxfp4(words, sp)
    assert torch.equal(Q.unpack_fp4(p2), codes) and torch.equal(s2.view(torch.uint8), scale.view(torch.uint8))


def test_bf16_copy_is_exact():
    q, s = Q.quant_fp8_block(torch.randn(64, 96), 32)
    assert torch.equal(F.fp8_block_to_bf16(q, s, 32).float(), Q.dequant_fp8_block(q, s, 32))


# -- every role through every layout (hand-made table; the real families run in tests/e2e/test_convert.py) -------------
def _hand_table(ragged: bool) -> list[TensorEntry]:
    dense = (160, 192) if ragged else (96, 128)
    return [
        TensorEntry("embed.weight", (50, 64), "bf16", "embed"),
        TensorEntry("layers.0.hc_attn_fn", (24, 256), "f32", "hc_fn"),
        TensorEntry("layers.0.ffn.gate.tid2eid", (50, 2), "i64", "tid2eid"),
        TensorEntry("layers.0.attn.wq_a.weight", dense, "fp8_block", "linear"),
        TensorEntry("mtp.0.attn.wq_a.weight", dense, "fp8_block", "linear"),
        TensorEntry("layers.0.ffn.experts.0.w1.weight", (64, 160), "mxfp4", "linear", "expert"),
        TensorEntry("layers.0.ffn.experts.0.w2.weight", (160, 64), "mxfp4", "linear", "expert"),
        TensorEntry("layers.1.engram.embed.weight", (40, 64), "fp8_rows32", "small", "rows"),
    ]


@pytest.mark.parametrize("family", ["v41", "v4"])
@pytest.mark.parametrize("layout", L.LAYOUTS)
@pytest.mark.parametrize("expert_dtype", L.EXPERT_DTYPES)
def test_hand_table_round_trip(family, layout, expert_dtype, seed):
    args = get_preset(family, "tiny").replace(n_routed_experts=4)
    for entry in _hand_table(ragged=family == "v4"):
        if entry.init == "tid2eid":
            value = torch.randint(0, 4, entry.shape)
        else:
            value = torch.randn(entry.shape) * (0.05 if entry.init == "linear" else 1.0)
        hf = encode(entry, value, args)
        ref = {n: t for n, t in hf.items()}
        outs = L.outputs(entry, layout, expert_dtype, args)
        assert len({o.name for o in outs}) == len(outs)
        ours = {o.name: hf[o.source] for o in outs if o.source is not None}
        ours.update(L.compute(entry, hf, layout, expert_dtype, args))
        assert set(ours) == {o.name for o in outs} == set(L.stored_names(entry, layout, expert_dtype, args))
        for o in outs:
            assert tuple(ours[o.name].shape) == o.shape and L.DTYPE_NAMES[ours[o.name].dtype] == o.dtype, o
            base = entry.name.removesuffix(".weight")
            assert o.name == entry.name if o.kind == L.PLAIN else o.name == base + L.SUFFIXES[o.kind]
        want = value if entry.role == "i64" else _hf_value(entry, hf, args)
        assert torch.equal(L.dequantize(entry, ours, layout, expert_dtype, args), want), entry.name
        back = L.to_reference(entry, ours, layout, expert_dtype, args)
        if entry.role == "mxfp4" and expert_dtype == "fp8":
            assert torch.equal(Q.dequant_mxfp4(back[entry.name], back[entry.scale_name]), want)
        else:
            assert set(back) == set(ref)
            for n, t in back.items():
                assert t.dtype == ref[n].dtype and torch.equal(_bytes(t), _bytes(ref[n])), n
        if layout == "hopper" and L.bf16_cache_eligible(entry, args):
            assert torch.equal(ours[L.name_of(entry, "weight_bf16")].float(), want)


def _hf_value(entry: TensorEntry, hf: dict, args) -> torch.Tensor:
    t = hf[entry.name]
    if entry.role in ("bf16", "f32"):
        return t.float()
    s = hf[entry.scale_name]
    if entry.role == "fp8_block":
        return Q.dequant_fp8_block(t, s, args.weight_block)
    if entry.role == "mxfp4":
        return Q.dequant_mxfp4(t, s)
    return Q.dequant_fp8_rows32(t, s)


def test_unknown_layout_and_expert_dtype():
    e = _hand_table(False)[3]
    args = get_preset("v41", "tiny")
    with pytest.raises(ValueError, match="unknown layout 'ampere'"):
        L.outputs(e, "ampere", "fp4", args)
    with pytest.raises(ValueError, match="unknown expert dtype 'int4'"):
        L.outputs(e, "hopper", "int4", args)


# -- BF16 cache rule ---------------------------------------------------------------------------------------------------
def test_bf16_cache_rule_matches_seed_memory_growth():
    """Full V4.1-Flash at TP8: the cache costs 2.70 GiB per rank (seed: 72.71 -> 75.43 GB, SGLang GB = 2^30 bytes)."""
    args = get_preset("v41", "full")
    table = tensor_table(args)
    per_rank = L.bf16_cache_bytes_per_rank(table, args, tp=8) / 2 ** 30
    assert abs(per_rank - (75.43 - 72.71)) < 0.05, per_rank
    everything = sum(e.shape[0] * e.shape[1] * 2 // (8 if e.shard in ("col", "row", "head") else 1)
                     for e in table if e.role == "fp8_block") / 2 ** 30
    assert everything > 3.0  # caching every dense FP8 weight would overshoot the seed's figure
    eligible = [e for e in table if L.bf16_cache_eligible(e, args)]
    assert eligible and all(e.role == "fp8_block" and e.name.startswith("layers.") for e in eligible)
    assert not any(L.bf16_cache_eligible(e, get_preset("v4", "full")) for e in tensor_table(get_preset("v4", "full")))
