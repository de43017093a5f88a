"""Lossless weight-format transforms used by `convert` (and by `build` to re-pad sharded tensors), in plain torch.

Every function here re-lays or widens already-quantized data; none of them rounds. Each raises `FormatError`
rather than return a tensor that would dequantize to anything but the input's exact values.

- `expand_block_scales`: e8m0 b×b block scales (b = 32 or 128) -> e8m0 1×32 scales along K (MXFP8). Exact: every
  1×32 group lies inside one b×b block, so it inherits that block's scale.
- `swizzle_mx_scales` / `unswizzle_mx_scales`: the 128×4 tiled scale layout read by Blackwell block-scaled MMA.
- `widen_mxfp4_to_fp8`: MXFP4 (e2m1 + e8m0 per 1×32) -> FP8 e4m3 + one e8m0 scale per t×t tile
  (architecture.md §3.2: S = max(sub-scales) / 2^6, value = e2m1 · s/S, a power of two <= 2^6, so |value| <= 384).
- `tile_blocks` / `untile_blocks`: [N, K] -> [ceil(N/b), ceil(K/b), b, b] block-contiguous tiles (Hopper FP8).
- `marlin_pack_mxfp4` / `marlin_unpack_mxfp4`: MXFP4 in the register-fragment order of `mma.sync.m16n8k16` (Hopper
  MXFP4-weight × BF16-activation MoE kernel).
- `fp8_block_to_bf16`: the BF16 copy of a block-scaled FP8 weight (exact: e4m3 has 3 mantissa bits, BF16 has 7).

Why not nvidia-modelopt (0.47.0 was downloaded and read, not installed): its MXFP4/MXFP8/FP8 `QTensor` classes
quantize real-valued weights, while convert only re-lays data that is already quantized, and the pieces we need
are not public there: no FP4->FP8 widening, no block-scale expansion, no Marlin packing, and the 128×4 scale
swizzle exists only as a helper nested inside `modelopt.torch.export.diffusers_utils.swizzle_nvfp4_scales` (a
state-dict pass for NVFP4 names). Importing `modelopt.torch.quantization.qtensor` also imports the whole
quantization package (pydantic configs, plugins, modes) and the wheel hard-requires scipy, pulp, omegaconf,
ninja and nvidia-ml-py, none of which this CPU-only stage otherwise needs. Its rounding also differs from the
checkpoint's: `MXFP4QTensor.quantize` sends e2m1 ties down (0.75 -> 0.5, 1.75 -> 1.5, 3.5 -> 3; we and the
DeepSeek kernels round to nearest even) and takes scales from float `log2` rather than the fp32 bit pattern, so
it could not reproduce `model_def/quant.py` bit for bit where quantization is needed (synthetic checkpoints).
"""
from __future__ import annotations

import functools

import torch

from dsflash.model_def.quant import (E4M3, E8M0, dequant_fp8_block, dequant_mxfp4, e8m0_decode, e8m0_encode, pack_fp4,
                                     unpack_fp4)

MX_GROUP = 32            # elements per MX scale along K
SWIZZLE_ROWS = 128       # rows per Blackwell scale tile
SWIZZLE_COLS = 4         # scale columns (4 × 32 = 128 elements of K) per Blackwell scale tile
MARLIN_TILE = 32         # Hopper MXFP4 tile: 32 (N) × 32 (K), i.e. one MX scale group along K
WIDEN_HEADROOM = 6       # S = max(sub-scales) / 2^6: e2m1 max 6 · 2^6 = 384 <= 448


