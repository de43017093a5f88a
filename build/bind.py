"""Attach the plugin kernels an engine selects (engine.json `plugins`) to a loaded reference model.

`load_engine_model` reads each rank tensor once: the dequantized value fills the reference parameter, and for the
ops bound here the tensors in the format the kernel reads are kept as well (FP8 codes + e8m0 block scales, the
BF16-cache copy, stacked MXFP4 experts, split mHC weights). What cannot run a plugin runs its reference and the log
says so once; nothing silently changes numerics.
"""
from __future__ import annotations

import copy
import logging

import torch

from dsflash.build.gemm_shapes import GROUP32_BLOCK, NOT_LINEAR_SUFFIXES, fits_kernel, gemm_block, stacks
from dsflash.model_def import dispatch, v4
from dsflash.model_def.csa2 import Attention, Indexer
from dsflash.model_def.layers import Expert, Linear, RMSNorm
from dsflash.plugins.refs import expand_weight_scales

log = logging.getLogger("dsflash.bind")
ATTENTIONS = (Attention, v4.Attention)   # V4.1's and V4's: the same `_output` (sink attention, inverse RoPE, WO-A)


def resolve_plugins(engine_plugins: dict, override: str | dict | None) -> dict:
    """engine.json's selection, or an override: "reference" for all ops, or {op: impl}."""
    if override is None:
        chosen = dict(engine_plugins)
    elif override == dispatch.REFERENCE:
        chosen = {op: dispatch.REFERENCE for op in engine_plugins}
    else:
        chosen = {**engine_plugins, **override}
    for op, impl in chosen.items():
        if op not in dispatch.PLUGIN_IMPLS or impl not in dispatch.PLUGIN_IMPLS[op]:
            allowed = {k: list(v) for k, v in dispatch.PLUGIN_IMPLS.items()}
            raise ValueError(f"plugin {op}={impl!r} is not known; choices: {allowed}")
    return chosen


def wants_kernel_format(plugins: dict, args, entry) -> bool:
    """Whether the loader must keep this entry's quantized tensors for a plugin."""
    if entry.role == "fp8_block":
        return (plugins.get("gemm") == "fp8_gemm" and gemm_block(args) is not None
                and not entry.name.endswith(NOT_LINEAR_SUFFIXES))
    if entry.role == "mxfp4":
        return plugins.get("moe") in dispatch.MOE_PLUGINS
    return False


def moe_binds(plugins: dict, args) -> bool:
    """Whether `bind_plugins` binds the MoE plugin for this selection (the loader then makes no dense experts)."""
    return plugins.get("moe") in dispatch.MOE_PLUGINS and bool(args.norm_topk_prob)


def _fp8_linears(model):
    for name, mod in model.named_modules():
        if isinstance(mod, Linear) and mod.quant == "fp8":
            yield name, mod


