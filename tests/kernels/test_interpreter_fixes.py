"""interpreter_fixes._patch_lang: a kernel launch patches triton.language once, its @triton.jit helpers' calls do
not patch it again, and the launch's end restores the language (CPU, under Triton's interpreter only)."""
import pytest
import torch
import triton
import triton.language as tl

from dsflash.plugins.kernel_device import interpreting

pytestmark = [pytest.mark.gpu, pytest.mark.interpret]


@triton.jit
def _double(v):
    return v * 2


@triton.jit
def _double_five_times_kernel(x_ptr, y_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    v = tl.load(x_ptr + offs)
    for _ in tl.static_range(5):
        v = _double(v)
    tl.store(y_ptr + offs, v)


def test_a_launch_patches_the_language_once_and_restores_it(monkeypatch):
    if not interpreting():
        pytest.skip("the fixes apply under Triton's interpreter only")
    import interpreter_fixes
    orig = interpreter_fixes._patch_lang.__defaults__[0]
    calls = []

    def counted(fn):
        calls.append(fn.__name__)
        return orig(fn)
    monkeypatch.setattr(interpreter_fixes._patch_lang, "__defaults__", (counted, ))
    builtin_load = tl.load
    x = torch.arange(16, dtype=torch.float32)
    for launch in range(2):
        y = torch.empty_like(x)
        _double_five_times_kernel[(1, )](x, y, N=16)
        assert torch.equal(y, x * 32)
        assert calls == ["_double_five_times_kernel"] * (launch + 1), calls   # the 5 helper calls patched nothing
        assert interpreter_fixes._Patched.langs is None and tl.load is builtin_load   # restored after the launch
