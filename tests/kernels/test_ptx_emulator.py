"""The PTX emulator the interpreter tier runs our kernels' inline asm on (ptx_emulator.py), against torch's own
conversions and IEEE arithmetic: every e4m3 pair, f16x2 products and sums, fp32 fma, bit moves, and a refusal of
anything outside its subset. CPU only."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from ptx_emulator import Emulator  # noqa: E402


def _f16_bits(x: torch.Tensor) -> np.ndarray:
    return x.to(torch.float16).view(torch.int16).numpy().view(np.uint16).astype(np.uint32)


def test_e4m3_pairs_convert_as_torch_does():
    """All 65536 byte pairs: the low byte's value lands in the low half (NaN patterns compared as NaN)."""
    pairs = np.arange(1 << 16, dtype=np.uint32).view(np.int32)
    (got,) = Emulator("{\n.reg .b16 l, h;\nmov.b32 {l, h}, $1;\ncvt.rn.f16x2.e4m3x2 $0, l;\n}", "=r,r")([pairs])
    b = torch.from_numpy(np.arange(1 << 16, dtype=np.uint16).view(np.uint8).copy()).view(torch.float8_e4m3fn)
    want = b.to(torch.float16).view(-1, 2)
    got16 = torch.from_numpy(got.view(np.uint32).astype(np.uint32).view(np.uint16).view(np.float16).copy()).view(-1, 2)
    assert torch.equal(got16.isnan(), want.isnan())
    ok = ~want.isnan()
    assert torch.equal(got16[ok], want[ok])


def test_f16x2_and_f32_arithmetic_round_once_to_nearest_even():
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(4096, 2, generator=g) * 4).to(torch.float16), \
        (torch.randn(4096, 2, generator=g) * 4).to(torch.float16), (torch.randn(4096, 2, generator=g)).to(torch.float16)
    pack = lambda t: (_f16_bits(t[:, 0]) | (_f16_bits(t[:, 1]) << 16)).view(np.int32)  # noqa: E731
    unpack = lambda v: torch.from_numpy(v.view(np.uint32).view(np.uint16).view(np.float16).copy()).view(-1, 2)  # noqa: E731
    exact = lambda f: f(a.double(), b.double(), c.double()).to(torch.float16)  # noqa: E731  (one rounding)
    for asm, want in (("mul.rn.f16x2 $0, $1, $2;", exact(lambda x, y, z: x * y)),
                      ("add.rn.f16x2 $0, $1, $2;", exact(lambda x, y, z: x + y)),
                      ("fma.rn.f16x2 $0, $1, $2, $3;", exact(lambda x, y, z: x * y + z))):
        (got,) = Emulator(asm, "=r,r,r,r")([pack(a), pack(b), pack(c)])
        assert torch.equal(unpack(got), want), asm
    x, y, z = (torch.randn(4096, generator=g, dtype=torch.float64).float() for _ in range(3))
    (got,) = Emulator("fma.rn.f32 $0, $1, $2, $3;", "=f,f,f,f")([x.numpy(), y.numpy(), z.numpy()])
    assert torch.equal(torch.from_numpy(got), (x.double() * y.double() + z.double()).float())
    (got,) = Emulator("{\n.reg .b16 f0, f1;\nmov.b32 {f0, f1}, $1;\ncvt.f32.f16 $0, f1;\n}", "=f,r")([pack(a)])
    assert torch.equal(torch.from_numpy(got), a[:, 1].float())


def test_bit_moves_pack_unpack_and_logical_shifts():
    x = np.array([0x80000001, 0x12345678, 0xFFFFFFFF], dtype=np.uint32).view(np.int32)
    y = np.array([0x0123456789ABCDEF, -1, 5], dtype=np.int64)
    asm = ("{\n.reg .b32 lo, hi, t;\nmov.b64 {lo, hi}, $2;\nshr.b32 t, $1, 4;\nand.b32 t, t, 0x0F0F0F0F;\n"
           "xor.b32 t, t, lo;\nshl.b32 hi, hi, 1;\nor.b32 $0, t, hi;\n}")
    (got,) = Emulator(asm, "=r,r,l")([x, y])
    xu, yu = x.view(np.uint32).astype(np.uint64), y.view(np.uint64)
    lo, hi = yu & 0xFFFFFFFF, yu >> np.uint64(32)
    want = ((((xu >> np.uint64(4)) & 0x0F0F0F0F) ^ lo) | ((hi << np.uint64(1)) & 0xFFFFFFFF)) & 0xFFFFFFFF
    assert np.array_equal(got.view(np.uint32), want.astype(np.uint32))


def test_instructions_outside_the_subset_are_refused():
    with pytest.raises(NotImplementedError, match="ex2.approx.f32"):
        Emulator("ex2.approx.f32 $0, $1;", "=f,f")([np.ones(2, np.float32)])
