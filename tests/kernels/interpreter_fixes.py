"""Five gaps of Triton's interpreter (TRITON_INTERPRET=1) that the GPU does not have, mended for our parity tests:

- float casts: the interpreter truncates fp32 -> bf16 (and rounds fp8 half-up without carry), where the GPU rounds
  to nearest even (`cvt.rn`, and `cvt.rn.satfinite` for FP8). Casts between the dtypes torch also has go through
  torch's round-to-nearest-even here, saturating FP8 as the GPU does;
- `tl.dot` on BF16 operands: the interpreter multiplies their raw uint16 storage. BF16 operands are widened to fp32
  first (exact), as a tensor core's products are;
- libdevice: the interpreter gives its dispatch stubs no body (they return None). The functions our kernels call
  are given their numpy equivalents (`_LIBDEVICE`; numpy's rint rounds half to even, as __nv_rintf);
- inline PTX: the interpreter runs none. Our kernels' snippets run on `ptx_emulator.Emulator` (the subset of PTX
  they use, bit for bit; an instruction outside it raises);
- programmatic dependent launch: `gdc_wait` / `gdc_launch_dependents` are builtins the interpreter does not patch
  (calling one raises); with one program at a time they have nothing to order, and run as no-ops.

Without these, a correct kernel fails its parity test under the interpreter and a rounding bug could hide. One cost
is cut too: the interpreter re-patches triton.language on every @triton.jit helper call (`_patch_lang`). Applied
once, by tests/kernels/conftest.py, only when the interpreter is on."""
from __future__ import annotations

import functools
import sys

import numpy as np
import torch
import triton.language as tl
from triton.language.extra import cuda as tl_cuda
from triton.language.extra import libdevice
from triton.language.extra.cuda import libdevice as cuda_libdevice
from triton.runtime import interpreter as _interp

from ptx_emulator import Emulator

_TORCH_FLOATS = {tl.float64: torch.float64, tl.float32: torch.float32, tl.float16: torch.float16,
                 tl.bfloat16: torch.bfloat16, tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2}
_SATFINITE = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
_INT_OF_WIDTH = {8: torch.int8, 16: torch.int16, 32: torch.int32, 64: torch.int64}


def _convert_float(data: np.ndarray, src_ty, dst_ty, rounding_mode, _orig=_interp._convert_float) -> np.ndarray:
    src, dst = _TORCH_FLOATS.get(src_ty), _TORCH_FLOATS.get(dst_ty)
    if src is None or dst is None or rounding_mode == _interp._ir.ROUNDING_MODE.RTZ:
        return _orig(data, src_ty, dst_ty, rounding_mode)
    bits = np.ascontiguousarray(data).view(f"int{src_ty.primitive_bitwidth}")
    x = torch.from_numpy(bits).view(src)
    if dst in _SATFINITE:
        x = x.float().clamp(-_SATFINITE[dst], _SATFINITE[dst])
    out = x.to(dst).view(_INT_OF_WIDTH[dst_ty.primitive_bitwidth]).numpy()
    return out.view(f"uint{dst_ty.primitive_bitwidth}").reshape(data.shape)


def _widen_bf16(h):
    if h.dtype.scalar != tl.bfloat16:
        return h
    return _interp.TensorHandle(_convert_float(h.data, tl.bfloat16, tl.float32, None).view(np.float32), tl.float32)


def _create_dot(self, a, b, d, input_precision, max_num_imprecise_acc, _orig=_interp.InterpreterBuilder.create_dot):
    return _orig(self, _widen_bf16(a), _widen_bf16(b), d, input_precision, max_num_imprecise_acc)


@functools.cache
def _emulator(asm: str, constraints: str) -> Emulator:
    return Emulator(asm, constraints)


def _create_inline_asm(self, asm, constraints, values, ty, is_pure, pack):
    assert pack == 1, f"PTX emulator: pack={pack} (only elementwise asm on one element per call)"
    outs = _emulator(asm, constraints)([v.data for v in values])
    tys = ty if isinstance(ty, (list, tuple)) else [ty]
    return _AsmCall(*(_interp.TensorHandle(o, t.scalar) for o, t in zip(outs, tys)))


class _AsmCall:
    """What tl.inline_asm_elementwise reads back from the builder: the call's results by index."""

    def __init__(self, *results):
        self.results = results

    def get_result(self, i: int):
        return self.results[i]


def _elementwise(fn):
    def run(x, *rest):
        out = fn(x.handle.data, *(r.handle.data if isinstance(r, tl.tensor) else r for r in rest))
        return tl.tensor(_interp.TensorHandle(out.astype(x.handle.data.dtype), x.handle.dtype.scalar), x.type)
    return run


# libdevice function -> numpy equivalent on fp32 operands (fast_dividef: the exact quotient, within its 2 ulp)
_LIBDEVICE = {"rint": np.rint, "exp": np.exp, "log1p": np.log1p, "fast_dividef": np.divide}


_GDC = ("gdc_wait", "gdc_launch_dependents")


class _Patched:
    """The lang modules the running kernel launch has patched (None between launches)."""
    langs: frozenset | None = None


def _lang_modules(fn) -> frozenset:
    return frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)


def _patch_lang(fn, _orig=_interp._patch_lang):
    """The interpreter's own patching of a kernel's globals, plus the PDL builtins as no-ops in every dsflash
    module that imported them (the kernel's helpers may live in another module).

    The interpreter also calls this on every call of a @triton.jit helper inside a kernel, where it would patch the
    same modules again (their members are patched in place, so it changes nothing) and drop the scope: ~3 ms a
    call, most of an interpreted GEMV's time. Inside a launch that has patched the helper's modules it returns at
    once; the launch's own scope still restores everything when the launch ends."""
    langs = _lang_modules(fn)
    if _Patched.langs is not None:        # a helper call inside a launch, whose scope the interpreter drops
        if langs <= _Patched.langs:
            return _interp._LangPatchScope()
        _Patched.langs |= langs           # a helper seeing another lang module: patched as the interpreter does
        return _orig(fn)
    scope = _orig(fn)
    for name, module in list(sys.modules.items()):
        if name.startswith("dsflash.") and module is not None:
            for g in _GDC:
                if getattr(module, g, None) is getattr(tl_cuda, g):
                    scope.set_attr(module, g, lambda *args, **kwargs: None)
    _Patched.langs = langs                # a launch: its scope is restored in the interpreter's `finally`
    restore = scope.restore

    def restore_and_close() -> None:
        _Patched.langs = None
        restore()
    scope.restore = restore_and_close
    return scope


def apply() -> None:
    if getattr(_interp, "_dsflash_fixed", False):
        return
    _interp._convert_float = _convert_float
    _interp.InterpreterBuilder.create_dot = _create_dot
    _interp.InterpreterBuilder.create_inline_asm = _create_inline_asm
    _interp._patch_lang = _patch_lang
    for name, fn in _LIBDEVICE.items():
        for module in (libdevice, cuda_libdevice):
            setattr(module, name, _elementwise(fn))
    _interp._dsflash_fixed = True
