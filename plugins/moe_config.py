"""Tiles of the MXFP4 MoE expert kernels (`moe.py`): the config, the measured default rule, the candidates build
times, and the table serve looks configs up in. Triton-free (build and CPU tests import it).

`build` times `moe_candidates` per local expert shape and token bucket and records the winners in tuned.json
(`build.tune`, op "moe"); at engine load `set_table` installs them; `lookup` returns a bucket's tuned config, or the
default rule's and says so once in the log.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

from dsflash.plugins.tuning import ConfigTable, k_slices, m_bucket

log = logging.getLogger(__name__)

# Deterministic expert reduction (`set_deterministic`): each (token, expert) pair's output lands in a row of its own
# and the rows are summed in slot order (`moe.pair_sum`) instead of fp32 atomic adds into the token's row, whose
# order varies from run to run
_deterministic = False


def set_deterministic(on: bool) -> None:
    """Make the MoE plugin's expert reduction deterministic on GPUs (serve's batch-invariant mode turns it on, as
    SGLang's deterministic inference does); torch's `use_deterministic_algorithms(True)` does too."""
    global _deterministic
    _deterministic = bool(on)


def deterministic() -> bool:
    """Whether the MoE plugin reduces expert outputs in a fixed order (`set_deterministic`, or torch's flag)."""
    import torch
    return _deterministic or torch.are_deterministic_algorithms_enabled()


@dataclass(frozen=True)
class MoeConfig:
    """Expert-GEMM tiles. gemv: the decode path (one (token, expert) pair per program, CUDA-core GEMV, bn13/bk13
    for the w13 tile of 2·bn13 rows, bn2/bk2 for w2, no token blocks); else the sorted path (block_m tokens of one
    expert per program, MXFP4 dequantized to BF16 in registers by `tl.dot_scaled`, BF16 tensor cores)."""
    gemv: bool = True
    bn13: int = 64
    bk13: int = 128
    bn2: int = 128
    bk2: int = 128
    warps: int = 4          # w13 kernel
    stages: int = 4
    block_m: int = 16
    warps2: int = 4         # w2 kernel
    split13: int = 1        # GEMV K slices (w13: reduced by the tile's last program; w2: atomic adds)
    split2: int = 1
    acc16: bool = False     # GEMV: f16 in-block accumulation (`_mx_gemv16_step`), activations as f16 codes
    stages2: int = 0        # w2 pipelining depth (0: `stages`)
    pdl: bool = False       # GEMV: programmatic dependent launch (each kernel's launch and ramp overlap the tail of
                            # the kernel before it; it waits for that kernel's outputs with griddepcontrol.wait).
                            # Neither a default nor a candidate: in a decode step it costs 1-3 µs per layer at T = 1-8
                            # (benchmarks/README.md, session 15), which `build`'s timing, a launch chained to its own
                            # twin, does not see (it favoured PDL at one TP8 rank's M = 1)
    pdl2: bool = False      # GEMV: w2 alone launched with PDL. Its programs become resident once every w13 program has
                            # started (w13 lets dependents launch at its start), so during w13's last wave and its
                            # split-K tail; the row-per-thread w2 requests its weights before waiting for h. Neither a
                            # default nor a candidate: the op alone runs up to 6 % faster, but in a decode step (the
                            # shared expert on its side stream) it saves nothing at T = 1 / 3 and costs 2.4 µs per
                            # layer at T = 8 (benchmarks/README.md, session 22)
    rows2: bool = False     # GEMV w2 by the row-per-thread-pair Gluon kernel (`moe_gluon`; acc16, short intermediate:
                            # `rows_fit`), warps2 warps of 16 rows
    unroll13: bool = False  # GEMV w13 (acc16): each K slice unrolled, its steps' weights, scales and activations
                            # loaded into registers `stages` steps ahead (no shared-memory staging, no barrier)
    tc13: bool = False      # GEMV w13 on tensor cores (`moe_tc`; acc16, 1×32 blocks, sm_90): 32-row tiles of 128-K
                            # chunks, split13 K slices, the weights by TMA through a ring of `stages` chunks. Neither a
                            # default nor a candidate: on one TP8 rank it matches the CUDA-core GEMV at M = 3 and is
                            # 1.10x slower at M = 8 (H100, benchmarks/README.md, session 46; session 20's register-
                            # staged version was 1.05-1.3x slower everywhere on the H200)
    f8: bool = False        # sorted path on FP8 tensor cores (`moe_f8`, sm90: MXFP4 codes re-biased into e4m3 in
                            # registers, one k32 wgmma per 32-block, fp32 promotion per block); stages: the TMA ring's
                            # depth (stages2 for w2), bn2: w2's output rows per program (64 per tile); block_m 16

    def tag(self) -> str:
        kind = ("gemv16" if self.acc16 else "gemv") if self.gemv else f"mma_m{self.block_m}"
        s2 = f"/{self.stages2}" if self.stages2 and self.stages2 != self.stages else ""
        flags = ("_pdl" if self.pdl else "") + ("_pdl2" if self.pdl2 else "") + ("_rows" if self.rows2 else "") \
            + ("_tc13" if self.tc13 else "") + ("_u13" if self.unroll13 else "") + ("_f8" if self.f8 else "")
        return (f"{kind}_13n{self.bn13}k{self.bk13}w{self.warps}x{self.split13}"
                f"_2n{self.bn2}k{self.bk2}w{self.warps2}x{self.split2}_s{self.stages}{s2}{flags}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "MoeConfig":
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})

    @property
    def xq_layout(self) -> str:
        """The activation layout the config's expert GEMMs read (see `router`)."""
        return ("gemv16" if self.acc16 else "gemv") if self.gemv else "bf16"


