"""The subset of PTX our Triton kernels write as inline asm, run elementwise on numpy arrays, so that Triton's
interpreter (which runs no PTX) can run those kernels on the CPU (tests/kernels/interpreter_fixes.py).

The subset: bit moves and logic on .b16/.b32/.b64 registers (`mov` with {lo, hi} packing and unpacking, `shl`,
`shr` (logical, as .b types are), `and`, `or`, `xor`), `cvt.rn.f16x2.e4m3x2`, `cvt.f32.f16`, and the .rn
arithmetic `mul`, `add`, `fma` on .f32 and .f16x2. Registers hold raw bits (uint16/32/64); $N are the asm
call's operands, outputs first, as its constraint string orders them. An instruction outside the subset raises, so
a kernel never runs on a silently wrong emulation.

Rounding: every .rn result is rounded to nearest even once, from a float64 value. That value is exact for mul and add
of f16/f32 operands; for fma it is the exact product plus the addend rounded to float64, so a result could differ
from the GPU's single rounding only when that sum needs more than 53 bits and lands within a float64 ulp of a
halfway point (operands 2^30+ apart in magnitude and the product's bits exactly at a tie): not met by test data."""
from __future__ import annotations

import re

import numpy as np
import torch

_UINT = {16: np.uint16, 32: np.uint32, 64: np.uint64}


def _statements(asm: str) -> list[str]:
    """The asm's instructions, without the scope braces around the whole, `.reg` declarations and comments."""
    out = []
    for raw in re.sub(r"//[^\n]*", "", asm).split(";"):
        stmt = raw.strip().lstrip("{").strip().lstrip("}").strip()
        if stmt and not stmt.startswith(".reg"):
            out.append(stmt)
    return out


def _operands(text: str) -> list:
    """'d, {a, b}, 0x1C' -> ['d', ['a', 'b'], '0x1C']"""
    ops, depth, cur = [], 0, ""
    for ch in text:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        if ch == "," and depth == 0:
            ops.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        ops.append(cur.strip())
    return [[r.strip() for r in o.strip("{} ").split(",")] if o.startswith("{") else o for o in ops]


def _e4m3x2_to_f16x2(v: np.ndarray) -> np.ndarray:
    b = torch.from_numpy(np.ascontiguousarray(v.astype(np.uint16)).view(np.uint8).copy())
    h = b.view(torch.float8_e4m3fn).to(torch.float16).view(torch.int16).numpy().view(np.uint16)
    h = h.reshape(*v.shape, 2).astype(np.uint32)
    return h[..., 0] | (h[..., 1] << 16)                      # the low byte's value in the low half


def _f16x2(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    lo = (v & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float64)
    hi = (v >> 16).astype(np.uint16).view(np.float16).astype(np.float64)
    return lo, hi


def _pack_f16x2(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        a = lo.astype(np.float16).view(np.uint16).astype(np.uint32)
        b = hi.astype(np.float16).view(np.uint16).astype(np.uint32)
    return a | (b << 16)


def _f32(v: np.ndarray) -> np.ndarray:
    return v.astype(np.uint32).view(np.float32).astype(np.float64)


def _to_f32_bits(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return x.astype(np.float32).view(np.uint32)


class Emulator:
    def __init__(self, asm: str, constraints: str):
        self.program = [(s.split(None, 1)[0], _operands(s.split(None, 1)[1] if " " in s else ""))
                        for s in _statements(asm)]
        self.kinds = [c.lstrip("=") for c in constraints.split(",")]
        self.n_out = sum(1 for c in constraints.split(",") if c.startswith("="))

    def __call__(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        regs: dict[str, np.ndarray] = {}
        for i, x in enumerate(inputs):
            width = {"f": 32, "r": 32, "l": 64, "h": 16}[self.kinds[self.n_out + i]]
            regs[f"${self.n_out + i}"] = np.ascontiguousarray(x).view(_UINT[width]).astype(np.uint64)
        shape = np.broadcast_shapes(*(x.shape for x in inputs)) if inputs else ()

        def val(o):
            if o in regs:
                return regs[o]
            if re.fullmatch(r"-?(0[xX][0-9a-fA-F]+|\d+)", o):
                return np.full(shape, int(o, 0) & 0xFFFFFFFFFFFFFFFF, dtype=np.uint64)
            raise KeyError(f"PTX emulator: operand {o!r} read before it is written")

        for op, args in self.program:
            parts = op.split(".")
            name, ty = parts[0], parts[-1]
            if name == "mov":
                dst, src = args
                width = int(ty[1:])
                if isinstance(dst, list):                 # unpack: low part first
                    w = width // len(dst)
                    for j, d in enumerate(dst):
                        regs[d] = (val(src) >> np.uint64(w * j)) & np.uint64((1 << w) - 1)
                elif isinstance(src, list):               # pack
                    w = width // len(src)
                    acc = np.zeros(shape, dtype=np.uint64)
                    for j, s in enumerate(src):
                        acc |= val(s) << np.uint64(w * j)
                    regs[dst] = acc
                else:
                    regs[dst] = val(src)
            elif name in ("shl", "shr", "and", "or", "xor") and ty[0] == "b":
                width = int(ty[1:])
                a, b = val(args[1]), val(args[2])
                mask = np.uint64((1 << width) - 1)
                res = {"shl": lambda: a << b, "shr": lambda: (a & mask) >> b, "and": lambda: a & b,
                       "or": lambda: a | b, "xor": lambda: a ^ b}[name]()
                regs[args[0]] = res & mask
            elif op == "cvt.rn.f16x2.e4m3x2":
                regs[args[0]] = _e4m3x2_to_f16x2(val(args[1]) & np.uint64(0xFFFF)).astype(np.uint64)
            elif op == "cvt.f32.f16":
                h = (val(args[1]) & np.uint64(0xFFFF)).astype(np.uint16).view(np.float16)
                regs[args[0]] = h.astype(np.float32).view(np.uint32).astype(np.uint64)
            elif name in ("mul", "add", "fma") and parts[1] == "rn" and ty in ("f32", "f16x2"):
                fn = {"mul": lambda x, y: x * y, "add": lambda x, y: x + y,
                      "fma": lambda x, y, z: x * y + z}[name]
                srcs = [val(a) for a in args[1:]]
                if ty == "f32":
                    regs[args[0]] = _to_f32_bits(fn(*(_f32(s) for s in srcs))).astype(np.uint64)
                else:
                    halves = [_f16x2(s.astype(np.uint32)) for s in srcs]
                    lo = fn(*(h[0] for h in halves))
                    hi = fn(*(h[1] for h in halves))
                    regs[args[0]] = _pack_f16x2(lo, hi).astype(np.uint64)
            else:
                raise NotImplementedError(f"PTX emulator: instruction {op!r} is outside the subset")

        outs = []
        for i in range(self.n_out):
            kind = self.kinds[i]
            v = regs[f"${i}"]
            outs.append({"f": lambda: v.astype(np.uint32).view(np.float32),
                         "r": lambda: v.astype(np.uint32).view(np.int32),
                         "l": lambda: v.view(np.int64),
                         "h": lambda: v.astype(np.uint16).view(np.int16)}[kind]().reshape(shape))
        return outs