def bind_plugins(model, args, plugins: dict, kept: dict[str, dict[str, torch.Tensor]], inter_local: int,
                 ep_size: int) -> dict[str, int]:
    """Attach plugins to `model` in place; `kept[entry name]` = {"q", "s"(, "bf16")} from the engine.
    Returns how many sites each op bound."""
    from dsflash.plugins import registry   # registers torch.ops.dsflash.*
    dispatch.use_eager_ops(registry.eager_ops)
    if not model.numerics.deploy:
        raise ValueError("plugins implement deploy numerics; load the model with numerics='deploy'")
    bound = {op: 0 for op in plugins}
    block = gemm_block(args)
    if plugins.get("gemm") == "fp8_gemm" and block is not None:
        stacked = _bind_stacked_w13(model, kept, block) | _bind_stacked_qkv_a(model, kept, block)
        bound["gemm"] += len(stacked) // 2
        for name, lin in _fp8_linears(model):
            t = kept.get(f"{name}.weight")
            if name in stacked or t is None:   # no kernel-format tensors: WO-A's weight (run as an einsum)
                continue
            if not fits_kernel(t["q"].shape[1]):
                dispatch.warn_once(f"gemm-k:{t['q'].shape[1]}", "gemm plugin: K=%d is not a multiple of 32; those "
                                   "linears run the reference", t["q"].shape[1])
                continue
            lin.plugin = fp8_linear_plugin(t, block)
            bound["gemm"] += 1
    if plugins.get("moe") in dispatch.MOE_PLUGINS:   # (norm_topk_prob=false: said once, the reference runs)
        bound["moe"] = _bind_moe(model, args, kept, inter_local, ep_size, plugins["moe"] == "mxfp4_overlap")
    if plugins.get("mhc") in ("fused", "fused_overlap"):
        for name, mod in model.named_modules():
            if hasattr(mod, "hc_plugin"):
                mod.hc_plugin = fused_hc(mod, overlap=plugins["mhc"] == "fused_overlap")
                bound["mhc"] += 1
    if plugins.get("norm") == "fused":
        for mod in model.modules():
            if isinstance(mod, RMSNorm) and mod.weight.shape[-1] % 32 == 0:   # the kernel's 32-wide blocks
                mod.plugin = dispatch.FusedRMSNorm()
                bound["norm"] += 1
        for mod in model.modules():   # an attention's q_norm and kv_norm (both bound above): one launch
            if isinstance(mod, ATTENTIONS) and mod.q_norm.plugin is not None and mod.kv_norm.plugin is not None \
                    and mod.q_norm.eps == mod.kv_norm.eps:
                mod.qkv_norm_plugin = dispatch.FusedRMSNormPair()
    if plugins.get("swiglu") == "fused":
        for mod in model.modules():
            if isinstance(mod, Expert) and mod.w1.quant == "fp8":   # shared experts (routed ones: the MoE plugin)
                mod.act_plugin = dispatch.FusedSwiGLU()
                bound["swiglu"] += 1
    if plugins.get("wo_a") == "fused":
        for mod in model.modules():
            if isinstance(mod, ATTENTIONS):
                mod.wo_a.weight.data = mod.wo_a.weight.data.to(torch.bfloat16).contiguous()
                mod.fused_wo_a = True
                bound["wo_a"] += 1
    if plugins.get("kv_quant") == "fused":
        for mod in model.modules():
            if isinstance(mod, Attention):   # V4.1's window rows (V4 engines keep the reference)
                mod.fused_kv_quant = True
                bound["kv_quant"] += 1
    if plugins.get("rope") == "fused":
        for mod in model.modules():
            if isinstance(mod, (Attention, Indexer)):   # V4.1's rotated rows (V4 engines keep the reference)
                mod.fused_rope = True
                bound["rope"] += 1
    if plugins.get("attention") == "fused":
        for mod in model.modules():   # V4.1's slot decode steps; the kernel reads BF16 rows (V4: the reference)
            if isinstance(mod, Attention) and mod.act_dtype == torch.bfloat16:
                mod.fused_attention = True
                bound["attention"] += 1
    if plugins.get("index") == "fused":
        for mod in model.modules():   # V4.1's slot decode steps; the kernel reads BF16 keys (V4: the reference)
            if isinstance(mod, Attention) and mod.indexer is not None and mod.act_dtype == torch.bfloat16:
                mod.indexer.fused_scores = True
                bound["index"] += 1
    for op, n in bound.items():
        if n == 0 and plugins[op] != dispatch.REFERENCE:   # said once, never a silent reference
            dispatch.warn_once(f"unbound:{op}", "plugin %s=%s bound no site of this model; it runs the reference",
                               op, plugins[op])
    log.info("plugins bound: %s", bound)
    return bound


def fp8_linear_plugin(t: dict[str, torch.Tensor], block: int = 32) -> dispatch.FP8Linear:
    """The `FP8Linear` of one kept entry {"q", "s"(, "bf16")}: its `block`×`block` scales in the kernels' 32×32
    format, activations quantized per 1×block."""
    return stacked_fp8_linear([t], block)


