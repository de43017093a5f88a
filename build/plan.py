"""The build plan: model args + Mapping + limits + target arch -> what each rank holds (computable from a preset alone).

`plan_ranks` needs only the name table, so `dsflash build --dry-run` reports the per-rank layout of the full-size
models on a CPU without any weights.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from dsflash.build.shard import Cut, ShardError, experts_per_prefix, plan_cut
from dsflash.model_def.mapping import Mapping
from dsflash.model_def.names import TensorEntry

ARCHES = ("cpu", "sm90", "sm100")
ARCH_LAYOUT = {"cpu": "reference", "sm90": "hopper", "sm100": "blackwell"}
# Expert intermediate tile of the MoE kernel per arch: local widths are padded up to it after sharding.
EXPERT_TILE = {"cpu": 1, "sm90": 64, "sm100": 64}


@dataclass
class BuildConfig:
    max_batch_size: int = 8
    max_num_tokens: int = 8192
    max_seq_len: int = 8192
    kv_cache_dtype: str = "auto"
    speculative_algorithm: str | None = None
    speculative_num_draft_tokens: int = 0
    # CPU engines run the plain-PyTorch references; float64 makes their "fp32 math" independent of summation order,
    # so TP sharding or chunk shapes cannot move a value across an FP8/FP4 rounding boundary (exactness tests)
    # "" = the arch's default (build/engine.py `default_dtype`): bfloat16 for the GPU plugins, float32 on CPU
    dtype: str = ""
    # ops that keep the plain-PyTorch reference in a GPU engine (engine.json `plugins`), e.g. ["gemm"]
    disable_plugins: list[str] = field(default_factory=list)
    enable_plugins: list[str] = field(default_factory=list)   # opt-in plugins (build.engine.OPT_IN_PLUGINS)
    # wall-clock cap of build-time kernel tuning; buckets left untuned fall back visibly in serve
    tune_budget_s: float = 600.0

    def __post_init__(self) -> None:
        for k in ("max_batch_size", "max_num_tokens", "max_seq_len"):
            if getattr(self, k) < 1:
                raise ValueError(f"--{k.replace('_', '-')} must be >= 1, got {getattr(self, k)}")
        if self.tune_budget_s < 0:
            raise ValueError(f"--tune-budget-s must be >= 0, got {self.tune_budget_s}")
        if self.dtype not in ("", "float32", "float64", "bfloat16"):
            raise ValueError(f"--dtype must be float32, float64 or bfloat16, got {self.dtype!r}")
        from dsflash.model_def.dispatch import PLUGIN_IMPLS
        for flag, ops in (("--disable-plugin", self.disable_plugins), ("--enable-plugin", self.enable_plugins)):
            for op in ops:
                if op not in PLUGIN_IMPLS:
                    raise ValueError(f"{flag} {op!r}: not a plugin op; choices: {sorted(PLUGIN_IMPLS)}")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"--kv-cache-dtype must be auto or fp8, got {self.kv_cache_dtype!r}")


@dataclass
class RankPlan:
    rank: int
    tensors: int = 0
    bytes: int = 0
    cuts: dict[str, Cut] = field(default_factory=dict, repr=False)


def check_topology(args, mapping: Mapping) -> None:
    """Refuse a tp/moe_ep that does not divide heads, output groups, index heads or experts (one clear message)."""
    tp, ep, mtp = mapping.tp_size, mapping.moe_ep_size, mapping.moe_tp_size
    checks = [("tp", tp, "num_attention_heads", args.num_attention_heads), ("tp", tp, "o_groups", args.o_groups),
              ("tp", tp, "index_n_heads", args.index_n_heads), ("moe_ep", ep, "n_routed_experts", args.n_routed_experts),
              ("moe_tp", mtp, "moe_intermediate_size", args.moe_intermediate_size)]
    if args.family == "v41" and args.n_draft:
        checks.append(("moe_ep", ep, "dspark_n_routed_experts", args.dspark_n_routed_experts))
    for flag, parts, name, value in checks:
        if value % parts:
            raise ShardError(f"{flag}={parts} does not divide {name}={value} of this model; "
                             f"choose a {flag} that divides it")


def stored_bytes(entry: TensorEntry, cut: Cut, weight_block: int) -> int:
    return TensorEntry(entry.name, cut.shape(entry.shape), entry.role, entry.init, entry.shard).stored_bytes(weight_block)


def plan_rank(args, table: list[TensorEntry], mapping: Mapping, arch: str) -> RankPlan:
    """What `mapping.rank` holds: the cut of every entry on it, tensor count and bytes."""
    check_topology(args, mapping)
    n_exp = experts_per_prefix(table)
    plan = RankPlan(mapping.rank)
    for e in table:
        cut = plan_cut(e, mapping, n_exp, args.weight_block, EXPERT_TILE[arch])
        if cut is None:
            continue
        plan.cuts[e.name] = cut
        plan.tensors += len(e.stored(args.weight_block))
        plan.bytes += stored_bytes(e, cut, args.weight_block)
    return plan


def plan_ranks(args, table: list[TensorEntry], mapping: Mapping, arch: str) -> list[RankPlan]:
    return [plan_rank(args, table, mapping.for_rank(r), arch) for r in range(mapping.world_size)]


def expert_widths(args, mapping: Mapping, arch: str) -> dict[str, int]:
    """Logical and padded per-rank expert intermediate width."""
    local = args.moe_intermediate_size // mapping.moe_tp_size
    tile = EXPERT_TILE[arch]
    return {"expert_inter_local": local, "expert_inter_padded": -(-local // tile) * tile}


def build_config_dict(cfg: BuildConfig) -> dict:
    return asdict(cfg)
