"""Building blocks shared by the V4 and V4.1 reference models: numerics, parallel linears, RoPE, mHC, MoE, attention.

Everything here is plain PyTorch and defines the numerics the Triton plugins must reproduce. Parallel layers take a
`Mapping` (local shapes) and a `Comm` (visible reductions, fp32), never globals.
"""
from __future__ import annotations

import functools

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from dsflash.model_def.mapping import Mapping, split_range
from dsflash.model_def.quant import fake_quant_fp8

NUMERICS_MODES = ("hf", "deploy")


def wide(x: torch.Tensor) -> torch.Tensor:
    """The dtype of "fp32 math": fp32, or fp64 when the model runs in fp64 (exactness tests build it so)."""
    return x if x.dtype == torch.float64 else x.float()


def wide_weight(w: torch.Tensor) -> torch.Tensor:
    """`wide(w)` of a weight that fp32 math reads in every forward (the vocabulary head, the compressors, the
    router), made once and kept beside it, as the official reference upcasts these at load: a BF16 engine would
    otherwise cast the 129280-row head (1.3 GB in, 2.6 GB out) in every decode step. Rebuilt when w changes in place
    or moves; not kept while autograd records (training)."""
    if w.dtype in (torch.float32, torch.float64):
        return w
    if torch.is_grad_enabled() and w.requires_grad:
        return wide(w)
    key = (w.data_ptr(), w._version, w.device)
    kept = getattr(w, "_dsflash_wide", None)
    if kept is None or kept[0] != key:
        kept = (key, wide(w))
        w._dsflash_wide = kept
    return kept[1]


@dataclass(frozen=True)
class Numerics:
    """`hf`: what transformers computes. `deploy`: + FP8 1×act_block activation quantization before FP8/FP4 linears."""
    mode: str = "hf"
    act_block: int = 32

    def __post_init__(self) -> None:
        if self.mode not in NUMERICS_MODES:
            raise ValueError(f"numerics must be one of {NUMERICS_MODES}, got {self.mode!r}")

    @property
    def deploy(self) -> bool:
        return self.mode == "deploy"

    def act_in(self, x: torch.Tensor, quantized: bool) -> torch.Tensor:
        if not (self.deploy and quantized):
            return x
        # The reference rounds the activation to BF16 before act_quant; it is BF16 everywhere in deploy.
        return fake_quant_fp8(x.to(torch.bfloat16).to(x.dtype), self.act_block)


class Comm(Protocol):
    tp_size: int
    tp_rank: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...


class LocalComm:
    """One rank: reductions are identities."""
    tp_size = 1
    tp_rank = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


class CommCounts:
    """What a TP comm's all-reduces moved: calls, and messages by size in bytes (the fp32 message as sent)."""

    def __init__(self) -> None:
        self.calls = 0
        self.by_size: dict[int, int] = {}

    def add(self, nbytes: int) -> None:
        self.calls += 1
        self.by_size[nbytes] = self.by_size.get(nbytes, 0) + 1

    @property
    def bytes(self) -> int:
        return sum(b * n for b, n in self.by_size.items())


