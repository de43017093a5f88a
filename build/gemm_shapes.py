"""The dense FP8 GEMM shapes an engine's rank runs, from engine.json alone (what `build` tunes the group-32 GEMM for).

Only V4.1's 32×32-block FP8 linears are group-32 GEMMs; V4's 128×128 blocks are another kernel's format, so a V4
engine has none. `attn.wo_a` is stored as FP8 but run by the WO-A plugin, not as an FP8 linear, so it is left out.
"""
from __future__ import annotations

from dsflash.build.plan import plan_rank
from dsflash.convert.layouts import bf16_cache_eligible
from dsflash.model_def.config import args_from_hf_dict
from dsflash.model_def.mapping import Mapping
from dsflash.model_def.names import tensor_table

GROUP32_BLOCK = 32
NOT_LINEAR_SUFFIXES = ("attn.wo_a.weight",)
SHARED_W13 = ("shared_experts.w1.weight", "shared_experts.w3.weight")


def stacks_w13(rows: int) -> bool:
    """Whether a shared expert's local w1 and w3 ([rows, D] each) run as one GEMM over [w1; w3] (`build.bind` binds
    them so): when the 32-row scale blocks do not straddle the seam."""
    return rows % GROUP32_BLOCK == 0


def _is_dense_linear(name: str, role: str) -> bool:
    return role == "fp8_block" and not name.endswith(NOT_LINEAR_SUFFIXES)


def dense_gemm_shapes(engine: dict, rank: int = 0) -> list[dict]:
    """Distinct local (N, K) of the group-32 FP8 linears `rank` runs: [{"n", "k", "bf16_cache", "names"}], sorted.

    A shared expert's w1 and w3 count once, as their stacked [2·I_local, D] (the engine binds them as one GEMM).
    bf16_cache: some tensor of that shape has a `.weight_bf16` copy in this engine (hopper layout and
    `bf16_cache_eligible`), so the BF16-cache path is a candidate; tensors of the shape without one (e.g. `mtp.*`
    sharing a `layers.*` shape) run the FP8 path with the bucket's best FP8 config (`tune.gemm_table`).
    """
    args = args_from_hf_dict(engine["model"], "engine.json")
    if args.weight_block != GROUP32_BLOCK:
        return []
    # plan only the dense FP8 entries: the experts' cuts (most of the table) do not matter here
    table = [e for e in tensor_table(args) if _is_dense_linear(e.name, e.role)]
    mapping = Mapping.from_dict(engine["mapping"]).for_rank(rank)
    cuts = plan_rank(args, table, mapping, engine["arch"]).cuts
    hopper = engine.get("layout") == "hopper"
    shapes: dict[tuple[int, int], dict] = {}
    for e in table:
        if e.name not in cuts:
            continue
        n, k = cuts[e.name].shape(e.shape)
        if e.name.endswith(SHARED_W13) and stacks_w13(n):   # one GEMM over [w1; w3]
            if e.name.endswith(SHARED_W13[1]):
                continue
            n *= 2
        s = shapes.setdefault((n, k), {"n": n, "k": k, "bf16_cache": False, "names": []})
        s["names"].append(e.name)
        s["bf16_cache"] |= hopper and bf16_cache_eligible(e, args)
    return [shapes[nk] for nk in sorted(shapes)]
