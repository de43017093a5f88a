"""Engine directories: writing (`dsflash build`) and reading (serve, generate).

An engine dir holds `engine.json` (model args, Mapping, build config, arch, layout, plugin selection, per-rank file
list), `rank{R}.safetensors` (this rank's tensors under checkpoint names, cut per the name table's shard rules and
padded after sharding) and `tuned.json`. Engines are written to a temp dir and renamed when complete.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from dsflash.build.plan import ARCH_LAYOUT, BuildConfig, expert_widths, plan_rank, plan_ranks
from dsflash.build.shard import cut_stored
from dsflash.build.source import open_source
from dsflash.convert.atomic import atomic_dir
from dsflash.model_def import build_model
from dsflash.model_def.checkpoint import CheckpointError, read_safetensors_header
from dsflash.model_def.config import args_from_hf_dict
from dsflash.model_def.dispatch import MOE_PLUGINS
from dsflash.model_def.mapping import Mapping
from dsflash.model_def.names import TensorEntry, tensor_table

ENGINE_FILE = "engine.json"
ENGRAM_TABLE = ".engram.embed.weight"   # loaded as stored (FP8 rows + e8m0 scales), never dequantized whole
ENGINE_VERSION = 2   # 2: the vocabulary head is split over the TP ranks


class EngineError(ValueError):
    pass


def current_arch() -> str:
    """'cpu' without a GPU, else 'sm<major><minor>' of device 0."""
    if not torch.cuda.is_available():
        return "cpu"
    major, minor = torch.cuda.get_device_capability(0)
    return f"sm{major}{minor}"


def check_layout_arch(layout: str, arch: str) -> None:
    if arch not in ARCH_LAYOUT:
        raise EngineError(f"--arch must be one of {sorted(ARCH_LAYOUT)}, got {arch!r}")
    if ARCH_LAYOUT[arch] != layout:
        raise EngineError(f"a '{layout}' checkpoint cannot make an {arch} engine: {arch} needs layout "
                          f"'{ARCH_LAYOUT[arch]}' (dsflash convert --layout {ARCH_LAYOUT[arch]})")


def write_engine(ckpt_dir: str | Path, out: str | Path, mapping: Mapping, arch: str, cfg: BuildConfig,
                 progress: bool = True) -> Path:
    src = open_source(ckpt_dir)
    check_layout_arch(src.layout, arch)
    args = src.args
    check_speculative(args, cfg)
    table = tensor_table(args)
    plans = plan_ranks(args, table, mapping, arch)
    out = Path(out)
    if out.exists():
        raise EngineError(f"{out}: output directory already exists")
    with atomic_dir(out, "tmp-build") as tmp:
        ranks = []
        for plan in plans:
            tensors: dict[str, torch.Tensor] = {}
            for e in tqdm(table, desc=f"rank {plan.rank}", unit="tensor", disable=not progress):
                cut = plan.cuts.get(e.name)
                if cut is not None:
                    piece = cut_stored(e, src.stored(e), cut, args.weight_block)
                    tensors.update(to_layout(local_entry(e, cut), piece, src.layout, src.expert_dtype, args))
            fname = f"rank{plan.rank}.safetensors"
            save_file(tensors, str(tmp / fname), metadata={"rank": str(plan.rank)})
            ranks.append({"file": fname, "tensors": len(tensors), "bytes": plan.bytes,
                          "sha256": _sha256(tmp / fname)})
        engine = engine_meta(args, mapping, arch, cfg, src.layout, src.expert_dtype, ranks,
                             source=str(Path(ckpt_dir).resolve()))
        from dsflash.build.tune import write_tuned
        write_tuned(tmp, engine, arch)
        (tmp / ENGINE_FILE).write_text(json.dumps(engine, indent=2))
        verify_engine(tmp)
        src.copy_tokenizer(tmp)
    return out


def engine_meta(args, mapping: Mapping, arch: str, cfg: BuildConfig, layout: str, expert_dtype: str, ranks: list,
                **extra) -> dict:
    """engine.json of a build (`extra`: where its weights come from)."""
    return {
        "version": ENGINE_VERSION,
        "model": args.to_hf_dict(),
        "mapping": mapping.for_rank(0).to_dict(),
        "build_config": cfg.__dict__,
        "arch": arch,
        "layout": layout,
        "expert_dtype": expert_dtype,
        **expert_widths(args, mapping, arch),
        "plugins": default_plugins(arch, tuple(cfg.disable_plugins), args.family, tuple(cfg.enable_plugins)),
        **extra,
        "ranks": ranks,
    }


def check_speculative(args, cfg: BuildConfig) -> None:
    """The recorded drafter must exist in the model: DSpark stages (V4.1) or MTP blocks (V4)."""
    alg, n = cfg.speculative_algorithm, cfg.speculative_num_draft_tokens
    if alg is None:
        if n:
            raise EngineError("--speculative-num-draft-tokens needs --speculative-algorithm")
        return
    if alg == "dspark" and (args.family != "v41" or not args.n_draft):
        raise EngineError(f"--speculative-algorithm dspark needs a V4.1 model with DSpark stages (this is {args.family})")
    if alg == "mtp" and (args.family != "v4" or not args.n_draft):
        raise EngineError(f"--speculative-algorithm mtp needs a V4 model with an MTP block (this is {args.family})")
    limit = args.dspark_block_size if alg == "dspark" else args.n_draft
    if not 0 <= n <= limit:
        raise EngineError(f"--speculative-num-draft-tokens must be in 1..{limit} for {alg}, got {n}")


def local_entry(e: TensorEntry, cut) -> TensorEntry:
    return TensorEntry(e.name, cut.shape(e.shape), e.role, e.init, e.shard)


def to_layout(e: TensorEntry, ref: dict[str, torch.Tensor], layout: str, expert_dtype: str, args) -> dict:
    """A rank's piece (reference on-disk format) in the engine's layout: tiles and scales are per-rank matrices."""
    if layout == "reference" and expert_dtype == "fp4":
        return ref
    from dsflash.convert import layouts
    out = {o.name: ref[o.source] for o in layouts.outputs(e, layout, expert_dtype, args) if o.source is not None}
    out.update(layouts.compute(e, ref, layout, expert_dtype, args))
    return out


# The plugin each op of a family's GPU engines takes (None: the last, fastest, of `PLUGIN_IMPLS`). V4 shares the FP8
# linears (1×128 / 128×128 groups, read in the kernels' 32×32 scale format), the norms, the shared expert's SwiGLU,
# WO-A and the mHC kernels (each site its own coefficients, so nothing to overlap: `fused`), and the MoE kernels
# (1×128 expert activations, hash-routed layers given their picks).
FAMILY_PLUGINS = {"v41": None,
                  "v4": {"gemm": "fp8_gemm", "norm": "fused", "swiglu": "fused", "mhc": "fused", "wo_a": "fused",
                         "moe": "mxfp4_overlap"}}


# Kernels an engine binds only when asked (`--enable-plugin`): a kernel lands here until its GPU parity tests have
# run. None at present (session 40's rope / attention / index kernels were proven on a GPU in session 42).
OPT_IN_PLUGINS: tuple[str, ...] = ()


def default_plugins(arch: str, disabled: tuple[str, ...] = (), family: str = "v41",
                    enabled: tuple[str, ...] = ()) -> dict[str, str]:
    """Per-op implementation: CPU engines run the plain-PyTorch references, GPU engines the plugin kernels their
    family's formats allow (`FAMILY_PLUGINS`; `disabled` ops keep the reference, like trtllm-build's
    `--gemm_plugin disable`; `OPT_IN_PLUGINS` bind only when `enabled`)."""
    from dsflash.model_def.dispatch import PLUGIN_IMPLS, REFERENCE
    chosen = FAMILY_PLUGINS[family]

    def impl(op: str, impls: tuple[str, ...]) -> str:
        if arch == "cpu" or op in disabled or (op in OPT_IN_PLUGINS and op not in enabled):
            return REFERENCE
        return impls[-1] if chosen is None else chosen.get(op, REFERENCE)
    return {op: impl(op, impls) for op, impls in PLUGIN_IMPLS.items()}


def default_dtype(arch: str) -> str:
    """Activation dtype of an engine: the plugin kernels run BF16; CPU references fp32 (or fp64 for exactness)."""
    return "float32" if arch == "cpu" else "bfloat16"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class Engine:
    path: Path
    meta: dict

    @property
    def args(self):
        return args_from_hf_dict(self.meta["model"], str(self.path / ENGINE_FILE))

    @property
    def world_size(self) -> int:
        return int(self.meta["mapping"]["world_size"])

    def mapping(self, rank: int) -> Mapping:
        return Mapping.from_dict(self.meta["mapping"]).for_rank(rank)

    @property
    def dummy_seed(self) -> int | None:
        """The seed of an engine built with dummy weights (generated at load time), else None."""
        w = self.meta.get("weights")
        return None if w is None else int(w["seed"])

    def rank_file(self, rank: int) -> Path:
        if self.dummy_seed is not None:
            raise EngineError(f"{self.path / ENGINE_FILE}: a dummy-weight engine has no rank files")
        return self.path / self.meta["ranks"][rank]["file"]


def is_current_engine(path: str | Path) -> bool:
    """Whether `path` holds an engine.json of this dsflash's format version: caches of built engines (`dsflash demo`,
    `bench --load-format dummy`) rebuild any other instead of failing on it."""
    try:
        return json.loads((Path(path) / ENGINE_FILE).read_text()).get("version") == ENGINE_VERSION
    except (OSError, json.JSONDecodeError):
        return False


def open_engine(path: str | Path, check_arch: bool = True) -> Engine:
    path = Path(path)
    f = path / ENGINE_FILE
    if not f.is_file():
        raise EngineError(f"{f}: not an engine directory (engine.json missing; run `dsflash build`)")
    try:
        meta = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise EngineError(f"{f}: not valid JSON ({e})") from None
    if meta.get("version") != ENGINE_VERSION:
        raise EngineError(f"{f}: engine format version {meta.get('version')!r}, this dsflash reads {ENGINE_VERSION}")
    if check_arch and meta["arch"] != current_arch():
        raise EngineError(f"{f}: engine was built for {meta['arch']}, but this machine is {current_arch()}; "
                          f"rebuild it with `dsflash build --arch {current_arch()}`")
    for r in meta["ranks"]:
        if r.get("file") is not None and not (path / r["file"]).is_file():
            raise EngineError(f"{path / r['file']}: rank file is missing")
    return Engine(path, meta)


class ShapeOnlyComm:
    """The TP coordinates of a rank for shape checks on the meta device; it never communicates."""

    def __init__(self, mapping: Mapping):
        self.tp_size, self.tp_rank = mapping.tp_size, mapping.tp_rank

    def all_reduce(self, x):
        raise RuntimeError("ShapeOnlyComm is for building models on the meta device only")


def rank_tensors(eng: Engine, rank: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """{name: (shape, safetensors dtype)} of a rank file, read from its header after checking the file is as long
    as the header says (a truncated or corrupt rank file fails here, naming the file)."""
    try:
        header = read_safetensors_header(eng.rank_file(rank))
    except CheckpointError as e:
        raise EngineError(str(e)) from None
    return {k: (tuple(v["shape"]), v["dtype"]) for k, v in header.items()}


def check_rank_tensor(file: Path, have: dict, name: str, shape: tuple, dtype: str) -> None:
    """`name` is in the rank file (`have`: `rank_tensors`) with this shape and dtype, or an EngineError says not."""
    if name not in have:
        raise EngineError(f"{file}: tensor '{name}' is missing")
    if have[name] != (tuple(shape), dtype):
        raise EngineError(f"{file}: tensor '{name}' is {have[name][1]} {list(have[name][0])}, "
                          f"expected {dtype} {list(shape)}")


def verify_engine(path: str | Path) -> None:
    """Every rank file against the model built on the meta device: names, shapes, dtypes; nothing missing/extra."""
    from dsflash.convert import layouts
    eng = open_engine(path, check_arch=False)
    args, meta = eng.args, eng.meta
    table = tensor_table(args)
    plans = plan_ranks(args, table, eng.mapping(0), meta["arch"])
    padded, local = meta["expert_inter_padded"], meta["expert_inter_local"]
    for r, plan in enumerate(plans):
        m = eng.mapping(r)
        model = build_model(args, "deploy", mapping=m, comm=ShapeOnlyComm(m), device="meta")
        params = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        have = None if eng.dummy_seed is not None else rank_tensors(eng, r)
        expected = {}
        for e in table:
            cut = plan.cuts.get(e.name)
            if cut is None:
                continue
            le = local_entry(e, cut)
            p = params.get(e.name)
            where = f"{eng.path if have is None else eng.rank_file(r)}: tensor '{e.name}'"
            if p is None:
                raise EngineError(f"{where} has no parameter in the rank-{r} model")
            want = tuple(p.shape)
            if ".experts." in e.name and padded != local:
                want = tuple(padded if s == local else s for s in want)
            if le.shape != want:
                raise EngineError(f"{where} has logical shape {list(le.shape)}, rank-{r} model expects {list(want)}")
            for o in layouts.outputs(le, meta["layout"], meta["expert_dtype"], args):
                expected[o.name] = (o.shape, o.dtype)
        if have is not None:
            for name, (shape, dtype) in expected.items():
                check_rank_tensor(eng.rank_file(r), have, name, shape, dtype)
            extra = sorted(set(have) - set(expected))
            if extra:
                raise EngineError(f"{eng.rank_file(r)}: unexpected tensors, e.g. {extra[:3]}")
        unused = [n for n in dict(model.named_parameters()) if n not in plan.cuts]
        if unused:
            raise EngineError(f"{eng.path if have is None else eng.rank_file(r)}: no tensors for rank-{r} model "
                              f"parameters, e.g. {unused[:3]}")


class RankFile:
    """A rank's stored tensors, read from rank{R}.safetensors, each checked against the file's header first."""

    def __init__(self, eng: Engine, rank: int):
        self.eng, self.args, self.file, self.have = eng, eng.args, eng.rank_file(rank), rank_tensors(eng, rank)

    def __enter__(self) -> "RankFile":
        self._ctx = safe_open(str(self.file), framework="pt")
        self.f = self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)

    def stored(self, le: TensorEntry, logical: tuple[int, ...]) -> dict[str, torch.Tensor]:
        """The entry's tensors in the engine's layout (logical: the unpadded model shape, unused here)."""
        from dsflash.convert import layouts
        outs = layouts.outputs(le, self.eng.meta["layout"], self.eng.meta["expert_dtype"], self.args)
        for o in outs:
            check_rank_tensor(self.file, self.have, o.name, o.shape, o.dtype)
        return {o.name: self.f.get_tensor(o.name) for o in outs}

    def reference(self, le: TensorEntry, logical: tuple[int, ...]) -> dict[str, torch.Tensor]:
        """The entry's tensors in the HF format (codes + e8m0 scales), which the kernels read."""
        from dsflash.convert import layouts
        meta = self.eng.meta
        return layouts.to_reference(le, self.stored(le, logical), meta["layout"], meta["expert_dtype"],
                                    self.args)