def _gemv_split(tiles: int, k_iters: int, target: int = 400, max_split: int = 6) -> int:
    """K slices so that about `target` programs run, keeping >= 2 K steps per slice. (H200 sweep,
    benchmarks/moe_gemv_sweep_h200.json: with 4-warp tiles, ~400 programs is where the latency-bound GEMV stops
    gaining from more warps and starts paying for the split-K reduction.) The count the kernels launch: none of the
    slices of cdiv(k_iters, split) steps is left empty (`k_slices`: 6 of 20 steps -> 5 slices of 4)."""
    return k_slices(k_iters, max(1, min(max_split, k_iters // 2, target // max(tiles, 1))))


def gemv_warps(rows: int, bk: int) -> int:
    """Warps of a decode GEMV tile of `rows` weight rows × bk K: each thread holds 16 weight words (128 codes) per
    step, so the activations it loads are reused over 4 rows (SASS: 8 rows-words per thread or fewer cost more
    instructions per weight element)."""
    return max(1, rows * (bk // 8) // 512)


def _gemv_cfg(bn13: int, bk13: int, bn2: int, bk2: int, stages: int, stages2: int, pairs: int, inter: int,
              dim: int, acc16: bool = True, split2: int | None = None) -> MoeConfig:
    """A decode GEMV config: warps from `gemv_warps` (w13 tiles hold 2·bn13 rows), split-K from the pair count
    (`_gemv_split`) unless given."""
    s13 = _gemv_split(pairs * -(-inter // bn13), dim // bk13)
    s2 = _gemv_split(pairs * -(-dim // bn2), -(-inter // bk2)) if split2 is None else split2
    return MoeConfig(True, bn13, bk13, bn2, bk2, gemv_warps(2 * bn13, bk13), stages, 16, gemv_warps(bn2, bk2), s13,
                     s2, acc16, stages2)


def local_pair_slots(pairs: int, ep: int) -> int:
    """Program rows of an EP rank's decode GEMVs (`moe.router` lists its pairs): the T·k/ep pairs a rank gets on
    average, plus two standard deviations and one, at most all T·k. A rank that gets more (a hot expert) runs the
    extra pairs as second passes of the same programs."""
    if ep <= 1:
        return pairs
    mean = pairs / ep
    return max(1, min(pairs, math.ceil(mean + 2 * math.sqrt(mean)) + 1))


UNROLL_MAX_STEPS = 8   # (20 unrolled steps, one TP8 rank's M = 8 in one slice, ran 1.5x slower: code size)

# f16 in-block sums (`acc16`) only where a token's h has at least this many values (top-k × padded intermediate):
# their ~1e-3 error flips some of h's FP8 codes, and with few values one flip of a dominant one moves the output by
# 1-4 % (a tiny engine's 2 × 64: 2-5 of 160 one-token MoE sites over 1e-2, fp32 sums <= 2.1e-3; V4.1's 1,728-13,824
# and the mid engine's 3,072: <= 6.1e-3; benchmarks/README.md, session 31)
ACC16_MIN_H = 1024


def fp32_sums(cfg: MoeConfig) -> MoeConfig:
    """cfg with fp32 sums: `acc16` off, and with it the flags that need f16 sums (`rows2`, `unroll13`, `tc13`)."""
    return dataclasses.replace(cfg, acc16=False, rows2=False, unroll13=False, tc13=False)


def sums_for_width(cfg: MoeConfig, topk: int, inter: int) -> MoeConfig:
    """cfg, or for narrow experts (top-k × inter < ACC16_MIN_H) its fp32-accumulating GEMV (`fp32_sums`)."""
    if cfg.gemv and cfg.acc16 and topk * inter < ACC16_MIN_H:
        return fp32_sums(cfg)
    return cfg


def unrolled_steps(cfg: MoeConfig, dim: int, inter_pad: int) -> int:
    """The K steps per slice the decode w13 GEMV unrolls (`MoeConfig.unroll13`) for an expert of hidden `dim` and
    padded intermediate `inter_pad`, 0 for its pipelined loop: only f16 tiles without masks (whole tiles and steps)
    whose launched slices (`k_slices`) all hold the same whole number of steps, at most UNROLL_MAX_STEPS, unroll."""
    steps = dim // cfg.bk13
    even = inter_pad % cfg.bn13 == 0 and dim % cfg.bk13 == 0
    if not (cfg.unroll13 and cfg.gemv and cfg.acc16 and even):
        return 0
    split = k_slices(steps, cfg.split13)
    if steps % split:
        return 0
    return steps // split if steps // split <= UNROLL_MAX_STEPS else 0


def rows_fit(inter: int) -> bool:
    """Whether `moe_gluon`'s row-per-thread-pair w2 GEMV takes this (padded) intermediate: rows of a multiple of 8
    words, all held in registers (K <= 512)."""
    return inter % 64 == 0 and inter <= 512


def _div(n: int, want: int, floor: int) -> int:
    """The largest power of two <= want dividing n (at least floor)."""
    b = want
    while b > floor and n % b:
        b //= 2
    return b


def _triton_gemv_default(pairs: int, inter: int, dim: int) -> MoeConfig:
    """The decode default with both GEMVs in Triton (see `default_moe_config`)."""
    bk13 = _div(dim, 256, 32)
    if inter >= 1024:
        return _gemv_cfg(32, bk13, 64, _div(inter, 256, 32), 3, 3, pairs, inter, dim)
    return _gemv_cfg(32, bk13, 256, 128, 3, 1, pairs, inter, dim, split2=2)


def for_qblock(cfg: MoeConfig, qblock: int) -> MoeConfig:
    """cfg with w13 tiles that hold whole qblock-wide quantization blocks of h (V4: 128), the w13 epilogue's unit: a
    narrower tile is widened to qblock rows of w1 and of w3 (GEMV warps resized as `gemv_warps` sizes them)."""
    if cfg.bn13 % qblock == 0:
        return cfg
    if cfg.gemv:
        return dataclasses.replace(cfg, bn13=qblock, warps=gemv_warps(2 * qblock, cfg.bk13))
    return dataclasses.replace(cfg, bn13=qblock, warps=max(cfg.warps, 8))


# The sorted path on FP8 tensor cores (`moe_f8`): 16-token blocks, 2 TMA stages of weights, 256 output rows per w2
# program: the best or within 1 % of it at one TP8 rank and TP1, M = 257 / 1024 / 4096, 2.0-2.4x the BF16-MMA
# default (H100, benchmarks/moe_f8_tma_s44_h100.json)
F8_SORTED = MoeConfig(False, 32, 128, 256, 32, 4, 2, 16, 4, f8=True)


def default_moe_config(t: int, topk: int, n_experts: int, inter: int, dim: int, ep: int = 1,
                       qblock: int = 32, arch: str | None = None) -> MoeConfig:
    """`_default_moe_config` with w13 tiles of whole h quantization blocks (`for_qblock`) and, for narrow experts,
    fp32 sums (`sums_for_width`). A decode w13 widened to 128-blocks has a quarter of the tiles, so it splits K
    further (up to 16 slices) for the same number of programs. On arch "sm90" (the running GPU's; None: unknown, as
    on the CPU) the sorted path runs on FP8 tensor cores where its shapes fit (`F8_SORTED`)."""
    cfg = sums_for_width(for_qblock(_default_moe_config(t, topk, n_experts, inter, dim, ep), qblock), topk, inter)
    if not cfg.gemv and arch == "sm90" and f8_fits(inter, dim, qblock):
        return F8_SORTED
    if qblock == 32 or not cfg.gemv:
        return cfg
    pairs = -(-t * topk // ep)
    return dataclasses.replace(cfg, split13=_gemv_split(pairs * -(-inter // cfg.bn13), dim // cfg.bk13,
                                                        1000 if ep > 1 else 400, 16))


def _default_moe_config(t: int, topk: int, n_experts: int, inter: int, dim: int, ep: int = 1) -> MoeConfig:
    """Decode (T·k <= 2E, i.e. about one token per active expert): the f16-accumulating GEMV path with the tiles the
    H200 sweep found best (benchmarks/moe_gemv_sweep_h200.json): w13 32 rows of w1 + 32 of w3 × 256 K per step;
    w2 64 rows × 256 K for a long intermediate (TP1-like); for a short one (one TP8 rank: 320) the row-per-thread-pair
    Gluon w2 (`rows2`, 4 warps): the whole pass 1.05-1.11× faster than with the best Triton w2 tile at M = 1 / 3 / 8
    (benchmarks/moe_w2_rows_s9_h200.json, measured with PDL, which is off since session 15: `MoeConfig.pdl`); else
    256 rows × 128 K, 2 K slices, no cp.async staging.
    Larger M: the sorted BF16-MMA path with 16-token blocks (32/64 once the average expert gets more than ~24/48
    tokens). n_experts is the local count; with ep EP ranks the routing spreads over ep times as many, and about
    1/ep of the (token, expert) pairs run here (the split-K counts aim at those)."""
    if t * topk <= 2 * n_experts * ep:
        pairs = -(-t * topk // ep)
        cfg = _triton_gemv_default(pairs, inter, dim)
        if ep > 1:   # an EP rank's few pairs on its listed-pair grid: w13 wins with ~1000 programs, not 400 (one EP8
            # rank, H200: the winners x5-6 / x3-4 / x2 / x1 at M = 1 / 3 / 8 / 64, benchmarks/moe_ep_s11_h200.json),
            # and so does w2 (x3 / x3 / x2 at M = 1 / 3 / 8: the pass 1.9-6.8 % faster than with one w2 slice,
            # session 19, benchmarks/moe_split_ab_s19_h200.json)
            cfg = dataclasses.replace(cfg, split13=_gemv_split(pairs * -(-inter // cfg.bn13), dim // cfg.bk13, 1000),
                                      split2=_gemv_split(pairs * -(-dim // cfg.bn2), -(-inter // cfg.bk2), 1000))
        return dataclasses.replace(cfg, rows2=True, warps2=4, split2=1) if rows_fit(inter) else cfg
    avg = t * topk / max(1, n_experts * ep)
    bm = 16 if avg <= 24 else (32 if avg <= 48 else 64)
    if bm == 16:   # w2 in 32-K steps: 3-12 % faster than 64 / 128 at one TP8 rank and TP1, M = 257 / 1024 (H100,
        # benchmarks/moe_sorted_tiles_s43_h100.json)
        return MoeConfig(False, 32, _div(dim, 128, 32), 64, 32, 4, 3, 16, 4)
    return MoeConfig(False, 64, _div(dim, 128, 32), 128, _div(inter, 128, 32), 8, 3, bm, 8)


def moe_candidates(t: int, topk: int, n_experts: int, inter: int, dim: int, ep: int = 1,
                   qblock: int = 32, arch: str | None = None) -> list[MoeConfig]:
    """Tile candidates the bench and `build` time (the default first): the fp32-accumulating GEMV at the default
    tiles and at the previous default tiles, other f16 tilings, other split-K counts; for a short intermediate the
    row-per-thread w2 at other warp counts and the Triton w2 tiles it replaced as the default. Where the default is
    the sorted path (larger M), its tiles around the default (`_sorted_candidates`) and, for V4.1's shapes, the sorted
    path on FP8 tensor cores (`moe_f8`) at other ring depths and w2 widths. With V4's qblock 128 every w13
    tile is widened to whole 128-blocks of h (`for_qblock`). Narrow experts get no f16 sums (`sums_for_width`).
    arch: the GPU's (`default_moe_config`); the FP8 sorted tiles are offered on "sm90" and where it is unknown (None)."""
    out = [default_moe_config(t, topk, n_experts, inter, dim, ep, qblock, arch)]
    out += [sums_for_width(for_qblock(c, qblock), topk, inter)
            for c in _moe_candidates(t, topk, n_experts, inter, dim, ep)]
    if not out[0].gemv and arch in (None, "sm90") and f8_fits(inter, dim, qblock):
        out += [dataclasses.replace(F8_SORTED, stages=st, bn2=bn2)
                for st, bn2 in ((3, 256), (4, 256), (3, 64), (3, 512), (3, 1280), (4, 640))]
    if qblock != 32 and out[0].gemv:   # the widened w13 tiles: other K depths and split counts
        d = out[0]
        for bk in (128, 256, 512):
            if dim % bk == 0:
                c = dataclasses.replace(d, bk13=bk, warps=gemv_warps(2 * d.bn13, bk))
                out += [dataclasses.replace(c, split13=sp) for sp in (1, 2, 4, 8, 16) if sp <= dim // bk]
    return list(dict.fromkeys(out))


def f8_fits(inter_pad: int, dim: int, qblock: int = 32) -> bool:
    """Shapes `moe_f8` runs: 1×32 blocks of h (V4.1), whole 128-K chunks of D, whole 32-blocks of the intermediate."""
    return qblock == 32 and dim % 128 == 0 and inter_pad % 32 == 0


def _sorted_candidates(d: MoeConfig, inter: int) -> list[MoeConfig]:
    """Tiles of the sorted path around its default d: the w13 tile's rows, K depth, warps and pipeline depth, each
    with d's w2; then w2's rows and K depth with d's w13. (H100, one TP8 rank and TP1 at M = 257 / 1024,
    benchmarks/moe_sorted_tiles_s43_h100.json: w2's K step is worth 3-12 %, the w13 tile 0-8 %; 8-warp w13 tiles
    and 256-deep K steps are slower everywhere, kept for other GPUs and shapes.)"""
    out = [dataclasses.replace(d, bn13=bn, bk13=bk, warps=w, stages=st)
           for bn, bk, w, st in ((32, 256, 4, 3), (32, 128, 4, 4), (32, 128, 4, 2), (64, 128, 4, 3), (64, 128, 8, 3))]
    out += [dataclasses.replace(d, bn2=bn, bk2=bk, warps2=w)
            for bn, bk, w in ((64, _div(inter, 64, 32), 4), (64, _div(inter, 128, 32), 4), (128, d.bk2, 8),
                              (256, d.bk2, 8), (32, d.bk2, 4))]
    return out


def _moe_candidates(t: int, topk: int, n_experts: int, inter: int, dim: int, ep: int = 1) -> list[MoeConfig]:
    """The candidates of 1×32 activations (`moe_candidates`), `_default_moe_config` first."""
    first = _default_moe_config(t, topk, n_experts, inter, dim, ep)
    if not first.gemv:
        return [first] + _sorted_candidates(first, inter)
    p = -(-t * topk // ep)   # the pairs this rank runs (all of them without EP): the GEMVs' split-K sizes for them
    out = [first]
    d = first
    if first.rows2:   # the variations below are of the Triton w2 default; the Gluon one varies its warps
        out += [dataclasses.replace(first, warps2=w) for w in (2, 8)]
        d = _triton_gemv_default(p, inter, dim)
        out.append(d)
    old = _gemv_cfg(_div(inter, 64 if inter >= 1024 else 32, 32), _div(dim, 128, 32), _div(dim, 128, 32),
                    _div(inter, 128, 32), 4, 4, p, inter, dim, acc16=False)
    out += [dataclasses.replace(d, acc16=False), old, dataclasses.replace(old, acc16=True),
            dataclasses.replace(d, split13=max(1, d.split13 // 2), split2=1),
            dataclasses.replace(d, split13=min(6, d.split13 + 1)),   # (one EP8 rank's M = 8: x3 2.4 % faster
            # than x2 on some routings, 2.3 % slower on the bench's: benchmarks/moe_split_near_s19_h200.json)
            dataclasses.replace(d, split13=min(6, 2 * d.split13)),
            dataclasses.replace(d, split13=min(6, 4 * d.split13)),
            _gemv_cfg(64, _div(dim, 256, 32), 128, _div(inter, 256, 32), 3, 3, p, inter, dim),
            _gemv_cfg(32, _div(dim, 512, 32), 128, _div(inter, 128, 32), 1, 1, p, inter, dim)]
    if d.acc16:   # w13 slices unrolled with register prefetch, where a slice is short (`unrolled_steps`): up to
        # 5 % faster at one EP8 rank's M = 1 and one TP8 rank's M = 3, slower elsewhere (session 21,
        # benchmarks/moe_unroll_s21_h200.json)
        for c in (dataclasses.replace(first, unroll13=True, stages=2),
                  dataclasses.replace(first, unroll13=True, split13=min(6, 2 * first.split13))):
            if unrolled_steps(c, dim, inter):
                out.append(c)
    # (Measured and dropped, H200 session 8: w2 in one K step per program for a short intermediate, 1.06-1.16x slower
    # at TP8 M = 1 / 3 / 8; w2 with one program per token instead of per pair, benchmarks/moe_w2_by_token_s8_h200.json.)
    return list(dict.fromkeys(out))


# -- the table build writes and serve reads --------------------------------------------------------------------------
def key_str(n_experts: int, inter: int, dim: int, topk: int, bucket: int, ep: int = 1, qblock: int = 32) -> str:
    """Table key of a local expert shape (E experts, padded intermediate, hidden, top-k; over ep EP ranks; V4's
    1×128 activation blocks) at a token bucket."""
    return (f"E{n_experts}xI{inter}xD{dim}k{topk}" + (f"ep{ep}" if ep > 1 else "") + (f"q{qblock}" if qblock != 32
                                                                                          else "") + f"@{bucket}")


_moe_table = ConfigTable("moe", str, log)


def set_table(entries: dict | None) -> None:
    """Install tuned configs {key_str(...): MoeConfig dict} (None: no table)."""
    _moe_table.install(None if entries is None else {k: MoeConfig.from_dict(v) for k, v in entries.items()})


def lookup(t: int, topk: int, n_experts: int, inter: int, dim: int, ep: int = 1, qblock: int = 32,
           arch: str | None = None) -> MoeConfig:
    """The config for T tokens: the tuned one of the bucket, else `default_moe_config` (logged once per key)."""
    return _moe_table.get(key_str(n_experts, inter, dim, topk, m_bucket(t), ep, qblock),
                          lambda: default_moe_config(t, topk, n_experts, inter, dim, ep, qblock, arch), MoeConfig.tag,
                          args=(t, topk, n_experts, inter, dim, ep, qblock, arch))
