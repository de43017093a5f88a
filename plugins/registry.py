"""The plugin ops as `torch.library` custom ops (namespace `dsflash`), each with a fake (meta) implementation.

CUDA tensors run the Triton kernels (their modules are imported on first use, so importing this file needs no
Triton); CPU tensors run the plain-PyTorch `*_ref` functions. Ops are functional (fresh outputs, no aliasing), allocate
only their outputs and never sync with the host, so they can be captured in CUDA graphs and traced by torch.compile.
Call them as `torch.ops.dsflash.<name>(...)` after `import dsflash.plugins.registry`. `eager_ops` holds the same
functions undecorated: an eager caller that is not being traced skips the dispatcher's ~25 µs per call (H200 host;
benchmarks/README.md, "Session 37").
"""
from __future__ import annotations

import functools
import types
from typing import Callable, Optional

import torch
from torch import Tensor

from dsflash.plugins import refs

QBLOCK = refs.QBLOCK
NS = 4


_EAGER: dict[str, Callable] = {}


def _custom_op(name: str):
    """`torch.library.custom_op(name)` (the ops mutate nothing) that also keeps the plain function for `eager_ops`."""
    def wrap(fn):
        _EAGER[name.split("::")[1]] = fn
        return torch.library.custom_op(name, mutates_args=())(fn)
    return wrap


def _scale_dtype(e8m0: bool) -> torch.dtype:
    return refs.E8M0 if e8m0 else torch.float32


# -- activation quantization ------------------------------------------------------------------------------------------
@_custom_op("dsflash::act_quant")
def act_quant(x: Tensor, scale_e8m0: bool = False, block: int = QBLOCK) -> tuple[Tensor, Tensor]:
    """x [..., K] -> (e4m3 [..., K], scales [..., K/32] fp32 | e8m0), one scale per 1×block (32 or 128)."""
    fmt = "e8m0" if scale_e8m0 else "fp32"
    if x.is_cuda:
        from dsflash.plugins.act_quant import act_quant as k
        return k(x, fmt, block=block)
    return refs.act_quant_ref(x, fmt, block)


