"""`dsflash convert`: HF checkpoint -> canonical checkpoint, streamed tensor by tensor, atomic and resumable.

Output directory (`--out`):
  config.json
      {"dsflash": {"format": 1, "version": <dsflash version>, "layout": "reference"|"hopper"|"blackwell",
                   "expert_dtype": "fp4"|"fp8", "weight_block": b, "expert_block": t (fp8 experts) or null,
                   "source": {"path": <absolute HF dir>,
                              "sha256": {"config.json": <hex>, "model.safetensors.index.json": <hex>}}},
       "model": <args.to_hf_dict(): the HF config of the text model, readable by model_def.config.args_from_hf_dict>}
  model-NNNNN-of-MMMMM.safetensors
      our tensors (names and formats in layouts.py), at most `--max-shard-size` bytes each (an entry's tensors never
      straddle two shards; an entry larger than the limit gets a shard of its own). Inside a shard tensors are
      ordered 8-, 4-, 2-, then 1-byte dtypes, so every tensor starts aligned to its element size.
  model.safetensors.index.json   {"metadata": {"total_size": bytes}, "weight_map": {name: shard}} (HF convention)
  manifest.json
      {"format": 1, "layout", "expert_dtype", "tensors": [{"name", "shape", "dtype", "sha256" (of the tensor's
       bytes), "shard", "kind" (layouts.SUFFIXES key or "plain"), "entry" (the HF name-table entry)}, ...]}
      in write order, plus "shards": {file: sha256 of the whole file}.
  tokenizer.json, tokenizer_config.json, ... (copied when present; tokenizer.json is required)

Work happens in `<out>.partial` next to `--out` and is renamed to `--out` only once everything, manifest and config
last, is written, so `--out` exists only complete. Each finished shard is fsynced and recorded with its sha256 in
`<out>.partial/progress.json`; a failed or interrupted run leaves the temp dir, and a rerun with the same
arguments reuses every recorded shard whose file still hashes to the recorded value (a run with other arguments,
source or shard size starts over). Memory: one entry's tensors at a time; tensors copied unchanged (every tensor
of the reference layout, embeddings, Engram tables) stream in 16 MiB chunks, so peak memory does not grow with
the number of layers or with the size of a single copied tensor.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from dsflash.convert import layouts as L
from dsflash.convert.formats import FormatError
from dsflash.model_def import names as N
from dsflash.model_def.checkpoint import INDEX_FILE, SINGLE_FILE, CheckpointError, HFCheckpoint
from dsflash.model_def.names import TensorEntry

FORMAT = 1
CONFIG_FILE = "config.json"
MANIFEST_FILE = "manifest.json"
PROGRESS_FILE = "progress.json"
PARTIAL_SUFFIX = ".partial"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja")
DEFAULT_SHARD_BYTES = 5 * 10 ** 9
CHUNK = 16 << 20


class ConvertError(ValueError):
    """A conversion that cannot go on; the message names the file and tensor."""


def dsflash_version() -> str:
    try:
        from importlib.metadata import version

        return version("dsflash")
    except Exception:  # running from a copied tree that is not installed
        return "unknown"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


# -- reading the source ----------------------------------------------------------------------------------------------
class SourceReader:
    """Reads tensors of a validated HFCheckpoint with positioned reads into fresh buffers.

    Not `HFCheckpoint.get`: that keeps a `safe_open` handle per shard, which memory-maps the whole file, and every page
    a read touches stays resident in the process, so RSS would grow to the size of everything converted (measured:
    reading 400 MB through one handle raised peak RSS by ~390 MB). Plain reads leave only the page cache behind.
    """

    def __init__(self, ckpt: HFCheckpoint):
        self.ckpt = ckpt
        self._data_start: dict[str, int] = {}

    def span(self, name: str) -> tuple[Path, int, int]:
        """(file, absolute offset, byte length) of an HF tensor."""
        shard = self.ckpt.weight_map[name]
        path = self.ckpt.path / shard
        if shard not in self._data_start:
            with open(path, "rb") as f:
                self._data_start[shard] = 8 + int.from_bytes(f.read(8), "little")
        begin, end = self.ckpt.header(shard)[name]["data_offsets"]
        return path, self._data_start[shard] + begin, end - begin

    def get(self, name: str) -> torch.Tensor:
        dtype, shape = self.ckpt.info(name)
        path, offset, nbytes = self.span(name)
        buf = torch.empty(nbytes, dtype=torch.uint8)
        with open(path, "rb") as f:
            f.seek(offset)
            got = f.readinto(buf.numpy())
        if got != nbytes:
            raise CheckpointError(f"{path}: tensor '{name}' is truncated ({got} of {nbytes} bytes)")
        return buf.view(L.TORCH_DTYPES[dtype]).reshape(shape)

    def chunks(self, name: str):
        """The tensor's raw bytes in chunks of at most CHUNK bytes."""
        path, offset, nbytes = self.span(name)
        with open(path, "rb") as f:
            f.seek(offset)
            left = nbytes
            while left:
                data = f.read(min(CHUNK, left))
                if not data:
                    raise CheckpointError(f"{path}: tensor '{name}' is truncated ({nbytes - left} of {nbytes} bytes)")
                left -= len(data)
                yield data


