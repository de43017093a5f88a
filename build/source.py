"""Build inputs: an HF checkpoint (reference layout) or a `dsflash convert` output dir, read tensor by tensor.

Either way `stored(entry)` yields the entry's tensors in the reference on-disk format, which build cuts per rank.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open

from dsflash.model_def.checkpoint import CheckpointError, HFCheckpoint, read_safetensors_header
from dsflash.model_def.config import args_from_hf_dict
from dsflash.model_def.names import TensorEntry, tensor_table

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class HFSource:
    layout = "reference"
    expert_dtype = "fp4"

    def __init__(self, path: Path):
        self.path = path
        self.ckpt = HFCheckpoint(path)
        self.args = self.ckpt.args
        self.ckpt.validate(tensor_table(self.args))

    def stored(self, e: TensorEntry) -> dict[str, torch.Tensor]:
        names = [e.name] + ([e.scale_name] if e.quantized else [])
        return {n: self.ckpt.get(n) for n in names}

    def copy_tokenizer(self, dst: Path) -> None:
        _copy_tokenizer(self.path, dst)


class CanonicalSource:
    """A `dsflash convert` output: config.json {"dsflash": {...}, "model": {...}}, manifest.json, shards."""

    def __init__(self, path: Path, meta: dict):
        self.path = path
        info = meta["dsflash"]
        self.layout = info["layout"]
        self.expert_dtype = info.get("expert_dtype", "fp4")
        self.args = args_from_hf_dict(meta["model"], str(path / "config.json"))
        man = path / "manifest.json"
        if not man.is_file():
            raise CheckpointError(f"{man}: manifest missing (incomplete `dsflash convert` output?)")
        manifest = json.loads(man.read_text())
        entries = manifest["tensors"] if isinstance(manifest, dict) else manifest
        self.shard_of = {t["name"]: t["shard"] for t in entries}
        headers = {shard: read_safetensors_header(path / shard) for shard in sorted(set(self.shard_of.values()))}
        self._handles: dict[str, object] = {}
        from dsflash.convert import layouts
        self._layouts = layouts
        self._validate(headers)

    def _validate(self, headers: dict[str, dict]) -> None:
        """Every tensor the config's model needs in this layout is in the manifest and in its shard with the shape
        and dtype the config implies (a config edited after convert, or a shard from another checkpoint, fails here
        naming the shard and tensor, before build writes anything)."""
        for e in tensor_table(self.args):
            for o in self._layouts.outputs(e, self.layout, self.expert_dtype, self.args):
                shard = self.shard_of.get(o.name)
                if shard is None:
                    raise CheckpointError(f"{self.path / 'manifest.json'}: tensor '{o.name}' is missing")
                t = headers[shard].get(o.name)
                if t is None:
                    raise CheckpointError(f"{self.path / shard}: tensor '{o.name}' is missing (manifest.json lists it)")
                if (tuple(t["shape"]), t["dtype"]) != (tuple(o.shape), o.dtype):
                    raise CheckpointError(f"{self.path / shard}: tensor '{o.name}' is {t['dtype']} {t['shape']}, "
                                          f"config.json implies {o.dtype} {list(o.shape)}")

    def _get(self, name: str) -> torch.Tensor:
        if name not in self.shard_of:
            raise CheckpointError(f"{self.path / 'manifest.json'}: tensor '{name}' is missing")
        shard = self.shard_of[name]
        if shard not in self._handles:
            self._handles[shard] = safe_open(str(self.path / shard), framework="pt")
        return self._handles[shard].get_tensor(name)

    def stored(self, e: TensorEntry) -> dict[str, torch.Tensor]:
        names = self._layouts.stored_names(e, self.layout, self.expert_dtype, self.args)
        ours = {n: self._get(n) for n in names}
        return self._layouts.to_reference(e, ours, self.layout, self.expert_dtype, self.args)

    def copy_tokenizer(self, dst: Path) -> None:
        _copy_tokenizer(self.path, dst)


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for f in TOKENIZER_FILES:
        if (src / f).is_file():
            shutil.copyfile(src / f, dst / f)


def open_source(path: str | Path):
    path = Path(path)
    cfg = path / "config.json"
    if not cfg.is_file():
        raise CheckpointError(f"{cfg}: file not found (expected an HF checkpoint or a `dsflash convert` output)")
    meta = json.loads(cfg.read_text())
    if "dsflash" in meta:
        return CanonicalSource(path, meta)
    return HFSource(path)
