"""Split-K reduction inside one launch, shared by the GEMM, GEMV, MoE and WO-A kernels.

Every K slice stores its fp32 partial to a workspace and bumps its output tile's counter (acq_rel, GPU scope); the
last slice to arrive sums the partials in slice order (deterministic: the same sum whatever the arrival order), runs
the kernel's own epilogue, and resets the counter, so counters are zero between launches and no second kernel runs.
Imports Triton: load this module lazily.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# k_slices lives in tuning (Triton-free); the kernel sources of earlier commits that benchmarks/ replay import it here
from dsflash.plugins.tuning import k_slices  # noqa: F401

_counters: dict[tuple[str, str, int], torch.Tensor] = {}


def split_counter(device: torch.device, n: int, owner: str) -> torch.Tensor:
    """int32 tile counters for `owner`'s launches on `device`, zero between calls; grown (one allocation) when a larger
    grid first needs more. One buffer per owner, so kernels of different ops never share a counter; calls of one owner
    run on one stream at a time. (Keyed by device type too: TRITON_INTERPRET runs on the CPU.)"""
    idx = device.index if device.index is not None else (torch.cuda.current_device() if device.type == "cuda" else 0)
    key = (owner, device.type, idx)
    c = _counters.get(key)
    if c is None or c.numel() < n:
        c = torch.zeros(max(n, 1 << 14), dtype=torch.int32, device=device)
        _counters[key] = c
    return c


@triton.jit
def splitk_arrive(part, ws_ptr, off, mask, cnt_ptr, tile, pid_k, SPLIT, SLAB):
    """Store K slice pid_k's fp32 partial at ws_ptr + pid_k·SLAB + off; True for the tile's last slice to arrive."""
    tl.store(ws_ptr + pid_k * SLAB + off, part, mask=mask)
    tl.debug_barrier()
    done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
    return done == SPLIT - 1


@triton.jit
def splitk_total(ws_ptr, off, mask, cnt_ptr, tile, SPLIT, SLAB, MAX_SPLIT: tl.constexpr = 0):
    """(The last slice only) the sum of the tile's SPLIT partials in slice order, in off's layout (no constant
    tensors, so Gluon kernels call it too); resets the tile's counter. MAX_SPLIT (a constexpr >= SPLIT, 0: a runtime
    loop): the loop unrolled, slices past SPLIT masked, so every partial's load is in flight before the adds (the
    same sum: a masked slice adds 0.0)."""
    tot = tl.load(ws_ptr + off, mask=mask, other=0.0, cache_modifier=".cg")
    if MAX_SPLIT > 0:
        for s in tl.static_range(1, MAX_SPLIT):
            tot += tl.load(ws_ptr + s * SLAB + off, mask=mask & (s < SPLIT), other=0.0, cache_modifier=".cg")
    else:
        for s in range(1, SPLIT):
            tot += tl.load(ws_ptr + s * SLAB + off, mask=mask, other=0.0, cache_modifier=".cg")
    tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")
    return tot


@triton.jit
def splitk_store(out_ptr, part, off, mask, ws_ptr, cnt_ptr, tile, pid_k, SPLIT, SLAB, MAX_SPLIT: tl.constexpr = 0):
    """K slice pid_k's fp32 partial -> out_ptr + off in out's dtype: stored directly when SPLIT == 1, else through
    the workspace (`splitk_arrive`), the tile's last slice to arrive storing the slice-order sum (`splitk_total`,
    unrolled to MAX_SPLIT when > 0). The workspace slab is laid out as the output (`splitk_store_ws` otherwise)."""
    splitk_store_ws(out_ptr, part, off, mask, ws_ptr, off, mask, cnt_ptr, tile, pid_k, SPLIT, SLAB, MAX_SPLIT)


@triton.jit
def splitk_store_ws(out_ptr, part, off, mask, ws_ptr, ws_off, ws_mask, cnt_ptr, tile, pid_k, SPLIT, SLAB,
                    MAX_SPLIT: tl.constexpr = 0):
    """`splitk_store` with the workspace slab in its own layout: ws_off / ws_mask place the partial in the slab,
    off / mask in the output (e.g. a swap-AB kernel's [rows, tokens] partial kept token-minor in the workspace, so a
    thread's adjacent tokens are one vector access: `decode_ws_tokens`)."""
    if SPLIT == 1:
        tl.store(out_ptr + off, part.to(out_ptr.dtype.element_ty), mask=mask)
    elif splitk_arrive(part, ws_ptr, ws_off, ws_mask, cnt_ptr, tile, pid_k, SPLIT, SLAB):
        tot = splitk_total(ws_ptr, ws_off, ws_mask, cnt_ptr, tile, SPLIT, SLAB, MAX_SPLIT)
        tl.store(out_ptr + off, tot.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def splitk_store_rows_tokens(out_ptr, acc, rows, rows_ok, toks, toks_ok, n_rows, ws_ptr, WS_Q, cnt_ptr, tile, pid_k,
                             SPLIT, MAX_SPLIT: tl.constexpr = 0):
    """A swap-AB decode kernel's [rows, tokens] fp32 tile -> out[tok, row] (out [tokens, n_rows]), K slices reduced
    through the token-minor workspace [SPLIT, n_rows, WS_Q] (`decode_ws_tokens`, `splitk_store_ws`). rows, rows_ok:
    [R, 1]; toks, toks_ok: [1, Q], in acc's layout."""
    splitk_store_ws(out_ptr, acc, toks * n_rows + rows, rows_ok & toks_ok, ws_ptr, rows * WS_Q + toks,
                    rows_ok & (toks < WS_Q), cnt_ptr, tile, pid_k, SPLIT, n_rows * WS_Q, MAX_SPLIT)


def decode_ws_tokens(m: int, tile_tokens: int) -> int:
    """Token columns of a swap-AB decode kernel's split-K workspace [split, rows, columns] for m tokens: the power of
    two >= m (at most the tile's). A thread of the MMA layout holds two adjacent tokens: from two columns up they are
    one 8-byte access, the mask constant over them (the columns past m are summed, never stored). The token-major
    [split, m, rows] slab cost the 24 MB shared w13 0.7 µs at m = 8 (benchmarks/gemm_decode_m8.py, session 18)."""
    return min(triton.next_power_of_2(m), tile_tokens)
