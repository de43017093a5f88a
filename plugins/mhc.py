"""mHC (manifold-constrained hyper-connections, n = 4 streams) kernels, V4.1 semantics (architecture.md §2.2).

(a) `hc_pre`: x = Σ_j pre_j·X_j (fp32 -> BF16) -> RMSNorm -> BF16 (-> FP8 1×32), one kernel.
(b) `hc_mix`: the 24-wide projection over 4·D on tensor cores with the fp32 weights as one BF16 main term plus two
    BF16 correction terms (fp32 accumulation; split-K over 4·D), then one epilogue kernel (a token per program) that
    reduces the partials and the squared-sum statistic and does rsqrt, sigmoid / 2·sigmoid, softmax and the 20
    Sinkhorn iterations on per-thread scalars.
(c) `hc_post`: X'_k = post_k·f(x) + Σ_j comb[j,k]·X_j, optionally fused with the next site's collapse with V4.1's
    lagged `pre` -> RMSNorm (-> FP8), since that `pre` is known before the expand runs.
Row kernels take one token per program; a row of up to 8 chunks (V4.1's D 5120: 5) stays in registers, with every load
issued before the first store; a longer one is walked in chunks, the norm's second pass re-reading the BF16 row it wrote
(L1/L2-resident). Imports Triton: load this module lazily.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.tools.tensor_descriptor import TensorDescriptor

from dsflash.plugins.act_quant import _div, _quant_g32, _rsqrt_mean, _store_q_scale
from dsflash.plugins.tuning import k_slices
from dsflash.plugins.refs import (  # noqa: F401  (re-exported)
    E4M3, E8M0, QBLOCK, hc_mix_ref, hc_post_ref, hc_pre_ref, hc_split_weight)

NS = 4  # hc_mult
NMIX = (2 + NS) * NS  # 24 logits
NMIX_PAD = 32


# -- row kernels: collapse / expand / norm / quant --------------------------------------------------------------------
@triton.jit
def _norm_quant_pass(y_row, w_ptr, q_row, s_row, D, r, QUANT: tl.constexpr, SCALE_E8M0: tl.constexpr,
                     CHUNK_G: tl.constexpr):
    """Second pass: y <- round(y·r·w) in place (y holds the collapsed BF16 row), then optionally FP8-quantize."""
    g = tl.arange(0, CHUNK_G)
    j = tl.arange(0, 32)
    for d0 in range(0, D, CHUNK_G * 32):
        offs = d0 + g[:, None] * 32 + j[None, :]
        mask = offs < D
        v = tl.load(y_row + offs, mask=mask, other=0.0).to(tl.float32)
        wv = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        v = ((v * r) * wv).to(y_row.dtype.element_ty)
        tl.store(y_row + offs, v, mask=mask)
        if QUANT:
            q, e = _quant_g32(v.to(tl.float32))
            kg = d0 // 32 + g
            _store_q_scale(q, e, q_row + offs, s_row + kg, mask, kg < D // 32, SCALE_E8M0)


@triton.jit
def _load_chunks(ptr, D, CHUNK_G: tl.constexpr, NCHUNK: tl.constexpr):
    """A row of D (≤ NCHUNK chunks of CHUNK_G·32) as a tuple of fp32 [CHUNK_G, 32] chunks, all loads in flight."""
    g = tl.arange(0, CHUNK_G)
    j = tl.arange(0, 32)
    out = ()
    for c in tl.static_range(NCHUNK):
        offs = c * (CHUNK_G * 32) + g[:, None] * 32 + j[None, :]
        out = out + (tl.load(ptr + offs, mask=offs < D, other=0.0).to(tl.float32), )
    return out


@triton.jit
def _load_streams(x_row, stride_xs, D, CHUNK_G: tl.constexpr, NCHUNK: tl.constexpr):
    """The 4 streams of a token's row, each as `_load_chunks` returns it: x[j][c] is chunk c of stream j."""
    return (_load_chunks(x_row, D, CHUNK_G, NCHUNK), _load_chunks(x_row + stride_xs, D, CHUNK_G, NCHUNK),
            _load_chunks(x_row + 2 * stride_xs, D, CHUNK_G, NCHUNK),
            _load_chunks(x_row + 3 * stride_xs, D, CHUNK_G, NCHUNK))


