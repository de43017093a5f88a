"""KV-cache page accounting: byte figures of the real cache formats, hand-checked, and the page pool."""
from fractions import Fraction

import pytest

from dsflash.model_def import get_preset
from dsflash.serve.runtime.block_manager import (BlockManager, CacheLayout, cache_layout, kv_cache_capacity,
                                                 v4_entry_bytes, v41_entry_bytes)

GiB = 2 ** 30


def test_entry_formats():
    # V4.1: FP4 latent 256 packed + 32 e4m3 scales; FP4 index key 64 + 4 e8m0; FP8 window row 512 + 16 ue8m0
    assert v41_entry_bytes(512, 128) == (288, 68, 528)
    # V4: 448 e4m3 nope + 64 BF16 RoPE (128 B) + 7 ue8m0 + 1 pad; FP4 index key 68
    assert v4_entry_bytes(512, 64, 128) == (584, 68)
    # tiny: 96 nope + 32 BF16 RoPE (64 B) + 2 scales (blocks of 64, the last partial) = 162 -> 168
    assert v4_entry_bytes(128, 32, 64) == (168, 34)


def test_v41_full():
    """Sources 2, 8, 14 (ratio 2) and 20 (ratio 1), 356 B per entry: 3 x 356 / 2 + 356 = 890 B/token.
    Fixed: 40 layers x 128 rows x 528 B = 2,703,360; three ratio-2 open groups, 1 row x 512 x fp32 x (kv, gate) =
    4,096 each; Engram look-back 3 int32 ids = 12. Total 2,715,660 B = 47.7 blocks of 64 x 890 = 56,960 B -> 48."""
    lay = cache_layout(get_preset("v41", "full"))
    assert lay.bytes_per_token == 890
    assert lay.bytes_per_block == 56960
    assert dict(lay.fixed) == {"window": 2703360, "layers.2.partial_group": 4096, "layers.8.partial_group": 4096,
                               "layers.14.partial_group": 4096, "engram_history": 12}
    assert lay.fixed_bytes == 2715660 and lay.state_blocks == 48
    assert lay.blocks_for(1) == 49 and lay.blocks_for(64) == 49 and lay.blocks_for(65) == 50
    assert round(890 * 2 ** 20 / GiB, 2) == 0.87      # architecture.md §4.2: 0.87 GiB per 1M tokens


def test_v4_full():
    """21 CSA (r=4: 584 + 68 B per entry) and 20 HCA (r=128: 584 B) layers: 21 x 652/4 + 20 x 584/128 = 3,514.25
    B/token (architecture.md §4.1: 3,514). Fixed: window 43 x 128 x 584 = 3,214,336; CSA compressor fp32 kv+score
    2x[8,1024] = 65,536 plus its indexer's 2x[8,256] = 16,384 (x21); HCA 2x[128,512] = 524,288 (x20)."""
    lay = cache_layout(get_preset("v4", "full"))
    assert lay.bytes_per_token == Fraction(14057, 4)
    assert lay.bytes_per_block == 224912
    fixed = dict(lay.fixed)
    assert fixed["window"] == 3214336
    assert fixed["layers.2.compressor"] == 65536 and fixed["layers.2.indexer.compressor"] == 16384
    assert fixed["layers.3.compressor"] == 524288
    assert lay.fixed_bytes == 3214336 + 21 * 81920 + 20 * 524288 == 15420416
    assert lay.state_blocks == 69                        # 15,420,416 / 224,912 = 68.56
    assert round(float(lay.bytes_per_token) * 2 ** 20 / GiB, 2) == 3.43


def test_tiny_presets():
    """V4.1 tiny: sources 2, 4 (r=2) and 6 (r=1), 72 + 34 B per entry -> 212 B/token, 13,568 B/block; fixed 10 x 32
    x 132 + 2 x 1,024 + 12 = 44,300 B -> 4 blocks. V4 tiny: 2 x 202/4 + 2 x 168/128 = 103.625 B/token, 6,632 B/block;
    fixed 5 x 32 x 168 + 2 x (16,384 + 8,192) + 2 x 131,072 = 338,176 B -> 51 blocks."""
    a = cache_layout(get_preset("v41", "tiny"))
    assert (a.bytes_per_token, a.bytes_per_block, a.fixed_bytes, a.state_blocks) == (212, 13568, 44300, 4)
    b = cache_layout(get_preset("v4", "tiny"))
    assert (b.bytes_per_token, b.bytes_per_block, b.fixed_bytes, b.state_blocks) == (Fraction(829, 8), 6632, 338176, 51)
    assert cache_layout(get_preset("v41", "tiny"), block_size=16).bytes_per_block == 16 * 212


def small_pool(blocks: int) -> BlockManager:
    lay = CacheLayout("test", 4, (("kv", 1, 16),), (("state", 100),))   # 64 B blocks; state takes 2
    return BlockManager(lay, blocks * 64 + 63)


def test_pool_grows_block_by_block_and_frees():
    bm = small_pool(10)
    assert bm.total_blocks == 10 and bm.layout.state_blocks == 2
    assert bm.needed("a", 1) == 3 and bm.needed("a", 4) == 3 and bm.needed("a", 5) == 4
    t = bm.grow("a", 3)
    assert len(t) == 3 and bm.num_used == 3
    assert bm.grow("a", 4) == t and bm.num_used == 3          # same page
    bm.grow("a", 9)
    assert bm.num_used == 5 and bm.usage == 0.5
    bm.grow("b", 8)
    assert bm.num_free == 1 and not bm.can_hold("b", 9 + 4) and bm.can_hold("b", 12)
    assert not bm.can_hold("c", 1) and bm.can_hold("a", 13) and not bm.can_hold("a", 13, reserve=1)
    with pytest.raises(RuntimeError, match="exhausted"):
        bm.grow("c", 1)
    pages = set(bm.tables["a"]) | set(bm.tables["b"])
    assert len(pages) == 9                                     # no page handed out twice
    bm.free("a")
    bm.free("b")
    bm.free("never-allocated")
    assert bm.num_used == 0 and bm.usage == 0.0 and sorted(bm.free_ids) == list(range(10))


def test_pool_too_small_for_one_request():
    with pytest.raises(ValueError, match="one request needs at least 3"):
        small_pool(2)


def test_capacity():
    assert kv_cache_capacity(12345) == 12345
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        kv_cache_capacity(0)
    with pytest.raises(ValueError, match="fraction"):
        kv_cache_capacity(None, 1.5)
    assert 0 < kv_cache_capacity(None, 0.5) < kv_cache_capacity(None, 1.0)


@pytest.mark.gpu
def test_capacity_from_free_gpu_memory():
    import torch
    free, _ = torch.cuda.mem_get_info()
    assert 0.45 * free <= kv_cache_capacity(None, 0.5, "cuda") <= 0.55 * free
