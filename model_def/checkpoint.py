"""Lazy, validated reading of Hugging Face checkpoints of the DeepSeek-V4 family.

Shards are opened on demand and tensors read one at a time, so memory stays at one tensor. Before any tensor is
read, `validate` checks every shard's header against the name table (presence, dtype, on-disk shape) and every
file's size against its header, so a truncated download or a checkpoint of the wrong family fails up front with
one message naming the file and tensor.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
from safetensors import safe_open

from dsflash.model_def.config import ConfigError, ModelArgs, load_args
from dsflash.model_def.names import TensorEntry
from dsflash.model_def.quant import dequant_fp8_block, dequant_fp8_rows32, dequant_mxfp4

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Tensors of the HF checkpoint the text model does not use (V4.1 vision tower; V4 MTP copies of embed/head).
IGNORED_PREFIXES = ("vision.", "aligner.", "image_start", "image_end", "image_newline")


class CheckpointError(ValueError):
    """A checkpoint on disk that does not match what the model expects."""


def read_safetensors_header(path: Path) -> dict:
    """Parse a safetensors header and check the file is as long as the header says."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise CheckpointError(f"{path}: truncated safetensors file (header of {n} bytes, file {size} bytes)")
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: shard file is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    header.pop("__metadata__", None)
    end = max((t["data_offsets"][1] for t in header.values()), default=0)
    if 8 + n + end > size:
        raise CheckpointError(f"{path}: truncated safetensors file: {size} bytes on disk, header describes "
                              f"{8 + n + end} bytes")
    return header


def _refuse_dsflash_outputs(path: Path) -> None:
    """A `dsflash convert` output or an engine dir passed where a Hugging Face checkpoint belongs: say what it is and
    which command takes it (its config.json would otherwise fail as an HF config with a misleading field error)."""
    if (path / "engine.json").is_file():
        raise CheckpointError(f"{path}: a dsflash engine directory, not a Hugging Face checkpoint "
                              f"(`dsflash generate/serve --engine {path}` run it)")
    cfg = path / "config.json"
    try:
        meta = json.loads(cfg.read_text()) if cfg.is_file() else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return   # load_args reports it
    if isinstance(meta, dict) and "dsflash" in meta:
        info = meta["dsflash"]
        layout = info.get("layout", "?") if isinstance(info, dict) else "?"
        raise CheckpointError(f"{path}: a `dsflash convert` output (layout {layout}), not a Hugging Face checkpoint "
                              f"(`dsflash build --ckpt {path}` takes it)")


class HFCheckpoint:
    """A checkpoint directory: config, shard index and lazily opened shards."""

    def __init__(self, path: str | Path, family: str | None = None):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: checkpoint directory not found")
        _refuse_dsflash_outputs(self.path)
        try:
            self.args: ModelArgs = load_args(self.path, family)
        except ConfigError as e:
            raise CheckpointError(str(e)) from None
        self.weight_map = self._read_index()
        self._headers: dict[str, dict] = {}
        self._handles: dict[str, object] = {}

    def _read_index(self) -> dict[str, str]:
        index = self.path / INDEX_FILE
        if index.is_file():
            try:
                wm = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
            return dict(wm)
        single = self.path / SINGLE_FILE
        if single.is_file():
            return {k: SINGLE_FILE for k in read_safetensors_header(single)}
        raise CheckpointError(f"{self.path}: neither {INDEX_FILE} nor {SINGLE_FILE} found")

    def header(self, shard: str) -> dict:
        if shard not in self._headers:
            self._headers[shard] = read_safetensors_header(self.path / shard)
        return self._headers[shard]

    def names(self) -> list[str]:
        return list(self.weight_map)

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(dtype string, shape) from the shard header, without reading data."""
        shard = self.weight_map[name]
        h = self.header(shard)
        if name not in h:
            raise CheckpointError(f"{self.path / shard}: tensor '{name}' is listed in {INDEX_FILE} but not in the shard")
        return h[name]["dtype"], tuple(h[name]["shape"])

    def get(self, name: str) -> torch.Tensor:
        """Read one tensor as stored."""
        if name not in self.weight_map:
            raise CheckpointError(f"{self.path}: tensor '{name}' is missing from the checkpoint")
        shard = self.weight_map[name]
        self.info(name)  # header + size check before touching the data
        if shard not in self._handles:
            self._handles[shard] = safe_open(str(self.path / shard), framework="pt")
        return self._handles[shard].get_tensor(name)

    def validate(self, table: list[TensorEntry]) -> None:
        """Every expected tensor present with its dtype and on-disk shape; nothing unexpected besides ignored parts."""
        block = self.args.weight_block
        expected: dict[str, tuple[tuple[int, ...], str]] = {}
        for e in table:
            expected.update(e.stored(block))
        for shard in sorted(set(self.weight_map.values())):
            self.header(shard)
        for name, (shape, dtype) in expected.items():
            if name not in self.weight_map:
                raise CheckpointError(f"{self.path / INDEX_FILE}: tensor '{name}' is missing "
                                      f"(expected {dtype} {list(shape)})")
            got_dtype, got_shape = self.info(name)
            where = self.path / self.weight_map[name]
            if got_dtype != dtype:
                raise CheckpointError(f"{where}: tensor '{name}' has dtype {got_dtype}, expected {dtype}")
            if got_shape != tuple(shape):
                raise CheckpointError(f"{where}: tensor '{name}' has shape {list(got_shape)}, expected {list(shape)}")
        for name in self.weight_map:
            if name not in expected and not self._ignored(name):
                raise CheckpointError(f"{self.path / self.weight_map[name]}: unexpected tensor '{name}' "
                                      f"(not part of the {self.args.family} model with this config)")

    def _ignored(self, name: str) -> bool:
        if name.startswith(IGNORED_PREFIXES):
            return True
        # V4 MTP blocks carry copies of embed/head that the model shares with the main model
        return self.args.family == "v4" and name.startswith("mtp.") and (".emb" in name or name.endswith("head.weight"))

    def load(self, entry: TensorEntry) -> torch.Tensor:
        """The entry's logical value in fp32 (dequantized) or as stored for integer tensors."""
        t = self.get(entry.name)
        if entry.role == "i64":
            return t
        if entry.role in ("bf16", "f32"):
            return t.float()
        s = self.get(entry.scale_name)
        where = f"{self.path / self.weight_map[entry.name]}: tensor '{entry.name}'"
        try:
            if entry.role == "fp8_block":
                return dequant_fp8_block(t, s, self.args.weight_block)
            if entry.role == "mxfp4":
                return dequant_mxfp4(t, s)
            return dequant_fp8_rows32(t, s)
        except ValueError as e:
            raise CheckpointError(f"{where}: {e}") from None