@triton.jit
def _stream_slices(x_row, stride_xs, offs, mask):
    """The 4 streams of a token's row at offs, in fp32 (the passes over D that do not hold the row in registers)."""
    return (tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32),
            tl.load(x_row + stride_xs + offs, mask=mask, other=0.0).to(tl.float32),
            tl.load(x_row + 2 * stride_xs + offs, mask=mask, other=0.0).to(tl.float32),
            tl.load(x_row + 3 * stride_xs + offs, mask=mask, other=0.0).to(tl.float32))


@triton.jit
def _expand_coeffs(post_row, comb_row, npre_row, FUSE_NEXT: tl.constexpr):
    """post_k, comb[j, k] (row-major, 16) and, when fused, the next site's pre_k, as scalars loaded once: loaded where
    they are used, the expand's stores (possible aliases to the compiler) would make every chunk reload them."""
    post = ()
    npre = ()
    for k in tl.static_range(4):
        post = post + (tl.load(post_row + k), )
        if FUSE_NEXT:
            npre = npre + (tl.load(npre_row + k), )
    comb = ()
    for i in tl.static_range(16):
        comb = comb + (tl.load(comb_row + i), )
    return post, comb, npre


@triton.jit
def _expand_stream(x0, x1, x2, x3, f, post, comb, k: tl.constexpr):
    """Output stream k of the expand, fp32: post_k·f(x) + Σ_j comb[j, k]·X_j."""
    return post[k] * f + (comb[k] * x0 + comb[4 + k] * x1 + comb[8 + k] * x2 + comb[12 + k] * x3)


@triton.jit
def _norm_quant_regs(xs, ws, y_row, q_row, s_row, D, r, QUANT: tl.constexpr, SCALE_E8M0: tl.constexpr,
                     CHUNK_G: tl.constexpr, NCHUNK: tl.constexpr):
    """`_norm_quant_pass` on a row held in registers (xs: the collapsed row's chunks, already rounded to y's dtype;
    ws: the norm weight's): y = round(x·r·w), then optionally FP8-quantize; no re-read of y."""
    g = tl.arange(0, CHUNK_G)
    j = tl.arange(0, 32)
    for c in tl.static_range(NCHUNK):
        offs = c * (CHUNK_G * 32) + g[:, None] * 32 + j[None, :]
        mask = offs < D
        v = ((xs[c] * r) * ws[c]).to(y_row.dtype.element_ty)
        tl.store(y_row + offs, v, mask=mask)
        if QUANT:
            q, e = _quant_g32(v.to(tl.float32))
            kg = c * CHUNK_G + g
            _store_q_scale(q, e, q_row + offs, s_row + kg, mask, kg < D // 32, SCALE_E8M0)


@triton.jit
def _hc_pre_kernel(
    x_ptr, pre_ptr, w_ptr, y_ptr, q_ptr, s_ptr,
    D,
    stride_xt, stride_xs, stride_pt, stride_y, stride_q, stride_s,
    eps,
    QUANT: tl.constexpr, SCALE_E8M0: tl.constexpr, CHUNK_G: tl.constexpr, NCHUNK: tl.constexpr,
):
    """Collapse + norm (+ FP8) of token t. NCHUNK > 0: the row (NCHUNK chunks) stays in registers, so every load is
    in flight at once and y is written once; else two passes over D, the second re-reading y."""
    t = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, CHUNK_G)
    j = tl.arange(0, 32)
    x_row = x_ptr + t * stride_xt
    y_row = y_ptr + t * stride_y
    p0 = tl.load(pre_ptr + t * stride_pt + 0)
    p1 = tl.load(pre_ptr + t * stride_pt + 1)
    p2 = tl.load(pre_ptr + t * stride_pt + 2)
    p3 = tl.load(pre_ptr + t * stride_pt + 3)
    acc = tl.zeros([CHUNK_G, 32], dtype=tl.float32)
    if NCHUNK > 0:
        ws = _load_chunks(w_ptr, D, CHUNK_G, NCHUNK)
        xin = _load_streams(x_row, stride_xs, D, CHUNK_G, NCHUNK)
        xs = ()
        for c in tl.static_range(NCHUNK):
            xf = (p0 * xin[0][c] + p1 * xin[1][c] + p2 * xin[2][c] + p3 * xin[3][c]).to(y_ptr.dtype.element_ty)
            xf = xf.to(tl.float32)
            acc += xf * xf
            xs = xs + (xf, )
        r = _rsqrt_mean(tl.sum(tl.sum(acc, axis=1), axis=0), D, eps)
        _norm_quant_regs(xs, ws, y_row, q_ptr + t * stride_q, s_ptr + t * stride_s, D, r, QUANT, SCALE_E8M0,
                         CHUNK_G, NCHUNK)
        return
    for d0 in range(0, D, CHUNK_G * 32):
        offs = d0 + g[:, None] * 32 + j[None, :]
        mask = offs < D
        x0, x1, x2, x3 = _stream_slices(x_row, stride_xs, offs, mask)
        xc = (p0 * x0 + p1 * x1 + p2 * x2 + p3 * x3).to(y_ptr.dtype.element_ty)
        tl.store(y_row + offs, xc, mask=mask)
        xf = xc.to(tl.float32)
        acc += xf * xf
    r = _rsqrt_mean(tl.sum(tl.sum(acc, axis=1), axis=0), D, eps)
    tl.debug_barrier()
    _norm_quant_pass(y_row, w_ptr, q_ptr + t * stride_q, s_ptr + t * stride_s, D, r, QUANT, SCALE_E8M0, CHUNK_G)