class DistComm:
    """torch.distributed TP group (gloo on CPU, NCCL on GPU); sums in fp32 as the numerics policy requires."""

    def __init__(self, mapping: Mapping, group=None):
        self.tp_size, self.tp_rank, self.group = mapping.tp_size, mapping.tp_rank, group
        self.counts, self.gathers = CommCounts(), CommCounts()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return x
        import torch.distributed as dist
        y = wide(x).contiguous()
        self.counts.add(y.numel() * y.element_size())
        dist.all_reduce(y, group=self.group)
        return y.to(x.dtype)

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' equal slices of the last dim joined in rank order (the vocabulary head's logits)."""
        import torch.distributed as dist
        y = x.contiguous()
        parts = [torch.empty_like(y) for _ in range(self.tp_size)]
        self.gathers.add(y.numel() * y.element_size() * self.tp_size)
        dist.all_gather(parts, y, group=self.group)
        return torch.cat(parts, -1)


class SimulatedComm:
    """One rank of a TP group run alone (the TP8-rank simulation, design.md §5): every all-reduce is a local no-op on
    the message DistComm would send (the rank's own partial sum passes on, so the values are not the model's), and is
    counted; `wait(nbytes)`, when given, then spends the measured time of that collective (`bench collectives`)."""

    def __init__(self, mapping: Mapping, wait=None):
        self.tp_size, self.tp_rank = mapping.tp_size, mapping.tp_rank
        self.counts, self.gathers = CommCounts(), CommCounts()
        self.wait = wait

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return x
        y = wide(x).contiguous()
        nbytes = y.numel() * y.element_size()
        self.counts.add(nbytes)
        if self.wait is not None:
            self.wait(nbytes)
        return y.to(x.dtype)

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """A gather's output shape, this rank's slice repeated; waits as an all-reduce of half the output's bytes
        (a ring all-gather moves half of what a ring all-reduce of the same size does)."""
        nbytes = x.numel() * x.element_size() * self.tp_size
        self.gathers.add(nbytes)
        if self.wait is not None:
            self.wait(nbytes // 2)
        return x.repeat(*([1] * (x.dim() - 1)), self.tp_size)


def gather_last(comm, x: torch.Tensor, total: int) -> torch.Tensor:
    """Join the TP ranks' equal slices [..., total / tp] of the last dim, in rank order -> [..., total]: the comm's
    own all-gather where it has one, else the sum of each rank's slice placed among zeros (an all-reduce)."""
    if comm.tp_size == 1:
        return x
    gather = getattr(comm, "all_gather_last", None)
    if gather is not None:
        return gather(x)
    full = x.new_zeros(*x.shape[:-1], total)
    start = comm.tp_rank * x.shape[-1]
    full[..., start:start + x.shape[-1]] = x
    return comm.all_reduce(full)


def tp_of(mapping: Mapping | None) -> tuple[int, int]:
    return (1, 0) if mapping is None else (mapping.tp_size, mapping.tp_rank)


def local_slice(total: int, mapping: Mapping | None) -> tuple[int, int]:
    """[start, stop) of this TP rank's share of `total` (must divide)."""
    tp, rank = tp_of(mapping)
    return split_range(total, tp, rank)


# -- norms -------------------------------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dim in fp32; returns fp32."""
    xf = wide(x)
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return y if weight is None else y * wide(weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        # kept in fp32 although stored BF16: the reference upcasts norm weights at load
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.plugin: nn.Module | None = None   # dispatch.FusedRMSNorm, attached by an engine loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.plugin is not None:
            return self.plugin(x, self.weight, self.eps)
        return rms_norm(x, self.eps, self.weight).to(x.dtype)


# -- linears -----------------------------------------------------------------------------------------------------
class Linear(nn.Module):
    """y = x·Wᵀ (+ b). `weight` holds dequantized values; `quant` names the on-disk format (None/'fp8'/'fp4')."""

    def __init__(self, in_features: int, out_features: int, numerics: Numerics, quant: str | None = None,
                 bias: bool = False, dtype: torch.dtype = torch.float32):
        super().__init__()
        assert quant in (None, "fp8", "fp4"), quant
        self.in_features, self.out_features, self.numerics, self.quant = in_features, out_features, numerics, quant
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=torch.float32)) if bias else None
        self.plugin: nn.Module | None = None   # dispatch.FP8Linear, attached by an engine loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.plugin is not None:
            y = self.plugin(x).to(self.weight.dtype)
        else:
            x = self.numerics.act_in(x, self.quant is not None)
            y = F.linear(x.to(self.weight.dtype), self.weight)
        return y if self.bias is None else y + self.bias.to(y.dtype)


class ColumnParallelLinear(Linear):
    """Output features split over TP ranks; no communication."""

    def __init__(self, in_features: int, out_features: int, numerics: Numerics, mapping: Mapping | None = None,
                 quant: str | None = None, dtype: torch.dtype = torch.float32):
        start, stop = local_slice(out_features, mapping)
        super().__init__(in_features, stop - start, numerics, quant, dtype=dtype)


