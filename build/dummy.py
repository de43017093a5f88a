"""Dummy-weight engines (`dsflash build --preset F/N --dummy-weights`, `dsflash bench --load-format dummy`).

An engine with `"weights": {"format": "dummy", "seed": S}` in engine.json holds no rank files: at load time each
rank tensor is drawn (the synthetic checkpoint's init rules, `convert.synth`), quantized to its checkpoint role
and put into the engine's layout by the same code a converted checkpoint goes through, so loading and binding take
the path real weights take. A full-size rank's routed experts, which the MoE plugin reads in the HF format, are
drawn on the load device (minutes of CPU work otherwise) and never stored in any other form.
"""
from __future__ import annotations

import math
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F

from dsflash.build.plan import ARCH_LAYOUT, BuildConfig, plan_ranks
from dsflash.convert.atomic import atomic_dir
from dsflash.model_def.mapping import Mapping
from dsflash.model_def.names import TensorEntry, tensor_table

DUMMY_FORMAT = "dummy"
CHUNK_ELEMENTS = 1 << 27   # a full-size Engram table (~12G elements a rank) is drawn and quantized in row chunks
ROW_LOCAL_ROLES = ("fp8_rows32", "mxfp4")   # quantized row by row: a row chunk encodes alone


def write_dummy_engine(args, out: str | Path, mapping: Mapping, arch: str, cfg: BuildConfig, seed: int = 0) -> Path:
    """An engine of `args` whose weights are generated at load time (engine.json, tuned.json, tokenizer)."""
    from dsflash.build.engine import ENGINE_FILE, EngineError, check_speculative, engine_meta, verify_engine
    from dsflash.build.tune import write_tuned
    from dsflash.convert.synth import TOKENIZER_FILES, tokenizer_source_dir
    import json
    check_speculative(args, cfg)
    out = Path(out)
    if out.exists():
        raise EngineError(f"{out}: output directory already exists")
    plans = plan_ranks(args, tensor_table(args), mapping, arch)
    ranks = [{"file": None, "tensors": p.tensors, "bytes": p.bytes} for p in plans]
    with atomic_dir(out, "tmp-build") as tmp:
        engine = engine_meta(args, mapping, arch, cfg, ARCH_LAYOUT[arch], "fp4", ranks,
                             weights={"format": DUMMY_FORMAT, "seed": int(seed)})
        write_tuned(tmp, engine, arch)
        (tmp / ENGINE_FILE).write_text(json.dumps(engine, indent=2))
        verify_engine(tmp)
        src = tokenizer_source_dir()
        for f in TOKENIZER_FILES:
            shutil.copyfile(src / f, tmp / f)
    return out


class DummyRank:
    """A rank's tensors drawn in place. A tensor every rank holds whole is drawn alike on each (seeded by its name);
    a rank's slice is drawn from a seed of its own. Padded expert widths are zero, as the builder pads them."""

    def __init__(self, eng, rank: int, device: str):
        self.eng, self.rank, self.device = eng, rank, device
        self.seed, self.args, self.meta = eng.dummy_seed, eng.args, eng.meta
        self._global = {e.name: e.shape for e in tensor_table(self.args)}

    def __enter__(self) -> "DummyRank":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def reference(self, le: TensorEntry, logical: tuple[int, ...],
                  device: str | None = None) -> dict[str, torch.Tensor]:
        """The entry's tensors in the HF checkpoint format, drawn on `device` (default: the load device)."""
        whole = tuple(logical) == tuple(self._global[le.name])
        key = le.name if whole else f"{le.name}@rank{self.rank}"
        device = device or self.device
        rows = max(1, CHUNK_ELEMENTS // max(1, math.prod(logical[1:])))
        if le.role not in ROW_LOCAL_ROLES or logical[0] <= rows or tuple(logical) != tuple(le.shape):
            return self._draw(le, logical, key, device)
        parts = [self._draw(TensorEntry(le.name, (min(rows, le.shape[0] - r0), *le.shape[1:]), le.role, le.init,
                                        le.shard), None, f"{key}#{r0}", device)
                 for r0 in range(0, le.shape[0], rows)]
        return {name: torch.cat([p[name] for p in parts]) for name in parts[0]}

    def _draw(self, le: TensorEntry, logical: tuple[int, ...] | None, key: str, device) -> dict[str, torch.Tensor]:
        from dsflash.convert.synth import encode, synth_value
        logical = tuple(le.shape) if logical is None else tuple(logical)
        value = synth_value(TensorEntry(le.name, logical, le.role, le.init, le.shard), self.args, self.seed, key=key,
                            device=device)
        if logical != tuple(le.shape):   # expert widths padded after sharding
            value = F.pad(value, [p for lo, hi in zip(reversed(logical), reversed(le.shape)) for p in (0, hi - lo)])
        return encode(le, value, self.args)

    def stored(self, le: TensorEntry, logical: tuple[int, ...]) -> dict[str, torch.Tensor]:
        """The entry's tensors in the engine's layout (drawn and converted on the CPU, as the converter does)."""
        from dsflash.build.engine import to_layout
        return to_layout(le, self.reference(le, logical, "cpu"), self.meta["layout"], self.meta["expert_dtype"],
                         self.args)