# -- writing shards --------------------------------------------------------------------------------------------------
@dataclass
class ShardPlan:
    file: str
    items: list[tuple[TensorEntry, list[L.OutTensor]]] = field(default_factory=list)
    nbytes: int = 0

    def tensors(self) -> list[L.OutTensor]:
        return [o for _, outs in self.items for o in outs]


def plan_shards(table: list[TensorEntry], layout: str, expert_dtype: str, args, shard_bytes: int) -> list[ShardPlan]:
    """Group the entries' outputs into shards of at most `shard_bytes` (entries never straddle shards)."""
    shards = [ShardPlan("")]
    for e in table:
        outs = L.outputs(e, layout, expert_dtype, args)
        size = sum(o.nbytes for o in outs)
        if shards[-1].items and shards[-1].nbytes + size > shard_bytes:
            shards.append(ShardPlan(""))
        shards[-1].items.append((e, outs))
        shards[-1].nbytes += size
    for i, s in enumerate(shards):
        s.file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    return shards


class ShardWriter:
    """Writes one safetensors file whose header is known up front; tensors arrive in any order, one at a time."""

    def __init__(self, path: Path, tensors: list[L.OutTensor], metadata: dict[str, str]):
        self.path = path
        order = sorted(tensors, key=lambda o: -L.DTYPE_BYTES[o.dtype])  # stable: aligned starts
        header: dict[str, object] = {"__metadata__": metadata}
        self._slot: dict[str, tuple[int, int]] = {}
        pos = 0
        for o in order:
            header[o.name] = {"dtype": o.dtype, "shape": list(o.shape), "data_offsets": [pos, pos + o.nbytes]}
            self._slot[o.name] = (pos, o.nbytes)
            pos += o.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._base = 8 + len(raw)
        self._f = open(path, "wb")
        self._f.write(len(raw).to_bytes(8, "little") + raw)
        self._f.truncate(self._base + pos)
        self.sha: dict[str, str] = {}

    def write_tensor(self, name: str, t: torch.Tensor) -> None:
        data = t.contiguous().view(torch.uint8).reshape(-1).numpy()
        self._put(name, [memoryview(data)])

    def copy_tensor(self, name: str, reader: SourceReader, source: str) -> None:
        self._put(name, reader.chunks(source))

    def _put(self, name: str, chunks) -> None:
        offset, nbytes = self._slot[name]
        h, done = hashlib.sha256(), 0
        self._f.seek(self._base + offset)
        for c in chunks:
            self._f.write(c)
            h.update(c)
            done += len(c)
        if done != nbytes:
            raise ConvertError(f"{self.path}: tensor '{name}' has {done} bytes, expected {nbytes}")
        self.sha[name] = h.hexdigest()

    def close(self) -> str:
        """Flush and fsync; returns the file's sha256."""
        missing = set(self._slot) - set(self.sha)
        assert not missing, sorted(missing)[:3]
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        return sha256_file(self.path)

    def abort(self) -> None:
        self._f.close()


# -- the conversion --------------------------------------------------------------------------------------------------
@dataclass
class ConvertResult:
    out: Path
    tensors: int
    bytes: int
    shards_written: int
    shards_reused: int


def _source_identity(ckpt: HFCheckpoint) -> dict:
    """sha256 of the source's config.json and shard index (of the header, for a single-file checkpoint)."""
    src = {"config.json": sha256_file(ckpt.path / "config.json")}
    index = ckpt.path / INDEX_FILE
    if index.is_file():
        src[INDEX_FILE] = sha256_file(index)
    else:
        with open(ckpt.path / SINGLE_FILE, "rb") as f:
            head = f.read(8)
            src[SINGLE_FILE + " (header)"] = hashlib.sha256(head + f.read(int.from_bytes(head, "little"))).hexdigest()
    return src


