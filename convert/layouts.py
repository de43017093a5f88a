"""Canonical checkpoint layouts: which tensors `dsflash convert` writes for each name-table entry, and back.

A layout maps every `TensorEntry` (model_def/names.py) to output tensors named `<base><suffix>` (`base` = the HF name
without `.weight`; suffixes in `SUFFIXES`, the one table of our names). Unquantized tensors (BF16/F32/I64) and the
V4.1 Engram tables (FP8 e4m3 + e8m0 1×32, embedding gathers rather than GEMMs) keep their HF names and bytes in every
layout. `b` below is the family's dense block (`args.weight_block`: 32 for V4.1, 128 for V4); N = out features,
K = in features of the logical [N, K] weight.

reference — the HF quantization as is (design.md §1):
    dense FP8     `<base>.weight` F8_E4M3 [N, K], `<base>.scale` F8_E8M0 [ceil(N/b), ceil(K/b)]
    experts fp4   `<base>.weight` I8 [N, K/2] (e2m1 pairs, low nibble = even k), `<base>.scale` F8_E8M0 [N, K/32]
    experts fp8   `<base>.weight` F8_E4M3 [N, K], `<base>.scale` F8_E8M0 [ceil(N/t), ceil(K/t)] (widened, see below)

hopper (sm90):
    dense FP8     `<base>.weight_tiled` F8_E4M3 [ceil(N/b), ceil(K/b), b, b]: tile (i, j) holds W[i·b:(i+1)·b,
                  j·b:(j+1)·b] row-major (K contiguous), zero padded at ragged edges (only tiny test models have
                  them). One tile = one scale block, so a K step of the group-32 GEMM loads one contiguous 1 KiB
                  tile (b = 32; 16 KiB for V4's 128×128) with a single TMA/cp.async box, and a TP cut at any block
                  boundary (288 = 9·32 rows of a TP8 shared-expert slice) stays a plain slice of dims 0/1.
                  `<base>.scale_f32` F32 [ceil(N/b), ceil(K/b)]: the block scales decoded to fp32 (Hopper has no
                  e8m0 conversion; the promotion FMA reads them directly; still exact powers of two).
                  `<base>.weight_bf16` BF16 [N, K] for BF16-cache-eligible weights (`bf16_cache_eligible`).
                  (Measured on the H200, the FP8 GEMM/GEMV kernels read the plain [N, K] codes + e8m0 scales
                  fastest (benchmarks/README.md), so today the engine loader untiles these at load time.)
    experts fp4   Marlin-style tiles for the MXFP4-weight × BF16-activation MoE kernel (formats.py
                  `marlin_pack_mxfp4`): `<base>.weight_packed` I32 [N/32, K/32, 128]: tile (i, j) = rows 32i.., K
                  32j.. (one MX group) as 32 lanes × 4 int32 words in the B-fragment order of mma.m16n8k16, nibbles
                  interleaved (0, 2, 4, 6, 1, 3, 5, 7) so one shift-and-mask yields a BF16x2 pair; tiles N-major so a
                  CTA owning an N stripe streams K contiguously. `<base>.scale_packed` F8_E8M0 [N/32, K/32, 32]:
                  tile (i, j) slot g·4 + j' holds the scale of row 32i + 8j' + g (lane group g reads 4 bytes).
    experts fp8   widened (below), then as dense FP8 with t×t tiles (`.weight_tiled`, `.scale_f32`), no BF16 copy.

blackwell (sm100):
    dense FP8     `<base>.weight` F8_E4M3 [N, K] unchanged (K-major, as tcgen05 block-scaled MMA reads it);
                  `<base>.scale_mx` F8_E8M0 [ceil(N/128)·128, ceil(K/128)·4]: the b×b block scales expanded to MXFP8
                  1×32 along K ([N, K/32], exact: each 1×32 group lies inside one block) and stored in the 128×4
                  tiled order of the block-scaled MMA / cuBLAS "1D block scaling factors layout": tile (I, J) covers
                  rows 128I.. and scale columns 4J.., occupies 512 bytes at 512·(I·ceil(K/128) + J), and row r,
                  column c of the tile sits at byte (r % 32)·16 + (r // 32)·4 + c; padding bytes are 0.
    experts fp4   `<base>.weight` I8 [N, K/2] unchanged (OCP MXFP4 K-major, low nibble = even k, what the MX GEMM
                  reads) + `<base>.scale_mx` (its 1×32 scales, swizzled the same way).
    experts fp8   widened, then `<base>.weight` F8_E4M3 [N, K] + `<base>.scale_mx` from the t×t tile scales.

--expert-dtype fp8 widens MXFP4 experts to FP8 losslessly (architecture.md §3.2): per t×t tile the new e8m0 scale
is S = max(sub-scales) / 2^6 and each value is e2m1 · (s / S), a power of two <= 2^6 times an e2m1 value, so
|value| <= 384 < 448 and nothing rounds (checked; a tile whose sub-scales spread beyond 2^14 is refused). The tile
is t = b: 32×32 for V4.1 (as TensorRT-LLM's converter does, matching its dense blocks) and 128×128 for V4 (as the
official convert.py does), so widened experts are ordinary dense FP8 of the family's block and every kernel and
tool for dense FP8 handles them.

`dequantize` maps a layout's tensors back to the logical fp32 value; `to_reference` back to the HF on-disk tensors
(what build cuts per rank). Both are exact; the round-trip tests compare them bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping as MappingT

import torch

from dsflash.convert import formats as F
from dsflash.model_def.names import TensorEntry
from dsflash.model_def.quant import (E4M3, E8M0, dequant_fp8_block, dequant_fp8_rows32, dequant_mxfp4, e8m0_decode,
                                     e8m0_encode, quant_mxfp4)

LAYOUTS = ("reference", "hopper", "blackwell")
EXPERT_DTYPES = ("fp4", "fp8")

# The one table of our tensor names: kind -> suffix appended to the entry's base name (HF name minus `.weight`).
SUFFIXES: dict[str, str] = {
    "weight": ".weight",                # as stored by HF (or widened FP8 experts, F8_E4M3 [N, K])
    "scale": ".scale",                  # e8m0 block scales as HF stores them (reference; Engram tables everywhere)
    "weight_tiled": ".weight_tiled",    # hopper: F8_E4M3 [N/b, K/b, b, b] block tiles
    "scale_f32": ".scale_f32",          # hopper: F32 [N/b, K/b] decoded block scales
    "weight_bf16": ".weight_bf16",      # hopper: BF16 [N, K] cache of an eligible dense weight
    "weight_packed": ".weight_packed",  # hopper: I32 [N/32, K/32, 128] Marlin-style MXFP4 expert tiles
    "scale_packed": ".scale_packed",    # hopper: F8_E8M0 [N/32, K/32, 32] their scales, lane order
    "scale_mx": ".scale_mx",            # blackwell: F8_E8M0 1×32 scales in the 128×4 swizzled layout
}
PLAIN = "plain"  # unquantized tensors keep their full HF name

DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.int64: "I64", torch.int32: "I32",
               torch.int8: "I8", torch.uint8: "U8", E4M3: "F8_E4M3", E8M0: "F8_E8M0"}
TORCH_DTYPES = {v: k for k, v in DTYPE_NAMES.items()}
DTYPE_BYTES = {"BF16": 2, "F32": 4, "I64": 8, "I32": 4, "I8": 1, "U8": 1, "F8_E4M3": 1, "F8_E8M0": 1}

# BF16 cache (hopper) — rule and reason.
# A BF16 copy is worth its memory only where the group-32 FP8 GEMM is slower than a BF16 GEMM. On H200 (HBM
# BW ~4.8 TB/s, BF16 dense ~989 TFLOP/s, FP8 ~1979 TFLOP/s, fp32 CUDA cores ~67 TFLOP/s) an FP8 weight with 32×32
# scales needs a promotion `acc += partial · (sa · sb)` after every 32-deep K step, a multiply and an FMA per output
# element per 32 K on the CUDA cores, which caps the group-32 GEMM near R8 ≈ 0.7 PFLOP/s (1 / (1/1979T + 1/1072T)).
# Per GEMM of M tokens: FP8 takes max(NK/BW, 2MNK/R8), BF16 max(2NK/BW, 2MNK/989T); BF16 wins only for
# M > R8/BW ≈ 150 tokens (prefill chunks: the seed workload prefills 8,192-token prompts; big verify batches), while
# decode steps keep reading the FP8 copy (half the bytes). Saving and cost both scale with N·K, so every weight pays
# the same per byte of cache; what differs is whether its GEMM regularly sees M >= 150. Hence the rule, per entry:
#   1. dense FP8 with group-32 scales (`fp8_block` and weight_block == 32: V4.1). V4's 128×128 blocks promote once
#      per 128 K: measured at M = 4096 (benchmarks/gemm_v4_s12_h200.json) its FP8 GEMM matches or beats the BF16
#      one on five of six V4 shapes (0.97–1.26×) at half the bytes; only wq_b (K = 1024) is faster in BF16 (366
#      against 456 µs at TP1, ~11 µs per layer and 4096 tokens on a TP8 rank), which would cost 0.34 GiB of copies
#      per TP8 rank: no copy.
#   2. in a main decoder layer (`layers.*`): those GEMMs see every prompt token. The MTP / DSpark drafter blocks
#      (`mtp.*`) never run without speculative decoding (the seed's measured configuration) and with it see
#      batch × draft tokens per step, below ~150 except at the largest batches: their copy (0.30 GiB per TP8 rank)
#      would mostly sit idle.
#   Experts (MXFP4: the MoE kernel widens to BF16 in registers; a BF16 copy of 464 GiB cannot be held), Engram
#   tables (gathers) and BF16/F32 tensors are never copied.
# Cost: full-size V4.1-Flash at TP8 holds 2.70 GiB of BF16 copies per rank (tests/unit/test_layouts.py), which
# matches the seed's weight growth 72.71 -> 75.43 GB per GPU (+2.72; SGLang logs GB = 2^30 bytes); caching every
# dense FP8 weight instead would cost 3.01 GiB.
BF16_CACHE_BLOCK = 32
BF16_CACHE_PREFIX = "layers."


def bf16_cache_eligible(entry: TensorEntry, args) -> bool:
    """Whether the hopper layout adds a `.weight_bf16` copy of this entry (rule and reason above)."""
    return (entry.role == "fp8_block" and args.weight_block == BF16_CACHE_BLOCK
            and entry.name.startswith(BF16_CACHE_PREFIX))


@dataclass(frozen=True)
class OutTensor:
    """One tensor of the canonical checkpoint: computed, or copied byte for byte from HF tensor `source`."""
    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype string
    kind: str   # PLAIN or a key of SUFFIXES
    source: str | None = None

    @property
    def nbytes(self) -> int:
        n = DTYPE_BYTES[self.dtype]
        for d in self.shape:
            n *= d
        return n


def check_layout(layout: str, expert_dtype: str = "fp4") -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of: {', '.join(LAYOUTS)}")
    if expert_dtype not in EXPERT_DTYPES:
        raise ValueError(f"unknown expert dtype {expert_dtype!r}; expected one of: {', '.join(EXPERT_DTYPES)}")


def name_of(entry: TensorEntry, kind: str) -> str:
    return entry.name if kind == PLAIN else entry.name.removesuffix(".weight") + SUFFIXES[kind]


def _fmt(entry: TensorEntry, args, expert_dtype: str) -> tuple[str, int]:
    """(effective format, block): plain | rows32 | fp8 (dense or widened expert, with its block) | fp4."""
    if entry.role in ("bf16", "f32", "i64"):
        return "plain", 0
    if entry.role == "fp8_rows32":
        return "rows32", 32
    if entry.role == "fp8_block":
        return "fp8", args.weight_block
    return ("fp8", args.weight_block) if expert_dtype == "fp8" else ("fp4", 32)


def outputs(entry: TensorEntry, layout: str, expert_dtype: str, args) -> list[OutTensor]:
    """The tensors `entry` becomes in `layout`, in write order."""
    check_layout(layout, expert_dtype)
    fmt, b = _fmt(entry, args, expert_dtype)
    hf = entry.stored(args.weight_block)
    n, k = entry.shape[0], entry.shape[-1]

    def out(kind: str, shape, dtype: str, copy: bool = False) -> OutTensor:
        name = name_of(entry, kind)
        return OutTensor(name, tuple(shape), dtype, kind, name if copy else None)

    widened = entry.role == "mxfp4" and fmt == "fp8"
    if fmt == "plain":
        return [out(PLAIN, entry.shape, hf[entry.name][1], copy=True)]
    if fmt == "rows32":
        return [out("weight", *hf[entry.name], copy=True), out("scale", *hf[entry.scale_name], copy=True)]
    grid = (F.cdiv(n, b), F.cdiv(k, b))
    mx = F.swizzled_shape(n, k // F.MX_GROUP)
    if layout == "reference":
        if fmt == "fp4" or not widened:
            return [out("weight", *hf[entry.name], copy=True), out("scale", *hf[entry.scale_name], copy=True)]
        return [out("weight", (n, k), "F8_E4M3"), out("scale", grid, "F8_E8M0")]
    if layout == "hopper":
        if fmt == "fp4":
            t = F.MARLIN_TILE
            return [out("weight_packed", (n // t, k // t, 128), "I32"),
                    out("scale_packed", (n // t, k // t, 32), "F8_E8M0")]
        res = [out("weight_tiled", (*grid, b, b), "F8_E4M3"), out("scale_f32", grid, "F32")]
        if bf16_cache_eligible(entry, args):
            res.append(out("weight_bf16", (n, k), "BF16"))
        return res
    # blackwell
    if fmt == "fp4":
        return [out("weight", *hf[entry.name], copy=True), out("scale_mx", mx, "F8_E8M0")]
    return [out("weight", (n, k), "F8_E4M3", copy=not widened), out("scale_mx", mx, "F8_E8M0")]


def stored_names(entry: TensorEntry, layout: str, expert_dtype: str, args) -> list[str]:
    """Names of the tensors `entry` occupies in a canonical checkpoint of `layout`."""
    return [o.name for o in outputs(entry, layout, expert_dtype, args)]


def _fp8_of(entry: TensorEntry, src: MappingT[str, torch.Tensor], args) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(e4m3 [N, K], e8m0 block grid, block) of a dense FP8 entry or a widened MXFP4 expert (HF tensors in `src`)."""
    w, s = src[entry.name], src[entry.scale_name]
    if entry.role == "fp8_block":
        return w, s, args.weight_block
    q, tile_scale = F.widen_mxfp4_to_fp8(w, s, args.weight_block)
    return q, tile_scale, args.weight_block