@triton.jit
def _hc_post_kernel(
    x_ptr, fx_ptr, post_ptr, comb_ptr, xo_ptr, npre_ptr, w_ptr, y_ptr, q_ptr, s_ptr,
    D,
    stride_xt, stride_xs, stride_ft, stride_pt, stride_ct, stride_ot, stride_os, stride_nt, stride_y, stride_q,
    stride_s,
    eps,
    FUSE_NEXT: tl.constexpr, QUANT: tl.constexpr, SCALE_E8M0: tl.constexpr, CHUNK_G: tl.constexpr,
    NCHUNK: tl.constexpr,
):
    """Expand (+ the next site's collapse + norm (+ FP8)) of token t. NCHUNK > 0 (with FUSE_NEXT): the row stays in
    registers, every load in flight before the first store, y written once; else passes over D re-reading y."""
    t = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, CHUNK_G)
    j = tl.arange(0, 32)
    x_row = x_ptr + t * stride_xt
    o_row = xo_ptr + t * stride_ot
    post, comb, npre = _expand_coeffs(post_ptr + t * stride_pt, comb_ptr + t * stride_ct, npre_ptr + t * stride_nt,
                                      FUSE_NEXT)
    acc = tl.zeros([CHUNK_G, 32], dtype=tl.float32)
    tl.static_assert(NCHUNK == 0 or FUSE_NEXT, "the register-resident row is the fused path's")
    if NCHUNK > 0:
        ws = _load_chunks(w_ptr, D, CHUNK_G, NCHUNK)
        fs = _load_chunks(fx_ptr + t * stride_ft, D, CHUNK_G, NCHUNK)
        xin = _load_streams(x_row, stride_xs, D, CHUNK_G, NCHUNK)
        xs = ()
        for c in tl.static_range(NCHUNK):
            offs = c * (CHUNK_G * 32) + g[:, None] * 32 + j[None, :]
            mask = offs < D
            xn = tl.zeros([CHUNK_G, 32], dtype=tl.float32)
            for k in tl.static_range(4):
                ok = _expand_stream(xin[0][c], xin[1][c], xin[2][c], xin[3][c], fs[c], post, comb, k)
                ok = ok.to(xo_ptr.dtype.element_ty)
                tl.store(o_row + k * stride_os + offs, ok, mask=mask)
                xn += npre[k] * ok.to(tl.float32)
            xf = xn.to(y_ptr.dtype.element_ty).to(tl.float32)
            acc += xf * xf
            xs = xs + (xf, )
        r = _rsqrt_mean(tl.sum(tl.sum(acc, axis=1), axis=0), D, eps)
        _norm_quant_regs(xs, ws, y_ptr + t * stride_y, q_ptr + t * stride_q, s_ptr + t * stride_s, D, r, QUANT,
                         SCALE_E8M0, CHUNK_G, NCHUNK)
        return
    for d0 in range(0, D, CHUNK_G * 32):
        offs = d0 + g[:, None] * 32 + j[None, :]
        mask = offs < D
        x0, x1, x2, x3 = _stream_slices(x_row, stride_xs, offs, mask)
        f = tl.load(fx_ptr + t * stride_ft + offs, mask=mask, other=0.0).to(tl.float32)
        xn = tl.zeros([CHUNK_G, 32], dtype=tl.float32)
        for k in tl.static_range(4):
            ok = _expand_stream(x0, x1, x2, x3, f, post, comb, k).to(xo_ptr.dtype.element_ty)
            tl.store(o_row + k * stride_os + offs, ok, mask=mask)
            if FUSE_NEXT:
                xn += npre[k] * ok.to(tl.float32)
        if FUSE_NEXT:
            xc = xn.to(y_ptr.dtype.element_ty)
            tl.store(y_ptr + t * stride_y + offs, xc, mask=mask)
            xf = xc.to(tl.float32)
            acc += xf * xf
    if FUSE_NEXT:
        r = _rsqrt_mean(tl.sum(tl.sum(acc, axis=1), axis=0), D, eps)
        tl.debug_barrier()
        _norm_quant_pass(y_ptr + t * stride_y, w_ptr, q_ptr + t * stride_q, s_ptr + t * stride_s, D, r, QUANT,
                         SCALE_E8M0, CHUNK_G)