def rank_source(eng: Engine, rank: int, device: str):
    """Where a rank's tensors come from: its file, or (a dummy-weight engine) a generator on `device`."""
    if eng.dummy_seed is None:
        return RankFile(eng, rank)
    from dsflash.build.dummy import DummyRank
    return DummyRank(eng, rank, device)


def load_engine_model(path: str | Path, rank: int = 0, comm=None, device: str | None = None, dtype=None,
                      plugins: str | dict | None = None, check_arch: bool = True, dense_experts: bool = False):
    """The rank's model (deploy numerics) with its weights from rank{R}.safetensors, or generated in place for a
    dummy-weight engine (dtype: the build's `--dtype`; device: the current CUDA device for GPU engines, else the
    CPU).

    plugins: None = the engine's selection (engine.json `plugins`), "reference" = none, or {op: impl} overrides.
    Plugin ops get their tensors in the kernel's format (build/bind.py); padded expert columns are cut off for the
    reference experts (they are zero). When the MoE plugin binds, the routed experts' dequantized weights are not
    made at all (they stay on the meta device: a full-size rank's experts take 4× their MXFP4 bytes in BF16), unless
    `dense_experts` asks for them (the reference a site replay compares against, `build.bind.site_parity`)."""
    from dsflash.build.bind import bind_plugins, resolve_plugins, wants_kernel_format
    from dsflash.convert import layouts
    from dsflash.model_def import materialize
    eng = open_engine(path, check_arch=check_arch)
    if device is None:
        device = "cuda" if eng.meta["arch"] != "cpu" and torch.cuda.is_available() else "cpu"
    if dtype is None:
        dtype = getattr(torch, eng.meta["build_config"].get("dtype") or default_dtype(eng.meta["arch"]))
    chosen = resolve_plugins(eng.meta.get("plugins", default_plugins("cpu")), plugins)
    args, meta = eng.args, eng.meta
    mapping = eng.mapping(rank)
    model, shape_only, need = load_plan(eng, rank, comm, dtype, chosen, dense_experts)
    free = device_free_bytes(device)
    if free is not None and need > free:
        raise EngineError(f"{eng.path}: rank {rank} needs {need / 2**30:.1f} GiB of weights on {device}, which has "
                          f"{free / 2**30:.1f} GiB free (full-size models need GPU engines with their MoE plugin, "
                          f"or more ranks: --tp)")
    unfilled = set(materialize(model, device, shape_only))
    params = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    table = tensor_table(args)
    cuts = plan_rank(args, table, mapping, meta["arch"]).cuts
    kept: dict[str, dict[str, torch.Tensor]] = {}
    with rank_source(eng, rank, device) as source, torch.no_grad():
        for e in table:
            if e.name not in cuts:
                continue
            le = local_entry(e, cuts[e.name])
            p = params[e.name]
            if p.is_meta:   # an Engram table or a routed expert of the MoE plugin: the stored codes and scales
                ref = source.reference(le, tuple(p.shape))
                q, sc = ref[e.name].to(device), ref[e.scale_name].to(device)
                if e.name.endswith(ENGRAM_TABLE):
                    model.get_submodule(e.name.removesuffix(".weight")).set_stored(q, sc)
                else:
                    kept[e.name] = {"q": q, "s": sc}
                continue
            ours = source.stored(le, tuple(p.shape))
            if wants_kernel_format(chosen, args, le):
                # the kernels read the HF format (plain codes + e8m0 scales): unpack once, dequantize from that
                ref = layouts.to_reference(le, ours, meta["layout"], meta["expert_dtype"], args)
                value = layouts.dequantize(le, ref, "reference", "fp4", args)
                kept[e.name] = {"q": ref[e.name].to(device), "s": ref[e.scale_name].to(device)}
                bf16 = layouts.name_of(le, "weight_bf16")
                if bf16 in ours:
                    kept[e.name]["bf16"] = ours[bf16].to(device)
            else:
                value = layouts.dequantize(le, ours, meta["layout"], meta["expert_dtype"], args)
            if value.shape != p.shape:   # expert widths padded after sharding: the padding is zero
                value = value[tuple(slice(0, s) for s in p.shape)]
            p.copy_(value.to(p.dtype))
            unfilled.discard(e.name)
    if unfilled:
        raise EngineError(f"{eng.path}: rank {rank} has no tensors for model parameters, e.g. {sorted(unfilled)[:3]}")
    if any(impl != "reference" for impl in chosen.values()):
        bind_plugins(model, args, chosen, kept, meta["expert_inter_local"], mapping.moe_ep_size)
        from dsflash.build.tune import gemm_table, moe_table, read_tuned
        tuned = read_tuned(path)
        # no tuned.json (or no entry for a shape): the default config, logged once per shape
        if chosen.get("gemm") == "fp8_gemm":
            from dsflash.plugins import tuning
            tuning.set_table(gemm_table(tuned))
        if chosen.get("moe") in MOE_PLUGINS:
            from dsflash.plugins import moe_config
            moe_config.set_table(moe_table(tuned))
    replaced = tuple(f"{n}." for n, mod in model.named_modules() if hasattr(mod, "experts") and mod.plugin is not None)
    shapeless = [n for n, t in model.named_parameters() if t.is_meta and not n.startswith(replaced)]
    if shapeless:   # the MoE plugin was expected to bind (moe_binds) and did not
        raise EngineError(f"{eng.path}: rank {rank} has shape-only parameters no plugin replaces, e.g. {shapeless[:3]}")
    if hasattr(model, "load_tokenizer"):
        model.load_tokenizer(Path(path) / "tokenizer.json")
    return model.eval(), eng