def compute(entry: TensorEntry, src: MappingT[str, torch.Tensor], layout: str, expert_dtype: str,
            args) -> dict[str, torch.Tensor]:
    """The computed (non-copied) outputs of `entry`, from its HF tensors `src` (name -> tensor as stored)."""
    outs = [o for o in outputs(entry, layout, expert_dtype, args) if o.source is None]
    if not outs:
        return {}
    fmt, _ = _fmt(entry, args, expert_dtype)
    n, k = entry.shape
    res: dict[str, torch.Tensor] = {}
    if fmt == "fp4":
        w, s = src[entry.name], src[entry.scale_name]
        if layout == "hopper":
            res[name_of(entry, "weight_packed")], res[name_of(entry, "scale_packed")] = F.marlin_pack_mxfp4(w, s)
        else:
            res[name_of(entry, "scale_mx")] = F.swizzle_mx_scales(s)
    else:
        q, s, b = _fp8_of(entry, src, args)
        if layout == "reference":
            res[name_of(entry, "weight")], res[name_of(entry, "scale")] = q, s
        elif layout == "hopper":
            res[name_of(entry, "weight_tiled")] = F.tile_blocks(q, b)
            res[name_of(entry, "scale_f32")] = e8m0_decode(s)
            if bf16_cache_eligible(entry, args):
                res[name_of(entry, "weight_bf16")] = F.fp8_block_to_bf16(q, s, b)
        else:
            if entry.role == "mxfp4":  # widened; a dense weight is copied as is
                res[name_of(entry, "weight")] = q
            res[name_of(entry, "scale_mx")] = F.swizzle_mx_scales(F.expand_block_scales(s, n, k, b))
    want = {o.name: o for o in outs}
    assert set(res) == set(want), (entry.name, sorted(res), sorted(want))
    for name, t in res.items():
        o = want[name]
        assert tuple(t.shape) == o.shape and DTYPE_NAMES[t.dtype] == o.dtype, (name, t.shape, t.dtype, o)
    return res


