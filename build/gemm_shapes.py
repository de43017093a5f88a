"""The dense FP8 GEMM shapes an engine's rank runs, from engine.json alone (what `build` tunes the FP8 GEMM for).

V4.1's linears have 32×32 weight blocks and 1×32 activation groups, V4's 128×128 and 1×128; the GEMM kernels read
both (V4's scales expanded to the 32×32 format). `attn.wo_a` is stored as FP8 but run as a BF16 einsum (or by the
WO-A plugin), not as an FP8 linear, so it is left out.
"""
from __future__ import annotations

from dsflash.build.plan import plan_rank
from dsflash.convert.layouts import bf16_cache_eligible
from dsflash.model_def.config import args_from_hf_dict
from dsflash.model_def.mapping import Mapping
from dsflash.model_def.names import tensor_table
from dsflash.plugins.refs import ACT_BLOCKS

GROUP32_BLOCK = 32
NOT_LINEAR_SUFFIXES = ("attn.wo_a.weight",)
SHARED_W13 = ("shared_experts.w1.weight", "shared_experts.w3.weight")
QKV_A = ("attn.wq_a.weight", "attn.wkv.weight")   # an attention's wq_a and wkv: both read x, stacked as one GEMM


def gemm_block(args) -> int | None:
    """The block of a model's FP8 linears when the GEMM kernels take it: activation groups 1×b and weight blocks b×b
    (V4.1: 32, V4: 128), else None."""
    b = args.weight_block
    return b if args.act_block == b and b in ACT_BLOCKS else None


def fits_kernel(k: int) -> bool:
    """Whether the GEMM kernels take a linear of K inputs (their scales come per 32 columns); else it runs its
    reference (`build.bind`)."""
    return k % GROUP32_BLOCK == 0


def stacks(rows: int, w_block: int = GROUP32_BLOCK) -> bool:
    """Whether a linear of `rows` local rows and the one after it run as one GEMM over their row-stacked weights (a
    shared expert's [w1; w3], an attention's [wq_a; wkv]; `build.bind` binds them so): when the weight's scale
    blocks do not straddle the seam."""
    return rows % w_block == 0


def _is_dense_linear(name: str, role: str) -> bool:
    return role == "fp8_block" and not name.endswith(NOT_LINEAR_SUFFIXES)


def dense_gemm_shapes(engine: dict, rank: int = 0) -> list[dict]:
    """Distinct local (N, K) of the FP8 linears `rank` runs: [{"n", "k", "group", "bf16_cache", "names"}], sorted
    (group: the activation quantization block, 32 or V4's 128).

    A shared expert's w1 and w3 count once, as their stacked [2·I_local, D] (the engine binds them as one GEMM); an
    attention's wq_a and wkv as their stacked [q_lora + head_dim, D], and wkv alone too (a DSpark draft stage's
    window rows run it alone).
    bf16_cache: some tensor of that shape has a `.weight_bf16` copy in this engine (hopper layout and
    `bf16_cache_eligible`), so the BF16-cache path is a candidate; tensors of the shape without one (e.g. `mtp.*`
    sharing a `layers.*` shape) run the FP8 path with the bucket's best FP8 config (`tune.gemm_table`).
    """
    args = args_from_hf_dict(engine["model"], "engine.json")
    block = gemm_block(args)
    if block is None:
        return []
    # plan only the dense FP8 entries: the experts' cuts (most of the table) do not matter here
    table = [e for e in tensor_table(args) if _is_dense_linear(e.name, e.role)]
    mapping = Mapping.from_dict(engine["mapping"]).for_rank(rank)
    cuts = plan_rank(args, table, mapping, engine["arch"]).cuts
    hopper = engine.get("layout") == "hopper"
    entries = {e.name: e for e in table}
    shapes: dict[tuple[int, int], dict] = {}
    for e in table:
        if e.name not in cuts:
            continue
        n, k = cuts[e.name].shape(e.shape)
        if not fits_kernel(k):
            continue
        if e.name.endswith(SHARED_W13) and stacks(n, block):   # one GEMM over [w1; w3]
            if e.name.endswith(SHARED_W13[1]):
                continue
            n *= 2
        if e.name.endswith(QKV_A[0]) and stacks(n, block):   # one GEMM over [wq_a; wkv]
            kv = e.name.removesuffix(QKV_A[0]) + QKV_A[1]
            if kv in cuts:
                n += cuts[kv].shape(entries[kv].shape)[0]
        s = shapes.setdefault((n, k), {"n": n, "k": k, "group": block, "bf16_cache": False, "names": []})
        s["names"].append(e.name)
        s["bf16_cache"] |= hopper and bf16_cache_eligible(e, args)
    return [shapes[nk] for nk in sorted(shapes)]
