"""The checkpoint name table: one entry per HF tensor with its on-disk role, synthetic init and shard rule.

Each family module exports `tensor_table(args) -> list[TensorEntry]`; model parameters carry exactly these names,
so loading is a strict name match. Convert, build and the synthetic generator all read this one table.
"""
from __future__ import annotations

from dataclasses import dataclass

# role -> on-disk format (HF checkpoint); `.scale` companions are implied by the quantized roles
ROLES = {
    "bf16": "BF16",
    "f32": "F32",
    "i64": "I64",
    "fp8_block": "F8_E4M3 weight + F8_E8M0 block scale [ceil(out/b), ceil(in/b)]",
    "mxfp4": "I8 packed e2m1 [out, in/2] (low nibble = even index) + F8_E8M0 scale [out, in/32]",
    "fp8_rows32": "F8_E4M3 [rows, d] + F8_E8M0 scale [rows, d/32]",
}
DTYPE_BYTES = {"BF16": 2, "F32": 4, "I64": 8, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1}
QUANTIZED_ROLES = ("fp8_block", "mxfp4", "fp8_rows32")
INITS = ("linear", "embed", "norm", "hc_fn", "hc_base", "hc_scale", "sink", "bias", "ape", "tid2eid", "small")
SHARDS = (None, "col", "row", "rows", "expert", "head")


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]  # logical (dequantized) shape
    role: str
    init: str = "linear"
    shard: str | None = None

    def __post_init__(self) -> None:
        assert self.role in ROLES, (self.name, self.role)
        assert self.init in INITS, (self.name, self.init)
        assert self.shard in SHARDS, (self.name, self.shard)

    @property
    def quantized(self) -> bool:
        return self.role in QUANTIZED_ROLES

    @property
    def scale_name(self) -> str:
        assert self.quantized, self.name
        return self.name.removesuffix(".weight") + ".scale"

    def stored_bytes(self, weight_block: int) -> int:
        """Bytes this entry occupies on disk in the HF format."""
        total = 0
        for shape, dtype in self.stored(weight_block).values():
            n = DTYPE_BYTES[dtype]
            for d in shape:
                n *= d
            total += n
        return total

    def stored(self, weight_block: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """HF tensors this entry occupies on disk: name -> (shape, safetensors dtype)."""
        s = self.shape
        if self.role == "bf16":
            return {self.name: (s, "BF16")}
        if self.role == "f32":
            return {self.name: (s, "F32")}
        if self.role == "i64":
            return {self.name: (s, "I64")}
        if self.role == "fp8_block":
            b = weight_block
            return {self.name: (s, "F8_E4M3"), self.scale_name: ((-(-s[0] // b), -(-s[1] // b)), "F8_E8M0")}
        if self.role == "mxfp4":
            return {self.name: ((s[0], s[1] // 2), "I8"), self.scale_name: ((s[0], -(-s[1] // 32)), "F8_E8M0")}
        return {self.name: (s, "F8_E4M3"), self.scale_name: ((s[0], -(-s[1] // 32)), "F8_E8M0")}


def tensor_table(args) -> list[TensorEntry]:
    """The name table of the family `args` belongs to."""
    if args.family == "v41":
        from dsflash.model_def.v41 import tensor_table as table
    else:
        from dsflash.model_def.v4 import tensor_table as table
    return table(args)