class VocabParallelHead(ColumnParallelLinear):
    """The vocabulary head split by rows over the TP ranks, its logits gathered (TRT-LLM's `lm_head` with
    gather_output): each rank reads 1/tp of the 129280 × hidden weight per step instead of all of it. `fp32`: the
    logits in fp32 math on the kept fp32 weight (V4.1's reference), else the model dtype's linear, then fp32 (V4)."""

    def __init__(self, in_features: int, vocab: int, numerics: Numerics, mapping: Mapping | None, comm: Comm | None,
                 fp32: bool, dtype: torch.dtype = torch.float32):
        super().__init__(in_features, vocab, numerics, mapping, None, dtype=dtype)
        self.vocab, self.fp32, self.comm = vocab, fp32, comm or LocalComm()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = F.linear(wide(x), wide_weight(self.weight)) if self.fp32 else super().forward(x).float()
        return gather_last(self.comm, local, self.vocab)


class RowParallelLinear(Linear):
    """Input features split over TP ranks; partial outputs summed in fp32 (or left to the caller)."""

    def __init__(self, in_features: int, out_features: int, numerics: Numerics, mapping: Mapping | None = None,
                 comm: Comm | None = None, quant: str | None = None, reduce_output: bool = True,
                 dtype: torch.dtype = torch.float32):
        start, stop = local_slice(in_features, mapping)
        super().__init__(stop - start, out_features, numerics, quant, dtype=dtype)
        self.comm, self.reduce_output = comm or LocalComm(), reduce_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return self.comm.all_reduce(y) if self.reduce_output else y