def load_plan(eng: Engine, rank: int, comm, dtype: torch.dtype, chosen: dict, dense_experts: bool = False):
    """What loading a rank makes, before anything is allocated: (the model on the meta device, `shape_only(name)`:
    the tensors kept as stored instead of dequantized, bytes of weights the load will hold on its device).

    Kept as stored: the Engram tables (FP8 rows + e8m0 scales: 1 + 1/32 bytes an element) and, where the MoE plugin
    binds, the routed experts (MXFP4: 1/2 + 1/32). With plugins the rest of the rank's stored bytes is added, which
    bounds the kernels' copies of the dense weights."""
    from dsflash.build.bind import moe_binds
    model = build_model(eng.args, "deploy", mapping=eng.mapping(rank), comm=comm, dtype=dtype, device="meta")
    defer = moe_binds(chosen, eng.args) and not dense_experts

    def shape_only(name: str) -> bool:
        return name.endswith(ENGRAM_TABLE) or (defer and ".experts." in name)
    tensors = [*model.named_parameters(), *model.named_buffers()]
    need = sum(t.numel() * t.element_size() for n, t in tensors if not shape_only(n))
    stored = int(sum(t.numel() * (33 / 32 if n.endswith(ENGRAM_TABLE) else 17 / 32) for n, t in tensors
                     if shape_only(n)))
    need += stored
    if any(impl != "reference" for impl in chosen.values()):
        need += max(0, int(eng.meta["ranks"][rank].get("bytes", 0)) - stored)
    return model, shape_only, need


def device_free_bytes(device: str) -> int | None:
    """Free memory of `device` (CPU: MemAvailable), or None when it cannot be told."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.mem_get_info(dev)[0]
    if dev.type == "cpu":
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None