class FormatError(ValueError):
    """A tensor that cannot be converted exactly (callers prefix the file and tensor name)."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _as_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)


# -- block scales -> MX (1×32 along K) ------------------------------------------------------------------------------
def expand_block_scales(scale: torch.Tensor, n: int, k: int, block: int) -> torch.Tensor:
    """e8m0 [ceil(n/b), ceil(k/b)] -> e8m0 [n, k/32]: each 1×32 group of K takes the scale of its b×b block."""
    if block % MX_GROUP or k % MX_GROUP:
        raise FormatError(f"cannot expand {block}x{block} block scales to 1x{MX_GROUP}: K={k} and the block must be "
                          f"multiples of {MX_GROUP}")
    if tuple(scale.shape) != (cdiv(n, block), cdiv(k, block)):
        raise FormatError(f"scale shape {list(scale.shape)} does not match [{n}, {k}] with {block}x{block} blocks")
    b = _as_bytes(scale)
    out = b.repeat_interleave(block, 0)[:n].repeat_interleave(block // MX_GROUP, 1)[:, : k // MX_GROUP]
    return out.contiguous().view(E8M0)


def collapse_mx_scales(scale: torch.Tensor, block: int) -> torch.Tensor:
    """Inverse of `expand_block_scales` (e8m0 [n, k/32] -> [ceil(n/b), ceil(k/b)]); refuses non-uniform blocks."""
    b = _as_bytes(scale)
    n, g = b.shape
    per = block // MX_GROUP
    pick = b[::block, ::per]
    if not torch.equal(pick.repeat_interleave(block, 0)[:n].repeat_interleave(per, 1)[:, :g], b):
        raise FormatError(f"1x{MX_GROUP} scales are not constant over {block}x{block} blocks")
    return pick.contiguous().view(E8M0)


# -- Blackwell 128×4 scale swizzle ---------------------------------------------------------------------------------
def swizzled_shape(rows: int, cols: int) -> tuple[int, int]:
    return cdiv(rows, SWIZZLE_ROWS) * SWIZZLE_ROWS, cdiv(cols, SWIZZLE_COLS) * SWIZZLE_COLS


def swizzle_mx_scales(scale: torch.Tensor) -> torch.Tensor:
    """e8m0 [R, C] (C = K/32) -> e8m0 [R128, C4] holding the bytes in the 128×4 tiled order (zero padded).

    Tile (i, j) covers rows 128i..128i+127 and scale columns 4j..4j+3 and occupies bytes [512·(i·C4/4 + j), +512);
    inside it, (row r, col c) sits at byte (r % 32)·16 + (r // 32)·4 + c.
    """
    rows, cols = scale.shape
    rp, cp = swizzled_shape(rows, cols)
    pad = torch.zeros(rp, cp, dtype=torch.uint8)
    pad[:rows, :cols] = _as_bytes(scale)
    t = pad.reshape(rp // 128, 4, 32, cp // 4, 4)          # [i, r//32, r%32, j, c]
    t = t.permute(0, 3, 2, 1, 4)                            # [i, j, r%32, r//32, c]
    return t.reshape(rp, cp).contiguous().view(E8M0)


def unswizzle_mx_scales(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of `swizzle_mx_scales`: e8m0 [R128, C4] -> e8m0 [rows, cols]."""
    rp, cp = swizzled_shape(rows, cols)
    if tuple(swizzled.shape) != (rp, cp):
        raise FormatError(f"swizzled scale shape {list(swizzled.shape)} does not match [{rows}, {cols}] "
                          f"(expected [{rp}, {cp}])")
    t = _as_bytes(swizzled).reshape(rp // 128, cp // 4, 32, 4, 4)  # [i, j, r%32, r//32, c]
    t = t.permute(0, 3, 2, 1, 4).reshape(rp, cp)
    return t[:rows, :cols].contiguous().view(E8M0)


# -- MXFP4 -> FP8 widening -----------------------------------------------------------------------------------------
def widen_mxfp4_to_fp8(packed: torch.Tensor, scale: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 (int8 [n, k/2], e8m0 [n, k/32]) -> (e4m3 [n, k], e8m0 [ceil(n/t), ceil(k/t)]), exactly.

    Per t×t tile: S = max(sub-scales) / 2^6 (never below 2^-127), value = e2m1 · (s / S). Raises FormatError when a
    tile's sub-scales spread so far that some value falls below e4m3's smallest subnormal.
    """
    n, k = packed.shape[0], packed.shape[1] * 2
    if tile % MX_GROUP:
        raise FormatError(f"widening tile {tile} is not a multiple of {MX_GROUP}")
    if tuple(scale.shape) != (n, cdiv(k, MX_GROUP)):
        raise FormatError(f"MXFP4 scale shape {list(scale.shape)} does not match weight [{n}, {k}]")
    s = e8m0_decode(scale)                                              # [n, k/32] fp32 powers of two
    nt, kt, per = cdiv(n, tile), cdiv(k, tile), tile // MX_GROUP
    sp = torch.zeros(nt * tile, kt * per)
    sp[:n, : s.shape[1]] = s
    smax = sp.reshape(nt, tile, kt, per).amax((1, 3))                   # [nt, kt]
    tile_scale = torch.clamp(torch.ldexp(smax, torch.full(smax.shape, -WIDEN_HEADROOM, dtype=torch.int32)),
                             min=2.0 ** -127)
    ratio = s / tile_scale.repeat_interleave(tile, 0)[:n].repeat_interleave(per, 1)[:, : s.shape[1]]
    unit = torch.full(tuple(scale.shape), 127, dtype=torch.uint8).view(E8M0)  # e8m0 1.0: the bare e2m1 values
    q = (dequant_mxfp4(packed, unit) * ratio.repeat_interleave(MX_GROUP, 1)).to(E4M3)
    new_scale = e8m0_encode(tile_scale)
    exact, want = dequant_fp8_block(q, new_scale, tile), dequant_mxfp4(packed, scale)
    if not torch.equal(exact, want):
        bad = (exact != want).nonzero()[0].tolist()
        raise FormatError(f"MXFP4 -> FP8 widening with {tile}x{tile} tiles is not exact at element {bad}: the "
                          f"tile's sub-scales span more than 2^14")
    return q, new_scale


# -- Hopper FP8 block tiles ----------------------------------------------------------------------------------------
def tile_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """[n, k] -> [ceil(n/b), ceil(k/b), b, b]: block (i, j) = x[i·b:(i+1)·b, j·b:(j+1)·b], row-major, zero padded."""
    n, k = x.shape
    nt, kt = cdiv(n, block), cdiv(k, block)
    pad = torch.zeros(nt * block, kt * block, dtype=x.dtype)
    pad[:n, :k] = x
    return pad.reshape(nt, block, kt, block).permute(0, 2, 1, 3).contiguous()


def untile_blocks(t: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Inverse of `tile_blocks`."""
    nt, kt, b, b2 = t.shape
    if b != b2 or (nt, kt) != (cdiv(n, b), cdiv(k, b)):
        raise FormatError(f"tiled shape {list(t.shape)} does not match [{n}, {k}]")
    return t.permute(0, 2, 1, 3).reshape(nt * b, kt * b)[:n, :k].contiguous()


# -- BF16 cache ------------------------------------------------------------------------------------------------------
def fp8_block_to_bf16(q: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """Block-scaled FP8 -> BF16 [n, k] with the same values; raises when a value would leave BF16's range."""
    x = dequant_fp8_block(q, scale, block)
    y = x.to(torch.bfloat16)
    if not torch.equal(y.float(), x):
        raise FormatError("BF16 copy of the FP8 weight is not exact (a scaled value leaves BF16's exponent range)")
    return y


# -- Marlin-style MXFP4 (Hopper MXFP4 × BF16 MoE kernel) -----------------------------------------------------------
# One 32 (N) × 32 (K) tile = two k16 steps × four n8 blocks of `mma.sync.m16n8k16` (BF16). Lane t, g = t // 4,
# q = t % 4 holds the B fragment {k = 2q, 2q+1, 2q+8, 2q+9} × {n = g} of every n8 block. Lane value v (0..31):
# ks = v // 16, j = (v // 4) % 4, r = v % 4 -> (n = 8j + g, k = 16·ks + (2q, 2q+1, 2q+8, 2q+9)[r]). The 32 values of a
# lane form 4 little-endian int32 words (word w = values 8w..8w+7); nibble p (bits 4p..4p+3) of a word holds value
# 8w + MARLIN_NIBBLE_ORDER[p], so `(word >> 4i) & 0x000F000F` yields the BF16x2 register pair (2i, 2i+1).
MARLIN_NIBBLE_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# The order above as one permutation: n = 32·nt + 16·jh + 8·jl + g (n8 block j = 2·jh + jl), k = 32·kt + 16·ks + 8·h
# + 2·q + e (b0..b3 = (h, e) = 00, 01, 10, 11); lane = 4·g + q, word = 2·ks + jh, nibble = 4·e + 2·jl + h.
_MARLIN_PERM = (0, 4, 3, 7, 5, 1, 8, 2, 6)     # [nt, jh, jl, g, kt, ks, h, q, e] -> [nt, kt, g, q, ks, jh, e, jl, h]
_MARLIN_INV = (0, 5, 7, 2, 1, 4, 8, 3, 6)


@functools.lru_cache(maxsize=4)
def _marlin_gather(nt: int, kt: int) -> torch.Tensor:
    """Flat source index of every packed nibble (a 1-D gather is ~10x faster than the 9-D permuted copy on CPU;
    int32, 4 bytes per weight element, cached for the few expert shapes of a model)."""
    src = torch.arange(nt * kt * 1024, dtype=torch.int32).reshape(nt, 2, 2, 8, kt, 2, 2, 4, 2)
    return src.permute(_MARLIN_PERM).reshape(-1)


def marlin_pack_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 (int8 [n, k/2], e8m0 [n, k/32]) -> (int32 [n/32, k/32, 128], e8m0 [n/32, k/32, 32]) Marlin-style."""
    n, k = packed.shape[0], packed.shape[1] * 2
    if n % MARLIN_TILE or k % MARLIN_TILE:
        raise FormatError(f"MXFP4 weight [{n}, {k}] is not a whole number of {MARLIN_TILE}x{MARLIN_TILE} tiles")
    if tuple(scale.shape) != (n, k // MX_GROUP):
        raise FormatError(f"MXFP4 scale shape {list(scale.shape)} does not match weight [{n}, {k}]")
    nt, kt = n // MARLIN_TILE, k // MARLIN_TILE
    codes = unpack_fp4(packed).reshape(-1).index_select(0, _marlin_gather(nt, kt))
    pairs = codes.reshape(nt, kt, 512, 2)                                          # (low, high) nibble of each byte
    words = (pairs[..., 0] | (pairs[..., 1] << 4)).view(torch.int32)               # [nt, kt, 128]
    s = _as_bytes(scale).reshape(nt, 4, 8, kt).permute(0, 3, 2, 1).reshape(nt, kt, 32)  # slot 4·g + j: row 8j + g
    return words, s.contiguous().view(E8M0)


def marlin_unpack_mxfp4(words: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `marlin_pack_mxfp4`: -> (int8 [n, k/2], e8m0 [n, k/32])."""
    nt, kt, nw = words.shape
    if nw != 128 or tuple(scale.shape) != (nt, kt, 32):
        raise FormatError(f"Marlin tensors {list(words.shape)} / {list(scale.shape)} are not [nt, kt, 128] / "
                          f"[nt, kt, 32]")
    b = words.contiguous().view(torch.uint8)                                       # [nt, kt, 512]
    nib = torch.stack([b & 0xF, b >> 4], -1).reshape(nt, kt, 8, 4, 2, 2, 2, 2, 2)
    codes = nib.permute(_MARLIN_INV).reshape(nt * 32, kt * 32)
    s = _as_bytes(scale).reshape(nt, kt, 8, 4).permute(0, 3, 2, 1).reshape(nt * 32, kt)
    return pack_fp4(codes), s.contiguous().view(E8M0)