def _fp8_from(entry: TensorEntry, ours: MappingT[str, torch.Tensor], layout: str,
              args) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(e4m3 [N, K], e8m0 block grid, block) of an FP8-format entry stored in `layout`."""
    n, k = entry.shape
    b = args.weight_block
    if layout == "reference":
        return ours[name_of(entry, "weight")], ours[name_of(entry, "scale")], b
    if layout == "hopper":
        q = F.untile_blocks(ours[name_of(entry, "weight_tiled")], n, k)
        return q, e8m0_encode(ours[name_of(entry, "scale_f32")]), b
    mx = F.unswizzle_mx_scales(ours[name_of(entry, "scale_mx")], n, k // F.MX_GROUP)
    return ours[name_of(entry, "weight")], F.collapse_mx_scales(mx, b), b


def _fp4_from(entry: TensorEntry, ours: MappingT[str, torch.Tensor], layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = entry.shape
    if layout == "reference":
        return ours[name_of(entry, "weight")], ours[name_of(entry, "scale")]
    if layout == "hopper":
        return F.marlin_unpack_mxfp4(ours[name_of(entry, "weight_packed")], ours[name_of(entry, "scale_packed")])
    return ours[name_of(entry, "weight")], F.unswizzle_mx_scales(ours[name_of(entry, "scale_mx")], n, k // F.MX_GROUP)


def dequantize(entry: TensorEntry, ours: MappingT[str, torch.Tensor], layout: str, expert_dtype: str,
               args) -> torch.Tensor:
    """The entry's logical value (fp32; int64 for integer tables) from its tensors in `layout`."""
    check_layout(layout, expert_dtype)
    fmt, _ = _fmt(entry, args, expert_dtype)
    if fmt == "plain":
        t = ours[entry.name]
        return t if entry.role == "i64" else t.float()
    if fmt == "rows32":
        return dequant_fp8_rows32(ours[name_of(entry, "weight")], ours[name_of(entry, "scale")])
    if fmt == "fp4":
        return dequant_mxfp4(*_fp4_from(entry, ours, layout))
    q, s, b = _fp8_from(entry, ours, layout, args)
    return dequant_fp8_block(q, s, b)


