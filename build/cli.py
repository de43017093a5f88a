"""`dsflash build`: canonical/HF checkpoint + topology + limits + arch -> engine dir (or a per-rank plan with --dry-run)."""
from __future__ import annotations

import argparse
import json
import sys

from dsflash.build.plan import ARCHES, BuildConfig, expert_widths, plan_ranks
from dsflash.model_def.mapping import Mapping


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsflash build", description=__doc__)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--ckpt", help="`dsflash convert` output or HF checkpoint dir")
    src.add_argument("--preset", help="family/name (e.g. v41/full): a plan with --dry-run, or an engine with "
                                      "--dummy-weights")
    p.add_argument("--out", help="engine directory to write")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (= world size)")
    p.add_argument("--moe-ep", type=int, default=None, help="MoE expert-parallel size (default 1)")
    p.add_argument("--moe-tp", type=int, default=None, help="MoE tensor-parallel size (default tp / moe_ep)")
    p.add_argument("--arch", choices=ARCHES, default="cpu")
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--max-num-tokens", type=int, default=8192)
    p.add_argument("--max-seq-len", type=int, default=8192)
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"))
    p.add_argument("--dtype", default="", choices=("float32", "float64", "bfloat16"),
                   help="activation dtype (default: bfloat16 for GPU arches, float32 for cpu; float64 for exactness "
                        "tests of CPU engines)")
    p.add_argument("--disable-plugin", action="append", default=[], metavar="OP",
                   help="keep the plain-PyTorch reference for OP in a GPU engine (gemm, moe, mhc, wo_a, norm, swiglu, "
                        "kv_quant); repeatable")
    p.add_argument("--enable-plugin", action="append", default=[], metavar="OP",
                   help="also bind an opt-in plugin in a V4.1 GPU engine (build.engine.OPT_IN_PLUGINS: kernels not "
                        "yet proven on a GPU; none at present); repeatable")
    p.add_argument("--tune-budget-s", type=float, default=600.0,
                   help="time cap of kernel tuning on the GPU (untuned shapes use default configs, logged in serve)")
    p.add_argument("--speculative-algorithm", choices=("dspark", "mtp"), default=None,
                   help="record the drafter the engine serves with by default (dspark: V4.1, mtp: V4)")
    p.add_argument("--speculative-num-draft-tokens", type=int, default=0,
                   help="draft tokens per step (default: the DSpark block size / one per MTP layer)")
    p.add_argument("--dummy-weights", action="store_true",
                   help="with --preset: an engine without rank files whose weights are drawn at load time in the "
                        "engine's formats (vLLM/SGLang --load-format dummy); for performance runs at full size")
    p.add_argument("--seed", type=int, default=0, help="with --dummy-weights: the weights' seed")
    p.add_argument("--json-model-override-args", default="", metavar="JSON",
                   help="with --preset: replace config fields (SGLang's flag of this name), e.g. a full-width model "
                        "with fewer layers: '{\"num_hidden_layers\": 22, \"compress_ratios\": [...], ...}'")
    p.add_argument("--dry-run", action="store_true", help="print the per-rank plan and write nothing")
    p.add_argument("--json", action="store_true", help="with --dry-run: print the plan as JSON")
    return p


def dry_run(args, mapping: Mapping, arch: str, as_json: bool) -> dict:
    from dsflash.model_def.names import tensor_table
    plans = plan_ranks(args, tensor_table(args), mapping, arch)
    report = {"family": args.family, "arch": arch, "mapping": mapping.to_dict(), **expert_widths(args, mapping, arch),
              "ranks": [{"rank": p.rank, "tensors": p.tensors, "bytes": p.bytes} for p in plans]}
    if as_json:
        print(json.dumps(report))
    else:
        w = expert_widths(args, mapping, arch)
        print(f"{args.family} tp={mapping.tp_size} moe_tp={mapping.moe_tp_size} moe_ep={mapping.moe_ep_size} "
              f"arch={arch}: expert intermediate {w['expert_inter_local']} per rank, padded to {w['expert_inter_padded']}")
        print(f"{'rank':>4} {'tensors':>8} {'GiB':>9}")
        for p in plans:
            print(f"{p.rank:>4} {p.tensors:>8} {p.bytes / 2**30:>9.2f}")
    return report


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        for flag, v in (("--tp", a.tp), ("--moe-ep", a.moe_ep), ("--moe-tp", a.moe_tp)):
            if v is not None and v < 1:
                raise ValueError(f"{flag} must be >= 1, got {v}")
        mapping = Mapping(world_size=a.tp, rank=0, tp_size=a.tp, moe_ep_size=a.moe_ep, moe_tp_size=a.moe_tp)
        cfg = BuildConfig(a.max_batch_size, a.max_num_tokens, a.max_seq_len, a.kv_cache_dtype,
                          a.speculative_algorithm, a.speculative_num_draft_tokens, dtype=a.dtype,
                          disable_plugins=a.disable_plugin, enable_plugins=a.enable_plugin,
                          tune_budget_s=a.tune_budget_s)
        if a.dummy_weights and not a.preset:
            raise ValueError("--dummy-weights goes with --preset family/name (a checkpoint has weights of its own)")
        if a.json_model_override_args and not a.preset:
            raise ValueError("--json-model-override-args goes with --preset family/name (a checkpoint's config "
                             "matches its weights)")
        if a.preset:
            from dsflash.model_def.config import get_preset, override_args
            family, _, name = a.preset.partition("/")
            args = get_preset(family, name or "full")
            if a.json_model_override_args:
                try:
                    overrides = json.loads(a.json_model_override_args)
                except json.JSONDecodeError as e:
                    raise ValueError(f"--json-model-override-args: not valid JSON ({e})") from None
                args = override_args(args, overrides)
            if a.dry_run:
                dry_run(args, mapping, a.arch, a.json)
                return 0
            if not a.dummy_weights:
                raise ValueError("--preset builds a plan (--dry-run) or a dummy-weight engine (--dummy-weights); "
                                 "engines with weights need --ckpt")
            if not a.out:
                raise ValueError("--out is required (engine directory to write)")
            from dsflash.build.dummy import write_dummy_engine
            out = write_dummy_engine(args, a.out, mapping, a.arch, cfg, a.seed)
            print(f"engine written to {out} (dummy weights, seed {a.seed})")
            return 0
        if a.dry_run:
            from dsflash.build.source import open_source
            dry_run(open_source(a.ckpt).args, mapping, a.arch, a.json)
            return 0
        if not a.out:
            raise ValueError("--out is required (engine directory to write)")
        from dsflash.build.engine import write_engine
        out = write_engine(a.ckpt, a.out, mapping, a.arch, cfg)
    except (ValueError, OSError) as e:
        print(f"dsflash build: {e}", file=sys.stderr)
        return 2
    print(f"engine written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