@act_quant.register_fake
def _(x, scale_e8m0=False, block=QBLOCK):
    return (x.new_empty(x.shape, dtype=refs.E4M3),
            x.new_empty((*x.shape[:-1], x.shape[-1] // QBLOCK), dtype=_scale_dtype(scale_e8m0)))


@_custom_op("dsflash::rmsnorm_act_quant")
def rmsnorm_act_quant(x: Tensor, weight: Tensor, eps: float, scale_e8m0: bool = False, block: int = QBLOCK
                      ) -> tuple[Tensor, Tensor, Tensor]:
    """RMSNorm -> x.dtype -> FP8 1×block: (y [..., K], e4m3 [..., K], scales [..., K/32])."""
    fmt = "e8m0" if scale_e8m0 else "fp32"
    if x.is_cuda:
        from dsflash.plugins.act_quant import rmsnorm_act_quant as k
        return k(x, weight, eps, fmt, block)
    return refs.rmsnorm_act_quant_ref(x, weight, eps, fmt, block)


@rmsnorm_act_quant.register_fake
def _(x, weight, eps, scale_e8m0=False, block=QBLOCK):
    return (torch.empty_like(x), x.new_empty(x.shape, dtype=refs.E4M3),
            x.new_empty((*x.shape[:-1], x.shape[-1] // QBLOCK), dtype=_scale_dtype(scale_e8m0)))


@_custom_op("dsflash::rmsnorm")
def rmsnorm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim (K % 32 == 0) in fp32, rounded to x.dtype: the model's `RMSNorm` in one launch."""
    if x.is_cuda:
        from dsflash.plugins.act_quant import rmsnorm as k
        return k(x, weight, eps)
    return refs.rmsnorm_ref(x, weight, eps)


@rmsnorm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@_custom_op("dsflash::rmsnorm_pair")
def rmsnorm_pair(a: Tensor, wa: Tensor, b: Tensor, wb: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Two RMSNorms (e.g. q_norm and kv_norm over the stacked wq_a|wkv output's column slices) in one launch."""
    if a.is_cuda:
        from dsflash.plugins.act_quant import rmsnorm_pair as k
        return k(a, wa, b, wb, eps)
    return refs.rmsnorm_pair_ref(a, wa, b, wb, eps)


@rmsnorm_pair.register_fake
def _(a, wa, b, wb, eps):
    return a.new_empty(a.shape), b.new_empty(b.shape)


@_custom_op("dsflash::clipped_swiglu")
def clipped_swiglu(g: Tensor, u: Tensor, limit: float) -> Tensor:
    """The shared expert's silu(min(g, L)) · clamp(u, ±L) in fp32, rounded to BF16 (deploy numerics, before w2)."""
    if g.is_cuda:
        from dsflash.plugins.swiglu import clipped_swiglu as k
        return k(g, u, limit)
    return refs.clipped_swiglu_ref(g, u, limit).to(torch.bfloat16)


@clipped_swiglu.register_fake
def _(g, u, limit):
    return g.new_empty(g.shape, dtype=torch.bfloat16)


@_custom_op("dsflash::act_quant_dequant")
def act_quant_dequant(x: Tensor, weight: Optional[Tensor] = None, eps: float = 0.0, block: int = QBLOCK) -> Tensor:
    """(RMSNorm ->) FP8 1×block quantize -> dequantize, in x.dtype: the BF16-cache GEMM's activation."""
    if x.is_cuda:
        from dsflash.plugins.act_quant import act_quant_dequant as k
        return k(x, weight, eps, block)
    return refs.act_quant_dequant_ref(x, weight, eps, block)


@act_quant_dequant.register_fake
def _(x, weight=None, eps=0.0, block=QBLOCK):
    return torch.empty_like(x)


# -- GEMMs ------------------------------------------------------------------------------------------------------------
@_custom_op("dsflash::fp8_gemm")
def fp8_gemm(a_q: Tensor, a_s: Tensor, w_q: Tensor, w_s: Tensor, group: int = QBLOCK) -> Tensor:
    """Group-32 FP8 GEMM: e4m3 [M, K] (1×32 scales) × e4m3 [N, K] (32×32 e8m0) -> bf16 [M, N]; tiles from tuning.
    group 128: the scales are V4's 1×128 / 128×128 ones in that format (fewer promotions)."""
    if a_q.is_cuda:
        from dsflash.plugins.fp8_gemm import fp8_gemm as k
        return k(a_q, a_s, w_q, w_s, group=group)
    return refs.fp8_gemm_ref(a_q, a_s, w_q, w_s)


@fp8_gemm.register_fake
def _(a_q, a_s, w_q, w_s, group=QBLOCK):
    return a_q.new_empty((a_q.shape[0], w_q.shape[0]), dtype=torch.bfloat16)


@_custom_op("dsflash::bf16_cache_gemm")
def bf16_cache_gemm(x: Tensor, w_bf16: Tensor, act_block: int = QBLOCK) -> Tensor:
    """x [M, K] bf16 -> FP8 1×act_block quantize/dequantize -> @ w_bf16ᵀ (BF16 tensor cores) -> bf16 [M, N]."""
    if x.is_cuda:
        from dsflash.plugins.fp8_gemm import bf16_cache_gemm as k
        return k(x, w_bf16, act_block=act_block)
    return refs.bf16_cache_gemm_ref(x, w_bf16, act_block)


@bf16_cache_gemm.register_fake
def _(x, w_bf16, act_block=QBLOCK):
    return x.new_empty((*x.shape[:-1], w_bf16.shape[0]), dtype=torch.bfloat16)


@_custom_op("dsflash::fp8_linear")
def fp8_linear(x: Tensor, w_q: Tensor, w_s: Tensor, w_bf16: Optional[Tensor] = None, act_block: int = QBLOCK,
               w_s_t: Optional[Tensor] = None) -> Tensor:
    """An FP8 linear in deploy numerics: x bf16 [M, K] -> FP8 1×act_block quantize -> GEMM -> bf16 [M, N].

    V4.1: act_block 32, w_s the 32×32 block scales. V4: act_block 128, w_s its 128×128 scales in the kernels'
    32×32 format (`refs.expand_weight_scales`).
    The tuned table (`tuning.lookup`, filled from the engine's tuned.json) picks, per (N, K, M bucket), the FP8
    GEMM with its tile config or the BF16-cache GEMM on `w_bf16` (when the engine holds one); a shape missing
    from the table uses the default FP8 config and is logged once. w_s_t: the weight scales as the sm90 CUDA
    kernel reads them (`fp8_gemm_sm90.weight_scales_f32(w_s, tma=True)`, derived once per weight)."""
    if x.is_cuda:
        from dsflash.plugins import tuning
        from dsflash.plugins.fp8_gemm import bf16_cache_gemm
        n, k = w_q.shape
        path, cfg = tuning.lookup(n, k, x.shape[0], device_arch(x.device), act_block)
        if path == "bf16cache" and w_bf16 is not None:
            return bf16_cache_gemm(x, w_bf16, act_block=act_block)
        return fp8_linear_config(x, w_q, w_s, cfg, act_block, w_s_t)
    return refs.fp8_gemm_ref(*refs.act_quant_ref(x, block=act_block), w_q, w_s)


@functools.cache
def device_arch(device: torch.device) -> str:
    """'sm<major><minor>' of a CUDA device (what `build --arch` names it)."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}"


def fp8_linear_config(x: Tensor, w_q: Tensor, w_s: Tensor, cfg, act_block: int = QBLOCK,
                      w_s_t: Optional[Tensor] = None) -> Tensor:
    """The FP8 path of `fp8_linear` with one GEMM config (what `build` times): the 1×act_block activation
    quantization then the GEMM, or one launch for a quant_in_kernel config (when x suits its TMA: bf16, 16-byte
    aligned rows). The GEMM promotes once per act_block K where the config can (V4's 128-groups). An sm90 config
    takes fp32 activation scales and the weight's transposed fp32 scales (w_s_t; derived per call without it)."""
    if cfg.sm90:
        from dsflash.plugins.act_quant import act_quant
        from dsflash.plugins.fp8_gemm_sm90 import fp8_gemm_sm90_config
        return fp8_gemm_sm90_config(*act_quant(x, "fp32", block=act_block), w_q, w_s, cfg, w_s_t=w_s_t)
    if cfg.quant_in_kernel:
        from dsflash.plugins.fp8_gemm_gluon import bf16_tma_ready, fp8_linear_gluon_decode
        if bf16_tma_ready(x):
            return fp8_linear_gluon_decode(x, w_q, w_s, cfg, act_block=act_block)
    from dsflash.plugins.act_quant import act_quant
    from dsflash.plugins.fp8_gemm import fp8_gemm
    return fp8_gemm(*act_quant(x, "e8m0", codes16=cfg.acc16, block=act_block), w_q, w_s, cfg, group=act_block)


@fp8_linear.register_fake
def _(x, w_q, w_s, w_bf16=None, act_block=QBLOCK, w_s_t=None):
    return x.new_empty((x.shape[0], w_q.shape[0]), dtype=torch.bfloat16)


# -- mHC --------------------------------------------------------------------------------------------------------------
@_custom_op("dsflash::hc_mix")
def hc_mix(xflat: Tensor, fn: Tensor, fn_split: Tensor, base: Tensor, scale: Tensor, iters: int, hc_eps: float,
           norm_eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """mHC coefficients (pre, post, comb) in fp32 from xflat [T, 4·D]. fn [24, 4·D] fp32 (reference path);
    fn_split = hc_split_weight(fn) [3, 32, 4·D] bf16 (kernel path)."""
    if xflat.is_cuda:
        from dsflash.plugins.mhc import hc_mix as k
        return k(xflat, fn_split, base, scale, iters, hc_eps, norm_eps)
    return refs.hc_mix_ref(xflat, fn, base, scale, NS, iters, hc_eps, norm_eps)


@hc_mix.register_fake
def _(xflat, fn, fn_split, base, scale, iters, hc_eps, norm_eps):
    t = xflat.shape[0]
    f = torch.float32
    return xflat.new_empty((t, NS), dtype=f), xflat.new_empty((t, NS), dtype=f), xflat.new_empty((t, NS, NS), dtype=f)


@_custom_op("dsflash::hc_pre")
def hc_pre(X: Tensor, pre: Tensor, norm_weight: Tensor, eps: float) -> Tensor:
    """Collapse Σ_j pre_j·X_j -> RMSNorm -> bf16 [T, D]."""
    if X.is_cuda:
        from dsflash.plugins.mhc import hc_pre as k
        return k(X, pre, norm_weight, eps)
    return refs.hc_pre_ref(X, pre, norm_weight, eps)


@hc_pre.register_fake
def _(X, pre, norm_weight, eps):
    return X.new_empty((X.shape[0], X.shape[2]))


@_custom_op("dsflash::hc_pre_quant")
def hc_pre_quant(X: Tensor, pre: Tensor, norm_weight: Tensor, eps: float, scale_e8m0: bool = False
                 ) -> tuple[Tensor, Tensor, Tensor]:
    """Collapse -> RMSNorm -> (y bf16 [T, D], e4m3 [T, D], scales [T, D/32])."""
    fmt = "e8m0" if scale_e8m0 else "fp32"
    if X.is_cuda:
        from dsflash.plugins.mhc import hc_pre as k
        return k(X, pre, norm_weight, eps, True, fmt)
    return refs.hc_pre_ref(X, pre, norm_weight, eps, True, fmt)


@hc_pre_quant.register_fake
def _(X, pre, norm_weight, eps, scale_e8m0=False):
    t, _, d = X.shape
    return (X.new_empty((t, d)), X.new_empty((t, d), dtype=refs.E4M3),
            X.new_empty((t, d // QBLOCK), dtype=_scale_dtype(scale_e8m0)))


@_custom_op("dsflash::hc_post")
def hc_post(X: Tensor, fx: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """X'_k = post_k·f(x) + Σ_j comb[j,k]·X_j -> [T, 4, D] in X.dtype."""
    if X.is_cuda:
        from dsflash.plugins.mhc import hc_post as k
        return k(X, fx, post, comb)
    return refs.hc_post_ref(X, fx, post, comb)


@hc_post.register_fake
def _(X, fx, post, comb):
    return torch.empty_like(X)


@_custom_op("dsflash::hc_post_pre")
def hc_post_pre(X: Tensor, fx: Tensor, post: Tensor, comb: Tensor, next_pre: Tensor, norm_weight: Tensor,
                eps: float) -> tuple[Tensor, Tensor]:
    """Expand fused with the next site's collapse (V4.1 lagged pre) + RMSNorm: (X' [T, 4, D], y [T, D])."""
    if X.is_cuda:
        from dsflash.plugins.mhc import hc_post as k
        return k(X, fx, post, comb, next_pre, norm_weight, eps)
    return refs.hc_post_ref(X, fx, post, comb, next_pre, norm_weight, eps)


@hc_post_pre.register_fake
def _(X, fx, post, comb, next_pre, norm_weight, eps):
    return torch.empty_like(X), X.new_empty((X.shape[0], X.shape[2]))


@_custom_op("dsflash::hc_post_pre_quant")
def hc_post_pre_quant(X: Tensor, fx: Tensor, post: Tensor, comb: Tensor, next_pre: Tensor, norm_weight: Tensor,
                      eps: float, scale_e8m0: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Expand + next collapse + RMSNorm + FP8: (X' [T, 4, D], y [T, D], e4m3 [T, D], scales [T, D/32])."""
    fmt = "e8m0" if scale_e8m0 else "fp32"
    if X.is_cuda:
        from dsflash.plugins.mhc import hc_post as k
        return k(X, fx, post, comb, next_pre, norm_weight, eps, True, fmt)
    return refs.hc_post_ref(X, fx, post, comb, next_pre, norm_weight, eps, True, fmt)


@hc_post_pre_quant.register_fake
def _(X, fx, post, comb, next_pre, norm_weight, eps, scale_e8m0=False):
    t, _, d = X.shape
    return (torch.empty_like(X), X.new_empty((t, d)), X.new_empty((t, d), dtype=refs.E4M3),
            X.new_empty((t, d // QBLOCK), dtype=_scale_dtype(scale_e8m0)))


# -- MoE (V4.1 router + MXFP4 routed experts) -------------------------------------------------------------------------
@_custom_op("dsflash::moe_router")
def moe_router(x: Tensor, gate_w: Tensor, bias: Tensor, topk: int, route_scale: float, gate_temp: float = 1.0
               ) -> tuple[Tensor, Tensor]:
    """sqrt(softplus(x·Wgᵀ / gate_temp)) + bias -> top-k ids int32 [T, k], weights fp32 [T, k] (normalised, scaled)."""
    if x.is_cuda:
        from dsflash.plugins.moe import router as k
        w, ids, _ = k(x, gate_w, bias, topk, route_scale, gate_temp, xq_layout=None)
        return w, ids
    w, ids = refs.router_ref(x, gate_w, bias, topk, route_scale, gate_temp)
    return w, ids.to(torch.int32)


@moe_router.register_fake
def _(x, gate_w, bias, topk, route_scale, gate_temp=1.0):
    t = x.shape[0]
    return x.new_empty((t, topk), dtype=torch.float32), x.new_empty((t, topk), dtype=torch.int32)


@_custom_op("dsflash::moe")
def moe(x: Tensor, gate_w: Tensor, gate_bias: Optional[Tensor], topk: int, route_scale: float, w13_q: Tensor,
        w13_s: Tensor, w2_q: Tensor, w2_s: Tensor, swiglu_limit: float, inter: int, shared: Optional[Tensor] = None,
        gate_temp: float = 1.0, expert_start: int = 0, qblock: int = 32, hash_ids: Optional[Tensor] = None) -> Tensor:
    """Router + routed MXFP4 experts (w13 stacked [E, 2·I_pad, D/2], w2 [E, D, I_pad/2], e8m0 1×32 scales) + the shared
    expert's output -> fp32 [T, D] before the TP all-reduce; `inter` = the logical intermediate width; gate_bias
    fp32 [E], or [T, E] when tokens select with different biases (V4.1's `bias_vl` on image tokens). Expert
    parallelism: gate_w routes over all experts, w13/w2 hold this rank's block of them from expert_start, and the
    output is this rank's share. V4: qblock 128 (the experts' activations quantized per 1×128) and, on hash-routed
    layers, hash_ids int32 [T, k] (the picks, `tid2eid` of the tokens; gate_bias is then unused and may be None)."""
    if x.is_cuda:
        from dsflash.plugins.moe import moe as k
        return k(x, gate_w, gate_bias, topk, route_scale, w13_q, w13_s, w2_q, w2_s, swiglu_limit, inter, shared,
                 gate_temp, expert_start=expert_start, qblock=qblock, hash_ids=hash_ids)
    ipad = w13_q.shape[1] // 2
    return refs.moe_ref(x, gate_w, gate_bias, topk, route_scale, w13_q[:, :ipad], w13_s[:, :ipad], w13_q[:, ipad:],
                        w13_s[:, ipad:], w2_q, w2_s, swiglu_limit, inter, shared, gate_temp, expert_start, qblock,
                        hash_ids)


@moe.register_fake
def _(x, gate_w, gate_bias, topk, route_scale, w13_q, w13_s, w2_q, w2_s, swiglu_limit, inter, shared=None,
      gate_temp=1.0, expert_start=0, qblock=32, hash_ids=None):
    return x.new_empty(x.shape, dtype=torch.float32)


# -- WO-A -------------------------------------------------------------------------------------------------------------
@_custom_op("dsflash::wo_a")
def wo_a(o: Tensor, cos: Tensor, sin: Tensor, w: Tensor) -> Tensor:
    """Inverse RoPE (last 2·cos.shape[-1] channels of each head) + grouped projection: o [T, H, d] -> [T, G·R]."""
    if o.is_cuda:
        from dsflash.plugins.wo_a import wo_a as k
        return k(o, cos, sin, w)
    return refs.wo_a_ref(o, cos, sin, w, o.dtype)


@wo_a.register_fake
def _(o, cos, sin, w):
    return o.new_empty((o.shape[0], w.shape[0]))


# -- RoPE (+ fake quantization of the rotated rows) -----------------------------------------------------------------
@_custom_op("dsflash::rope_quant")
def rope_quant(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool = False, quant: str = "none",
               block: int = QBLOCK) -> Tensor:
    """RoPE on the last 2·cos.shape[-1] channels of x [..., (H,) d] at the positions of cos / sin [..., rd/2], then
    `quant` ("none", "fp8", "fp4_pow2", "fp4_e4m3") per `block` channels, in x.dtype (`refs.rope_quant_ref`)."""
    if x.is_cuda:
        from dsflash.plugins.rope_quant import rope_quant as k
        return k(x, cos, sin, inverse, quant, block)
    return refs.rope_quant_ref(x, cos, sin, inverse, quant, block)


@rope_quant.register_fake
def _(x, cos, sin, inverse=False, quant="none", block=QBLOCK):
    return torch.empty_like(x)


# -- decode attention over the decode slots ---------------------------------------------------------------------------
@_custom_op("dsflash::slot_attention")
def slot_attention(q: Tensor, ring: Tensor, slot_ids: Tensor, pos: Tensor, kv: Optional[Tensor], sel: Optional[Tensor],
                   sink: Tensor, scale: float) -> Tensor:
    """One decode token per request over its slot's window ring and (kv, sel) top-k entries, with a sink logit:
    q [N, H, d] -> [N, H, d] (`refs.slot_attention_ref`)."""
    if q.is_cuda:
        from dsflash.plugins.slot_attention import slot_attention as k
        return k(q, ring, slot_ids, pos, kv, sel, sink, scale)
    return refs.slot_attention_ref(q, ring, slot_ids, pos, kv, sel, sink, scale)


@slot_attention.register_fake
def _(q, ring, slot_ids, pos, kv, sel, sink, scale):
    return torch.empty_like(q)


@_custom_op("dsflash::slot_index_scores")
def slot_index_scores(q: Tensor, w: Tensor, index_k: Tensor, slot_ids: Tensor, pos: Tensor, ratio: int,
                      scale: float) -> Tensor:
    """An index source's partial scores [N, E] over the decode slots' visible entries (0 past them):
    `refs.slot_index_scores_ref`."""
    if q.is_cuda:
        from dsflash.plugins.slot_index import slot_index_scores as k
        return k(q, w, index_k, slot_ids, pos, ratio, scale)
    return refs.slot_index_scores_ref(q, w, index_k, slot_ids, pos, ratio, scale)


@slot_index_scores.register_fake
def _(q, w, index_k, slot_ids, pos, ratio, scale):
    return q.new_empty((q.shape[0], index_k.shape[1]), dtype=torch.float32)


OPS = ("act_quant", "rmsnorm_act_quant", "rmsnorm", "rmsnorm_pair", "clipped_swiglu", "act_quant_dequant",
       "fp8_gemm", "bf16_cache_gemm", "fp8_linear", "hc_mix", "hc_pre", "hc_pre_quant", "hc_post", "hc_post_pre",
       "hc_post_pre_quant", "moe_router", "moe", "wo_a", "rope_quant", "slot_attention", "slot_index_scores")
assert set(_EAGER) == set(OPS), sorted(set(_EAGER) ^ set(OPS))
eager_ops = types.SimpleNamespace(**_EAGER)
