"""Op dispatch: the one place where the model reaches the plugin kernels (design.md §2).

A reference module runs plain PyTorch until an engine loader attaches a plugin to it (`build/bind.py`); the plugin
modules below hold the tensors in the layout their kernel reads and call `torch.ops.dsflash.*`, which are
registered by `dsflash.plugins.registry` (imported by whoever binds; model_def imports no plugin code); eager
forwards call the same functions without the dispatcher once the binder installed them (`use_eager_ops`). On CPU
tensors the same ops run the plugins' plain-PyTorch `*_ref`, so the wiring is testable without a GPU.

Which ops an engine binds is recorded in engine.json's `plugins` ({op: impl}); `PLUGIN_IMPLS` lists the choices.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from dsflash.model_def.layers import apply_rope
from dsflash.model_def.layers import rope_cos_sin as rope_angles
from dsflash.model_def.quant import fake_quant_fp4_e4m3scale, fake_quant_fp4_pow2, fake_quant_fp8

log = logging.getLogger("dsflash.dispatch")

REFERENCE = "reference"
PLUGIN_IMPLS = {
    "gemm": (REFERENCE, "fp8_gemm"),     # FP8 dense linears (V4.1 and V4): FP8 GEMM or BF16-cache GEMM, per tuned.json
    # router + MXFP4 routed experts + shared-expert add; `mxfp4_overlap` runs the shared expert on a second CUDA
    # stream while the router and the routed experts run, and adds its output after them
    "moe": (REFERENCE, "mxfp4", "mxfp4_overlap"),
    # mHC coefficients, collapse + norm, expand (+ next collapse + norm); `fused_overlap` also computes each site's
    # coefficients on a second CUDA stream while the attention or MoE runs (seed post §3.1)
    "mhc": (REFERENCE, "fused", "fused_overlap"),
    "wo_a": (REFERENCE, "fused"),        # inverse RoPE + grouped output projection
    "norm": (REFERENCE, "fused"),        # RMSNorm in one kernel (q_norm, kv_norm, k_norm, the final norm, ...)
    "swiglu": (REFERENCE, "fused"),      # the shared expert's clipped SwiGLU (+ BF16 rounding) in one kernel
    # V4.1's window KV rows (RoPE'd K = V) quantized FP8 1×32 and back in one kernel (`act_quant_dequant`)
    "kv_quant": (REFERENCE, "fused"),
    # V4.1's RoPE and the quantization of the rotated rows (queries; window rows FP8; index keys and queries FP4;
    # compressed entries FP4) in one kernel per site (`rope_quant`)
    "rope": (REFERENCE, "fused"),
    # V4.1's decode attention over the decode slots (window ring + top-k entries, sink softmax) in one kernel
    "attention": (REFERENCE, "fused"),
    # V4.1's index scores over the decode slots' visible entries only, read in place (not all E rows gathered)
    "index": (REFERENCE, "fused"),
}
MOE_PLUGINS = PLUGIN_IMPLS["moe"][1:]
_warned: set[str] = set()
_ops = None
_eager_ops = None


def use_eager_ops(namespace) -> None:
    """Install the plugin ops as plain functions (`dsflash.plugins.registry.eager_ops`, by the engine loader): eager
    forwards then call them without the dispatcher; traced ones (torch.compile) still go through torch.ops."""
    global _eager_ops
    _eager_ops = namespace


def ops():
    """The plugin ops: the installed plain functions outside tracing, else torch.ops.dsflash, with a clear message
    when nothing registered them (checked once: this is on every call)."""
    global _ops
    if _eager_ops is not None and not torch.compiler.is_compiling():
        return _eager_ops
    if _ops is None:
        if not hasattr(torch.ops.dsflash, "fp8_linear"):
            raise RuntimeError("dsflash plugin ops are not registered: import dsflash.plugins.registry before running "
                               "a model with plugins bound (build.bind.bind_plugins does)")
        _ops = torch.ops.dsflash
    return _ops


def warn_once(key: str, msg: str, *args) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(msg, *args)


def _flat(x: torch.Tensor) -> torch.Tensor:
    """[..., K] -> contiguous BF16 [T, K] (the kernels' activation format)."""
    return x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()


class FP8Linear(nn.Module):
    """Plugin of an FP8 `Linear`: e4m3 [N, K] + e8m0 scales in the kernels' 32×32 format (V4's 128×128 blocks
    expanded), and the BF16-cache copy when the engine holds one; `dsflash::fp8_linear` quantizes the activation per
    1×act_block (32: V4.1, 128: V4) and picks the FP8 or the BF16-cache GEMM from the tuned table (logged
    fallback)."""

    def __init__(self, w_q: torch.Tensor, w_s: torch.Tensor, w_bf16: torch.Tensor | None, act_block: int = 32):
        from dsflash.plugins.fp8_gemm_sm90 import weight_scales_f32
        super().__init__()
        self.register_buffer("w_q", w_q.contiguous())
        self.register_buffer("w_s", w_s.contiguous())
        self.register_buffer("w_bf16", None if w_bf16 is None else w_bf16.to(torch.bfloat16).contiguous())
        # the scales as the sm90 CUDA GEMM reads them (fp32, transposed; ~1/256 of the FP8 weight's bytes), derived
        # here once rather than per call (not saved: the engine holds w_s)
        self.register_buffer("w_s_t", weight_scales_f32(self.w_s, tma=True), persistent=False)
        self.act_block = act_block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ops().fp8_linear(_flat(x), self.w_q, self.w_s, self.w_bf16, self.act_block, self.w_s_t)   # [T, N] bf16
        return y.view(*x.shape[:-1], y.shape[-1])


class FusedRMSNorm(nn.Module):
    """Plugin of an `RMSNorm` (last dim a multiple of 32): `dsflash::rmsnorm`, the reference's fp32 math and rounding
    in one launch. Holds no tensors: the module's own weight is passed in."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return ops().rmsnorm(_rows_of(x), weight, eps).view(x.shape)


class FusedRMSNormPair(nn.Module):
    """Plugin of an attention's q_norm and kv_norm: `dsflash::rmsnorm_pair`, the two `FusedRMSNorm`s in one launch
    (their inputs: the column slices of the stacked wq_a|wkv output, read in place). Holds no tensors: the norms'
    own weights are passed in."""

    def forward(self, a: torch.Tensor, norm_a: nn.Module, b: torch.Tensor, norm_b: nn.Module
                ) -> tuple[torch.Tensor, torch.Tensor]:
        assert norm_a.eps == norm_b.eps, (norm_a.eps, norm_b.eps)
        ya, yb = ops().rmsnorm_pair(_rows_of(a), norm_a.weight, _rows_of(b), norm_b.weight, norm_a.eps)
        return ya.view(a.shape), yb.view(b.shape)


def _rows_of(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] as the norm kernels' rows: its leading dims flattened; strided rows (e.g. a stacked GEMM's column
    slice) kept in place, a non-contiguous last dim copied."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


class FusedSwiGLU(nn.Module):
    """Plugin of a shared expert's clipped SwiGLU: `dsflash::clipped_swiglu`, h in deploy numerics (fp32 math,
    rounded to BF16 before w2) in one launch instead of the reference's widen / clamp / silu / multiply / round."""

    def forward(self, g: torch.Tensor, u: torch.Tensor, limit: float) -> torch.Tensor:
        return ops().clipped_swiglu(g, u, limit)