def stacked_fp8_linear(parts: list[dict[str, torch.Tensor]], block: int = 32) -> dispatch.FP8Linear:
    """One `FP8Linear` over the row-stacked kernel tensors of `parts` ({"q", "s"(, "bf16")}, each a multiple of
    `block` rows; `block`×`block` scales, 1×block activation groups); the BF16-cache copy only when every part has
    one."""
    def rows(ts: list[torch.Tensor]) -> torch.Tensor:   # (1-byte float dtypes concatenated as bytes)
        if len(ts) == 1:   # one part: its own tensor, not a copy
            return ts[0]
        if ts[0].element_size() == 1:
            return torch.cat([t.view(torch.uint8) for t in ts]).view(ts[0].dtype)
        return torch.cat(ts)
    scales = [expand_weight_scales(p["s"], *p["q"].shape, block) for p in parts]
    bf16 = rows([p["bf16"] for p in parts]) if all("bf16" in p for p in parts) else None
    return dispatch.FP8Linear(rows([p["q"] for p in parts]), rows(scales), bf16, block)


def _bind_stacked_w13(model, kept, block: int) -> set[str]:
    """Each FP8 shared expert's w1 and w3 read the same input: bind one `FP8Linear` over [w1; w3] as the expert's
    `w13_plugin` (its BF16-cache copy stacked too). Returns the names of the linears it covers."""
    done: set[str] = set()
    for name, mod in model.named_modules():
        if not (isinstance(mod, Expert) and mod.w1.quant == "fp8" and stacks(mod.w1.out_features, block)):
            continue
        t1, t3 = kept.get(f"{name}.w1.weight"), kept.get(f"{name}.w3.weight")
        if t1 is None or t3 is None or not fits_kernel(t1["q"].shape[1]):
            continue
        mod.w13_plugin = stacked_fp8_linear([t1, t3], block)
        done |= {f"{name}.w1", f"{name}.w3"}
    return done


def _bind_stacked_qkv_a(model, kept, block: int) -> set[str]:
    """Each attention's wq_a and wkv read the same x: bind one `FP8Linear` over [wq_a; wkv] as its `wqkv_a_plugin`
    (one launch and one weight stream at decode instead of two), and each of the two to its rows of the stacked
    tensors (views: a DSpark draft stage's window rows run wkv alone). Returns the names of the linears it covers."""
    done: set[str] = set()
    for name, mod in model.named_modules():
        if not (isinstance(mod, ATTENTIONS) and mod.wq_a.quant == "fp8" and mod.wkv.quant == "fp8"):
            continue
        tq, tkv = kept.get(f"{name}.wq_a.weight"), kept.get(f"{name}.wkv.weight")
        if tq is None or tkv is None or not fits_kernel(tq["q"].shape[1]) or not stacks(tq["q"].shape[0], block):
            continue
        mod.wqkv_a_plugin = stacked_fp8_linear([tq, tkv], block)
        nq = tq["q"].shape[0]
        mod.wq_a.plugin = _row_slice(mod.wqkv_a_plugin, 0, nq)
        mod.wkv.plugin = _row_slice(mod.wqkv_a_plugin, nq, mod.wqkv_a_plugin.w_q.shape[0])
        done |= {f"{name}.wq_a", f"{name}.wkv"}
    return done


