"""`dsflash convert --hf DIR --out DIR --layout reference|hopper|blackwell [--expert-dtype fp4|fp8]`."""
from __future__ import annotations

import argparse
import re
import sys

import torch

from dsflash.convert.layouts import EXPERT_DTYPES, LAYOUTS
from dsflash.convert.writer import DEFAULT_SHARD_BYTES, convert

_UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30}


def parse_size(text: str) -> int:
    """'5GB', '512MiB', '1000000' -> bytes (HF's max_shard_size spelling)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 5GB, 512MiB, 1000000)")
    n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if n < 1:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return n


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsflash convert",
                                description="HF checkpoint (DeepSeek-V4.1-Flash / V4-Flash) -> canonical checkpoint: "
                                            "our names, the target GPU's weight layout, manifest with hashes.")
    p.add_argument("--hf", required=True, help="Hugging Face checkpoint directory")
    p.add_argument("--out", required=True, help="output directory (must not exist; written atomically)")
    p.add_argument("--layout", required=True, help=f"weight layout: {' | '.join(LAYOUTS)}")
    p.add_argument("--expert-dtype", default="fp4", help="routed experts: fp4 (MXFP4 as shipped) or fp8 "
                                                          "(widened losslessly)")
    p.add_argument("--family", choices=("v41", "v4"), default=None,
                   help="require this model family (v41 = DeepSeek-V4.1-Flash, v4 = DeepSeek-V4-Flash)")
    p.add_argument("--max-shard-size", type=parse_size, default=DEFAULT_SHARD_BYTES,
                   help="largest output shard, e.g. 5GB (default) or 512MiB")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads for the format math (default: torch's default; 1 is fastest on a "
                        "busy host, where multi-threaded small ops spend their time in barriers)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.layout not in LAYOUTS:
        print(f"dsflash convert: error: unknown layout {a.layout!r}; expected one of: {', '.join(LAYOUTS)}",
              file=sys.stderr)
        return 2
    if a.expert_dtype not in EXPERT_DTYPES:
        print(f"dsflash convert: error: unknown expert dtype {a.expert_dtype!r}; expected one of: "
              f"{', '.join(EXPERT_DTYPES)}", file=sys.stderr)
        return 2
    threads = torch.get_num_threads()
    try:
        if a.threads:
            torch.set_num_threads(a.threads)
        res = convert(a.hf, a.out, a.layout, a.expert_dtype, a.family, a.max_shard_size, progress=not a.no_progress,
                      log=lambda msg: print(msg, file=sys.stderr))
    except (ValueError, OSError) as e:  # ConvertError, CheckpointError, ConfigError, FormatError, I/O
        print(f"dsflash convert: error: {e}", file=sys.stderr)
        return 1
    finally:
        torch.set_num_threads(threads)
    reused = f", {res.shards_reused} reused" if res.shards_reused else ""
    print(f"wrote {res.out} ({a.layout}, experts {a.expert_dtype}): {res.tensors} tensors, {res.bytes / 1e9:.3f} GB "
          f"in {res.shards_written + res.shards_reused} shards{reused}")
    return 0