class MXFP4MoE(nn.Module):
    """Plugin of a V4.1 `MoE` (text tokens) or a V4 `MoE`: router + routed MXFP4 experts + shared-expert add, one op.

    w13_q int8 [E, 2·I_pad, D/2] (w1 rows, then w3), w13_s e8m0 [E, 2·I_pad, D/32], w2_q [E, D, I_pad/2],
    w2_s [E, D, I_pad/32]; `inter` is the logical local intermediate width (padded columns are zero). Under expert
    parallelism the E experts are this rank's block, global ids expert_start.. (the gate routes over all of them).
    qblock: the experts' activation quantization block (V4.1 32, V4 128). `overlap_shared`: the model computes the
    shared expert on the device's second side stream (`side_stream(device, 1)`) while this op runs, and adds it
    after (`shared_expert_forked`): the op then starts its fp32 sum at 0 instead of at the shared output."""

    def __init__(self, w13_q, w13_s, w2_q, w2_s, inter: int, topk: int, route_scale: float, gate_temp: float,
                 swiglu_limit: float, expert_start: int = 0, qblock: int = 32, overlap_shared: bool = False):
        super().__init__()
        for name, t in (("w13_q", w13_q), ("w13_s", w13_s), ("w2_q", w2_q), ("w2_s", w2_s)):
            self.register_buffer(name, t.contiguous())
        self.expert_start, self.qblock = expert_start, qblock
        self.inter, self.topk, self.route_scale = inter, topk, route_scale
        self.gate_temp, self.swiglu_limit = gate_temp, swiglu_limit
        self.overlap_shared = overlap_shared

    def forward(self, flat: torch.Tensor, gate_w: torch.Tensor, gate_bias: torch.Tensor | None,
                shared: torch.Tensor | None, hash_ids: torch.Tensor | None = None) -> torch.Tensor:
        """flat [T, D], shared [T, D] (the shared expert's output, or None) -> fp32 [T, D] before the TP all-reduce;
        hash_ids int32 [T, k]: the picks of a V4 hash-routed layer (which has no gate bias: None)."""
        return ops().moe(_flat(flat), gate_w, gate_bias, self.topk, self.route_scale, self.w13_q, self.w13_s,
                         self.w2_q, self.w2_s, self.swiglu_limit, self.inter, shared, self.gate_temp,
                         self.expert_start, self.qblock, hash_ids)