def _row_slice(plugin: dispatch.FP8Linear, lo: int, hi: int) -> dispatch.FP8Linear:
    """The `FP8Linear` of rows [lo, hi) of a stacked one (lo a multiple of its 32-row scale blocks), sharing its
    storage."""
    b = GROUP32_BLOCK
    bf16 = None if plugin.w_bf16 is None else plugin.w_bf16[lo:hi]
    return dispatch.FP8Linear(plugin.w_q[lo:hi], plugin.w_s[lo // b:-(-hi // b)], bf16, plugin.act_block)


def fused_hc(block, overlap: bool) -> dispatch.FusedHC:
    """The mHC plugin of a V4.1 block, from its own fp32 mixing weights (split for the tensor-core kernel)."""
    from dsflash.plugins.refs import hc_split_weight
    with torch.no_grad():
        return dispatch.FusedHC(hc_split_weight(block.hc_attn_fn), hc_split_weight(block.hc_ffn_fn), overlap)


def _bind_moe(model, args, kept, inter_local: int, ep_size: int, overlap_shared: bool = False) -> int:
    """Bind every V4.1 or V4 MoE; under expert parallelism (ep_size > 1) a rank's block of experts, which the plugin
    addresses from its first global id. The experts' activations are quantized per 1×`args.act_block` (V4: 128);
    V4's gate is stored as the BF16 the router kernel reads (its checkpoint values: the same numbers).
    overlap_shared (`mxfp4_overlap`): the model runs the shared expert on a second stream beside the op."""
    from dsflash.model_def.v41 import MoE
    if not args.norm_topk_prob:
        dispatch.warn_once("moe-norm", "moe plugin: norm_topk_prob=false runs the reference MoE")
        return 0
    n = 0
    for name, moe in model.named_modules():
        if isinstance(moe, v4.MoE):
            ids = [e for e, m in enumerate(moe.experts) if m is not None]
            moe.gate.weight.data = moe.gate.weight.data.to(torch.bfloat16).contiguous()
            topk, scale, temp = moe.gate.topk, moe.gate.route_scale, 1.0
        elif isinstance(moe, MoE):
            ids = sorted(int(e) for e in moe.experts)
            topk, scale, temp = moe.gate.topk, moe.gate.scale, moe.gate.temp
        else:
            continue
        if ids != list(range(ids[0], ids[0] + len(ids))) or len(ids) * ep_size != moe.gate.weight.shape[0]:
            raise ValueError(f"{name}: the MoE plugin needs each of the {ep_size} EP ranks to own a contiguous block "
                             f"of {moe.gate.weight.shape[0]} // {ep_size} experts, this rank owns {ids[0]}..{ids[-1]} "
                             f"({len(ids)})")

        # the experts' stored tensors are handed over (popped from kept), so a layer's per-expert copies are freed
        # once stacked: a lean full-size rank would otherwise hold its routed experts twice while it binds
        w1, w3, w2 = ([kept.pop(f"{name}.experts.{e}.{w}.weight") for e in ids] for w in ("w1", "w3", "w2"))
        w13_q = torch.stack([torch.cat([a["q"], b["q"]]) for a, b in zip(w1, w3)])     # [E, 2·I_pad, D/2]
        w13_s = torch.stack([torch.cat([a["s"], b["s"]]) for a, b in zip(w1, w3)])
        del w1, w3
        w2_q, w2_s = torch.stack([t["q"] for t in w2]), torch.stack([t["s"] for t in w2])
        del w2
        moe.plugin = dispatch.MXFP4MoE(w13_q, w13_s, w2_q, w2_s, inter_local, topk, scale, temp, args.swiglu_limit,
                                       ids[0], args.act_block, overlap_shared)
        n += 1
    return n


# -- verification: every bound site against its reference on the activations a real forward produces ------------------
def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def site_parity(model, input_ids: torch.Tensor, max_per_kind: int = 1000) -> list[dict]:
    """Run `model.logits(input_ids)` once, capture the inputs of every site that has a plugin bound, then replay
    each site with its plugin and with its reference on the same input: [{site, kind, rel}] (‖Δ‖/‖ref‖).

    End-to-end token equality is not a usable check on random-weight models: deploy numerics (pow2-scaled FP8/FP4
    quantizers, top-k routing and selection) amplify a 1e-5 relative perturbation into a 5-40 % logit change, so
    two correct implementations that round differently disagree on most greedy tokens (on trained synthetic
    checkpoints, `dsflash synth --train-steps`, they agree). Site replay isolates each kernel, with the engine's
    real weights, shapes and activations."""
    from dsflash.model_def.v41 import Block, MoE
    if any(p.is_meta for p in model.parameters()):
        raise ValueError("site_parity replays each site against its reference: load the model with "
                         "load_engine_model(..., dense_experts=True) so the routed experts have reference weights")
    captured, hooks = [], []
    counts: dict[str, int] = {}

    def keep(kind, name, mod, payload):
        if counts.get(kind, 0) < max_per_kind and not any(c[1] == name for c in captured):
            counts[kind] = counts.get(kind, 0) + 1
            captured.append((kind, name, mod, payload))

    for name, mod in model.named_modules():
        if isinstance(mod, Linear) and mod.plugin is not None:
            hooks.append(mod.register_forward_pre_hook(
                lambda m, a, n=name: keep("gemm", n, m, (a[0].detach().clone(),))))
        elif isinstance(mod, MoE) and mod.plugin is not None:
            hooks.append(mod.register_forward_pre_hook(
                lambda m, a, n=name: keep("moe", n, m, (a[0].detach().clone(),))))
        elif isinstance(mod, v4.MoE) and mod.plugin is not None:   # (x, token ids: the hash layers route by them)
            hooks.append(mod.register_forward_pre_hook(
                lambda m, a, n=name: keep("moe_v4", n, m, (a[0].detach().clone(), a[1]))))
        elif isinstance(mod, RMSNorm) and mod.plugin is not None:
            hooks.append(mod.register_forward_pre_hook(
                lambda m, a, n=name: keep("norm", n, m, (a[0].detach().clone(),))))
        elif isinstance(mod, Expert) and mod.w13_plugin is not None:   # the stacked w1|w3 GEMM
            hooks.append(mod.register_forward_pre_hook(
                lambda m, a, n=name: keep("gemm_w13", n + ".w13", m, (a[0].detach().clone(),))))
        elif isinstance(mod, dispatch.FusedRMSNormPair):   # (a, q_norm, b, kv_norm)
            hooks.append(mod.register_forward_pre_hook(
                lambda m, a, n=name: keep("norm_pair", n, m, (a[0].detach().clone(), a[1], a[2].detach().clone(),
                                                               a[3]))))
        elif isinstance(mod, dispatch.FusedSwiGLU):   # the kernel alone: its expert's GEMMs are sites of their own
            hooks.append(mod.register_forward_pre_hook(
                lambda m, a, n=name: keep("swiglu", n, m, (a[0].detach().clone(), a[1].detach().clone(), a[2]))))
        elif isinstance(mod, Block) and mod.hc_plugin is not None:   # the forward enters a block at open_attn
            mod.open_attn = _capturing(mod, mod.open_attn, lambda a, n=name, m=mod: keep("mhc", n, m, a[:2]))
        elif type(mod) is v4.Block and mod.hc_plugin is not None:   # (X, ids); MTP blocks: the same kernels
            entered = {}
            mod.open_attn = _capturing(mod, mod.open_attn, lambda a, e=entered: e.__setitem__("X", a[0]))
            mod.close_attn = _capturing(mod, mod.close_attn, lambda a, n=name, m=mod, e=entered:
                                        keep("mhc_v4", n, m, (e["X"], a[2])))
        if isinstance(mod, ATTENTIONS) and mod.wqkv_a_plugin is not None:   # the stacked wq_a|wkv GEMM
            mod.prepare = _capturing(mod, mod.prepare, lambda a, n=name, m=mod: keep("gemm_qkv_a", n + ".wqkv_a", m,
                                                                                      a[:1]))
        if isinstance(mod, ATTENTIONS) and mod.fused_wo_a:
            mod._project = _capturing(mod, mod._project, lambda a, n=name, m=mod: keep("wo_a", n, m, a))
    try:
        with torch.no_grad():
            model.logits(input_ids)
    finally:
        for h in hooks:
            h.remove()
        for mod in model.modules():
            for wrapped in ("_project", "prepare", "open_attn", "close_attn"):
                if wrapped in mod.__dict__:
                    delattr(mod, wrapped)
    return [{"site": name, "kind": kind, "rel": _replay(kind, mod, payload)} for kind, name, mod, payload in captured]


def _capturing(mod, fn, record):
    def wrapped(*a):
        record(tuple(t.detach().clone() if isinstance(t, torch.Tensor) else t for t in a))
        return fn(*a)
    return wrapped


def _reference_copy(mod):
    """The site's reference in fp32 ("deploy numerics in fp32", what the kernels' `*_ref` define): a copy with every
    plugin detached. Comparing against the BF16 model instead would charge the kernels for the BF16 model's own
    extra roundings (e.g. the expert intermediate, which the MoE kernel keeps in fp32)."""
    ref = copy.deepcopy(mod)
    for m in ref.modules():
        for attr in ("plugin", "hc_plugin", "act_plugin", "w13_plugin", "wqkv_a_plugin", "qkv_norm_plugin"):
            if getattr(m, attr, None) is not None:
                setattr(m, attr, None)
        for flag in ("fused_wo_a", "fused_kv_quant", "fused_rope", "fused_attention", "fused_scores"):
            if getattr(m, flag, False):
                setattr(m, flag, False)
    return ref.float()


def _f32(t):
    return t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t


class _PassThrough(torch.nn.Module):
    """Stands in for a nested site during a replay, so each replay measures one plugin (`zero`: contributes 0)."""

    def __init__(self, zero: bool = False):
        super().__init__()
        self.zero = zero

    def forward(self, x, *_):
        return torch.zeros_like(x) if self.zero else x


# nested sites neutralised per replayed kind (their names, and whether they contribute 0): the FFN inside a block
# (whose replay attends with the identity), wo_b after WO-A, the shared expert in the MoE
_NESTED = {"mhc": (("ffn",), False), "mhc_v4": (("ffn",), False), "wo_a": (("wo_b",), False),
           "moe": (("shared_experts",), True), "moe_v4": (("shared_experts",), True)}


def _replay(kind: str, mod, payload) -> float:
    ref = _reference_copy(mod)
    nested = _NESTED.get(kind)
    if nested:
        saved = {name: getattr(mod, name) for name in nested[0]}
        for m in (mod, ref):
            for name in nested[0]:
                setattr(m, name, _PassThrough(nested[1]))
    try:
        with torch.no_grad():
            if kind == "swiglu":
                from dsflash.plugins.refs import clipped_swiglu_ref
                g, u, limit = payload
                return _rel(mod(g, u, limit), clipped_swiglu_ref(g.float(), u.float(), limit))
            if kind in ("gemm", "moe", "norm"):
                return _rel(mod(payload[0]), ref(payload[0].float()))
            if kind == "gemm_w13":
                x = payload[0]
                return _rel(mod.w13_plugin(x), torch.cat([ref.w1(x.float()), ref.w3(x.float())], -1))
            if kind == "norm_pair":
                a, norm_a, b, norm_b = payload
                got = mod(a, norm_a, b, norm_b)
                want = _reference_copy(norm_a)(a.float()), _reference_copy(norm_b)(b.float())
                return max(_rel(got[0], want[0]), _rel(got[1], want[1]))
            if kind == "gemm_qkv_a":
                x = payload[0]
                return _rel(mod.wqkv_a_plugin(x), torch.cat([ref.wq_a(x.float()), ref.wkv(x.float())], -1))
            if kind == "mhc":
                X, pre = payload
                got = mod(X, pre, lambda x: x, None)
                want = ref(X.float(), pre.float(), lambda x: x, None)
                return max(_rel(got[0], want[0]), _rel(got[1], want[1]))
            if kind == "mhc_v4":
                X, ids = payload
                return _rel(mod(X, ids, lambda x: x), ref(X.float(), ids, lambda x: x))
            if kind == "moe_v4":
                X, ids = payload
                return _rel(mod(X, ids), ref(X.float(), ids))
            return _rel(mod._project(*payload), ref._project(*(_f32(t) for t in payload)))
    finally:
        if nested:
            for name, m in saved.items():
                setattr(mod, name, m)
