"""Weight bytes one rank's load holds on its device, by how it is loaded (`build.engine.load_plan`; nothing is
allocated, the models are built on the meta device):

  lean       the engine's plugins; Engram tables and (MoE plugin) routed experts kept as stored
  dense      the same, plus the experts' dequantized BF16 weights (`dense_experts=True`, for site replays)
  reference  no plugins: every tensor dequantized (BF16), Engram tables still kept as stored

Prints a table and writes JSON.
  python3 benchmarks/rank_memory.py [--presets v41/full,v4/full] [--tp 8] [--arch sm90] [--json F]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from dsflash.build.engine import Engine, ShapeOnlyComm, default_plugins, engine_meta, load_plan
from dsflash.build.plan import ARCH_LAYOUT, BuildConfig, plan_ranks
from dsflash.model_def import get_preset, tensor_table
from dsflash.model_def.mapping import Mapping

GIB = 2 ** 30


def rank_bytes(preset: str, tp: int, arch: str) -> dict:
    family, name = preset.split("/")
    args = get_preset(family, name)
    mapping = Mapping(world_size=tp, rank=0, tp_size=tp)
    plans = plan_ranks(args, tensor_table(args), mapping, arch)
    ranks = [{"file": None, "bytes": p.bytes} for p in plans]
    eng = Engine(Path(preset), engine_meta(args, mapping, arch, BuildConfig(), ARCH_LAYOUT[arch], "fp4", ranks,
                                           weights={"format": "dummy", "seed": 0}))
    comm = ShapeOnlyComm(eng.mapping(0))
    plugins = default_plugins(arch, (), family)
    modes = {"lean": (plugins, False), "dense": (plugins, True), "reference": ({op: "reference" for op in plugins},
                                                                              False)}
    row = {"preset": preset, "tp": tp, "arch": arch, "stored_bytes": plans[0].bytes}
    for mode, (chosen, dense) in modes.items():
        row[f"{mode}_bytes"] = load_plan(eng, 0, comm, torch.bfloat16, chosen, dense)[2]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", default="v41/full,v4/full")
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--arch", default="sm90")
    p.add_argument("--json", default="")
    a = p.parse_args()
    rows = [rank_bytes(preset, a.tp, a.arch) for preset in a.presets.split(",")]
    print(f"{'preset':<10} {'tp':>3} {'arch':<6} {'stored GiB':>10} {'lean GiB':>9} {'dense GiB':>10} "
          f"{'reference GiB':>14}")
    for r in rows:
        print(f"{r['preset']:<10} {r['tp']:>3} {r['arch']:<6} {r['stored_bytes'] / GIB:>10.1f} "
              f"{r['lean_bytes'] / GIB:>9.1f} {r['dense_bytes'] / GIB:>10.1f} {r['reference_bytes'] / GIB:>14.1f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"rank": 0, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