def _load_progress(tmp: Path, key: str) -> dict:
    try:
        prog = json.loads((tmp / PROGRESS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return prog.get("shards", {}) if prog.get("key") == key else {}


def _save_progress(tmp: Path, key: str, done: dict) -> None:
    part = tmp / (PROGRESS_FILE + ".tmp")
    part.write_text(json.dumps({"key": key, "shards": done}))
    os.replace(part, tmp / PROGRESS_FILE)


def convert(hf_dir: str | Path, out_dir: str | Path, layout: str, expert_dtype: str = "fp4", family: str | None = None,
            shard_bytes: int = DEFAULT_SHARD_BYTES, progress: bool = True, log=print) -> ConvertResult:
    """Convert an HF checkpoint into a canonical checkpoint of `layout` at `out_dir` (which must not exist)."""
    L.check_layout(layout, expert_dtype)
    hf, out = Path(hf_dir), Path(out_dir)
    if out.exists():
        raise ConvertError(f"{out}: output directory already exists (remove it or choose another --out)")
    ckpt = HFCheckpoint(hf, family)
    args = ckpt.args
    table = N.tensor_table(args)
    ckpt.validate(table)
    if not (hf / "tokenizer.json").is_file():
        raise ConvertError(f"{hf / 'tokenizer.json'}: tokenizer file is missing")
    reader = SourceReader(ckpt)
    shards = plan_shards(table, layout, expert_dtype, args, shard_bytes)
    source = {"path": str(hf.resolve()), "sha256": _source_identity(ckpt)}
    meta = {"format": FORMAT, "version": dsflash_version(), "layout": layout, "expert_dtype": expert_dtype,
            "weight_block": args.weight_block,
            "expert_block": args.weight_block if expert_dtype == "fp8" else None, "source": source}
    plan_desc = [[s.file, [[o.name, list(o.shape), o.dtype] for o in s.tensors()]] for s in shards]
    key = hashlib.sha256(json.dumps([meta, plan_desc]).encode()).hexdigest()

    tmp = out.with_name(out.name + PARTIAL_SUFFIX)
    done = _load_progress(tmp, key) if tmp.is_dir() else {}
    if tmp.exists() and not done:
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    reusable = {f: rec for f, rec in done.items() if (tmp / f).is_file() and sha256_file(tmp / f) == rec["sha256"]}
    if done:
        log(f"dsflash convert: resuming in {tmp}: {len(reusable)} of {len(shards)} shards already written")
    done = reusable
    _save_progress(tmp, key, done)

    total = sum(s.nbytes for s in shards)
    bar = tqdm(total=total, desc=f"convert {layout}", unit="B", unit_scale=True, disable=not progress)
    written = 0
    for s in shards:
        if s.file in done:
            bar.update(s.nbytes)
            continue
        path = tmp / s.file
        current = "(header)"
        w = None
        try:
            w = ShardWriter(path, s.tensors(), {"format": "pt", "dsflash_layout": layout})
            for entry, outs in s.items:
                current = entry.name
                computed = {}
                if any(o.source is None for o in outs):
                    names = list(entry.stored(args.weight_block))
                    computed = L.compute(entry, {n: reader.get(n) for n in names}, layout, expert_dtype, args)
                for o in outs:
                    current = o.name
                    if o.source is None:
                        w.write_tensor(o.name, computed[o.name])
                    else:
                        w.copy_tensor(o.name, reader, o.source)
                del computed
                bar.update(sum(o.nbytes for o in outs))
            file_sha = w.close()
        except OSError as e:
            if w is not None:
                w.abort()
            raise ConvertError(f"{path}: writing tensor '{current}' failed: {e.strerror or e}; the finished shards "
                               f"are kept in {tmp}: rerun the same command to resume") from None
        except (FormatError, CheckpointError) as e:
            if w is not None:
                w.abort()
            raise ConvertError(f"{hf}: tensor '{current}': {e}") from None
        except BaseException:
            if w is not None:
                w.abort()
            raise
        done[s.file] = {"sha256": file_sha, "tensors": {o.name: w.sha[o.name] for o in s.tensors()}}
        _save_progress(tmp, key, done)
        written += 1
    bar.close()

    try:
        _finish(tmp, hf, args, meta, shards, done, layout, expert_dtype)
        os.rename(tmp, out)
    except OSError as e:
        raise ConvertError(f"{tmp}: finishing the output failed: {e.strerror or e}; rerun the same command to "
                           f"resume") from None
    n_tensors = sum(len(s.tensors()) for s in shards)
    return ConvertResult(out, n_tensors, total, written, len(shards) - written)


def _finish(tmp: Path, hf: Path, args, meta: dict, shards: list[ShardPlan], done: dict, layout: str,
            expert_dtype: str) -> None:
    """Index, manifest, tokenizer files and config.json (last) into the temp dir."""
    rows, weight_map = [], {}
    for s in shards:
        sha = done[s.file]["tensors"]
        for entry, outs in s.items:
            for o in outs:
                rows.append({"name": o.name, "shape": list(o.shape), "dtype": o.dtype, "sha256": sha[o.name],
                             "shard": s.file, "kind": o.kind, "entry": entry.name})
                weight_map[o.name] = s.file
    total = sum(s.nbytes for s in shards)
    (tmp / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    head = {"format": FORMAT, "layout": layout, "expert_dtype": expert_dtype,
            "shards": {s.file: done[s.file]["sha256"] for s in shards}}
    body = ",\n".join(json.dumps(r) for r in rows)  # one tensor per line
    (tmp / MANIFEST_FILE).write_text(json.dumps(head)[:-1] + ', "tensors": [\n' + body + "\n]}\n")
    for f in TOKENIZER_FILES:
        if (hf / f).is_file():
            shutil.copyfile(hf / f, tmp / f)
    (tmp / PROGRESS_FILE).unlink(missing_ok=True)
    (tmp / CONFIG_FILE).write_text(json.dumps({"dsflash": meta, "model": args.to_hf_dict()}, indent=2))