# -- mixing coefficients ----------------------------------------------------------------------------------------------
@triton.jit
def _hc_mix_proj_kernel(
    x_desc, h_desc, ws_ptr,
    T, K,
    stride_ws,
    SPLIT, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """Partial rows ws[split, t, 0:32] over a K slice: columns 0-23 Σ_k x[t,k]·(h0+h1+h2)[r,k], column 31 Σ_k x[t,k]²
    (the weight's padding rows 24-31 are not read back). x and the three weight terms arrive by TMA; each term is one
    BF16 MMA into the same fp32 accumulator."""
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t = offs_t < T
    rr = tl.arange(0, 32)
    n_iter = tl.cdiv(K, BLOCK_K)
    per = tl.cdiv(n_iter, SPLIT)
    it0 = pid_s * per
    it1 = tl.minimum(it0 + per, n_iter)
    acc = tl.zeros([BLOCK_T, 32], dtype=tl.float32)
    sq = tl.zeros([BLOCK_T], dtype=tl.float32)
    for it in tl.range(it0, it1, num_stages=NUM_STAGES):
        k0 = it * BLOCK_K
        x = x_desc.load([pid_t * BLOCK_T, k0])          # [BT, BK] bf16
        h2 = h_desc.load([64, k0])                       # [32, BK] bf16, smallest term first
        h1 = h_desc.load([32, k0])
        h0 = h_desc.load([0, k0])
        xf = x.to(tl.float32)
        sq += tl.sum(xf * xf, axis=1)
        acc = tl.dot(x, h2.T, acc)
        acc = tl.dot(x, h1.T, acc)
        acc = tl.dot(x, h0.T, acc)
    part = tl.where(rr[None, :] == 31, sq[:, None], acc)
    tl.store(ws_ptr + pid_s * stride_ws + offs_t[:, None] * 32 + rr[None, :], part, mask=mask_t[:, None])


@triton.jit
def _normalize_rows(c, eps, one):
    """c: 16 scalars, row-major 4×4 -> each row divided by (its sum + eps). One approximate reciprocal per row
    (`div.approx`, ~2 ulp; the sums are ≥ eps, far from the range it mishandles): the Sinkhorn loop is a
    latency-bound chain (H200, ncu: 4.1 cycles per issued instruction on one warp per scheduler) of ~190
    instructions per iteration with IEEE division, ~80 with this."""
    out = ()
    for j in tl.static_range(4):
        inv = libdevice.fast_dividef(one, c[4 * j] + c[4 * j + 1] + c[4 * j + 2] + c[4 * j + 3] + eps)
        for k in tl.static_range(4):
            out = out + (c[4 * j + k] * inv, )
    return out


@triton.jit
def _normalize_cols(c, eps, one):
    """c: 16 scalars, row-major 4×4 -> each column divided by (its sum + eps)."""
    inv = ()
    for k in tl.static_range(4):
        inv = inv + (libdevice.fast_dividef(one, c[k] + c[4 + k] + c[8 + k] + c[12 + k] + eps), )
    out = ()
    for i in tl.static_range(16):
        out = out + (c[i] * inv[i % 4], )
    return out


@triton.jit
def _hc_mix_epilogue_kernel(
    ws_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr,
    K, stride_ws,
    hc_eps, norm_eps,
    SPLIT, ITERS, SPLIT_P2: tl.constexpr,
):
    """One token per program. The SPLIT partial rows of the token are summed in one masked load and one reduction and
    written back over ws[0, t]; re-read as 25 scalars, the rsqrt, sigmoids, softmax and Sinkhorn iterations then run
    on per-thread scalars, with no cross-thread reduction. (A [tokens, 4, 4] tile instead spends ~0.35 µs per Sinkhorn
    iteration in cross-warp reductions: H200, session 8.)"""
    t = tl.program_id(0).to(tl.int64)
    # the constants first, so that their loads overlap the partials' (the barriers below keep loads from moving)
    s0 = tl.load(scale_ptr + 0)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    b = ()
    for i in tl.static_range(24):
        b = b + (tl.load(base_ptr + i), )
    sp = tl.arange(0, SPLIT_P2)
    col = tl.arange(0, 32)
    row = ws_ptr + t * 32
    tot = tl.sum(tl.load(row + sp[:, None] * stride_ws + col[None, :], mask=(sp < SPLIT)[:, None], other=0.0), axis=0)
    tl.debug_barrier()          # every thread's loads of ws[0, t] are done before it is overwritten
    tl.store(row + col, tot)
    tl.debug_barrier()          # and the sums are visible to every thread of the program
    r = _rsqrt_mean(tl.load(row + 31), K, norm_eps)
    one = tl.full([], 1.0, tl.float32)
    for i in tl.static_range(4):
        zp = (tl.load(row + i) * r) * s0 + b[i]
        zq = (tl.load(row + 4 + i) * r) * s1 + b[4 + i]
        tl.store(pre_ptr + t * 4 + i, _div(one, 1.0 + tl.exp(-zp)) + hc_eps)
        tl.store(post_ptr + t * 4 + i, 2.0 * _div(one, 1.0 + tl.exp(-zq)))
    # Sinkhorn: softmax over k (+eps), column-normalise, then (ITERS-1)× row- and column-normalise
    z = ()
    for i in tl.static_range(16):
        z = z + ((tl.load(row + 8 + i) * r) * s2 + b[8 + i], )
    c = ()
    for j in tl.static_range(4):
        m = tl.maximum(tl.maximum(z[4 * j], z[4 * j + 1]), tl.maximum(z[4 * j + 2], z[4 * j + 3]))
        e0 = tl.exp(z[4 * j] - m)
        e1 = tl.exp(z[4 * j + 1] - m)
        e2 = tl.exp(z[4 * j + 2] - m)
        e3 = tl.exp(z[4 * j + 3] - m)
        den = e0 + e1 + e2 + e3
        c = c + (_div(e0, den) + hc_eps, _div(e1, den) + hc_eps, _div(e2, den) + hc_eps, _div(e3, den) + hc_eps)
    c = _normalize_cols(c, hc_eps, one)
    for _ in range(ITERS - 1):     # a runtime loop: unrolled it is ~80 KB of code, for no measured gain
        c = _normalize_cols(_normalize_rows(c, hc_eps, one), hc_eps, one)
    for i in tl.static_range(16):
        tl.store(comb_ptr + t * 16 + i, c[i])


# -- wrappers ---------------------------------------------------------------------------------------------------------
def _chunk_g(d: int) -> int:
    return min(triton.next_power_of_2(d // QBLOCK), 32)


def _row_chunks(d: int) -> int:
    """Chunks of a row the norm kernels hold in registers (0: too long, two passes over D). V4.1's D 5120: 5."""
    n = triton.cdiv(d, _chunk_g(d) * QBLOCK)
    return n if n <= 8 else 0


def _check_streams(X: torch.Tensor) -> tuple[int, int]:
    assert X.dim() == 3 and X.shape[1] == NS, f"X must be [T, {NS}, D], got {tuple(X.shape)}"
    assert X.stride(2) == 1, "X's last dim must be contiguous"
    assert X.dtype in (torch.bfloat16, torch.float16, torch.float32), X.dtype
    t, _, d = X.shape
    assert d % QBLOCK == 0, d
    return t, d


def _quant_outputs(t: int, d: int, dev, quant: bool, scale_fmt: str):
    assert scale_fmt in ("fp32", "e8m0"), scale_fmt
    if not quant:
        return None, None
    q = torch.empty((t, d), dtype=E4M3, device=dev)
    s = torch.empty((t, d // QBLOCK), dtype=torch.uint8 if scale_fmt == "e8m0" else torch.float32, device=dev)
    return q, s


def hc_pre(X: torch.Tensor, pre: torch.Tensor, norm_weight: torch.Tensor, eps: float, quant: bool = False,
           scale_fmt: str = "fp32"):
    """Collapse + RMSNorm (+ FP8). X [T, 4, D] bf16, pre [T, 4] fp32, norm_weight [D] -> y [T, D] (, q, s)."""
    t, d = _check_streams(X)
    assert pre.shape == (t, NS) and pre.dtype == torch.float32 and pre.stride(1) == 1, (pre.shape, pre.dtype)
    assert norm_weight.shape == (d,) and norm_weight.is_contiguous()
    y = torch.empty((t, d), dtype=X.dtype, device=X.device)
    q, s = _quant_outputs(t, d, X.device, quant, scale_fmt)
    if t > 0:
        _hc_pre_kernel[(t,)](
            X, pre, norm_weight, y, q if quant else y, s if quant else y,
            d,
            X.stride(0), X.stride(1), pre.stride(0), d, d, d // QBLOCK,
            float(eps),
            QUANT=quant, SCALE_E8M0=scale_fmt == "e8m0", CHUNK_G=_chunk_g(d), NCHUNK=_row_chunks(d),
            num_warps=8 if _row_chunks(d) > 2 else 4)
    if not quant:
        return y
    return y, q, (s.view(E8M0) if scale_fmt == "e8m0" else s)


def hc_post(X: torch.Tensor, fx: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
            next_pre: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 1e-20,
            quant: bool = False, scale_fmt: str = "fp32"):
    """Expand X' = post⊗f(x) + combᵀ·X; with next_pre also the next site's collapse + norm (+ FP8).

    X [T, 4, D] bf16, fx [T, D], post [T, 4] fp32, comb [T, 4, 4] fp32 (comb[j, k]: stream j -> k),
    next_pre [T, 4] fp32, norm_weight [D]. Returns X' or (X', y) or (X', y, q, s).
    """
    t, d = _check_streams(X)
    assert fx.shape == (t, d) and fx.stride(1) == 1, (tuple(fx.shape), t, d)
    assert post.shape == (t, NS) and post.dtype == torch.float32 and post.stride(1) == 1
    assert comb.shape == (t, NS, NS) and comb.dtype == torch.float32 and comb.stride(2) == 1 and comb.stride(1) == NS
    fuse = next_pre is not None
    if fuse:
        assert next_pre.shape == (t, NS) and next_pre.dtype == torch.float32 and next_pre.stride(1) == 1
        assert norm_weight is not None and norm_weight.shape == (d,) and norm_weight.is_contiguous()
    else:
        assert not quant, "quant needs the fused next-site collapse (next_pre, norm_weight)"
    Xo = torch.empty((t, NS, d), dtype=X.dtype, device=X.device)
    y = torch.empty((t, d), dtype=X.dtype, device=X.device) if fuse else Xo
    q, s = _quant_outputs(t, d, X.device, quant, scale_fmt)
    if t > 0:
        _hc_post_kernel[(t,)](
            X, fx, post, comb, Xo, next_pre if fuse else post, norm_weight if fuse else post, y,
            q if quant else y, s if quant else y,
            d,
            X.stride(0), X.stride(1), fx.stride(0), post.stride(0), comb.stride(0), NS * d, d,
            next_pre.stride(0) if fuse else 0, d, d, d // QBLOCK,
            float(eps),
            FUSE_NEXT=fuse, QUANT=quant, SCALE_E8M0=scale_fmt == "e8m0", CHUNK_G=_chunk_g(d),
            NCHUNK=_row_chunks(d) if fuse else 0, num_warps=8 if fuse and _row_chunks(d) > 2 else 4)
    if not fuse:
        return Xo
    if not quant:
        return Xo, y
    return Xo, y, q, (s.view(E8M0) if scale_fmt == "e8m0" else s)


def hc_mix_tiles(t: int, k: int, num_sms: int = 132) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_K, SPLIT) by row count: small T splits 4·D over many programs, large T uses taller tiles."""
    bt = 16 if t <= 16 else (32 if t <= 128 else 64)
    bk = 64  # 128-byte TMA rows
    tiles = triton.cdiv(t, bt)
    n_iter = triton.cdiv(k, bk)
    # up to 128 slices (H200, D 5120, T <= 8: 11.8-12.0 µs against 12.4-12.7 at 64; benchmarks/mhc_s8_h200.json)
    split = k_slices(n_iter, min(triton.cdiv(num_sms, tiles), n_iter // 2, 128)) if tiles < num_sms else 1
    return bt, bk, split


def hc_mix(xflat: torch.Tensor, h: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int = 20,
           hc_eps: float = 1e-6, norm_eps: float = 1e-20) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC coefficients. xflat [T, 4·D] bf16 (K contiguous), h = hc_split_weight(fn) [3, 32, 4·D] bf16,
    base [24] fp32, scale [3] fp32 -> pre [T, 4], post [T, 4], comb [T, 4, 4] (all fp32)."""
    assert xflat.dim() == 2 and xflat.dtype == torch.bfloat16 and xflat.stride(1) == 1, (xflat.shape, xflat.dtype)
    assert xflat.data_ptr() % 16 == 0 and xflat.stride(0) % 8 == 0, "TMA needs 16-byte aligned rows"
    t, k = xflat.shape
    assert h.shape == (3, NMIX_PAD, k) and h.dtype == torch.bfloat16 and h.is_contiguous(), (tuple(h.shape), k)
    assert base.shape == (NMIX,) and base.dtype == torch.float32 and base.is_contiguous()
    assert scale.shape == (3,) and scale.dtype == torch.float32 and scale.is_contiguous()
    assert iters >= 1
    dev = xflat.device
    pre = torch.empty((t, NS), dtype=torch.float32, device=dev)
    post = torch.empty((t, NS), dtype=torch.float32, device=dev)
    comb = torch.empty((t, NS, NS), dtype=torch.float32, device=dev)
    if t == 0:
        return pre, post, comb
    bt, bk, split = hc_mix_tiles(t, k)
    ws = torch.empty((split, t, NMIX_PAD), dtype=torch.float32, device=dev)
    x_desc = TensorDescriptor(xflat, [t, k], [xflat.stride(0), 1], [bt, bk])
    h_desc = TensorDescriptor(h.view(3 * NMIX_PAD, k), [3 * NMIX_PAD, k], [k, 1], [NMIX_PAD, bk])
    _hc_mix_proj_kernel[(triton.cdiv(t, bt), split)](
        x_desc, h_desc, ws,
        t, k,
        ws.stride(0),
        SPLIT=split, BLOCK_T=bt, BLOCK_K=bk, NUM_STAGES=4, num_warps=4)
    _hc_mix_epilogue_kernel[(t,)](
        ws, base, scale, pre, post, comb,
        k, ws.stride(0),
        float(hc_eps), float(norm_eps),
        SPLIT=split, ITERS=iters, SPLIT_P2=triton.next_power_of_2(split), num_warps=4 if split > 8 else 1)
    return pre, post, comb
