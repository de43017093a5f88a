"""WO-A grouped output projection at small batch, with the inverse RoPE fused in front (V4.1 §2.4 step 6, §2.9).

z[t, g·R + r] = Σ_i W_a[g·R + r, i] · õ[t, g, i], õ = o with the last RD channels of every head rotated back
(interleaved pairs, angle −θ_t; rounded to o's dtype as the reference does), o viewed as [T, G, (H/G)·d].
Swap-AB tiles: W_a rows (BLOCK_P of one group) on the MMA's M side, by TMA straight into shared memory; the
≤ BLOCK_Q tokens on the N side, loaded, rotated and rounded in registers. Split-K partials go to an fp32 workspace
and the last program of a tile to arrive (an acq_rel counter, reset by that program, so no memset per call) sums
them in a fixed order and writes BF16: one launch, deterministic. On sm90 at T <= 8 the default is the Gluon decode
kernel of `wo_a_gluon` instead (activation slice rotated once per program, weights streamed by a TMA ring: 75-82 % of
copy bandwidth on TP1's 67 MB W_a). Imports Triton: load this module lazily.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from dsflash.plugins.refs import inverse_rope_ref, rope_cos_sin_ref, wo_a_ref  # noqa: F401  (re-exported)
from dsflash.plugins.splitk import split_counter, splitk_store

NUM_SMS = 132


@triton.jit
def _wo_a_kernel(w_desc, o_ptr, cos_ptr, sin_ptr, out_ptr, ws_ptr, cnt_ptr,
                 T, R, KG, HEAD_D, RD, SPLIT,
                 stride_ot, stride_ct, stride_zt, SLAB,
                 BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_q = tl.cdiv(T, BLOCK_Q)
    pid_p = pid // num_q
    pid_q = pid % num_q
    row0 = pid_p * BLOCK_P
    g = row0 // R                                          # BLOCK_P divides R: a tile lies in one group
    offs_q = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    mq = offs_q < T
    tq = offs_q.to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    n_it = KG // BLOCK_K
    per = tl.cdiv(n_it, SPLIT)
    it0 = pid_k * per
    it1 = tl.minimum(it0 + per, n_it)
    acc = tl.zeros([BLOCK_P, BLOCK_Q], dtype=tl.float32)
    for it in tl.range(it0, it1, num_stages=NUM_STAGES):
        k0 = it * BLOCK_K
        w = w_desc.load([row0, k0])                                                  # [BP, BK] bf16
        # inverse RoPE as x[k]·cos + x[k^1]·(±sin): pair (a, b) -> (a·cos + b·sin, b·cos − a·sin)
        ch = (g * KG + k0 + kk) % HEAD_D
        pj = (ch - (HEAD_D - RD)) // 2
        rope = ch >= HEAD_D - RD
        base = o_ptr + tq[None, :] * stride_ot + g * KG + k0
        x = tl.load(base + kk[:, None], mask=mq[None, :], other=0.0).to(tl.float32)         # [BK, BQ]
        xs = tl.load(base + (kk ^ 1)[:, None], mask=mq[None, :], other=0.0).to(tl.float32)  # pair-swapped
        cm = rope[:, None] & mq[None, :]
        cs = tl.load(cos_ptr + tq[None, :] * stride_ct + pj[:, None], mask=cm, other=1.0)
        sn = tl.load(sin_ptr + tq[None, :] * stride_ct + pj[:, None], mask=cm, other=0.0)
        sn = tl.where((kk % 2 == 0)[:, None], sn, -sn)
        xr = (x * cs + xs * sn).to(o_ptr.dtype.element_ty)
        acc = tl.dot(w, xr, acc)
    offs_p = row0 + tl.arange(0, BLOCK_P)
    z_off = tq[None, :] * stride_zt + offs_p[:, None]
    splitk_store(out_ptr, acc, z_off, mq[None, :], ws_ptr, cnt_ptr, pid, pid_k, SPLIT, SLAB)


@dataclass(frozen=True)
class WoAConfig:
    """Triton tiles, or with `gluon` the decode kernel of `wo_a_gluon` (T <= 8, sm90): `boxes` 64-K boxes per ring
    stage, `num_stages`, `split_k` K slices (raised to keep a slice within its shared-memory budget), `pdl`."""
    block_p: int = 128
    block_q: int = 16
    block_k: int = 128
    split_k: int = 1
    num_stages: int = 4
    num_warps: int = 4
    gluon: bool = False
    boxes: int = 0
    pdl: bool = False

    def tag(self) -> str:
        if self.gluon:
            return f"G{self.boxes}x{self.num_stages}s{self.split_k}{'_pdl' if self.pdl else ''}"
        return f"P{self.block_p}Q{self.block_q}K{self.block_k}s{self.split_k}st{self.num_stages}w{self.num_warps}"


def _split_for(tiles: int, k_iters: int, target: int = 2 * NUM_SMS, max_split: int = 16) -> int:
    tiles = max(tiles, 1)    # T = 0 launches nothing, but still asks for a config
    if tiles >= target // 2:
        return 1
    return max(1, min(-(-target // tiles), max(1, k_iters // 2), max_split))


def _rows_tile(r: int, want: int = 128) -> int:
    """The largest power-of-two weight-row tile <= want dividing the rows of one group (tiles stay in a group)."""
    bp = want
    while bp > 16 and r % bp:
        bp //= 2
    assert r % bp == 0, f"rows per group {r} need a multiple of 16"
    return bp


def _gluon_config(rows: int, kg: int, boxes: int, stages: int, per_sm: float, pdl: bool) -> WoAConfig:
    """A Gluon decode config whose K split puts about `per_sm` programs of 64 weight rows on every SM."""
    split = max(1, round(per_sm * NUM_SMS / (rows // 64)))
    return WoAConfig(64, 8, 64, min(split, kg // (64 * boxes)), stages, 4, gluon=True, boxes=boxes, pdl=pdl)


def _gluon_fits(t: int, rows: int, kg: int, r: int | None, head_d: int | None, rd: int | None) -> bool:
    if head_d is None or rd is None:
        return False
    from dsflash.plugins.wo_a_gluon import fits
    return fits(t, rows if r is None else r, kg, head_d, rd)


def default_config(t: int, rows: int, kg: int, r: int | None = None, arch: str | None = None,
                   head_d: int | None = None, rd: int | None = None) -> WoAConfig:
    """On sm90 at T <= 8 (when the heads' RoPE channels fit the kernel's boxes): the Gluon decode kernel, 2 boxes ×
    2 stages, about 3 programs per SM, PDL (H200, V4.1's TP1 and TP8 shapes at T = 1, 3, 8: within 3 % of the best
    candidate, 1.6-2.0x the best Triton tile; benchmarks/README.md "Session 10"). Else Triton: decode (T <= 16)
    128 weight rows × 16 tokens per tile, 128 K per TMA box, 4 stages, split-K up to ~2 programs per SM; larger T
    64-token tiles with 64 K per box (the pipelined activation, its pair swap and cos/sin then fit 3 stages in shared
    memory)."""
    if arch == "sm90" and _gluon_fits(t, rows, kg, r, head_d, rd):
        return _gluon_config(rows, kg, 2, 2, 3.0, True)
    if t <= 16:
        bq, bk, st = 16, (128 if kg % 128 == 0 else 64), 4
    else:
        bq, bk, st = 64, 64, 3
    bp = _rows_tile(rows if r is None else r)
    tiles = (rows // bp) * -(-t // bq)
    return WoAConfig(bp, bq, bk, _split_for(tiles, kg // bk), st, 4)


def candidates(t: int, rows: int, kg: int, r: int | None = None, arch: str | None = None,
               head_d: int | None = None, rd: int | None = None) -> list[WoAConfig]:
    """r: weight rows per group (o_lora_rank; default `rows`): row tiles must divide it. On sm90 at T <= 8 the Gluon
    decode rings come first, then the Triton tiles."""
    out = []
    if arch == "sm90" and _gluon_fits(t, rows, kg, r, head_d, rd):
        out += [_gluon_config(rows, kg, b, st, per_sm, pdl) for b, st in ((2, 3), (1, 3), (2, 2), (1, 4))
                for per_sm in (2.5, 3.0, 4.0) for pdl in (True, False)]
    d = default_config(t, rows, kg, r)
    out.append(d)
    if t <= 16:   # the default holds ~196 KB of shared memory (1 program per SM); these fit 2 per SM
        for bp, bk, st in ((64, 128, 4), (128, 64, 6), (128, 64, 4), (64, 128, 3)):
            if kg % bk == 0 and (rows if r is None else r) % bp == 0:
                tiles = (rows // bp) * -(-t // d.block_q)
                out.append(WoAConfig(bp, d.block_q, bk, _split_for(tiles, kg // bk), st, 4))
    return list(dict.fromkeys(out))


def _arch(device: torch.device) -> str | None:
    if device.type != "cuda":
        return None
    from dsflash.plugins.registry import device_arch
    return device_arch(device)


def wo_a(o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, w: torch.Tensor,
         config: WoAConfig | None = None) -> torch.Tensor:
    """o [T, H, d] BF16 (attention output, query-rotated), cos/sin [T, RD/2] fp32 (`rope_cos_sin_ref`), w = W_a
    [G·R, (H/G)·d] BF16 contiguous -> z [T, G·R] BF16 (`wo_a_ref`). Calls on one stream at a time (the split-K
    counters are shared per device)."""
    assert o.dim() == 3 and o.dtype == torch.bfloat16 and o.is_contiguous(), (tuple(o.shape), o.dtype)
    assert w.dim() == 2 and w.dtype == torch.bfloat16 and w.is_contiguous(), (tuple(w.shape), w.dtype)
    t, h, d = o.shape
    rows, kg = w.shape
    assert (h * d) % kg == 0, f"W_a in-features {kg} must divide H·d = {h * d}"
    g = h * d // kg
    assert rows % g == 0, (rows, g)
    r = rows // g
    assert cos.shape == sin.shape and cos.shape[0] == t and cos.dtype == sin.dtype == torch.float32
    assert cos.stride(1) == 1 and sin.stride(1) == 1 and cos.stride(0) == sin.stride(0)
    rd = 2 * cos.shape[1]
    assert 0 < rd <= d and rd % 2 == 0
    cfg = config or default_config(t, rows, kg, r, _arch(o.device), d, rd)
    if cfg.gluon and t > 0:
        assert o.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0, "the Gluon WO-A kernel reads o and W_a by TMA"
        from dsflash.plugins.wo_a_gluon import wo_a_gluon_decode
        return wo_a_gluon_decode(o, cos, sin, w, r, cfg.boxes, cfg.num_stages, cfg.split_k, cfg.pdl)
    assert r % cfg.block_p == 0 and kg % cfg.block_k == 0, (cfg, r, kg)
    out = torch.empty((t, rows), dtype=torch.bfloat16, device=o.device)
    if t == 0:
        return out
    num_q = triton.cdiv(t, cfg.block_q)
    tiles = (rows // cfg.block_p) * num_q
    split = max(1, min(cfg.split_k, kg // cfg.block_k))
    ws = torch.empty((split, t, rows), dtype=torch.float32, device=o.device) if split > 1 else out
    cnt = split_counter(o.device, tiles, "wo_a") if split > 1 else out
    w_desc = TensorDescriptor(w, [rows, kg], [kg, 1], [cfg.block_p, cfg.block_k])
    _wo_a_kernel[(tiles, split)](
        w_desc, o, cos, sin, out, ws, cnt,
        t, r, kg, d, rd, split,
        h * d, cos.stride(0), rows, t * rows,
        BLOCK_P=cfg.block_p, BLOCK_Q=cfg.block_q, BLOCK_K=cfg.block_k, NUM_STAGES=cfg.num_stages,
        num_warps=cfg.num_warps)
    return out