class FusedHC(nn.Module):
    """Plugin of a block's two mHC sites: the fp32 mixing weights split into BF16 main + two correction terms
    ([3, 32, n·D], `hc_split_weight`) for the tensor-core coefficient kernel. `overlap`: compute a site's
    coefficients on the device's side stream (`Forked`) while the attention or MoE runs on the current one (the
    coefficient kernels share no split-K counter with any other kernel, so they may run concurrently)."""

    def __init__(self, attn_split: torch.Tensor, ffn_split: torch.Tensor, overlap: bool = False):
        super().__init__()
        self.register_buffer("attn_split", attn_split.contiguous())
        self.register_buffer("ffn_split", ffn_split.contiguous())
        self.overlap = overlap


_side_streams: dict[tuple[int, int], torch.cuda.Stream] = {}


def side_stream(device: torch.device, slot: int = 0) -> torch.cuda.Stream | None:
    """A side stream of a CUDA device that off-critical-path work runs on (per device and slot, made on first use:
    slot 0 the mHC coefficients, slot 1 the shared expert, so that neither queues behind the other); None on the
    CPU, where `Forked` runs inline."""
    if device.type != "cuda":
        return None
    key = (device.index if device.index is not None else torch.cuda.current_device(), slot)
    if key not in _side_streams:
        _side_streams[key] = torch.cuda.Stream(device=key[0])
    return _side_streams[key]


def side_streams() -> list[torch.cuda.Stream]:
    """Every side stream made so far (a failed CUDA-graph capture joins them back: serve/runtime/cuda_graphs.py)."""
    return list(_side_streams.values())


class Forked:
    """`fn(*args)` started on `stream` behind everything queued so far on the current stream; `join()` makes the
    current stream wait for it and returns its result. With `stream` None it runs inline.

    Inside CUDA-graph capture the fork and the join become the graph's branch and merge. Memory: the result is
    allocated on `stream`, and the caching allocator hands its blocks only to later allocations on `stream`; each of
    those follows a fork, i.e. a wait for the current stream's work so far, so a block is never rewritten while the
    current stream may still read it. The caller keeps `args` alive until `join()`."""

    def __init__(self, stream: torch.cuda.Stream | None, fn, *args):
        self._stream = stream
        if stream is None:
            self._out = fn(*args)
            return
        self._main = torch.cuda.current_stream(stream.device)
        stream.wait_stream(self._main)
        with torch.cuda.stream(stream):
            self._out = fn(*args)

    def join(self):
        if self._stream is not None:
            self._main.wait_stream(self._stream)
        return self._out


def shared_expert_forked(plugin: MXFP4MoE, shared_expert, x: torch.Tensor) -> Forked | None:
    """The shared expert's output started on the second side stream when the MoE plugin overlaps it (None when it
    does not: the caller runs it in line and passes its output into the op)."""
    if not plugin.overlap_shared:
        return None
    return Forked(side_stream(x.device, 1), shared_expert, x)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, rd/2] fp32 of positions (flattened to [T]), the angles of `layers.apply_rope`."""
    return tuple(t.reshape(-1, t.shape[-1]).contiguous() for t in rope_angles(positions, inv_freq, torch.float32))


_ROPE_QUANTS = {"none": lambda y, block: y, "fp8": fake_quant_fp8, "fp4_pow2": fake_quant_fp4_pow2,
                "fp4_e4m3": fake_quant_fp4_e4m3scale}


def rope_rows(fused: bool, x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, quant: str = "none",
              block: int = 32) -> torch.Tensor:
    """`layers.apply_rope`, then `quant` of the rotated rows per `block` channels ("fp8": the window K = V rows,
    "fp4_pow2": index keys and queries, "fp4_e4m3": compressed entries): one `rope_quant` launch where the rope
    plugin is bound (`fused`), else the model's torch ops (~10 for the rotation, ~20 for a quantization)."""
    if fused:
        cos, sin = rope_angles(positions, inv_freq, torch.float32)
        return ops().rope_quant(x, cos, sin, False, quant, block)
    return _ROPE_QUANTS[quant](apply_rope(x, positions, inv_freq), block)


def wo_a_inverse_rope(o: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                      weight: torch.Tensor) -> torch.Tensor:
    """The WO-A plugin: inverse RoPE at the query positions + the grouped `wo_a`. o [B,S,h,d] -> [B,S,G·r] (o's
    dtype)."""
    b, s = o.shape[:2]
    cos, sin = rope_cos_sin(positions if positions.shape == (b, s) else positions.expand(b, s), inv_freq)
    z = ops().wo_a(o.reshape(b * s, *o.shape[2:]).to(torch.bfloat16).contiguous(), cos, sin, weight)
    return z.view(b, s, -1).to(o.dtype)