def to_reference(entry: TensorEntry, ours: MappingT[str, torch.Tensor], layout: str, expert_dtype: str,
                 args) -> dict[str, torch.Tensor]:
    """The entry's tensors in the HF on-disk format of its role (what `HFCheckpoint.get` returns), from `layout`.

    Bit-identical to the source for every tensor that was not widened. Widened experts are re-encoded as MXFP4 with
    the smallest power-of-two scale per 1×32 group (`quant.quant_mxfp4`): the same values, not always the same
    bytes, because MXFP4 encodings are not unique (6·s = 3·2s) and widening forgets which one the source used.
    """
    check_layout(layout, expert_dtype)
    fmt, _ = _fmt(entry, args, expert_dtype)
    if fmt == "plain":
        return {entry.name: ours[entry.name]}
    if fmt == "rows32":
        return {entry.name: ours[name_of(entry, "weight")], entry.scale_name: ours[name_of(entry, "scale")]}
    if fmt == "fp4":
        w, s = _fp4_from(entry, ours, layout)
        return {entry.name: w, entry.scale_name: s}
    q, s, b = _fp8_from(entry, ours, layout, args)
    if entry.role == "fp8_block":
        return {entry.name: q, entry.scale_name: s}
    value = dequant_fp8_block(q, s, b)
    packed, scale = quant_mxfp4(value)
    if not torch.equal(dequant_mxfp4(packed, scale), value):
        raise F.FormatError(f"tensor '{entry.name}': widened FP8 expert values are not MXFP4 values")
    return {entry.name: packed, entry.scale_name: scale}


def bf16_cache_bytes_per_rank(table: list[TensorEntry], args, tp: int) -> int:
    """Bytes of `.weight_bf16` copies one TP rank holds (tp-sharded entries split, replicated ones whole)."""
    total = 0
    for e in table:
        if bf16_cache_eligible(e, args):
            n = e.shape[0] * e.shape[1] * 2
            total += n // tp if e.shard in ("col", "row", "head") else n
    return total
