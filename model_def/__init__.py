"""dsflash.model_def: model args, Mapping, name table and the plain-PyTorch reference models of the V4 family."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dsflash.model_def.checkpoint import CheckpointError, HFCheckpoint
from dsflash.model_def.config import ConfigError, V4Args, V41Args, get_preset, load_args
from dsflash.model_def.layers import Numerics
from dsflash.model_def.mapping import Mapping
from dsflash.model_def.names import tensor_table

__all__ = ["CheckpointError", "ConfigError", "Mapping", "Numerics", "V4Args", "V41Args", "build_model",
           "get_preset", "load_args", "load_reference", "materialize", "tensor_table"]


def model_class(args):
    if args.family == "v41":
        from dsflash.model_def.v41 import DeepseekV41Model
        return DeepseekV41Model
    from dsflash.model_def.v4 import DeepseekV4Model
    return DeepseekV4Model


def build_model(args, numerics: str = "hf", mapping: Mapping | None = None, comm=None,
                dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> nn.Module:
    """An uninitialised model of `args`' family (use device='meta' for shape-only checks)."""
    with torch.device(device):
        return model_class(args)(args, Numerics(numerics, args.act_block), mapping=mapping, comm=comm, dtype=dtype)


def materialize(model: nn.Module, device: str | torch.device, keep_meta=lambda name: False) -> list[str]:
    """Give every parameter and buffer of a model built on the meta device uninitialised storage on `device`, except
    those whose name `keep_meta(name)` accepts (they stay shape-only: nothing may read them). Returns the names
    materialized; the caller fills each of them."""
    done = []
    for mod_name, mod in model.named_modules():
        for registry in (mod._parameters, mod._buffers):
            for key, t in registry.items():
                name = f"{mod_name}.{key}" if mod_name else key
                if t is None or not t.is_meta or keep_meta(name):
                    continue
                new = torch.empty_like(t, device=device)
                registry[key] = nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new
                done.append(name)
    return done


def load_weights(model: nn.Module, ckpt: HFCheckpoint, table, progress: bool = False) -> None:
    """Copy every table entry (dequantized) into the parameter of the same name; strict both ways."""
    from tqdm import tqdm
    params = dict(model.named_parameters())
    missing = set(params) - {e.name for e in table}
    params.update(dict(model.named_buffers()))  # integer tables (e.g. V4 `tid2eid`) live in buffers
    if missing:
        raise CheckpointError(f"model parameters without a checkpoint entry: {sorted(missing)[:5]}")
    for entry in tqdm(table, desc="load", unit="tensor", disable=not progress):
        p = params.get(entry.name)
        if p is None:
            raise CheckpointError(f"{ckpt.path}: tensor '{entry.name}' has no parameter in the model")
        value = ckpt.load(entry)
        if tuple(value.shape) != tuple(p.shape):
            raise CheckpointError(f"{ckpt.path}: tensor '{entry.name}' has logical shape {list(value.shape)}, "
                                  f"model expects {list(p.shape)}")
        with torch.no_grad():
            p.copy_(value.to(p.dtype))


def load_reference(checkpoint_dir: str | Path, numerics: str = "hf", device: str | torch.device = "cpu",
                   dtype: torch.dtype = torch.float32, progress: bool = False) -> nn.Module:
    """Load an HF checkpoint (either family) into the reference model, validating every tensor first."""
    ckpt = HFCheckpoint(checkpoint_dir)
    table = tensor_table(ckpt.args)
    ckpt.validate(table)
    model = build_model(ckpt.args, numerics, dtype=dtype, device=device)
    load_weights(model, ckpt, table, progress)
    tok = Path(checkpoint_dir) / "tokenizer.json"
    if hasattr(model, "load_tokenizer"):
        model.load_tokenizer(tok)
    return model.eval()