# -- RoPE / YaRN -------------------------------------------------------------------------------------------------
def rope_inv_freq(rope_dim: int, base: float, yarn: dict | None = None) -> torch.Tensor:
    """Inverse frequencies of `rope_dim/2` interleaved pairs; YaRN interpolation without mscale when `yarn` is set."""
    inv = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim))
    if not yarn:
        return inv.float()
    factor, orig = float(yarn["factor"]), float(yarn["original_max_position_embeddings"])
    beta_fast, beta_slow = float(yarn["beta_fast"]), float(yarn["beta_slow"])

    def corr_dim(n_rot: float) -> float:
        return rope_dim * math.log(orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr_dim(beta_fast)), 0)
    high = min(math.ceil(corr_dim(beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    smooth = 1 - ramp  # 1 = keep the original frequency (high-frequency pairs), 0 = interpolate by `factor`
    return (inv / factor * (1 - smooth) + inv * smooth).float()


@functools.lru_cache(maxsize=64)
def _rope_table(rope_dim: int, base: float, yarn_items: tuple | None, device: torch.device) -> torch.Tensor:
    with torch.device("cpu"):
        inv = rope_inv_freq(rope_dim, base, dict(yarn_items) if yarn_items else None)
    return inv.to(device)


def rope_table(rope_dim: int, base: float, yarn: dict | None, device) -> torch.Tensor:
    """`rope_inv_freq` on `device`, made once per (table, device): computed, never a weight, so a model built on the
    meta device and materialized later needs nothing re-derived."""
    return _rope_table(rope_dim, float(base), tuple(sorted(yarn.items())) if yarn else None, torch.device(device))


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor,
                 dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [..., rd/2] of positions [...] × inv_freq, taken in float64 (the angles reach 1e5+ radians), returned
    in `dtype`. Kept on the positions tensor: a forward's positions are rotated by every layer (queries, keys,
    indexer queries, the output's inverse) with a few tables, so each table's angles are taken once per forward."""
    kept = getattr(positions, "_dsflash_rope", None)
    key = (id(inv_freq), dtype, positions._version)
    if kept is not None and key in kept and kept[key][0] is inv_freq:
        return kept[key][1]
    ang = positions.to(torch.float64).unsqueeze(-1) * inv_freq.to(torch.float64)
    out = (ang.cos().to(dtype), ang.sin().to(dtype))
    if kept is None:
        kept = positions._dsflash_rope = {}
    kept[key] = (inv_freq, out)
    return out


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last `2*len(inv_freq)` channels of x as interleaved pairs at `positions`.

    x: [..., S, d] or [..., S, H, d]; positions: [S] or [B, S] (broadcast against x's leading dims).
    """
    rd = inv_freq.numel() * 2
    cos, sin = rope_cos_sin(positions, inv_freq, wide(x).dtype)   # [.., S, rd/2]
    if inverse:
        sin = -sin
    if x.dim() == positions.dim() + 2:  # heads axis between S and d
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    xf = wide(x)
    r = xf[..., -rd:].reshape(*x.shape[:-1], rd // 2, 2)
    a, b = r[..., 0], r[..., 1]
    rot = torch.stack([a * cos - b * sin, a * sin + b * cos], -1).reshape(*x.shape[:-1], rd)
    return torch.cat([xf[..., :-rd], rot], -1).to(x.dtype)


# -- mHC -----------------------------------------------------------------------------------------------------------
def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """softmax over the last axis + eps, column-normalise, then (iters-1)× row- then column-normalise. fp32."""
    c = wide(logits).softmax(-1) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return c


def hc_mix(xflat: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int,
           hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC coefficients from the flattened streams. xflat: [..., n*D] -> pre [...,n], post [...,n], comb [...,n,n]."""
    xf = wide(xflat)
    r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + norm_eps)
    m = (xf @ fn.to(xf.dtype).t()) * r  # [..., (2+n)*n]
    base, scale = base.to(xf.dtype), scale.to(xf.dtype)
    pre = torch.sigmoid(m[..., :n] * scale[0] + base[:n]) + hc_eps
    post = 2 * torch.sigmoid(m[..., n:2 * n] * scale[1] + base[n:2 * n])
    comb = (m[..., 2 * n:] * scale[2] + base[2 * n:]).unflatten(-1, (n, n))
    return pre, post, sinkhorn(comb, iters, hc_eps)


def hc_collapse(X: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """x = Σ_j pre_j · X_j. X: [..., n, D], pre: [..., n] -> [..., D] in X.dtype."""
    return (wide(pre).unsqueeze(-1) * wide(X)).sum(-2).to(X.dtype)


def hc_expand(X: torch.Tensor, fx: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """X'_k = post_k · f(x) + Σ_j comb[j,k] · X_j. X: [..., n, D], fx: [..., D]."""
    mixed = torch.einsum("...jk,...jd->...kd", wide(comb), wide(X))
    return (wide(post).unsqueeze(-1) * wide(fx).unsqueeze(-2) + mixed).to(X.dtype)


# -- MoE pieces ----------------------------------------------------------------------------------------------------
def sqrtsoftplus(x: torch.Tensor) -> torch.Tensor:
    return torch.sqrt(F.softplus(wide(x)))


def clipped_swiglu(g: torch.Tensor, u: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(g, limit)) · clamp(u, ±limit) in fp32."""
    g, u = wide(g), wide(u)
    if limit > 0:
        u = u.clamp(-limit, limit)
        g = g.clamp(max=limit)
    return F.silu(g) * u


def stacked_or_each(plugin: nn.Module | None, x: torch.Tensor, linears: tuple[Linear, ...]) -> tuple[torch.Tensor, ...]:
    """(lin(x) for lin in linears); with `plugin` (an `FP8Linear` over their row-stacked weights, bound by an engine
    loader) one GEMM whose output is split into theirs: the same dot product per column, one launch and one weight
    stream instead of several. The parts are column views of one [.., Σ N] tensor (rows not contiguous)."""
    if plugin is None:
        return tuple(lin(x) for lin in linears)
    return plugin(x).to(linears[0].weight.dtype).split([lin.out_features for lin in linears], -1)


def norm_pair(plugin: nn.Module | None, norms: tuple[RMSNorm, RMSNorm], xs: tuple[torch.Tensor, torch.Tensor]
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(norms[0](xs[0]), norms[1](xs[1])); with `plugin` (`dispatch.FusedRMSNormPair`, bound by an engine loader) both
    in one launch."""
    if plugin is None:
        return norms[0](xs[0]), norms[1](xs[1])
    return plugin(xs[0], norms[0], xs[1], norms[1])


class Expert(nn.Module):
    """Clipped SwiGLU FFN; the routing weight multiplies h before w2 (as the reference does)."""

    def __init__(self, dim: int, inter: int, numerics: Numerics, quant: str | None, swiglu_limit: float,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.w1 = Linear(dim, inter, numerics, quant, dtype=dtype)
        self.w2 = Linear(inter, dim, numerics, quant, dtype=dtype)
        self.w3 = Linear(dim, inter, numerics, quant, dtype=dtype)
        self.swiglu_limit = swiglu_limit
        self.act_plugin: nn.Module | None = None   # dispatch.FusedSwiGLU (shared experts), attached by an engine loader
        self.w13_plugin: nn.Module | None = None   # dispatch.FP8Linear over [w1; w3] (shared experts), likewise

    def _gate_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x·w1ᵀ, x·w3ᵀ), through `w13_plugin` when bound."""
        return stacked_or_each(self.w13_plugin, x, (self.w1, self.w3))

    def forward(self, x: torch.Tensor, route_weight: torch.Tensor | None = None) -> torch.Tensor:
        g, u = self._gate_up(x)
        if self.act_plugin is not None and route_weight is None and self.w2.numerics.deploy:
            # the deploy-rounded h below in one kernel (no routing weight: it would multiply before the rounding)
            return self.w2(self.act_plugin(g, u, self.swiglu_limit).to(x.dtype))
        h = clipped_swiglu(g, u, self.swiglu_limit)
        if route_weight is not None:
            h = h * wide(route_weight).unsqueeze(-1)
        if self.w2.numerics.deploy:
            h = h.to(torch.bfloat16)  # the reference casts h to BF16 before w2
        return self.w2(h.to(x.dtype))


# -- attention core ------------------------------------------------------------------------------------------------
def sink_attention(q: torch.Tensor, kv: torch.Tensor, allowed: torch.Tensor, sink: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """Softmax attention with a per-head sink logit in the denominator only; K = V = kv.

    q: [B,S,H,d]; kv: [B,T,d]; allowed: [B,S,T] bool; sink: [H] -> [B,S,H,d] (fp32 math, q.dtype out).
    The two products are batched matmuls over [B, S·H, ·] views: the GEMMs einsum would call, without its ~20
    permutes and views (this runs eagerly per layer in every decode step).
    """
    b, s, h, d = q.shape
    qf, kf = wide(q), wide(kv)
    logits = torch.bmm(qf.reshape(b, s * h, d), kf.transpose(1, 2)).view(b, s, h, -1) * scale
    logits = logits.masked_fill(~allowed.unsqueeze(2), float("-inf"))
    sink_l = wide(sink).view(1, 1, -1, 1).expand(b, s, h, 1)
    p = torch.cat([logits, sink_l], -1).softmax(-1)[..., :-1]
    return torch.bmm(p.reshape(b, s * h, -1), kf).view(b, s, h, d).to(q.dtype)


def gather_sink_attention(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
                          scale: float) -> torch.Tensor:
    """Sparse form of `sink_attention`: each query attends to rows `idx` of kv (−1 = empty slot).

    q: [B,S,H,d]; kv: [B,T,d]; idx: [B,S,K] int (−1 padded) -> [B,S,H,d].
    """
    B, S, K = idx.shape
    valid = idx >= 0
    rows = torch.gather(wide(kv), 1, idx.clamp(min=0).reshape(B, S * K, 1).expand(-1, -1, kv.shape[-1]))
    rows = rows.reshape(B, S, K, -1)
    logits = torch.einsum("bshd,bskd->bshk", wide(q), rows) * scale
    logits = logits.masked_fill(~valid.unsqueeze(2), float("-inf"))
    sink_l = wide(sink).view(1, 1, -1, 1).expand(B, S, -1, 1)
    p = torch.cat([logits, sink_l], -1).softmax(-1)[..., :-1]
    return torch.einsum("bshk,bskd->bshd", p, rows).to(q.dtype)
