"""Tile / split-K configurations of the group-32 FP8 GEMM, keyed by (N, K, M-bucket), with a guaranteed default.

Config heuristics live here, apart from the kernel body (style-anchors §3 practice 10-11). `build` times the
`candidates()` of each shape, records the winner (and whether the FP8 or the BF16-cache path won) with
`set_table()`-compatible entries in the engine's tuned.json; `serve` only looks up. A shape missing from a loaded
table falls back to `default_config()` and says so once in the log. Triton-free.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable, Hashable, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

NUM_SMS = 132  # H200
PATHS = ("fp8", "bf16cache")


@dataclass(frozen=True)
class GemmConfig:
    """Tiles of `_fp8_gemm_g32_kernel`. P is the operand on the tile's rows: A (tokens) normally, W with swap_ab.

    block_p/block_q: tile rows/cols; one 32-wide K block (one fp32 promotion) per pipelined loop iteration,
    num_stages of them in flight; split_k: K slices reduced in fp32 in the same launch (`splitk`); dequant_bf16: dequantize both
    operands to BF16 in registers and accumulate on BF16 tensor cores instead of FP8 MMA + per-32 promotion (same
    numerics: every product is exact, accumulation fp32); kgroups: 32-blocks per iteration (dequant_bf16 only);
    tiled_w: the weight was re-laid by `fp8_gemm.tile_weight` at build time so each TMA box is contiguous.
    gemv (M <= 8): the CUDA-core split-K GEMV of `fp8_gemv` instead of the MMA kernel, in the swap-AB orientation
    (weight rows on P): block_p weight rows per program (a power of two <= 32, so a tile shares one 32-row scale
    block), block_q the most tokens it takes (<= 8), block_k the K per loop iteration, split_k K slices reduced in
    the same launch, num_warps, num_stages; group_p, kgroups, dequant_bf16 and tiled_w keep their defaults.
    acc16 (gemv only): sum each 32-block's products as packed f16 FMAs, widened to fp32 once per block
    (`fp8_gemv._fp8_gemv16_kernel`); the activation then comes as f16 codes (`act_quant(x, codes16=True)`).
    gluon (K % 128 == 0): the explicit-wgmma kernels of `fp8_gemm_gluon`. Large M, normal orientation:
    block_p = BM (64 with 4 warps, 128 with 8), block_q = BN (64 or 128), num_stages 128-K TMA stages, group_p;
    maxnreg (0 = compiler's choice) caps registers per thread so more CTAs share an SM. With swap_ab, the decode
    kernel (M <= 8): block_p 64 weight rows, block_q 8 tokens, kgroups 128-K boxes per stage, split_k, num_stages;
    pdl launches it with programmatic dependent launch: its weight ring is requested before it waits for the
    previous kernel, so the weight stream starts during that kernel's tail. quant_in_kernel (gluon decode only):
    the kernel takes the bf16 activation and quantizes it per 1×32 itself (`fp8_linear_gluon_decode`, bit-identical
    to `act_quant` + the kernel): one launch per linear instead of two; every program re-quantizes the tokens of its
    K slice, so it pays where the weight is split over few tiles (the TP8 shapes) and loses on wide ones.
    sm90 (large M, sm_90, N % 8 == 0): the hand-scheduled CUDA kernel of `fp8_gemm_sm90` (fp32 activation scales,
    the weight's transposed fp32 scales): block_p = BM (64 per consumer warpgroup), block_q = BN (128, or 96 with
    three MMA partials in flight instead of two), num_stages
    TMA ring slots filled by a producer warpgroup (num_warps counts it), group_p the grouped tile order;
    ctas_per_sm 2 (one consumer warpgroup, at most 4 slots): two CTAs share each SM's registers and shared memory;
    mma_split 2 (128-wide tiles): each K block's MMA as two 64-wide ones into four half-width partials, so three
    half MMAs run during each half fold instead of one whole MMA during a whole fold (same registers). 192- and
    256-wide tiles (128 rows, one CTA per SM) read fewer operand bytes per MMA flop (their loads alone outrun
    `_scaled_mm`, "Session 27"); mma_split 2-4 cuts their MMAs to 96 or 64 columns so two partials fit next to the
    accumulator (`sm90_depth`).
    """
    block_p: int = 128
    block_q: int = 128
    split_k: int = 1
    num_warps: int = 8
    num_stages: int = 4
    swap_ab: bool = False
    dequant_bf16: bool = False
    group_p: int = 8
    kgroups: int = 1
    tiled_w: bool = False
    gemv: bool = False
    block_k: int = 0
    acc16: bool = False
    gluon: bool = False
    maxnreg: int = 0
    pdl: bool = False
    quant_in_kernel: bool = False
    sm90: bool = False
    ctas_per_sm: int = 1
    mma_split: int = 1

    def __post_init__(self) -> None:
        if self.sm90:
            assert not (self.gluon or self.dequant_bf16 or self.tiled_w or self.gemv or self.acc16 or self.block_k
                        or self.swap_ab or self.maxnreg or self.pdl or self.quant_in_kernel), \
                "sm90 configs are the CUDA large-M kernel and take no other path's options"
            assert self.block_p in (64, 128) and self.block_q in (96, 128, 192, 256), \
                f"sm90 tile {self.block_p}x{self.block_q}"
            assert self.num_warps == 4 * (self.block_p // 64 + 1), "sm90: a warpgroup per 64 rows + the producer"
            assert 3 <= self.num_stages <= 6 and self.split_k == 1 and self.kgroups == 1, self
            assert self.ctas_per_sm == 1 or (self.ctas_per_sm == 2 and self.block_p == 64 and self.num_stages <= 4), \
                "two CTAs per SM: a 64-row tile and at most 4 ring slots"
            assert self.block_q <= 128 or (self.block_p == 128 and self.ctas_per_sm == 1
                                           and self.num_stages <= (4 if self.block_q == 256 else 5)), \
                "tiles wider than 128: 128 rows, one CTA per SM, the ring in 227 KB"
            assert self.mma_split in (1, 2, 3, 4) and self.block_q % (32 * self.mma_split) == 0, \
                "mma_split: MMA units of whole 32-column scale blocks"
            assert sm90_depth(self.block_q, self.mma_split) >= 2, "the partials leave no room for a second MMA"
            return
        assert self.ctas_per_sm == 1 and self.mma_split == 1, "ctas_per_sm and mma_split are sm90 fields"
        if self.gluon:
            assert not (self.dequant_bf16 or self.tiled_w or self.gemv or self.acc16 or self.block_k), \
                "gluon configs are FP8 MMA and take no other path's options"
            assert self.num_stages >= 2 and (self.maxnreg == 0 or 64 <= self.maxnreg <= 255), self
            if self.swap_ab:   # decode kernel: 64 weight rows × 8 tokens, kgroups 128-K boxes per stage
                assert (self.block_p, self.block_q, self.num_warps) == (64, 8, 4), "gluon decode tile is 64x8, 4 warps"
                assert self.kgroups in (1, 2, 4) and self.split_k >= 1 and self.maxnreg == 0, self
                return
            assert not (self.pdl or self.quant_in_kernel), "pdl, quant_in_kernel: the gluon decode kernel only"
            assert self.block_p in (64, 128) and self.block_q in (64, 128), f"gluon tile {self.block_p}x{self.block_q}"
            assert self.num_warps == self.block_p // 16, "gluon: one warp per 16 tile rows (64 -> 4, 128 -> 8)"
            assert self.split_k == 1 and self.kgroups == 1, self
            return
        assert self.maxnreg == 0 and not (self.pdl or self.quant_in_kernel), \
            "maxnreg, pdl and quant_in_kernel are gluon fields"
        if self.gemv:
            bp, bq, bk = self.block_p, self.block_q, self.block_k
            assert 1 <= bp <= 32 and bp & (bp - 1) == 0, f"gemv block_p={bp} must be a power of two <= 32"
            assert 1 <= bq <= 8 and bq & (bq - 1) == 0, f"gemv block_q={bq} (tokens) must be a power of two <= 8"
            assert 64 <= bk <= 4096 and bk & (bk - 1) == 0, f"gemv block_k={bk} must be a power of two in [64, 4096]"
            assert bp * bk <= 32 * 1024, f"gemv tile {bp}x{bk} holds too many registers"
            assert self.split_k >= 1 and self.num_stages >= 1 and self.num_warps in (1, 2, 4, 8), self
            assert self.swap_ab and not (self.dequant_bf16 or self.tiled_w) and self.kgroups == 1, \
                "gemv configs are swap-AB and take no other MMA-path options"
            return
        assert self.block_k == 0 and not self.acc16, "block_k and acc16 are gemv fields"
        for f in ("block_p", "block_q"):
            v = getattr(self, f)
            assert v >= 16 and v & (v - 1) == 0, f"{f}={v} must be a power of two >= 16"
        assert self.block_p <= 256 and self.block_q <= 256, "TMA boxes are at most 256 rows"
        assert self.split_k >= 1 and self.num_stages >= 1, self
        assert self.num_warps in (4, 8), self
        assert self.kgroups in (1, 2, 4), self
        assert not self.tiled_w or self.swap_ab, "tiled weights are for the swap-AB (decode) orientation"

    @property
    def promotes_every(self) -> int:
        """K over which the config assumes constant scales: 32·kgroups for the Triton FP8-MMA kernel (one promotion
        per iteration), 32 for every other path (they promote or dequantize per 32-block; the Gluon large-M kernel
        takes the group from `fp8_gemm` itself)."""
        plain_mma = not (self.gluon or self.gemv or self.dequant_bf16 or self.sm90)
        return 32 * self.kgroups if plain_mma else 32

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "GemmConfig":
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})

    def tag(self) -> str:
        if self.sm90:
            return (f"C{self.block_p}x{self.block_q}st{self.num_stages}g{self.group_p}"
                    + (f"c{self.ctas_per_sm}" if self.ctas_per_sm > 1 else "")
                    + (f"h{self.mma_split}" if self.mma_split > 1 else ""))
        if self.gluon and self.swap_ab:
            return (f"LT{self.block_p}x{self.block_q}b{self.kgroups}s{self.split_k}st{self.num_stages}"
                    f"{'_pdl' if self.pdl else ''}{'_qa' if self.quant_in_kernel else ''}")
        if self.gluon:
            return (f"L{self.block_p}x{self.block_q}w{self.num_warps}st{self.num_stages}"
                    f"{f'r{self.maxnreg}' if self.maxnreg else ''}")
        if self.gemv:
            return (f"G{self.block_p}x{self.block_q}k{self.block_k}s{self.split_k}w{self.num_warps}st{self.num_stages}"
                    f"{'_h16' if self.acc16 else ''}")
        return (f"{'T' if self.swap_ab else 'N'}{self.block_p}x{self.block_q}s{self.split_k}"
                f"w{self.num_warps}st{self.num_stages}{f'_dq{self.kgroups}' if self.dequant_bf16 else ''}"
                f"{f'_k{self.kgroups}' if self.kgroups > 1 and not self.dequant_bf16 else ''}"
                f"{'_tw' if self.tiled_w else ''}")


def m_bucket(m: int) -> int:
    """Token-count bucket: the next power of two, capped at 4096 (all larger M share one bucket)."""
    b = 1
    while b < m and b < 4096:
        b *= 2
    return b


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def k_slices(n_it: int, want: int) -> int:
    """The split count to launch for `want` slices of n_it K iterations: at most n_it, and no slice left empty
    (every slice gets cdiv(n_it, split) iterations, the last at least one)."""
    return _cdiv(n_it, _cdiv(n_it, max(1, min(want, n_it))))


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _split_for(tiles: int, k_iters: int, target: int = 2 * NUM_SMS, max_split: int = 16) -> int:
    """Split K until about `target` programs run, keeping >= 2 loop iterations per split."""
    if tiles >= target // 2:
        return 1
    return max(1, min(_cdiv(target, tiles), max(1, k_iters // 2), max_split))


def default_config(n: int, k: int, m: int, arch: str | None = None, group: int = 32) -> GemmConfig:
    """A valid config for any shape (K % 32 == 0): swap-AB GEMV-like tiles for M <= 64, 128×64 otherwise (the
    FP8-MMA winner of the first H200 sweep; bigger tiles need more registers than the per-32 promotion leaves).
    On arch "sm90", M <= 8 and K % 128 == 0 take the Gluon decode kernel (`gluon_decode_default`). With V4's
    128-groups (`group` 128) a large M takes a 128×128 tile promoted once per 128 K (what the fewer promotions
    leave registers for); with 32-groups on sm90 the CUDA kernel (`SM90_DEFAULT`, 2× the Triton tile's throughput
    at M = 4096, benchmarks/README.md "Session 24")."""
    if arch == "sm90" and m <= GEMV_MAX_M and gluon_fits(k):
        return gluon_decode_default(n, k)
    if arch == "sm90" and m > 64 and group == 32 and sm90_fits(n):
        return SM90_DEFAULT
    kb = _cdiv(k, 32)
    if m <= 64:
        bq = max(16, _next_pow2(m))
        stages = 8 if bq <= 16 else (6 if bq <= 32 else 4)
        return GemmConfig(128, bq, _split_for(_cdiv(n, 128), kb), 4, stages, swap_ab=True)
    if group == 128:
        return GemmConfig(128, 128, _split_for(_cdiv(m, 128) * _cdiv(n, 128), _cdiv(kb, 4), target=NUM_SMS), 8, 3,
                          kgroups=4)
    return GemmConfig(128, 64, _split_for(_cdiv(m, 128) * _cdiv(n, 64), kb, target=NUM_SMS), 4, 6)


# The CUDA-core GEMV candidates (M <= 8): (block_p, block_k, num_warps, programs aimed at). Measured on the H200
# (fp8_gemv.py's docstring): they beat the MMA default at M = 1-2 (up to 81 % of copy bandwidth), tie or win
# slightly at M = 4, and lose at M = 8 (FFMA-bound), where the tuner keeps the MMA configs. st1 (no cp.async
# pipelining) was as fast or faster than 3 stages everywhere, so num_stages = 1.
GEMV_MAX_M = 8
_GEMV_SPACE = ((32, 256, 4, 4 * NUM_SMS), (16, 1024, 8, 2 * NUM_SMS), (8, 512, 1, 4 * NUM_SMS),
               (8, 1024, 2, 4 * NUM_SMS), (4, 1024, 2, 4 * NUM_SMS), (8, 2048, 4, 4 * NUM_SMS),
               (4, 2048, 4, 4 * NUM_SMS))


# acc16 (f16 in-block accumulation; offline SASS: 4.0 instructions per weight element at M = 4 and 7.3 at M = 8,
# against 7.2 and 12.7 for the fp32 GEMV): 4 rows per thread keep every token's accumulators in registers at M = 8.
_GEMV16_SPACE = ((4, 1024, 1, 4 * NUM_SMS), (4, 2048, 2, 4 * NUM_SMS), (8, 1024, 1, 4 * NUM_SMS),
                 (2, 2048, 2, 4 * NUM_SMS))


def _gemv_split(tiles: int, k_iters: int, target: int, max_split: int = 16) -> int:
    """K slices for about `target` programs (the reduction is fused, so one iteration per slice is fine)."""
    if tiles >= target // 2:
        return 1
    return max(1, min(_cdiv(target, tiles), k_iters, max_split))


def gemv_candidates(n: int, k: int) -> list[GemmConfig]:
    """The `gemv` configs tried for M <= 8 (block_q = 8 tokens at most)."""
    return [GemmConfig(bp, GEMV_MAX_M, _gemv_split(_cdiv(n, bp), _cdiv(k, bk), target), warps, 1, swap_ab=True,
                       gemv=True, block_k=bk, acc16=acc16)
            for space, acc16 in ((_GEMV_SPACE, False), (_GEMV16_SPACE, True))
            for bp, bk, warps, target in space]


# The Gluon wgmma kernel (M > 64). Measured at M = 4096 on the H200 (benchmarks/README.md, session 5): the 64-row
# tile capped at 168 registers (three CTAs per SM) was the fastest on all six shapes, 453-642 TFLOP/s.
GLUON_BLOCK_K = 128


def gluon_fits(k: int) -> bool:
    """Whether the Gluon kernels take this K: whole 128-wide K blocks (each W-scale row is read as 32-bit words)."""
    return k % GLUON_BLOCK_K == 0
GLUON_SPACE = (GemmConfig(64, 128, 1, 4, 3, gluon=True, maxnreg=168), GemmConfig(64, 128, 1, 4, 4, gluon=True),
               GemmConfig(64, 64, 1, 4, 3, gluon=True, maxnreg=128), GemmConfig(128, 128, 1, 8, 3, gluon=True))


def sm90_depth(block_q: int, mma_split: int) -> int:
    """MMA partials an sm90 consumer thread rotates: as many m64 × (block_q / mma_split) partials as fit next to
    its m64 × block_q accumulator in 192 fp32 registers (the rest of the 232 hold addresses, scales and the loop):
    depth - 1 MMAs run during each fold."""
    return min(4 * mma_split, (384 - block_q) * mma_split // block_q)


# The CUDA kernel of fp8_gemm_sm90 (M > 64), measured at M = 4096 on the H200 (benchmarks/README.md, sessions 24
# and 25): two CTAs per SM, each a 64-row tile with its own producer, 0.51-0.62 of `_scaled_mm` at 10 of the 11
# shapes (one CTA of two 128-row consumer warpgroups: 0.41-0.60); with the MMA split in halves, as fast or up to
# 13 % faster at 9 of the 11 shapes in two runs.
SM90_DEFAULT = GemmConfig(64, 128, 1, 8, 4, sm90=True, ctas_per_sm=2, mma_split=2)
SM90_SPACE = (SM90_DEFAULT, GemmConfig(64, 128, 1, 8, 3, sm90=True, ctas_per_sm=2, mma_split=2),
              GemmConfig(64, 128, 1, 8, 4, sm90=True, ctas_per_sm=2),
              GemmConfig(64, 128, 1, 8, 3, group_p=4, sm90=True, ctas_per_sm=2),
              GemmConfig(64, 128, 1, 8, 4, group_p=16, sm90=True, ctas_per_sm=2),
              GemmConfig(128, 128, 1, 12, 5, group_p=4, sm90=True), GemmConfig(128, 128, 1, 12, 4, sm90=True),
              # 96-wide tiles (three partials deep): 0.49 against 0.41 on the 576-row TP8 shared w13, slower elsewhere
              GemmConfig(64, 96, 1, 8, 4, sm90=True, ctas_per_sm=2),
              # 256 wide (session 27): the fastest at 6 of the 11 shapes in interleaved timing, 3-7 % faster than
              # the default there; slow where its few tiles leave a wave part empty (wq_a). 192 wide: never the fastest.
              GemmConfig(128, 256, 1, 12, 4, sm90=True, mma_split=4))


def sm90_fits(n: int) -> bool:
    """Whether the CUDA kernel takes this N (its output rows are written 16 bytes at a time)."""
    return n % 8 == 0


# The Gluon decode kernel (M <= 8): (128-K boxes per stage, ring stages). Every slot of the ring is requested up
# front. The session-6 sweep (benchmarks/gemm_decode_sweep.py, gemm_decode_sweep_h200.json: 17 rings × 10 splits
# at the three >= 16 MB shapes) was won everywhere by shallow rings (27-37 KB per program) with 2.5-4 programs per
# SM, all resident; deeper rings and a second wave lose 10-60 %.
_GLUON_DECODE_SPACE = ((1, 3), (2, 2), (1, 2), (1, 4), (2, 3), (4, 2))
_GLUON_DECODE_PER_SM = (2.5, 3.0, 4.0)   # programs per SM that the split counts aim at
SMEM_PER_SM = 228 * 1024      # H100 / H200
SMEM_PER_CTA = 227 * 1024     # the most one CTA may take
_SMEM_RESERVED = 1024         # per resident CTA


def gluon_decode_smem(boxes: int, stages: int, quant_in_kernel: bool = False) -> int:
    """Shared memory of one decode program: the ring of (64 weight + 8 token rows) × 128 K boxes (with
    quant_in_kernel, the 8 bf16 token rows the kernel quantizes as well), and barriers."""
    token_bytes = 8 * (1 + 2 * quant_in_kernel)
    return stages * boxes * (64 + token_bytes) * GLUON_BLOCK_K + 8 * stages


def gluon_decode_candidates(n: int, k: int) -> list[GemmConfig]:
    """Configs of the Gluon decode kernel (`fp8_gemm_gluon`, swap-AB, M <= 8) for an (N, K) weight: each ring of
    `_GLUON_DECODE_SPACE` with the split counts that put about 2.5, 3 and 4 programs on every SM (no split where
    the weight's 64-row tiles alone are that many), all of them resident at once; each with and without PDL, and
    each quantizing the activation in the kernel or not."""
    out = []
    tiles = _cdiv(n, 64)
    for boxes, stages in _GLUON_DECODE_SPACE:
        # resident programs per SM: shared memory, and registers (offline sm_90a builds: 48-56 per thread with one
        # box per stage, 80 with two, 128 with four)
        regs = 32 + 24 * boxes
        n_st = _cdiv(k, GLUON_BLOCK_K * boxes)
        for qa in (False, True):
            smem = gluon_decode_smem(boxes, stages, qa) + _SMEM_RESERVED
            per_sm = min(SMEM_PER_SM // smem, 65536 // (128 * regs))
            splits = set()
            for aim in _GLUON_DECODE_PER_SM:
                split = k_slices(n_st, round(aim * NUM_SMS / tiles))     # what the kernel launches
                if tiles * split <= per_sm * NUM_SMS:
                    splits.add(split)
            out += [GemmConfig(64, 8, s, 4, stages, swap_ab=True, kgroups=boxes, gluon=True, pdl=pdl,
                               quant_in_kernel=qa) for s in sorted(splits) for pdl in (False, True)]
    return out


def gluon_decode_default(n: int, k: int) -> GemmConfig:
    """The Gluon decode config for a shape `build` did not tune: PDL, the fewest K slices offered, four 128-K boxes
    per stage × 2 stages when the weight has fewer 64-row tiles than there are SMs (K is split: deeper stages per
    program), else 1 box × 3 stages. On the H200's nine V4.1 decode shapes this is 0-11 % slower than the tuned
    winner and 1.4-2.3× faster than the Triton default (gemm_decode_s6_h200.json, M = 1, 4, 8)."""
    ring = (4, 2) if _cdiv(n, 64) < NUM_SMS else (1, 3)
    fits = [c for c in gluon_decode_candidates(n, k)
            if c.pdl and not c.quant_in_kernel and (c.kgroups, c.num_stages) == ring]
    return min(fits, key=lambda c: c.split_k)


def candidates(n: int, k: int, m: int, group: int = 32) -> list[GemmConfig]:
    """The tuning space `build` (and the kernel bench) times for one (N, K, M) shape; the default comes first.
    group 128 (V4) adds FP8-MMA tiles promoted once per 64 or 128 K."""
    kb = _cdiv(k, 32)
    out = [default_config(n, k, m, group=group)]
    if m <= 64:
        bq = max(16, _next_pow2(m))
        for bp, stages, warps, target in ((128, 12, 4, 2 * NUM_SMS), (128, 8, 4, 4 * NUM_SMS),
                                          (256, 6, 8, 2 * NUM_SMS)):
            if bq >= 64 and stages > 6:
                stages = 6
            out.append(GemmConfig(bp, bq, _split_for(_cdiv(n, bp), kb, target), warps, stages, swap_ab=True))
        # dequantize-to-BF16 variants moving 128 K per iteration (fewer, larger TMA transactions); the 64-row tile
        # holds 115 registers per thread against 178 (offline sm_90a build), so twice the CTAs fit an SM
        for bp, kg, stages, warps in ((128, 4, 4, 4), (256, 4, 4, 8), (128, 2, 6, 4), (64, 4, 6, 4)):
            if bq >= 64:
                stages = min(stages, 3)
            out.append(GemmConfig(bp, bq, _split_for(_cdiv(n, bp), _cdiv(kb, kg)), warps, stages, swap_ab=True,
                                  dequant_bf16=True, kgroups=kg))
        # the same on build-time tiled weights (one contiguous 4-16 KB block per TMA box)
        for bp, kg, stages, dq in ((128, 4, 4, True), (128, 4, 6, True), (128, 1, 8, False), (64, 4, 6, True)):
            if bq >= 64:
                stages = min(stages, 3)
            out.append(GemmConfig(bp, bq, _split_for(_cdiv(n, bp), _cdiv(kb, kg)), 4, stages, swap_ab=True,
                                  dequant_bf16=dq, kgroups=kg, tiled_w=True))
        if m <= GEMV_MAX_M:
            out += gemv_candidates(n, k)
            if gluon_fits(k):
                out += gluon_decode_candidates(n, k)
    else:
        for cfg in (GemmConfig(128, 128, 1, 8, 4), GemmConfig(64, 128, 1, 4, 6),
                    GemmConfig(128, 256, 1, 8, 3, dequant_bf16=True, kgroups=2),
                    GemmConfig(128, 128, 1, 8, 3, dequant_bf16=True, kgroups=4),
                    GemmConfig(128, 256, 1, 8, 4, dequant_bf16=True)):
            split = _split_for(_cdiv(m, cfg.block_p) * _cdiv(n, cfg.block_q), _cdiv(kb, cfg.kgroups), target=NUM_SMS)
            out.append(dataclasses.replace(cfg, split_k=split))
        if gluon_fits(k):
            out += GLUON_SPACE
        if sm90_fits(n):
            out += SM90_SPACE
    # one FP8 MMA per 64 / 128 K, promoted once (the V4 reference's per-128-K promotion); offline sm_90a builds:
    # 80-214 registers, no spills (a 128×256 tile spilled)
    if group == 128:
        grouped = ((GemmConfig(128, max(16, _next_pow2(m)), 1, 4, 6, swap_ab=True, kgroups=4),
                    GemmConfig(128, max(16, _next_pow2(m)), 1, 4, 8, swap_ab=True, kgroups=2)) if m <= 64 else
                   (GemmConfig(128, 128, 1, 8, 3, kgroups=4), GemmConfig(128, 128, 1, 8, 4, kgroups=4),
                    GemmConfig(128, 128, 1, 8, 4, kgroups=2),
                    GemmConfig(64, 128, 1, 4, 4, kgroups=4), GemmConfig(128, 64, 1, 4, 5, kgroups=4)))
        for cfg in grouped:
            tiles = (_cdiv(n, cfg.block_p) if cfg.swap_ab else _cdiv(m, cfg.block_p) * _cdiv(n, cfg.block_q))
            split = _split_for(tiles, _cdiv(kb, cfg.kgroups), target=2 * NUM_SMS if cfg.swap_ab else NUM_SMS)
            out.append(dataclasses.replace(cfg, split_k=split))
    seen, uniq = set(), []
    for c in out:
        if c not in seen:
            seen.add(c)
            uniq.append(c)
    return uniq


# -- the table build writes and serve reads --------------------------------------------------------------------------
class ConfigTable:
    """Serve-side tuned configs with a visible fallback: a key missing from the installed table (or any key while no
    table is installed) gets the caller's default, and that is logged once per key (never silently). Answers are
    kept per call (`args`: the lookup's full arguments) until the next install: serve looks a config up on every
    launch, and a default is derived by walking the tuning space (a full-size rank's untuned decode step spent
    55 of its 275 ms there; benchmarks/README.md, "Session 37")."""

    def __init__(self, what: str, label: Callable[[Hashable], str], logger: logging.Logger):
        self.what, self.label, self.log = what, label, logger
        self.entries: dict | None = None
        self._warned: set = set()
        self._answers: dict = {}

    def install(self, entries: dict | None) -> None:
        self._warned.clear()
        self._answers.clear()
        self.entries = entries

    def get(self, key: Hashable, default: Callable[[], T], tag: Callable[[T], str], args: Hashable = None) -> T:
        if args is not None and args in self._answers:
            return self._answers[args]
        if self.entries is not None and key in self.entries:
            value = self.entries[key]
        else:
            value = default()
            if key not in self._warned:
                self._warned.add(key)
                self.log.warning("%s %s: no tuned entry%s, using the default config %s", self.what, self.label(key),
                                 "" if self.entries is not None else " (no table loaded)", tag(value))
        if args is not None:
            self._answers[args] = value
        return value


def key_str(n: int, k: int, bucket: int) -> str:
    return f"{n}x{k}@{bucket}"


_gemm_table = ConfigTable("fp8 GEMM", lambda key: key_str(*key), log)


def set_table(entries: dict | None) -> None:
    """Install tuned entries {"NxK@bucket": {"path": "fp8"|"bf16cache", "config": {...}}} (None: no table)."""
    if entries is None:
        _gemm_table.install(None)
        return
    t = {}
    for key, val in entries.items():
        nk, b = key.split("@")
        n, k = (int(v) for v in nk.split("x"))
        path = val.get("path", "fp8")
        assert path in PATHS, path
        t[(n, k, int(b))] = (path, GemmConfig.from_dict(val.get("config", {})))
    _gemm_table.install(t)


def lookup(n: int, k: int, m: int, arch: str | None = None, group: int = 32) -> tuple[str, GemmConfig]:
    """(path, config) for a GEMM of M tokens on `arch` (the running GPU's) whose scales are constant over `group`
    K; falls back to ("fp8", default_config) and logs that once per key."""
    return _gemm_table.get((n, k, m_bucket(m)), lambda: ("fp8", default_config(n, k, m, arch, group)),
                           lambda v: v[1].tag(), args=(n, k, m, arch, group))


def get_config(n: int, k: int, m: int, arch: str | None = None, group: int = 32) -> GemmConfig:
    return lookup(n, k, m, arch, group)[1]
