"""Plain-PyTorch references (`*_ref`) of the Hopper plugin ops: the deploy numerics the kernels must reproduce.

Triton-free and self-contained (no import from the other dsflash packages), so the CPU CI can test them. The
semantics equal `dsflash.model_def.quant` / `dsflash.model_def.layers` (tests/kernels/test_refs.py checks that):
FP8 e4m3 (max 448), power-of-two scales 2^ceil(log2(max(amax, 1e-4)/448)) from the fp32 bit pattern, RNE rounding,
RMSNorm in fp32 rounded to the activation dtype (BF16) before quantization, mHC coefficient math in fp32.
"""
from __future__ import annotations

import torch

FP8_MAX = 448.0
FP8_MIN_AMAX = 1e-4
QBLOCK = 32  # V4.1: activations 1×32, weights 32×32
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
def act_quant_ref(x: torch.Tensor, scale_fmt: str = "fp32") -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (K % 32 == 0) -> (e4m3 [..., K], scales [..., K/32] fp32 or e8m0): per-1×32 pow2 quantization."""
    xb = _blocks(x)
    s = fp8_pow2_scale(xb.abs().amax(-1))
    q = (xb / s.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(E4M3).reshape(x.shape)
    return q, (scale_to_e8m0(s) if scale_fmt == "e8m0" else s)


def act_dequant_ref(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """(e4m3 [..., K], scales [..., K/32]) -> values in `dtype` (exact for bf16: e4m3 times a power of two)."""
    return (q.float() * _expand_cols(scale_to_fp32(s))).to(dtype)


def act_fake_quant_ref(x: torch.Tensor) -> torch.Tensor:
    """Quantize then dequantize (same shape and dtype): what deploy numerics feed an FP8-weight linear."""
    q, s = act_quant_ref(x)
    return act_dequant_ref(q, s, x.dtype)


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in fp32 (weight upcast to fp32), rounded to x.dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def act_quant_dequant_ref(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """(optional RMSNorm ->) FP8 1×32 quantize -> dequantize to x.dtype (the BF16-cache GEMM's activation)."""
    return act_fake_quant_ref(x if weight is None else rmsnorm_ref(x, weight, eps))


def rmsnorm_act_quant_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, scale_fmt: str = "fp32"
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """norm -> BF16 -> per-1×32 FP8 (e.g. q_norm -> wq_b). Returns (y [..., K] x.dtype, q e4m3, scales)."""
    y = rmsnorm_ref(x, weight, eps)
    q, s = act_quant_ref(y, scale_fmt)
    return y, q, s


# -- group-32 FP8 dense GEMM ----------------------------------------------------------------------------------------
def quant_weight_fp8_ref(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [N, K] (multiples of 32) -> (e4m3 [N, K], e8m0 [N/32, K/32]) with pow2 32×32 block scales."""
    n, k = w.shape
    wb = w.float().reshape(n // QBLOCK, QBLOCK, k // QBLOCK, QBLOCK)
    s = fp8_pow2_scale(wb.abs().amax((1, 3)))  # [N/32, K/32]
    q = (wb / s[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(E4M3).reshape(n, k)
    return q, scale_to_e8m0(s)


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


def bf16_cache_gemm_ref(x: torch.Tensor, w_bf16: torch.Tensor) -> torch.Tensor:
    """BF16-cache path: activation through the FP8 quantize step, dequantized to BF16, times the cached BF16 weight."""
    return act_fake_quant_ref(x.to(torch.bfloat16)) @ w_bf16.t()


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


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64 (NaN/inf in out -> inf)."""
    o, r = out.double(), ref.double()
    if not torch.isfinite(o).all():
        return float("inf")
    return float((o - r).norm() / r.norm().clamp_min(1e-300))
