"""Plain-PyTorch references (`*_ref`) of the Hopper plugin ops: the deploy numerics the kernels must reproduce.

Triton-free and self-contained (no import from the other dsflash packages), so the CPU CI can test them. The
semantics equal `dsflash.model_def.quant` / `dsflash.model_def.layers` (tests/kernels/test_refs.py checks that):
FP8 e4m3 (max 448), power-of-two scales 2^ceil(log2(max(amax, 1e-4)/448)) from the fp32 bit pattern, RNE rounding,
RMSNorm in fp32 rounded to the activation dtype (BF16) before quantization, mHC coefficient math in fp32.
"""
from __future__ import annotations

import functools

import torch

FP8_MAX = 448.0
FP8_MIN_AMAX = 1e-4
QBLOCK = 32  # V4.1: activations 1×32, weights 32×32; the kernels' scale format for V4's 1×128 / 128×128 too
ACT_BLOCKS = (32, 128)   # activation quantization blocks the kernels implement (V4.1, V4)
E4M3 = torch.float8_e4m3fn
E8M0 = torch.float8_e8m0fnu


# -- scales ---------------------------------------------------------------------------------------------------------
def pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(x)) for positive normal fp32 x, from the bit pattern (exact)."""
    bits = x.float().contiguous().view(torch.int32)
    exp = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), exp)


def fp8_pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """Power-of-two FP8 scale s with amax/s <= 448 (fp32), as the official act_quant computes it."""
    return pow2_ceil(torch.clamp(amax.float(), min=FP8_MIN_AMAX) / FP8_MAX)


def scale_to_e8m0(s: torch.Tensor) -> torch.Tensor:
    """fp32 powers of two -> float8_e8m0fnu (the biased exponent byte)."""
    return ((s.float().contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8).view(E8M0)


def scale_to_fp32(s: torch.Tensor) -> torch.Tensor:
    """fp32 scales unchanged; e8m0 (or its uint8 bytes) -> fp32 powers of two (no host sync, byte 255 not checked)."""
    if s.dtype == torch.float32:
        return s
    byte = s.view(torch.uint8) if s.dtype == E8M0 else s
    return torch.ldexp(torch.ones(byte.shape, dtype=torch.float32, device=byte.device), byte.to(torch.int32) - 127)


def _blocks(x: torch.Tensor, block: int = QBLOCK) -> torch.Tensor:
    if x.shape[-1] % block:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of the quantization block {block}")
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _expand_cols(s: torch.Tensor, block: int = QBLOCK) -> torch.Tensor:
    return s.repeat_interleave(block, -1)


# -- activation quantization ----------------------------------------------------------------------------------------
def act_quant_ref(x: torch.Tensor, scale_fmt: str = "fp32", block: int = QBLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (K % 32 == 0) -> (e4m3 [..., K], scales [..., K/32] fp32 or e8m0): pow2 quantization per 1×`block`.

    block 32 (V4.1) or 128 (V4). The scales always come one per 32 columns, the kernels' format: a 128-block's scale
    is written for each of its four 32-blocks. A K that is not a multiple of `block` ends in a short block (as zero
    padding would: zeros never raise amax), as the V4 reference quantizes its ragged tiny-preset widths."""
    assert block % QBLOCK == 0, f"activation block {block} must be a multiple of {QBLOCK}"
    xb = _blocks(x)
    amax = xb.abs().amax(-1)                                   # [..., K/32]
    if block != QBLOCK:
        g = block // QBLOCK
        tail = -amax.shape[-1] % g
        padded = torch.nn.functional.pad(amax, (0, tail))
        amax = padded.reshape(*amax.shape[:-1], -1, g).amax(-1).repeat_interleave(g, -1)[..., :amax.shape[-1]]
    s = fp8_pow2_scale(amax)
    q = (xb / s.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(E4M3).reshape(x.shape)
    return q, (scale_to_e8m0(s) if scale_fmt == "e8m0" else s)


def codes16_ref(q: torch.Tensor) -> torch.Tensor:
    """e4m3 activation codes -> the same values × 2^-8 as f16 (exact: e4m3 subnormals stay f16 subnormals), the
    activation format of the f16-accumulating GEMV (`GemmConfig.acc16`)."""
    return (q.float() * 2.0 ** -8).to(torch.float16)


def act_dequant_ref(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """(e4m3 [..., K], scales [..., K/32]) -> values in `dtype` (exact for bf16: e4m3 times a power of two)."""
    return (q.float() * _expand_cols(scale_to_fp32(s))).to(dtype)


def act_fake_quant_ref(x: torch.Tensor, block: int = QBLOCK) -> torch.Tensor:
    """Quantize then dequantize (same shape and dtype): what deploy numerics feed an FP8-weight linear."""
    q, s = act_quant_ref(x, block=block)
    return act_dequant_ref(q, s, x.dtype)


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in fp32 (weight upcast to fp32), rounded to x.dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def rmsnorm_pair_ref(a: torch.Tensor, wa: torch.Tensor, b: torch.Tensor, wb: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Two RMSNorms (`rmsnorm_ref`), the pair `rmsnorm_pair` runs in one launch."""
    return rmsnorm_ref(a, wa, eps), rmsnorm_ref(b, wb, eps)


def act_quant_dequant_ref(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 0.0,
                          block: int = QBLOCK) -> torch.Tensor:
    """(optional RMSNorm ->) FP8 1×`block` quantize -> dequantize to x.dtype (the BF16-cache GEMM's activation)."""
    return act_fake_quant_ref(x if weight is None else rmsnorm_ref(x, weight, eps), block)


def rmsnorm_act_quant_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, scale_fmt: str = "fp32",
                          block: int = QBLOCK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """norm -> BF16 -> per-1×`block` FP8 (e.g. q_norm -> wq_b). Returns (y [..., K] x.dtype, q e4m3, scales)."""
    y = rmsnorm_ref(x, weight, eps)
    q, s = act_quant_ref(y, scale_fmt, block)
    return y, q, s


# -- group-32 FP8 dense GEMM ----------------------------------------------------------------------------------------
def quant_weight_fp8_ref(w: torch.Tensor, block: int = QBLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [N, K] (K a multiple of 32) -> (e4m3 [N, K], e8m0 [ceil(N/32), K/32]) with pow2 `block`×`block` scales
    (32: V4.1, 128: V4; ragged edges as zero padding), in the kernels' 32×32 format (`expand_weight_scales`)."""
    n, k = w.shape
    bn, bk = -(-n // block), -(-k // block)
    pad = torch.zeros(bn * block, bk * block, dtype=torch.float32, device=w.device)   # ragged edges: zeros
    pad[:n, :k] = w.float()
    s = fp8_pow2_scale(pad.reshape(bn, block, bk, block).abs().amax((1, 3)))   # [N/b, K/b]
    q = w.float() / s.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return q.clamp(-FP8_MAX, FP8_MAX).to(E4M3), expand_weight_scales(scale_to_e8m0(s), n, k, block)


def expand_weight_scales(w_s: torch.Tensor, n: int, k: int, block: int) -> torch.Tensor:
    """e8m0 `block`×`block` weight scales [ceil(N/b), ceil(K/b)] (V4: b = 128; ragged edges allowed) -> the 32×32
    scales [ceil(N/32), K/32] the kernels read (each value repeated over its block's 32×32 sub-blocks: exact)."""
    assert block % QBLOCK == 0 and k % QBLOCK == 0, (block, k)
    assert tuple(w_s.shape) == (-(-n // block), -(-k // block)), (tuple(w_s.shape), n, k, block)
    if block == QBLOCK:
        return w_s.contiguous()
    g = block // QBLOCK
    byte = w_s.view(torch.uint8) if w_s.dtype == E8M0 else w_s
    out = byte.repeat_interleave(g, 0)[:-(-n // QBLOCK)].repeat_interleave(g, 1)[:, :k // QBLOCK].contiguous()
    return out.view(w_s.dtype) if w_s.dtype == E8M0 else out


def dequant_weight_ref(w_q: torch.Tensor, w_s: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """e4m3 [N, K] + 32×32 block scales [ceil(N/32), K/32] -> `dtype` (exact in bf16 and fp32)."""
    n, k = w_q.shape
    s = scale_to_fp32(w_s).repeat_interleave(QBLOCK, 0)[:n].repeat_interleave(QBLOCK, 1)[:, :k]
    return (w_q.float() * s).to(dtype)


def fp8_gemm_ref(a_q: torch.Tensor, a_s: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor,
                 out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """y = Σ_kb (A_q[:,kb]·W_q[:,kb]ᵀ)·sa[m,kb]·sb[n/32,kb] in fp32, cast to out_dtype.

    a_q e4m3 [M, K], a_s [M, K/32] (fp32 or e8m0), w_q e4m3 [N, K], w_s [N/32, K/32] -> [M, N].
    """
    a = a_q.float() * _expand_cols(scale_to_fp32(a_s))
    return (a @ dequant_weight_ref(w_q, w_s).t()).to(out_dtype)


def bf16_cache_gemm_ref(x: torch.Tensor, w_bf16: torch.Tensor, act_block: int = QBLOCK) -> torch.Tensor:
    """BF16-cache path: activation through the FP8 quantize step, dequantized to BF16, times the cached BF16 weight."""
    return act_fake_quant_ref(x.to(torch.bfloat16), act_block) @ w_bf16.t()


# -- mHC ------------------------------------------------------------------------------------------------------------
def sinkhorn_ref(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """softmax over the last axis + eps, column-normalise, then (iters-1)× row- then column-normalise. fp32."""
    c = logits.float().softmax(-1) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return c


def hc_mix_ref(xflat: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int = 4,
               iters: int = 20, hc_eps: float = 1e-6, norm_eps: float = 1e-20
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC coefficients in fp32. xflat [T, n*D], fn [(2+n)*n, n*D] -> pre [T,n], post [T,n], comb [T,n,n]."""
    xf = xflat.float()
    r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + norm_eps)
    m = (xf @ fn.float().t()) * r
    base, scale = base.float(), scale.float()
    pre = torch.sigmoid(m[..., :n] * scale[0] + base[:n]) + hc_eps
    post = 2 * torch.sigmoid(m[..., n:2 * n] * scale[1] + base[n:2 * n])
    comb = (m[..., 2 * n:] * scale[2] + base[2 * n:]).unflatten(-1, (n, n))
    return pre, post, sinkhorn_ref(comb, iters, hc_eps)


def hc_split_weight(fn: torch.Tensor, rows: int = 32) -> torch.Tensor:
    """fp32 fn [R, K] -> [3, rows, K] bf16: main term + two correction terms (fn ≈ h0+h1+h2 to ~2^-24), zero-padded
    to `rows` rows so the projection is one tensor-core tile wide."""
    r, k = fn.shape
    assert r <= rows, (r, rows)
    f = torch.zeros(rows, k, dtype=torch.float32, device=fn.device)
    f[:r] = fn.float()
    h0 = f.to(torch.bfloat16)
    h1 = (f - h0.float()).to(torch.bfloat16)
    h2 = (f - h0.float() - h1.float()).to(torch.bfloat16)
    return torch.stack([h0, h1, h2]).contiguous()


def hc_collapse_ref(X: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """x = Σ_j pre_j · X_j in fp32, cast to X.dtype. X [..., n, D], pre [..., n] -> [..., D]."""
    return (pre.float().unsqueeze(-1) * X.float()).sum(-2).to(X.dtype)


def hc_pre_ref(X: torch.Tensor, pre: torch.Tensor, norm_weight: torch.Tensor, eps: float, quant: bool = False,
               scale_fmt: str = "fp32"):
    """Collapse -> RMSNorm (-> FP8 1×32). X [T, n, D] bf16, pre [T, n] fp32 -> y [T, D] (, q, s)."""
    y = rmsnorm_ref(hc_collapse_ref(X, pre), norm_weight, eps)
    if not quant:
        return y
    q, s = act_quant_ref(y, scale_fmt)
    return y, q, s


def hc_expand_ref(X: torch.Tensor, fx: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """X'_k = post_k · f(x) + Σ_j comb[j,k] · X_j (fp32, cast to X.dtype). X [T, n, D], fx [T, D]."""
    mixed = torch.einsum("...jk,...jd->...kd", comb.float(), X.float())
    return (post.float().unsqueeze(-1) * fx.float().unsqueeze(-2) + mixed).to(X.dtype)


def hc_post_ref(X: torch.Tensor, fx: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                next_pre: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 1e-20,
                quant: bool = False, scale_fmt: str = "fp32"):
    """Expand; with `next_pre` (V4.1's lagged pre) also the next site's collapse -> norm (-> FP8) on the new streams.
    Returns X' or (X', y) or (X', y, q, s)."""
    Xn = hc_expand_ref(X, fx, post, comb)
    if next_pre is None:
        return Xn
    res = hc_pre_ref(Xn, next_pre, norm_weight, eps, quant, scale_fmt)
    return (Xn, res) if not quant else (Xn, *res)


# -- MoE: router + MXFP4 routed experts (V4.1 §2.7) ---------------------------------------------------------------
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
ROUTER_NORM_EPS = 1e-20   # V4.1: `+1e-20` on the routing-weight sum


@functools.lru_cache(maxsize=None)
def _e2m1_table(device: torch.device) -> torch.Tensor:
    """The 16 code values, copied to `device` once (not a host-to-device copy per call: graph capturable)."""
    return torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32).to(device)


def mxfp4_dequant_ref(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MXFP4 [..., N, K/2] int8|uint8 (two e2m1 codes per byte, low nibble = even k) with e8m0 scales [..., N, K/32]
    (one per 1×32 along K) -> `dtype` [..., N, K]. Exact in fp32, and in bf16 for normal-range scales."""
    b = packed.view(torch.uint8)
    codes = torch.stack([b & 0xF, b >> 4], -1).reshape(*b.shape[:-1], b.shape[-1] * 2).long()
    vals = _e2m1_table(b.device)[codes]
    s = scale_to_fp32(scale).repeat_interleave(QBLOCK, -1)
    assert s.shape == vals.shape, (tuple(scale.shape), tuple(vals.shape))
    return (vals * s).to(dtype)


def random_mxfp4_experts(e: int, d: int, inter: int, ipad: int, gen: torch.Generator
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random stacked MXFP4 experts in the MoE op's format, on gen's device: w13_q int8 [E, 2·I_pad, D/2],
    w13_s e8m0 [E, 2·I_pad, D/32], w2_q [E, D, I_pad/2], w2_s [E, D, I_pad/32]; scales 2^-10..2^-4, and the
    columns past `inter` zero, as the converter pads them after sharding (for benches and tuning)."""
    dev = gen.device
    w13_q = torch.randint(-128, 128, (e, 2 * ipad, d // 2), dtype=torch.int8, device=dev, generator=gen)
    w13_s = torch.randint(117, 124, (e, 2 * ipad, d // 32), dtype=torch.uint8, device=dev, generator=gen)
    w2_q = torch.randint(-128, 128, (e, d, ipad // 2), dtype=torch.int8, device=dev, generator=gen)
    w2_s = torch.randint(117, 124, (e, d, ipad // 32), dtype=torch.uint8, device=dev, generator=gen)
    for half in (0, ipad):
        w13_q[:, half + inter:half + ipad] = 0
    w2_q[:, :, inter // 2:] = 0
    return w13_q, w13_s.view(E8M0), w2_q, w2_s.view(E8M0)


def fp8_fake_quant_ref(x: torch.Tensor, block: int = QBLOCK) -> torch.Tensor:
    """Deploy activation quantization in front of an FP8/FP4-weight linear (`Numerics.act_in`): round to BF16, FP8
    e4m3 per 1×block (32; V4: 128) with a pow2 scale, dequantize; returned in BF16 (exact)."""
    return act_fake_quant_ref(x.to(torch.bfloat16), block)


def sqrtsoftplus_ref(z: torch.Tensor) -> torch.Tensor:
    return torch.sqrt(torch.nn.functional.softplus(z.float()))


def router_ref(x: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor | None, topk: int, route_scale: float,
               gate_temp: float = 1.0, norm: bool = True, eps: float = ROUTER_NORM_EPS,
               hash_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """V4.1 / V4 `ffn.gate` in fp32: s = sqrt(softplus(x·Wᵀ / gate_temp)); ids = top-k of s + bias (bias for
    selection only), or hash_ids [T, k] (V4's hash-routed layers: `tid2eid` of the tokens; bias unused, may be None);
    weights = s at ids / (Σ + eps) (when norm and topk > 1) × route_scale.
    x [T, D], gate_w [E, D] (BF16), bias fp32 [E] or [T, E] (a row per token: `bias_vl` for image tokens)
    -> (weights fp32 [T, k], ids int64 [T, k])."""
    scores = sqrtsoftplus_ref((x.float() @ gate_w.float().t()) / gate_temp)
    if hash_ids is not None:
        idx = hash_ids.long()
    else:
        idx = (scores + bias.float()).topk(topk, dim=-1).indices
    w = scores.gather(1, idx)
    if norm and topk > 1:
        w = w / (w.sum(-1, keepdim=True) + eps)
    return w * route_scale, idx


def clipped_swiglu_ref(g: torch.Tensor, u: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(g, limit)) · clamp(u, ±limit) in fp32 (no clipping when limit <= 0)."""
    g, u = g.float(), u.float()
    if limit > 0:
        u = u.clamp(-limit, limit)
        g = g.clamp(max=limit)
    return torch.nn.functional.silu(g) * u


def ffn_ref(xq: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, limit: float,
            route_weight: torch.Tensor | None = None, qblock: int = QBLOCK) -> torch.Tensor:
    """One expert in deploy numerics on the quantized activation xq [R, D] with dequantized fp32 weights w1/w3 [I, D],
    w2 [D, I]: h = clipped SwiGLU (fp32) × route weight -> BF16 -> FP8 1×qblock fake quant -> w2, fp32 out [R, D]."""
    f = torch.nn.functional
    h = clipped_swiglu_ref(f.linear(xq.float(), w1), f.linear(xq.float(), w3), limit)
    if route_weight is not None:
        h = h * route_weight.float().unsqueeze(-1)
    return f.linear(fp8_fake_quant_ref(h, qblock).float(), w2)


def moe_experts_ref(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    w1_q: torch.Tensor, w1_s: torch.Tensor, w3_q: torch.Tensor, w3_s: torch.Tensor,
                    w2_q: torch.Tensor, w2_s: torch.Tensor, swiglu_limit: float, inter: int | None = None,
                    shared: torch.Tensor | None = None, qblock: int = QBLOCK) -> torch.Tensor:
    """Routed MXFP4 experts + shared-expert add, as `model_def.v41.MoE` (qblock 32) and `v4.MoE` (qblock 128: x and h
    quantized per 1×128) compute them in deploy numerics (before the TP all-reduce). x [T, D] (BF16), weights/ids
    [T, k] from the router; w1_q/w3_q [E, I_pad, D/2], w1_s/w3_s
    [E, I_pad, D/32], w2_q [E, D, I_pad/2], w2_s [E, D, I_pad/32] (reference MXFP4 layout, stacked over experts);
    `inter` = the logical intermediate width (the columns past it are padding and ignored); shared: the shared
    expert's output [T, D] (any float dtype) or None. Returns fp32 [T, D]: Σ_e (ascending e) y_e + shared.
    Under expert parallelism the weights are this rank's E experts and ids are local (`local_expert_ids`): an id of
    E or more was routed to another rank and contributes nothing here."""
    inter = w1_q.shape[1] if inter is None else inter
    xq = fp8_fake_quant_ref(x, qblock)
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        if e >= w1_q.shape[0]:
            continue
        rows, slot = torch.where(ids == e)
        w1 = mxfp4_dequant_ref(w1_q[e, :inter], w1_s[e, :inter])
        w3 = mxfp4_dequant_ref(w3_q[e, :inter], w3_s[e, :inter])
        w2 = mxfp4_dequant_ref(w2_q[e], w2_s[e])[:, :inter]
        y.index_add_(0, rows, ffn_ref(xq[rows], w1, w3, w2, swiglu_limit, weights[rows, slot], qblock))
    if shared is not None:
        y += shared.float()
    return y


def pair_sum_ref(rows: torch.Tensor, topk: int, shared: torch.Tensor | None = None) -> torch.Tensor:
    """The MoE's deterministic expert reduction: rows fp32 [T·k, D] (pair t·k + j's weighted expert output; zeros for
    a pair of another EP rank), shared [T, D] or None -> fp32 [T, D] = shared + rows[t·k] + rows[t·k + 1] + …,
    added in slot order."""
    t, d = rows.shape[0] // topk, rows.shape[1]
    out = torch.zeros((t, d), dtype=torch.float32, device=rows.device) if shared is None else shared.float()
    r = rows.view(t, topk, d)
    for j in range(topk):
        out = out + r[:, j]
    return out


def shared_expert_ref(x: torch.Tensor, w1_q: torch.Tensor, w1_s: torch.Tensor, w3_q: torch.Tensor,
                      w3_s: torch.Tensor, w2_q: torch.Tensor, w2_s: torch.Tensor, swiglu_limit: float) -> torch.Tensor:
    """The shared expert (group-32 FP8 weights) in deploy numerics, fp32 [T, D]."""
    w1, w3, w2 = (dequant_weight_ref(q, s) for q, s in ((w1_q, w1_s), (w3_q, w3_s), (w2_q, w2_s)))
    return ffn_ref(fp8_fake_quant_ref(x), w1, w3, w2, swiglu_limit)


def local_expert_ids(ids: torch.Tensor, expert_start: int, n_local: int) -> torch.Tensor:
    """Global expert ids -> ids into one EP rank's experts [expert_start, expert_start + n_local); an expert another
    rank owns becomes n_local (the experts' "not here" id). The routing weights stay as the router made them: they
    are normalised over all k picks, wherever those run."""
    local = ids - expert_start
    return torch.where((local >= 0) & (local < n_local), local, torch.full_like(local, n_local))


def moe_ref(x: torch.Tensor, gate_w: torch.Tensor, gate_bias: torch.Tensor | None, topk: int, route_scale: float,
            w1_q, w1_s, w3_q, w3_s, w2_q, w2_s, swiglu_limit: float, inter: int | None = None,
            shared: torch.Tensor | None = None, gate_temp: float = 1.0, expert_start: int = 0, qblock: int = QBLOCK,
            hash_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Router + routed experts + shared-expert add (fp32 [T, D], before the TP all-reduce). gate_w routes over all
    experts; the weights may be one EP rank's block of them, the experts expert_start.. (`local_expert_ids`).
    V4: qblock 128, and hash_ids [T, k] on its hash-routed layers (`router_ref`)."""
    w, idx = router_ref(x, gate_w, gate_bias, topk, route_scale, gate_temp, hash_ids=hash_ids)
    idx = local_expert_ids(idx, expert_start, w1_q.shape[0])
    return moe_experts_ref(x, w, idx, w1_q, w1_s, w3_q, w3_s, w2_q, w2_s, swiglu_limit, inter, shared, qblock)


# -- WO-A grouped output projection (V4.1 §2.4 step 6 / §2.9) --------------------------------------------------------
def rope_cos_sin_ref(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, rd/2] fp32 of positions [T] × inv_freq [rd/2], taken in float64 (as `layers.apply_rope`)."""
    ang = positions.to(torch.float64).unsqueeze(-1) * inv_freq.to(torch.float64)
    return ang.cos().float(), ang.sin().float()


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last 2·cos.shape[-1] channels (interleaved pairs) of x [..., d], or of each head of x [..., H, d]
    when x has one dim more than cos (`layers.apply_rope`); cos / sin [..., rd/2] the positions' shape, broadcast
    over x's leading dims. fp32 math, each product and sum rounded; returned in x.dtype."""
    rd = cos.shape[-1] * 2
    c, s = cos.float(), sin.float()
    if inverse:
        s = -s
    if x.dim() == cos.dim() + 1:
        c, s = c.unsqueeze(-2), s.unsqueeze(-2)
    xf = x.float()
    r = xf[..., -rd:].reshape(*x.shape[:-1], rd // 2, 2)
    a, b = r[..., 0], r[..., 1]
    rot = torch.stack([a * c - b * s, a * s + b * c], -1).reshape(*x.shape[:-1], rd)
    return torch.cat([xf[..., :-rd], rot], -1).to(x.dtype)


def inverse_rope_ref(o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Undo the query rotation on the last 2·len(cos) channels (interleaved pairs) of o [T, H, d]; fp32, in o.dtype."""
    return rope_ref(o, cos, sin, inverse=True)


# -- RoPE + fake quantization of the rotated rows (V4.1 queries, window rows, index keys, compressed entries) --------
FP4_MAX = 6.0
FP4_POW2_MIN_AMAX = 6.0 * 2.0 ** -126   # the FP4 pow2 scale stays a normal fp32
FP4_E4M3_MIN_AMAX = 6.0 * 2.0 ** -9     # the FP4 e4m3 scale stays >= e4m3's smallest subnormal
ROPE_QUANTS = ("none", "fp8", "fp4_pow2", "fp4_e4m3")


def round_e2m1_ref(x: torch.Tensor) -> torch.Tensor:
    """Nearest FP4 e2m1 value of fp32 x (ties to the even code), saturating at ±6; +0 for a zero code."""
    a = x.abs().clamp(max=FP4_MAX)
    r = torch.where(a < 2, torch.round(a * 2) * 0.5, torch.where(a < 4, torch.round(a), torch.round(a * 0.5) * 2))
    return torch.where((x < 0) & (r > 0), -r, r)


def fp4_fake_quant_ref(x: torch.Tensor, block: int, scale: str) -> torch.Tensor:
    """FP4 e2m1 per `block` channels with a pow2 scale (`scale="pow2"`: index keys / queries) or an e4m3 scale
    (`"e4m3"`: compressed KV entries), dequantized to x.dtype."""
    xb = _blocks(x, block)
    amax = xb.abs().amax(-1, keepdim=True)
    if scale == "pow2":
        s = pow2_ceil(amax.clamp(min=FP4_POW2_MIN_AMAX) / FP4_MAX)
    else:
        s = (amax.clamp(min=FP4_E4M3_MIN_AMAX) / FP4_MAX).clamp(-FP8_MAX, FP8_MAX).to(E4M3).float()
    return (round_e2m1_ref(xb / s) * s).reshape(x.shape).to(x.dtype)


def rope_quant_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False,
                   quant: str = "none", block: int = 32) -> torch.Tensor:
    """`rope_ref`, then (quant) FP8 e4m3 with pow2 scales (the window K = V rows), FP4 with pow2 scales (index
    keys and queries) or FP4 with e4m3 scales (compressed entries) per `block` channels of the whole row."""
    y = rope_ref(x, cos, sin, inverse)
    if quant == "fp8":
        return act_fake_quant_ref(y, block)
    if quant in ("fp4_pow2", "fp4_e4m3"):
        return fp4_fake_quant_ref(y, block, quant[4:])
    assert quant == "none", f"quant {quant!r}: one of {ROPE_QUANTS}"
    return y


def wo_a_ref(o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, w: torch.Tensor,
             out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Inverse RoPE, then the grouped low-rank projection: heads split into G = w.shape[0] / R groups,
    z[:, g·R:(g+1)·R] = o_g · W_a[g]ᵀ (fp32 accumulation). o [T, H, d], w [G·R, (H/G)·d] (BF16) -> [T, G·R]."""
    t, h, d = o.shape
    kg = w.shape[1]
    g = h * d // kg
    x = inverse_rope_ref(o, cos, sin).reshape(t, g, kg).float()
    z = torch.einsum("tgi,gri->tgr", x, w.float().view(g, -1, kg))
    return z.reshape(t, -1).to(out_dtype)


# -- decode attention over the decode slots (V4.1) ---------------------------------------------------------------------
def sink_attention_ref(q: torch.Tensor, kv: torch.Tensor, allowed: torch.Tensor, sink: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """Softmax attention with a per-head sink logit in the denominator only, K = V = kv (`layers.sink_attention`).
    q [B,S,H,d], kv [B,T,d], allowed [B,S,T] bool, sink [H] -> [B,S,H,d]; fp32 math, q.dtype out."""
    b, s, h, d = q.shape
    qf, kf = q.float(), kv.float()
    logits = torch.bmm(qf.reshape(b, s * h, d), kf.transpose(1, 2)).view(b, s, h, -1) * scale
    logits = logits.masked_fill(~allowed.unsqueeze(2), float("-inf"))
    sink_l = sink.float().view(1, 1, -1, 1).expand(b, s, h, 1)
    p = torch.cat([logits, sink_l], -1).softmax(-1)[..., :-1]
    return torch.bmm(p.reshape(b, s * h, -1), kf).view(b, s, h, d).to(q.dtype)


def slot_attention_ref(q: torch.Tensor, ring: torch.Tensor, slot_ids: torch.Tensor, pos: torch.Tensor,
                       kv: torch.Tensor | None, sel: torch.Tensor | None, sink: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """A decode token per request attends to its slot's window ring in position order (ring [S, W, d], row p % W
    holds position p; rows before position 0 masked) and, given kv [S, E + 1, d] (row E zero) and sel [N, k], to the
    entries sel picked (−1: empty, masked). q [N, H, d], slot_ids / pos [N], sink [H] -> [N, H, d]."""
    w = ring.shape[1]
    kpos = pos.view(-1, 1) - (w - 1) + torch.arange(w, device=pos.device)          # [N, W]
    keys = ring[slot_ids.unsqueeze(1), kpos % w].to(q.dtype)
    allowed = kpos >= 0
    if kv is not None:
        rows = torch.where(sel >= 0, sel, kv.shape[1] - 1)
        keys = torch.cat([keys, kv[slot_ids.unsqueeze(1), rows].to(q.dtype)], 1)
        allowed = torch.cat([allowed, sel >= 0], -1)
    return sink_attention_ref(q.unsqueeze(1), keys, allowed.unsqueeze(1), sink, scale)[:, 0]


def slot_index_scores_ref(q: torch.Tensor, w: torch.Tensor, index_k: torch.Tensor, slot_ids: torch.Tensor,
                          pos: torch.Tensor, ratio: int, scale: float) -> torch.Tensor:
    """An index source's partial scores over the decode slots: q [N, H, di] (this rank's index heads), w [N, H]
    head weights, index_k [S, E, di] -> [N, E] fp32, Σ_h w_h · ReLU(q_h · k_t) · scale for the (pos + 1) // ratio
    visible entries t of each request's slot, 0 past them (the caller masks those)."""
    keys = index_k[slot_ids].float()                                                # [N, E, di]
    logits = torch.einsum("nhd,ntd->nht", q.float(), keys).relu() * scale
    scores = (logits * w.float().unsqueeze(-1)).sum(1)
    visible = torch.arange(index_k.shape[1], device=q.device) < ((pos.long() + 1) // ratio).unsqueeze(-1)
    return torch.where(visible, scores, torch.zeros_like(scores))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64 (NaN/inf in out -> inf)."""
    o, r = out.double(), ref.double()
    if not torch.isfinite(o).all():
        return float("inf")
    return float((o - r).norm() / r.norm().clamp_min(1e-300))
