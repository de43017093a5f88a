"""CSA2, the DeepSeek-V4.1 attention: shared-KV MQA over an own sliding window plus cross-layer shared compressed KV.

Per layer (architecture.md §2.9): a low-rank query, one K=V latent (`wkv` + `kv_norm`, RoPE on its last `rope_dim`
channels, FP8 fake-quant of the whole vector in blocks of 32) kept for the last `sliding_window` positions, a
per-head sink and a grouped low-rank output. Layers with compress ratio r > 0 also attend to `index_topk` entries of
the compressed cache of their KV source (`kv_source_layer_ids`): only a source owns a `Compressor` (r = 2: softmax-gate
pooling of 2 tokens in fp32; r = 1: one entry per token) and the indexer keys (`wk` + `k_norm` of the pre-RoPE latent).
Index sources score queries against those keys and publish a top-k (two-level at and after the candidate source);
the layers up to the next index source reuse it. Semantics follow transformers' `deepseek_v41` (cached path).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dsflash.model_def import dispatch
from dsflash.model_def.layers import (ColumnParallelLinear, Linear, LocalComm, Numerics, RMSNorm, RowParallelLinear,
                                      apply_rope, local_slice, norm_pair, rope_table, sink_attention,
                                      stacked_or_each, tp_of, wide, wide_weight)
from dsflash.model_def.quant import fake_quant_fp8
from dsflash.model_def.ragged import DecodeRows, Ragged, all_reduce_each

WINDOW_KV_BLOCK = 32      # FP8 e4m3, pow2 scale per 32 channels, whole 512-d vector incl. RoPE channels
COMPRESSED_KV_BLOCK = 16  # FP4 e2m1 with an e4m3 scale per 16 channels
INDEX_BLOCK = 32          # FP4 e2m1 with a pow2 (e8m0) scale per 32 channels, index keys and queries


def wide_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype `wide` gives for `dtype` (fp64 model runs keep fp64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# -- selection primitives (pure functions) -------------------------------------------------------------------------
def pool_groups(kv: torch.Tensor, gate: torch.Tensor, ratio: int) -> torch.Tensor:
    """kv, gate [B, G*r, d] -> [B, G, d]: per channel, softmax of the gate over each group's r tokens (fp32)."""
    b, n, d = kv.shape
    kv = wide(kv).view(b, n // ratio, ratio, d)
    w = wide(gate).view(b, n // ratio, ratio, d).softmax(dim=2)
    return (kv * w).sum(2)


def visible_counts(positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """Compressed entries a query at `positions` may read: t < (pos + 1) // r (the group is complete)."""
    return (positions.long() + 1) // ratio


def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k best scores per row, −1 for empty slots (score −inf, or fewer than k entries).

    Ties go to the lower index (stable sort), so the set never depends on the row's length or layout.
    scores [..., T] -> long [..., k].
    """
    t = scores.shape[-1]
    kk = min(k, t)
    vals, idx = torch.sort(scores, dim=-1, descending=True, stable=True)
    idx = torch.where(vals[..., :kk] > float("-inf"), idx[..., :kk], torch.full_like(idx[..., :kk], -1))
    if kk < k:
        idx = F.pad(idx, (0, k - kk), value=-1)
    return idx


def indices_to_mask(idx: torch.Tensor, n: int) -> torch.Tensor:
    """−1-padded index lists [..., k] -> bool mask [..., n]."""
    mask = torch.zeros(*idx.shape[:-1], n + 1, dtype=torch.bool, device=idx.device)
    mask.scatter_(-1, torch.where(idx >= 0, idx, torch.full_like(idx, n)), True)
    return mask[..., :n]


def select_candidate_blocks(scores: torch.Tensor, counts: torch.Tensor, topk_blocks: int,
                            block_size: int) -> torch.Tensor:
    """Level one of the two-level top-k: keep the `topk_blocks` best blocks of `block_size` entries per query.

    scores [B,S,T] (invisible entries already −inf); counts [B,S] visible entries. A block scores the max of its
    entries; the block holding the newest visible entry (count − 1) is pinned. Returns a bool mask [B,S,T].
    """
    t = scores.shape[-1]
    nb = -(-t // block_size)
    blocks = F.pad(scores, (0, nb * block_size - t), value=float("-inf")).unflatten(-1, (nb, block_size)).amax(-1)
    newest = torch.div(counts.long() - 1, block_size, rounding_mode="floor")    # −1 (no pin) when nothing visible
    blocks = blocks.masked_fill(torch.arange(nb, device=scores.device) == newest.unsqueeze(-1), float("inf"))
    keep = indices_to_mask(topk_indices(blocks, topk_blocks), nb)
    # each block's flag over its entries (expand + flatten: `repeat_interleave` may sync with the host on a GPU)
    return keep.unsqueeze(-1).expand(*keep.shape, block_size).flatten(-2)[..., :t]


def layer_inv_freq(args, layer: int, device: torch.device) -> torch.Tensor:
    """RoPE table of `layer`: compressing layers (ratio 2 and 1) use compress_rope_theta + YaRN, others plain."""
    if args.ratio(layer) > 0:
        return rope_table(args.rope_dim, args.compress_rope_theta, args.yarn, device)
    return rope_table(args.rope_dim, args.rope_theta, None, device)


# -- per-request caches --------------------------------------------------------------------------------------------
@dataclass
class SourceCache:
    """Growing state of one KV source: compressed entries, index keys, and (r > 1) the partial group in fp32."""
    kv: torch.Tensor        # [B, T, head_dim]  RoPE'd, FP4 fake-quantized
    index_k: torch.Tensor   # [B, T, index_head_dim]  RoPE'd, FP4 fake-quantized
    buf_kv: torch.Tensor    # [B, m < r, head_dim] fp32 (fp64) projections of the tokens of the open group
    buf_gate: torch.Tensor  # [B, m < r, head_dim] fp32 gate logits of those tokens

    @classmethod
    def empty(cls, batch: int, head_dim: int, index_dim: int, dtype: torch.dtype, device=None) -> "SourceCache":
        z = functools.partial(torch.zeros, batch, 0, device=device)
        return cls(z(head_dim, dtype=dtype), z(index_dim, dtype=dtype), z(head_dim, dtype=wide_dtype(dtype)),
                   z(head_dim, dtype=wide_dtype(dtype)))

    @property
    def count(self) -> int:
        return self.kv.shape[1]


class BatchedSource:
    """A KV source's caches over a decode batch: compressed entries of all its requests end to end plus one zero
    row (what an empty top-k slot reads), each request's first row, and the index keys padded to [N, T_max, d]."""

    def __init__(self, caches: list[SourceCache], counts: torch.Tensor):
        kv = [c.kv[0] for c in caches]
        self.kv = torch.cat([*kv, kv[0].new_zeros(1, kv[0].shape[-1])])                 # [ΣT + 1, d]
        self.offsets = torch.cumsum(counts, 0) - counts                                   # [N]
        self.index_k = torch.nn.utils.rnn.pad_sequence([c.index_k[0] for c in caches], batch_first=True)


class DecodeBatch(DecodeRows):
    """The decode rows of a V4.1 forward (`ragged.DecodeRows`) with their contexts, the selections of the index
    sources ([N,1,k] top-k; "candidates": the block mask) and each KV source's batched caches."""

    def __init__(self, rag: Ragged, members: list[int], ctxs: list, slots=None):
        super().__init__(rag, members)
        self.ctxs = [ctxs[i] for i in members]
        self.selections: dict = {}
        self._sources: dict[int, BatchedSource] = {}
        # with decode slots that hold every member, the layers run `Attention.slot_scores` / `slot_attend` on them
        self.take_slots(slots, [c.state for c in self.ctxs])

    def compressed(self, source: int, refresh: bool) -> BatchedSource:
        """The batched caches of `source` (rebuilt when `refresh`: its layer has just appended to them)."""
        if refresh or source not in self._sources:
            caches = [c.state.sources[source] for c in self.ctxs]
            self._sources[source] = BatchedSource(caches, self.ints([c.count for c in caches]))
        return self._sources[source]


# -- modules -------------------------------------------------------------------------------------------------------
class Compressor(nn.Module):
    """`attn.compressor` of a KV source: returns the pre-RoPE latents of the groups completed by this chunk."""

    def __init__(self, args, ratio: int, numerics: Numerics, dtype: torch.dtype):
        super().__init__()
        self.ratio = ratio
        self.wkv = Linear(args.hidden_size, args.head_dim, numerics, None, dtype=dtype)
        self.wgate = Linear(args.hidden_size, args.head_dim, numerics, None, dtype=dtype) if ratio > 1 else None
        self.norm = RMSNorm(args.head_dim, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, cache: SourceCache) -> torch.Tensor:
        """x [B,S,D] -> latents [B,G,head_dim]; keeps the tokens of an unfinished group in `cache`."""
        return self.pool(self.project(x), cache, x.dtype)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The per-token part: ratio 1, the latents themselves (None); else the kv and gate projections, in fp32
        (the reference upcasts the ratio-2 compressor)."""
        if self.wgate is None:  # ratio 1: every token is its own entry, no pooling
            return self.norm(self.wkv(x)), None
        return F.linear(wide(x), wide_weight(self.wkv.weight)), F.linear(wide(x), wide_weight(self.wgate.weight))

    def pool(self, proj: tuple[torch.Tensor, torch.Tensor | None], cache: SourceCache,
             dtype: torch.dtype) -> torch.Tensor:
        """One request batch's projections [B,S,·] -> latents [B,G,head_dim] of the groups they complete."""
        kv, gate = proj
        if gate is None:
            return kv
        kv, gate = torch.cat([cache.buf_kv, kv], 1), torch.cat([cache.buf_gate, gate], 1)
        usable = kv.shape[1] // self.ratio * self.ratio
        cache.buf_kv, cache.buf_gate = kv[:, usable:], gate[:, usable:]
        return self.norm(pool_groups(kv[:, :usable], gate[:, :usable], self.ratio).to(dtype))


class Indexer(nn.Module):
    """`attn.indexer` of an index source; `wk`/`k_norm` only on KV sources (they produce the shared keys)."""

    def __init__(self, args, layer: int, numerics: Numerics, mapping, comm, dtype: torch.dtype):
        super().__init__()
        tp, _ = tp_of(mapping)
        if args.index_n_heads % tp:
            raise ValueError(f"index_n_heads={args.index_n_heads} is not divisible by tp={tp}")
        self.n_heads, self.head_dim = args.index_n_heads, args.index_head_dim
        self.n_local = args.index_n_heads // tp
        self.comm = comm
        self.wq_b = ColumnParallelLinear(args.q_lora_rank, self.n_heads * self.head_dim, numerics, mapping, "fp8",
                                         dtype=dtype)
        self.weights_proj = ColumnParallelLinear(args.hidden_size, self.n_heads, numerics, mapping, None, dtype=dtype)
        self.owns_k = layer in args.kv_source_layer_ids
        self.fused_rope = False   # set by an engine loader binding the rope plugin (`dispatch.rope_rows`)
        self.fused_scores = False   # set by an engine loader binding the index plugin (slot decode steps)
        if self.owns_k:
            self.wk = Linear(args.head_dim, self.head_dim, numerics, None, dtype=dtype)
            self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps)

    def keys(self, latent: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
        """Index keys of new entries: FP4(RoPE(k_norm(wk · latent))). latent [B,G,d], positions [B,G]."""
        return dispatch.rope_rows(self.fused_rope, self.k_norm(self.wk(latent)), positions, inv_freq, "fp4_pow2",
                                  INDEX_BLOCK)

    def queries(self, x: torch.Tensor, q_res: torch.Tensor, positions: torch.Tensor,
                inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-token part: this rank's index queries FP4(RoPE(wq_b · q_res)) [B,S,h_local,d] and head weights
        w = weights_proj(x) / sqrt(n_heads) [B,S,h_local] fp32."""
        b, s, _ = x.shape
        q = self.wq_b(q_res).view(b, s, self.n_local, self.head_dim)
        q = dispatch.rope_rows(self.fused_rope, q, positions, inv_freq, "fp4_pow2", INDEX_BLOCK)
        return q, wide(self.weights_proj(x)) * self.n_heads ** -0.5

    def partial_scores(self, q: torch.Tensor, w: torch.Tensor, index_k: torch.Tensor) -> torch.Tensor:
        """Σ_h w_h · ReLU(q_h · k_t) / sqrt(index_head_dim) over this rank's heads -> [B,S,T] fp32; the index heads
        are sharded, so the scores are these partials summed over the TP ranks."""
        logits = torch.einsum("bshd,btd->bsht", wide(q), wide(index_k)).relu() * self.head_dim ** -0.5
        return (logits * w.unsqueeze(-1)).sum(2)


class GroupedLinear(nn.Module):
    """`attn.wo_a`: block-diagonal projection of each head group to o_lora_rank (run unquantized, as the reference).

    weight [n_groups * rank, group_in]; x [.., n_groups, group_in] -> [.., n_groups * rank].
    """

    def __init__(self, n_groups: int, rank: int, group_in: int, dtype: torch.dtype):
        super().__init__()
        self.n_groups, self.rank = n_groups, rank
        self.weight = nn.Parameter(torch.empty(n_groups * rank, group_in, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.view(self.n_groups, self.rank, -1)
        return torch.einsum("...gi,gri->...gr", x.to(w.dtype), w).flatten(-2)


class Attention(nn.Module):
    """`layers.{l}.attn` (and `mtp.{s}.attn`): window + shared compressed KV, sink, inverse RoPE, grouped output."""

    def __init__(self, args, layer: int, numerics: Numerics, mapping=None, comm=None, dtype=torch.float32):
        super().__init__()
        tp, _ = tp_of(mapping)
        comm = comm or LocalComm()
        h, g, d = args.num_attention_heads, args.o_groups, args.head_dim
        if h % tp or g % tp:
            raise ValueError(f"num_attention_heads={h} and o_groups={g} must be divisible by tp={tp}")
        self.args, self.layer, self.ratio = args, layer, args.ratio(layer)
        self.act_dtype = dtype   # the model's activations (the compressor's pooled latents are cast to it)
        self.n_local, self.g_local, self.head_dim, self.window = h // tp, g // tp, d, args.sliding_window
        self.wq_a = Linear(args.hidden_size, args.q_lora_rank, numerics, "fp8", dtype=dtype)
        self.q_norm = RMSNorm(args.q_lora_rank, args.rms_norm_eps)
        self.wq_b = ColumnParallelLinear(args.q_lora_rank, h * d, numerics, mapping, "fp8", dtype=dtype)
        self.wkv = Linear(args.hidden_size, d, numerics, "fp8", dtype=dtype)
        self.kv_norm = RMSNorm(d, args.rms_norm_eps)
        self.wo_a = GroupedLinear(self.g_local, args.o_lora_rank, h * d // g, dtype)
        self.wo_b = RowParallelLinear(g * args.o_lora_rank, args.hidden_size, numerics, mapping, comm, "fp8",
                                      dtype=dtype)
        start, stop = local_slice(h, mapping)
        self.attn_sink = nn.Parameter(torch.zeros(stop - start, dtype=torch.float32))
        is_main = layer < args.n_layers
        self.kv_source = args.kv_source_of(layer) if is_main else -1
        self.index_source = args.index_source_of(layer) if is_main else -1
        self.compressor = Compressor(args, self.ratio, numerics, dtype) if self.kv_source == layer else None
        self.indexer = (Indexer(args, layer, numerics, mapping, comm, dtype) if self.index_source == layer
                        else None)
        self.fused_wo_a = False   # set by an engine loader binding the WO-A plugin (needs a BF16 wo_a.weight)
        self.fused_kv_quant = False   # set by an engine loader binding the kv_quant plugin
        self.fused_rope = False       # set by an engine loader binding the rope plugin (`dispatch.rope_rows`)
        self.fused_attention = False  # set by an engine loader binding the attention plugin (slot decode steps)
        self.wqkv_a_plugin: nn.Module | None = None   # dispatch.FP8Linear over [wq_a; wkv], attached likewise
        self.qkv_norm_plugin: nn.Module | None = None   # dispatch.FusedRMSNormPair (q_norm, kv_norm), likewise

    # -- shared pieces -------------------------------------------------------------------------------------------
    def _query_kv(self, x, positions, inv):
        """(q_res, roped q [B,S,h,d], window K = V rows) of x: wq_a and wkv read the same x, through one GEMM when
        `wqkv_a_plugin` is bound, and q_norm and kv_norm run in one launch when `qkv_norm_plugin` is."""
        qa, kva = stacked_or_each(self.wqkv_a_plugin, x, (self.wq_a, self.wkv))
        q_res, kvn = norm_pair(self.qkv_norm_plugin, (self.q_norm, self.kv_norm), (qa, kva))
        q = self.wq_b(q_res).view(*x.shape[:2], self.n_local, self.head_dim)
        return q_res, dispatch.rope_rows(self.fused_rope, q, positions, inv), self._window_rows(kvn, positions, inv)

    def window_kv(self, x: torch.Tensor, positions: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
        """K = V rows: FP8(RoPE(kv_norm(wkv · x))). x [B,S,D], positions [B,S] -> [B,S,head_dim]."""
        return self._window_rows(self.kv_norm(self.wkv(x)), positions, inv)

    def _window_rows(self, kvn, positions, inv):
        if self.fused_rope:   # rotation and quantization in one launch
            return dispatch.rope_rows(True, kvn, positions, inv, "fp8", WINDOW_KV_BLOCK)
        rows = apply_rope(kvn, positions, inv)
        if self.fused_kv_quant:   # one launch for the ~20 ops of the quantize-dequantize below
            return dispatch.ops().act_quant_dequant(rows, None, 0.0, WINDOW_KV_BLOCK)
        return fake_quant_fp8(rows, WINDOW_KV_BLOCK)

    def _output(self, q, keys, allowed, positions, inv):
        return self._project(sink_attention(q, keys, allowed, self.attn_sink, self.head_dim ** -0.5), positions, inv)

    def _project(self, o, positions, inv):
        """Attention output o [B,S,h,d] -> [B,S,D]: inverse RoPE at the query positions, `wo_a`, `wo_b`."""
        if self.fused_wo_a:   # inverse RoPE + grouped projection in one kernel (the WO-A plugin)
            return self.wo_b(dispatch.wo_a_inverse_rope(o, positions, inv, self.wo_a.weight))
        o = apply_rope(o, positions, inv, inverse=True)  # V carried RoPE: undo the query's rotation
        return self.wo_b(self.wo_a(o.flatten(-2).unflatten(-1, (self.g_local, -1))))

    # -- target model: the chunks of one forward -----------------------------------------------------------------
    def forward(self, x: torch.Tensor, ctxs: list, rag: Ragged, batch: "DecodeBatch | None" = None) -> torch.Tensor:
        """x [1,T,D] (after attn_norm; `rag` lays the chunks out) -> [1,T,D]: `prepare`, `core`, `finish`."""
        pos = rag.positions
        return self.finish(self.core(self.prepare(x, pos), ctxs, rag, batch), pos)

    def prepare(self, x: torch.Tensor, pos: torch.Tensor) -> tuple:
        """The per-token part before the caches, run once over all T rows of x [1,T,D] at positions [1,T]:
        (q [1,T,h,d] roped, window rows kv [1,T,d], the compressor's projections (kv, gate or None) on a KV source
        else None, the index queries (q, w) on an index source else None). Reads nothing but x, the positions and
        the weights, so a decode step's copy of it can be replayed as a CUDA graph (v41.py, `_piece`)."""
        inv = layer_inv_freq(self.args, self.layer, x.device)
        q_res, q, kv = self._query_kv(x, pos, inv)
        comp = self.compressor.project(x) if self.compressor is not None else None
        iq = self.indexer.queries(x, q_res, pos, inv) if self.indexer is not None else None
        return q, kv, comp, iq

    def finish(self, o: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The per-token part after the caches: attention output o [1,T,h,d] -> [1,T,D] (`_project`)."""
        return self._project(o, pos, layer_inv_freq(self.args, self.layer, o.device))

    def core(self, prepared: tuple, ctxs: list, rag: Ragged, batch: "DecodeBatch | None" = None) -> torch.Tensor:
        """What reads and writes the requests' caches, from `prepare`'s outputs -> attention output o [1,T,h,d].
        ctxs[i] (`ChunkContext` in v41.py) carries chunk i's positions, request state and per-forward selections.
        The compressor's pooling (it appends to each request's cache) runs chunk by chunk, the indexer's TP
        all-reduce once for all chunks; the window, index scores, top-k and attention run once for `batch` (the
        forward's single-token chunks, see `DecodeBatch`) and chunk by chunk for the others."""
        q, kv, (kv_p, gate_p), iq = (*prepared[:2], prepared[2] or (None, None), prepared[3])
        inv = layer_inv_freq(self.args, self.layer, q.device)
        none = [None] * len(ctxs)
        comp = none if kv_p is None else list(zip(rag.split(kv_p), none if gate_p is None else rag.split(gate_p)))
        iq = none if iq is None else list(zip(*map(rag.split, iq)))
        kvs, qs = rag.split(kv), rag.split(q)
        alone = [i for i in range(len(ctxs)) if batch is None or i not in batch.index]
        in_slots = batch is not None and batch.slots is not None
        if self.ratio and comp[0] is not None:   # a KV source: append the groups each chunk completes
            for i in alone:
                self._compress(comp[i], ctxs[i].state.sources[self.kv_source], inv, kvs[i].shape[0], self.act_dtype)
            if batch is not None and not in_slots:
                self._compress_batch(batch, [comp[i] for i in batch.members], inv, self.act_dtype)
        windows, partials = {}, []
        for i in alone:
            windows[i] = self._window_keys(ctxs[i], kvs[i])
            if self.ratio and iq[i] is not None:
                partials.append(self.indexer.partial_scores(*iq[i], ctxs[i].state.sources[self.kv_source].index_k))
        if in_slots:
            members = batch.member_rows(prepared)
            part = self.slot_scores(members, batch.slot_ids, batch.positions, batch.slots)
            if part is not None:
                partials.append(part)
        elif batch is not None and self.ratio and iq[0] is not None:
            cached = batch.compressed(self.kv_source, self.layer == self.kv_source)
            q_b, w_b = (torch.cat([iq[i][k] for i in batch.members]) for k in (0, 1))
            partials.append(self.indexer.partial_scores(q_b, w_b, cached.index_k))
        scores = iter(all_reduce_each(self.indexer.comm, partials) if partials else ())
        out = [None] * len(ctxs)
        for i in alone:
            ctx, (keys, allowed) = ctxs[i], windows[i]
            if self.ratio:
                cache = ctx.state.sources[self.kv_source]
                if self.indexer is not None:
                    ctx.selections[self.layer] = self._select(next(scores), ctx.positions, ctx.selections)
                sel = ctx.selections[self.index_source]
                keys = torch.cat([keys, cache.kv.to(keys.dtype)], 1)
                allowed = torch.cat([allowed, indices_to_mask(sel, cache.count)], -1)
            out[i] = sink_attention(qs[i], keys, allowed, self.attn_sink, self.head_dim ** -0.5)
        if in_slots:
            o = self.slot_attend(members, batch.slot_ids, batch.positions, batch.slots, next(scores, None),
                                 batch.selections)
        elif batch is not None:
            o = self._attend_batch(batch, torch.cat([qs[i] for i in batch.members]),
                                   torch.cat([kvs[i] for i in batch.members]), next(scores, None))
        if batch is not None:
            for k, i in enumerate(batch.members):
                out[i] = o[k:k + 1]
        return rag.join(out)

    # -- decode steps in fixed slots (decode_slots.py): fixed shapes, no host sync, so a CUDA graph captures them --
    def core_slots(self, members: tuple, slot_ids: torch.Tensor, pos: torch.Tensor, slots,
                   selections: dict) -> torch.Tensor:
        """`core` for N single-token requests whose caches sit in `slots`: `prepare`'s outputs as [N, 1, ...]
        (`members`), their slots [N] and positions [N, 1] -> o [N, 1, h, d]; the index source's top-k goes into
        `selections` for the layers after it."""
        part = self.slot_scores(members, slot_ids, pos, slots)
        scores = None if part is None else self.indexer.comm.all_reduce(part)
        return self.slot_attend(members, slot_ids, pos, slots, scores, selections)

    def slot_scores(self, members: tuple, slot_ids: torch.Tensor, pos: torch.Tensor, slots) -> torch.Tensor | None:
        """The part before the indexer's all-reduce: the window row written into each slot's ring, a KV source's
        new entry (a ratio-2 group's, computed every step from the open group; it becomes visible once the group
        completes, and is rewritten until then), and an index source's partial scores over every entry row
        [N, 1, E] (rows a query may not read are masked in `_select`)."""
        _, kv, comp, iq = members
        ring = slots.window[self.layer]
        ring[slot_ids, pos[:, 0] % self.window] = kv[:, 0].to(ring.dtype)
        if not self.ratio:
            return None
        src = slots.sources[self.kv_source]
        if comp is not None:
            self._compress_slots(comp, src, slot_ids, pos[:, 0])
        if self.indexer is None:
            return None
        q_i, w_i = iq
        if self.indexer.fused_scores:   # the visible entries only, read in place (the index plugin)
            return dispatch.ops().slot_index_scores(q_i[:, 0], w_i[:, 0], src.index_k, slot_ids, pos[:, 0],
                                                    self.ratio, self.indexer.head_dim ** -0.5).unsqueeze(1)
        return self.indexer.partial_scores(q_i, w_i, src.index_k[slot_ids])

    def slot_attend(self, members: tuple, slot_ids: torch.Tensor, pos: torch.Tensor, slots,
                    scores: torch.Tensor | None, selections: dict) -> torch.Tensor:
        """The part after the indexer's all-reduce: keys = the window ring in position order (oldest first, rows
        before position 0 masked) and, on compressing layers, the top-k entries of the slot -> o [N, 1, h, d]."""
        q = members[0]
        src = sel = None
        if self.ratio:
            src = slots.sources[self.kv_source]
            if self.indexer is not None:
                selections[self.layer] = self._select(scores, pos, selections)
            sel = selections[self.index_source]                                         # [N, 1, k], −1 = empty
        if self.fused_attention:   # the whole core in one kernel (the attention plugin)
            return dispatch.ops().slot_attention(q[:, 0], slots.window[self.layer], slot_ids, pos[:, 0],
                                                 None if src is None else src.kv, None if sel is None else sel[:, 0],
                                                 self.attn_sink, self.head_dim ** -0.5).unsqueeze(1)
        w = self.window
        kpos = pos - (w - 1) + torch.arange(w, device=pos.device)                      # [N, W]
        keys = slots.window[self.layer][slot_ids.unsqueeze(1), kpos % w].to(members[1].dtype)   # [N, W, d]
        allowed = (kpos >= 0).unsqueeze(1)                                              # [N, 1, W]
        if self.ratio:
            rows = torch.where(sel >= 0, sel, src.entries)[:, 0]                         # row E is zero
            keys = torch.cat([keys, src.kv[slot_ids.unsqueeze(1), rows].to(keys.dtype)], 1)
            allowed = torch.cat([allowed, sel >= 0], -1)
        return sink_attention(q, keys, allowed, self.attn_sink, self.head_dim ** -0.5)

    def _compress_slots(self, comp: tuple, src, slot_ids: torch.Tensor, pos: torch.Tensor) -> None:
        """`_compress_batch` in slots: pos [N]; the entry of the group holding pos is (re)computed and written."""
        kv_p, gate_p = comp                                                             # [N, 1, d] each
        r = self.ratio
        if gate_p is None:   # ratio 1: every token is its own entry (already normed by `project`)
            latent = kv_p
        else:
            src.buf_kv[slot_ids, pos % r] = kv_p[:, 0]
            src.buf_gate[slot_ids, pos % r] = gate_p[:, 0]
            latent = self.compressor.norm(pool_groups(src.buf_kv[slot_ids], src.buf_gate[slot_ids], r)
                                          .to(self.act_dtype))                          # [N, 1, d]
        entry = pos // r
        epos = (entry * r).unsqueeze(1)                                                 # [N, 1]
        inv = layer_inv_freq(self.args, self.layer, latent.device)
        src.index_k[slot_ids, entry] = self.indexer.keys(latent, epos, inv)[:, 0].to(src.index_k.dtype)
        rot = dispatch.rope_rows(self.fused_rope, latent, epos, inv, "fp4_e4m3", COMPRESSED_KV_BLOCK)
        src.kv[slot_ids, entry] = rot[:, 0].to(src.kv.dtype)

    def _attend_batch(self, batch: "DecodeBatch", q: torch.Tensor, kv: torch.Tensor,
                      scores: torch.Tensor | None) -> torch.Tensor:
        """The single-token chunks at once: q [N,1,h,d], kv [N,1,d] (their new window rows), scores [N,1,T_max]
        (index sources) -> [N,1,h,d]. Keys: each request's window rows (right-aligned, shorter ones padded) and, on
        compressing layers, the top-k compressed entries gathered from the batch's concatenated caches."""
        keys, allowed = self._batch_window_keys(batch, kv)
        if self.ratio:
            cached = batch.compressed(self.kv_source, False)
            if self.indexer is not None:
                batch.selections[self.layer] = self._select(scores, batch.positions, batch.selections)
            sel = batch.selections[self.index_source]                                   # [N,1,k], −1 = empty
            rows = torch.where(sel >= 0, sel + cached.offsets.view(-1, 1, 1), cached.kv.shape[0] - 1)
            keys = torch.cat([keys, cached.kv[rows[:, 0]].to(keys.dtype)], 1)            # [N, w+1+k, d]
            allowed = torch.cat([allowed, sel >= 0], -1)
        return sink_attention(q, keys, allowed, self.attn_sink, self.head_dim ** -0.5)

    def _batch_window_keys(self, batch: "DecodeBatch", kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Window keys [N, w+1, d] (the kept rows right-aligned, then the new row) and their mask [N,1,w+1]; each
        request keeps its last window − 1 rows for the next step."""
        olds = [ctx.state.window[self.layer] for ctx in batch.ctxs]
        lens = [o.shape[1] for o in olds]
        w = max(lens)
        old = torch.cat([o if n == w else F.pad(o, (0, 0, w - n, 0)) for o, n in zip(olds, lens)])
        keys = torch.cat([old.to(kv.dtype), kv], 1)
        keep = self.window - 1
        for k, (ctx, n) in enumerate(zip(batch.ctxs, lens)):
            ctx.state.window[self.layer] = keys[k:k + 1, w + 1 - min(n + 1, keep):]
        allowed = torch.arange(w + 1, device=kv.device) >= (w - batch.ints(lens)).unsqueeze(-1)
        return keys, allowed.unsqueeze(1)

    def _window_keys(self, ctx, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A chunk's window keys (the kept rows, then its own kv [B,S,d]) and their causal window mask [B,S,·];
        keeps the last window − 1 rows for the next chunk."""
        b, s, _ = kv.shape
        p0, qpos = ctx.start, ctx.positions[0]
        old = ctx.state.window[self.layer]
        keys = torch.cat([old.to(kv.dtype), kv], 1)
        kpos = torch.arange(p0 - old.shape[1], p0 + s, device=kv.device)
        allowed = ((kpos <= qpos[:, None]) & (kpos > qpos[:, None] - self.window)).expand(b, s, -1)
        ctx.state.window[self.layer] = keys[:, keys.shape[1] - min(keys.shape[1], self.window - 1):]
        return keys, allowed

    def _compress(self, proj, cache: SourceCache, inv: torch.Tensor, batch: int, dtype: torch.dtype) -> None:
        first = cache.count
        latent = self.compressor.pool(proj, cache, dtype)                            # pre-RoPE
        if latent.shape[1] == 0:
            return
        epos = ((first + torch.arange(latent.shape[1], device=latent.device)) * self.ratio).expand(batch, -1)
        # the indexer keys are derived from the latent before it is rotated into the main cache
        cache.index_k = torch.cat([cache.index_k, self.indexer.keys(latent, epos, inv).to(cache.index_k.dtype)], 1)
        rot = dispatch.rope_rows(self.fused_rope, latent, epos, inv, "fp4_e4m3", COMPRESSED_KV_BLOCK)
        cache.kv = torch.cat([cache.kv, rot.to(cache.kv.dtype)], 1)

    def _compress_batch(self, batch: "DecodeBatch", comps: list, inv: torch.Tensor, dtype: torch.dtype) -> None:
        """`_compress` for the batch's single tokens at once: the requests whose group this token completes are
        pooled, normed, keyed, rotated and quantized together; the others keep the token in their open group."""
        caches = [ctx.state.sources[self.kv_source] for ctx in batch.ctxs]
        r = self.ratio
        if comps[0][1] is None:   # ratio 1: every token is its own entry (already normed by `project`)
            done, latent = list(range(len(caches))), torch.cat([kv for kv, _ in comps])            # [N,1,d]
        else:
            done = [k for k, c in enumerate(caches) if c.buf_kv.shape[1] + 1 == r]
            opened = set(range(len(caches))) - set(done)
            for k in opened:
                caches[k].buf_kv = torch.cat([caches[k].buf_kv, comps[k][0]], 1)
                caches[k].buf_gate = torch.cat([caches[k].buf_gate, comps[k][1]], 1)
            if not done:
                return
            kv = torch.cat([torch.cat([caches[k].buf_kv, comps[k][0]], 1) for k in done])          # [Nc, r, d]
            gate = torch.cat([torch.cat([caches[k].buf_gate, comps[k][1]], 1) for k in done])
            for k in done:
                caches[k].buf_kv, caches[k].buf_gate = caches[k].buf_kv[:, :0], caches[k].buf_gate[:, :0]
            latent = self.compressor.norm(pool_groups(kv, gate, r).to(dtype))                      # [Nc,1,d]
        epos = batch.ints([caches[k].count * r for k in done]).unsqueeze(1)                       # [Nc, 1]
        keys = self.indexer.keys(latent, epos, inv)
        rot = dispatch.rope_rows(self.fused_rope, latent, epos, inv, "fp4_e4m3", COMPRESSED_KV_BLOCK)
        for j, k in enumerate(done):
            c = caches[k]
            c.index_k = torch.cat([c.index_k, keys[j:j + 1].to(c.index_k.dtype)], 1)
            c.kv = torch.cat([c.kv, rot[j:j + 1].to(c.kv.dtype)], 1)

    def _select(self, scores: torch.Tensor, pos: torch.Tensor, selections: dict) -> torch.Tensor:
        """Top-k entries per query, −1 padded [B,S,index_topk], of the summed index scores [B,S,T] (entries past a
        query's visible count, padding included, never qualify); the candidate source also publishes its block
        mask."""
        a = self.args
        counts = visible_counts(pos, self.ratio)
        scores = scores.masked_fill(torch.arange(scores.shape[-1], device=scores.device) >= counts.unsqueeze(-1),
                                    float("-inf"))
        cand = a.candidate_source_layer_id
        if self.layer == cand:
            selections["candidates"] = select_candidate_blocks(scores, counts, a.candidate_topk_blocks,
                                                               a.candidate_block_size)
        elif 0 <= cand < self.layer and "candidates" in selections:
            scores = scores.masked_fill(~selections["candidates"], float("-inf"))
        return topk_indices(scores, a.index_topk)

    # -- DSpark draft stage: a block of K positions attending to the context ring and to each other -----------------
    def draft_forward(self, x: torch.Tensor, ring: torch.Tensor, ring_valid: torch.Tensor,
                      frames: torch.Tensor) -> torch.Tensor:
        """x [B,K,D] block hidden; ring [B,W,d] context rows; ring_valid [B,W]; frames [B,K] RoPE positions.

        Non-causal inside the block: every block position sees every other and the valid context rows."""
        b, k, _ = x.shape
        inv = layer_inv_freq(self.args, self.layer, x.device)
        _, q, kv = self._query_kv(x, frames, inv)
        keys = torch.cat([ring.to(x.dtype), kv], 1)
        allowed = torch.cat([ring_valid.unsqueeze(1).expand(b, k, -1),
                             torch.ones(b, k, k, dtype=torch.bool, device=x.device)], -1)
        return self._output(q, keys, allowed, frames, inv)
