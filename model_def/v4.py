"""DeepSeek-V4-Flash reference model in plain PyTorch, and its checkpoint name table.

Numerics (design.md §3): `hf` is transformers 5.23 `DeepseekV4ForCausalLM` (weights dequantized, no activation or KV
quantization); `deploy` adds the official reference's QAT points (architecture.md §2.13): FP8 1×128 activations
before FP8/FP4-weight linears (not `wo_a`, router, compressor, `weights_proj`), FP8 (block 64) on the nope channels of
window and compressed KV, and Hadamard + FP4 (block 32) on indexer keys and queries.

One code path serves full forwards and incremental decoding: `logits` is a `step` on a fresh `V4State`. A step takes
any number of new tokens (a prefill chunk or one decode token); the state keeps per layer the window ring, the
compressor's pending rows of the unfinished group and the previous group's overlap rows, and the compressed caches.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsflash.model_def import dispatch, ragged
from dsflash.model_def.config import V4Args
from dsflash.model_def.decode_slots import SlotModel, V4DecodeSlots
from dsflash.model_def.layers import (ColumnParallelLinear, Comm, Expert, Linear, LocalComm, Numerics, RMSNorm,
                                      RowParallelLinear, apply_rope, hc_collapse, hc_expand, hc_mix, rms_norm,
                                      norm_pair, rope_table, sink_attention, sqrtsoftplus, stacked_or_each, tp_of,
                                      VocabParallelHead)
from dsflash.model_def.mapping import Mapping, split_range
from dsflash.model_def.names import TensorEntry
from dsflash.model_def.quant import fake_quant_fp4_pow2, fake_quant_fp8, hadamard
from dsflash.model_def.ragged import Chunk, DecodeRows, Ragged, all_reduce_each

KV_QUANT_BLOCK = 64      # FP8 scale block of window / compressed KV nope channels
INDEX_QUANT_BLOCK = 32   # FP4 scale block of indexer keys / queries
OVERLAP_RATIO = 4        # the ratio whose compressor overlaps windows and has an indexer


# -- name table ------------------------------------------------------------------------------------------------------
def _compressor_table(p: str, args: V4Args, ratio: int, dim: int) -> list[TensorEntry]:
    c = 2 if ratio == OVERLAP_RATIO else 1
    D = args.hidden_size
    return [TensorEntry(p + "wkv.weight", (c * dim, D), "bf16"),
            TensorEntry(p + "wgate.weight", (c * dim, D), "bf16"),
            TensorEntry(p + "ape", (ratio, c * dim), "f32", "ape"),
            TensorEntry(p + "norm.weight", (dim,), "bf16", "norm")]


def _block_table(p: str, args: V4Args, layer: int) -> list[TensorEntry]:
    D, H, d, n = args.hidden_size, args.num_attention_heads, args.head_dim, args.hc_mult
    q, g, ol, r = args.q_lora_rank, args.o_groups, args.o_lora_rank, args.ratio(layer)
    E, I = args.n_routed_experts, args.moe_intermediate_size

    def e(name, shape, role, init="linear", shard=None):
        return TensorEntry(p + name, tuple(shape), role, init, shard)

    t = [e("attn_norm.weight", (D,), "bf16", "norm"), e("ffn_norm.weight", (D,), "bf16", "norm")]
    for site in ("attn", "ffn"):
        t += [e(f"hc_{site}_fn", ((2 + n) * n, n * D), "f32", "hc_fn"),
              e(f"hc_{site}_base", ((2 + n) * n,), "f32", "hc_base"),
              e(f"hc_{site}_scale", (3,), "f32", "hc_scale")]
    t += [e("attn.wq_a.weight", (q, D), "fp8_block"),
          e("attn.q_norm.weight", (q,), "bf16", "norm"),
          e("attn.wq_b.weight", (H * d, q), "fp8_block", shard="col"),
          e("attn.wkv.weight", (d, D), "fp8_block"),
          e("attn.kv_norm.weight", (d,), "bf16", "norm"),
          e("attn.wo_a.weight", (g * ol, H * d // g), "fp8_block", shard="col"),  # FP8 on disk, run unquantized
          e("attn.wo_b.weight", (D, g * ol), "fp8_block", shard="row"),
          e("attn.attn_sink", (H,), "f32", "sink", "head")]
    if r:
        t += _compressor_table(p + "attn.compressor.", args, r, d)
    if r == OVERLAP_RATIO:
        ih, hd = args.index_n_heads, args.index_head_dim
        t += [e("attn.indexer.wq_b.weight", (ih * hd, q), "fp8_block", shard="col"),
              e("attn.indexer.weights_proj.weight", (ih, D), "bf16", shard="col")]
        t += _compressor_table(p + "attn.indexer.compressor.", args, r, hd)
    t.append(e("ffn.gate.weight", (E, D), "bf16"))
    if layer < args.num_hash_layers:
        t.append(e("ffn.gate.tid2eid", (args.vocab_size, args.num_experts_per_tok), "i64", "tid2eid"))
    else:
        t.append(e("ffn.gate.bias", (E,), "f32", "bias"))
    for x in range(E):
        t += [e(f"ffn.experts.{x}.w1.weight", (I, D), "mxfp4", shard="expert"),
              e(f"ffn.experts.{x}.w2.weight", (D, I), "mxfp4", shard="expert"),
              e(f"ffn.experts.{x}.w3.weight", (I, D), "mxfp4", shard="expert")]
    t += [e("ffn.shared_experts.w1.weight", (I, D), "fp8_block"),
          e("ffn.shared_experts.w2.weight", (D, I), "fp8_block"),
          e("ffn.shared_experts.w3.weight", (I, D), "fp8_block")]
    return t


def _head_table(p: str, args: V4Args) -> list[TensorEntry]:
    D, n = args.hidden_size, args.hc_mult
    return [TensorEntry(p + "hc_head_fn", (n, n * D), "f32", "hc_fn"),
            TensorEntry(p + "hc_head_base", (n,), "f32", "hc_base"),
            TensorEntry(p + "hc_head_scale", (1,), "f32", "hc_scale")]


def tensor_table(args: V4Args) -> list[TensorEntry]:
    """Every tensor of the V4-Flash HF checkpoint (architecture.md §3.1), MTP copies of embed/head excluded."""
    D, V = args.hidden_size, args.vocab_size
    t = [TensorEntry("embed.weight", (V, D), "bf16", "embed")]
    for i in range(args.n_layers):
        t += _block_table(f"layers.{i}.", args, i)
    t += [TensorEntry("norm.weight", (D,), "bf16", "norm"), TensorEntry("head.weight", (V, D), "bf16", shard="col")]
    t += _head_table("", args)
    for j in range(args.n_draft):
        p = f"mtp.{j}."
        t += _block_table(p, args, args.n_layers + j)
        t += [TensorEntry(p + "e_proj.weight", (D, D), "fp8_block"),
              TensorEntry(p + "h_proj.weight", (D, D), "fp8_block"),
              TensorEntry(p + "enorm.weight", (D,), "bf16", "norm"),
              TensorEntry(p + "hnorm.weight", (D,), "bf16", "norm"),
              TensorEntry(p + "norm.weight", (D,), "bf16", "norm")]
        t += _head_table(p, args)
    return t


# -- numerics helpers ------------------------------------------------------------------------------------------------
def _acc(x: torch.Tensor) -> torch.Tensor:
    """x in its accumulation dtype: fp32, or fp64 for a float64 model."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _bf16(x: torch.Tensor) -> torch.Tensor:
    """Round to BF16 and back: the reference's activations are BF16 wherever it quantizes."""
    return x.to(torch.bfloat16).to(x.dtype)


def _fq_fp8(x: torch.Tensor, block: int) -> torch.Tensor:
    """FP8 fake-quant with `block`-wide pow2 scales along the last dim; a ragged tail forms its own (short) block.

    Zero padding leaves every block's amax unchanged, so this equals per-block quantization of the ragged layout
    (the tiny presets have nope = 96 channels and 64/96-wide linear inputs against blocks of 64/128)."""
    pad = -x.shape[-1] % block
    if not pad:
        return fake_quant_fp8(x, block)
    return fake_quant_fp8(F.pad(x, (0, pad)), block)[..., :x.shape[-1]]


class _RaggedNumerics(Numerics):
    """`Numerics` whose deploy act quant accepts widths that are not a multiple of the block (tiny presets)."""

    def act_in(self, x: torch.Tensor, quantized: bool) -> torch.Tensor:
        if not (self.deploy and quantized):
            return x
        return _fq_fp8(_bf16(x), self.act_block)


def _index_quant(x: torch.Tensor) -> torch.Tensor:
    """Indexer key/query QAT: Hadamard rotation of the whole head, then FP4 e2m1 with e8m0 scales per 32."""
    return fake_quant_fp4_pow2(_bf16(hadamard(_bf16(x))), INDEX_QUANT_BLOCK)


# -- decoding state --------------------------------------------------------------------------------------------------
class V4State:
    """Per-request state of a batch that advances in lockstep: `pos` tokens seen and one dict of tensors per main
    layer; the same per MTP block (`mtp_pos[j]`, `mtp[j]`). Tensors are replaced, never written in place, so a
    snapshot is a shallow copy of the dicts."""

    def __init__(self, layers: list[dict], mtp: list[dict]):
        self.pos, self.mtp_pos = 0, [0] * len(mtp)
        self._layers, self.mtp = layers, mtp
        self.batch = layers[0]["win"].shape[0] if layers else 1
        self.slots, self.slot = None, None   # decode_slots.V4DecodeSlots holding the main layers' caches, its slot

    # The main layers' caches as per-request tensors, for every path but a slot decode step: a state whose caches
    # sit in a decode slot (model_def/decode_slots.py) gets them back first, and gives the slot up.
    @property
    def layers(self) -> list[dict]:
        self._to_lists()
        return self._layers

    @layers.setter
    def layers(self, value: list[dict]) -> None:
        self._to_lists()
        self._layers = value

    def _to_lists(self) -> None:
        if self.slot is not None:
            self.slots.unpack(self)

    def forget_caches(self) -> None:
        """Drop the per-request caches: a decode slot holds them (`V4DecodeSlots`)."""
        self._layers = None

    def snapshot(self):
        return self.pos, list(self.mtp_pos), [dict(d) for d in self.layers], [dict(d) for d in self.mtp]

    def restore(self, snap) -> None:
        self._to_lists()   # (before `pos` changes: a slot's caches are read back at the current position)
        self.pos, self.mtp_pos = snap[0], list(snap[1])
        self.layers, self.mtp = [dict(d) for d in snap[2]], [dict(d) for d in snap[3]]


# -- modules ---------------------------------------------------------------------------------------------------------
class Compressor(nn.Module):
    """Gated pooling of every `ratio` tokens into one `dim`-wide entry (architecture.md §2.5).

    Ratio 4 overlaps: each token projects to 2·dim channels, the first half joins the *next* group's pool, so entry t
    pools 8 rows (group t−1's first half, group t's second half) with a per-channel softmax over the rows. Entries are
    normalized, rotated at position t·ratio and (deploy) quantized: FP8 nope for attention KV, Hadamard + FP4 for
    indexer keys."""

    def __init__(self, args: V4Args, ratio: int, dim: int, numerics: Numerics, kind: str,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.ratio, self.dim, self.kind, self.numerics = ratio, dim, kind, numerics
        self.overlap = ratio == OVERLAP_RATIO
        c = 2 if self.overlap else 1
        self.nope = dim - args.rope_dim
        # BF16 on disk, computed in fp32 without act quant (as the reference upcasts them)
        self.wkv = Linear(args.hidden_size, c * dim, numerics, dtype=dtype)
        self.wgate = Linear(args.hidden_size, c * dim, numerics, dtype=dtype)
        self.ape = nn.Parameter(torch.zeros(ratio, c * dim))
        self.norm = RMSNorm(dim, args.rms_norm_eps)

    def init_state(self, st: dict, key: str, B: int, dtype: torch.dtype, device: torch.device) -> None:
        r, w = self.ratio, self.wkv.out_features
        acc = dict(dtype=torch.promote_types(dtype, torch.float32), device=device)
        st[key + ".pend_kv"] = torch.zeros(B, r, w, **acc)  # rows of the unfinished group
        st[key + ".pend_sc"] = torch.full((B, r, w), float("-inf"), **acc)
        if self.overlap:  # first halves of the last complete group (zero / -inf before the first)
            st[key + ".prev_kv"] = torch.zeros(B, r, self.dim, **acc)
            st[key + ".prev_sc"] = torch.full((B, r, self.dim), float("-inf"), **acc)
        st[key + ".cache"] = torch.zeros(B, 0, self.dim, dtype=dtype, device=device)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-token part: kv and gate projections [.., c·dim] in the accumulation dtype."""
        return _acc(self.wkv(x)), _acc(self.wgate(x))

    def pool(self, proj: tuple[torch.Tensor, torch.Tensor], pos0: int, st: dict, key: str,
             inv_freq: torch.Tensor) -> torch.Tensor:
        """Feed one request batch's projections [B,S,·] of tokens pos0..; returns the whole compressed cache
        [B,T,dim], T = (pos0+S)//ratio."""
        kv, sc = proj
        B, S, _ = kv.shape
        r, d = self.ratio, self.dim
        pos = pos0 + torch.arange(S, device=kv.device)
        sc = sc + self.ape[pos % r]
        n_pend = pos0 % r  # rows of the unfinished group already seen
        kv = torch.cat([st[key + ".pend_kv"][:, :n_pend], kv], 1)
        sc = torch.cat([st[key + ".pend_sc"][:, :n_pend], sc], 1)
        G = kv.shape[1] // r
        cut, rem = G * r, kv.shape[1] - G * r
        st[key + ".pend_kv"] = torch.cat([kv[:, cut:], st[key + ".pend_kv"][:, rem:]], 1)
        st[key + ".pend_sc"] = torch.cat([sc[:, cut:], st[key + ".pend_sc"][:, rem:]], 1)
        if G == 0:
            return st[key + ".cache"]
        kv, sc = kv[:, :cut].unflatten(1, (G, r)), sc[:, :cut].unflatten(1, (G, r))  # [B,G,r,c*d]
        if self.overlap:
            prev_kv = torch.cat([st[key + ".prev_kv"].unsqueeze(1), kv[:, :-1, :, :d]], 1)
            prev_sc = torch.cat([st[key + ".prev_sc"].unsqueeze(1), sc[:, :-1, :, :d]], 1)
            st[key + ".prev_kv"], st[key + ".prev_sc"] = kv[:, -1, :, :d], sc[:, -1, :, :d]
            kv = torch.cat([prev_kv, kv[..., d:]], 2)  # [B,G,2r,d]
            sc = torch.cat([prev_sc, sc[..., d:]], 2)
        t = pos0 // r + torch.arange(G, device=kv.device)
        e = self._entries(kv, sc, (t * r).expand(B, G), inv_freq)  # [B,G,d]
        st[key + ".cache"] = torch.cat([st[key + ".cache"], e.to(st[key + ".cache"].dtype)], 1)
        return st[key + ".cache"]

    def pool_decode(self, proj: tuple[torch.Tensor, torch.Tensor], rows: DecodeRows, sts: list[dict], key: str,
                    inv_freq: torch.Tensor) -> list[torch.Tensor]:
        """`pool` for the forward's decode rows (one token each): proj [N,1,·]; -> each request's whole compressed
        cache [1,T_i,dim]. The requests whose group the token completes pool theirs together."""
        kv, sc = proj
        r, d, starts = self.ratio, self.dim, rows.starts
        pos = rows.positions[:, 0]
        slot = pos % r                                   # the token's row in its group
        sc = sc + self.ape[slot].unsqueeze(1)
        n = torch.arange(len(starts), device=kv.device)
        # pending rows with the token written at its slot: an open group's new pending rows, a completed one's group
        pend_kv = torch.cat([st[key + ".pend_kv"] for st in sts]).index_put((n, slot), kv[:, 0])   # [N,r,c*d]
        pend_sc = torch.cat([st[key + ".pend_sc"] for st in sts]).index_put((n, slot), sc[:, 0])
        done = [k for k, p in enumerate(starts) if p % r == r - 1]   # the rows whose token completes a group
        done_rows = rows.ints(done)
        for k, st in enumerate(sts):
            if starts[k] % r != r - 1:
                st[key + ".pend_kv"], st[key + ".pend_sc"] = pend_kv[k:k + 1], pend_sc[k:k + 1]
        if done:
            kv, sc = pend_kv[done_rows].unsqueeze(1), pend_sc[done_rows].unsqueeze(1)  # [Nd,1,r,c*d]
            if self.overlap:
                prev_kv = torch.stack([sts[k][key + ".prev_kv"][0] for k in done]).unsqueeze(1)   # [Nd,1,r,d]
                prev_sc = torch.stack([sts[k][key + ".prev_sc"][0] for k in done]).unsqueeze(1)
                for j, k in enumerate(done):
                    sts[k][key + ".prev_kv"], sts[k][key + ".prev_sc"] = kv[j:j + 1, -1, :, :d], sc[j:j + 1, -1, :, :d]
                kv = torch.cat([prev_kv, kv[..., d:]], 2)                               # [Nd,1,2r,d]
                sc = torch.cat([prev_sc, sc[..., d:]], 2)
            e = self._entries(kv, sc, pos[done_rows].unsqueeze(1) // r * r, inv_freq)            # [Nd,1,d]
            for j, k in enumerate(done):
                cache = sts[k][key + ".cache"]
                sts[k][key + ".cache"] = torch.cat([cache, e[j:j + 1].to(cache.dtype)], 1)
        return [st[key + ".cache"] for st in sts]


    def _entries(self, kv: torch.Tensor, sc: torch.Tensor, epos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
        """Complete groups' rows kv, sc [B,G,rows,d] -> their entries [B,G,d] at positions epos [B,G]: the per-channel
        softmax-gated sum, norm, RoPE and (deploy) quantization."""
        e = rms_norm((kv * sc.softmax(2)).sum(2), self.norm.eps, self.norm.weight)
        e = apply_rope(e, epos, inv_freq)
        if self.numerics.deploy:
            if self.kind == "index":
                return _index_quant(e)
            return torch.cat([_fq_fp8(_bf16(e[..., :self.nope]), KV_QUANT_BLOCK), e[..., self.nope:]], -1)
        return e

    def pool_slots(self, proj: tuple[torch.Tensor, torch.Tensor], st: dict, key: str, slot_ids: torch.Tensor,
                   pos: torch.Tensor, inv_freq: torch.Tensor) -> None:
        """`pool_decode` in decode slots (`st`: the layer's slot tensors; pos [N]): the token's row written into its
        open group, the group's entry computed from it and written at row pos // ratio of the cache (visible once
        the group completes, rewritten until then), and, when the token completes the group, its first halves kept
        as the next entry's previous rows (overlap)."""
        kv, sc = proj                                                                     # [N,1,c*d]
        r, d = self.ratio, self.dim
        row = pos % r
        pend_kv, pend_sc = st[key + ".pend_kv"], st[key + ".pend_sc"]
        pend_kv[slot_ids, row] = kv[:, 0]
        pend_sc[slot_ids, row] = (sc + self.ape[row].unsqueeze(1))[:, 0]
        kv, sc = pend_kv[slot_ids].unsqueeze(1), pend_sc[slot_ids].unsqueeze(1)              # [N,1,r,c*d]
        if self.overlap:
            prev_kv, prev_sc = st[key + ".prev_kv"], st[key + ".prev_sc"]
            old_kv, old_sc = prev_kv[slot_ids].unsqueeze(1), prev_sc[slot_ids].unsqueeze(1)   # [N,1,r,d]
            done = (row == r - 1).view(-1, 1, 1)
            prev_kv[slot_ids] = torch.where(done, kv[:, 0, :, :d], old_kv[:, 0])
            prev_sc[slot_ids] = torch.where(done, sc[:, 0, :, :d], old_sc[:, 0])
            kv = torch.cat([old_kv, kv[..., d:]], 2)                                      # [N,1,2r,d]
            sc = torch.cat([old_sc, sc[..., d:]], 2)
        e = self._entries(kv, sc, (pos // r * r).unsqueeze(1), inv_freq)                  # [N,1,d]
        cache = st[key + ".cache"]
        cache[slot_ids, pos // r] = e[:, 0].to(cache.dtype)


class Indexer(nn.Module):
    """Lightning indexer (§2.6): per query, the top-`index_topk` visible ratio-4 entries by Σ_h w_h·ReLU(q_h·k_t)."""

    def __init__(self, args: V4Args, numerics: Numerics, mapping: Mapping | None, comm: Comm, dtype: torch.dtype):
        super().__init__()
        tp, _ = tp_of(mapping)
        self.n_heads_total, self.head_dim, self.topk = args.index_n_heads, args.index_head_dim, args.index_topk
        self.n_heads = self.n_heads_total // tp
        self.numerics, self.comm = numerics, comm
        self.wq_b = ColumnParallelLinear(args.q_lora_rank, self.n_heads_total * self.head_dim, numerics, mapping,
                                         "fp8", dtype=dtype)
        self.weights_proj = ColumnParallelLinear(args.hidden_size, self.n_heads_total, numerics, mapping, dtype=dtype)
        self.compressor = Compressor(args, OVERLAP_RATIO, self.head_dim, numerics, "index", dtype)

    def queries(self, x: torch.Tensor, qr: torch.Tensor, pos: torch.Tensor,
                inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-token part: this rank's index queries [B,S,h,hd] (RoPE'd at pos [B,S], deploy: Hadamard + FP4)
        and head weights [B,S,h] = weights_proj(x) / sqrt(n_heads)."""
        q = apply_rope(self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim)), pos, inv_freq)
        if self.numerics.deploy:
            q = _index_quant(q)
        return q, _acc(self.weights_proj(x)) * self.n_heads_total ** -0.5

    def partial_scores(self, q: torch.Tensor, w: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Σ_h w_h·ReLU(q_h·k_t)/sqrt(hd) over this rank's heads -> [B,S,T]; the caller sums it over the TP ranks."""
        score = torch.einsum("bshd,btd->bsht", _acc(q), _acc(k)).relu() * self.head_dim ** -0.5
        return (score * w.unsqueeze(-1)).sum(2)

    def select(self, score: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Summed scores [B,S,T] of a chunk at positions pos [S] -> selected [B,S,T] bool over the compressed
        entries."""
        B, S, T = score.shape
        visible = (torch.arange(T, device=score.device) < ((pos + 1) // OVERLAP_RATIO).unsqueeze(-1)).expand(B, S, T)
        score = score.masked_fill(~visible, float("-inf"))
        # stable descending sort: ties (e.g. all heads ReLU'd to 0) go to the lower index, whatever T is, so a
        # chunked prefill picks what a full forward picks; picks past the visible range are dropped (the −1 slots)
        top = score.argsort(dim=-1, descending=True, stable=True)[..., :min(self.topk, T)]
        return torch.zeros_like(visible).scatter(-1, top, visible.gather(-1, top))


def _padded(caches: list[torch.Tensor]) -> torch.Tensor:
    """Caches [1,T_i,d] -> [N,T_max,d], zero rows after each one's end."""
    return torch.nn.utils.rnn.pad_sequence([c[0] for c in caches], batch_first=True)


class Attention(nn.Module):
    """Shared-latent MQA (K = V) over the sliding window plus compressed entries, with sink and grouped output (§2.4).

    RoPE on the last rope_dim channels (plain theta on ratio-0 layers; compress theta + YaRN, no mscale, otherwise);
    the output is inverse-rotated at the query position before `wo_a` (block-diagonal per group, unquantized)."""

    def __init__(self, args: V4Args, layer: int, numerics: Numerics, mapping: Mapping | None, comm: Comm,
                 dtype: torch.dtype):
        super().__init__()
        tp, _ = tp_of(mapping)
        D, H, d, q = args.hidden_size, args.num_attention_heads, args.head_dim, args.q_lora_rank
        g, ol = args.o_groups, args.o_lora_rank
        self.ratio, self.window, self.head_dim, self.eps = args.ratio(layer), args.sliding_window, d, args.rms_norm_eps
        self.layer = layer
        self.n_heads, self.n_groups, self.o_lora_rank = H // tp, g // tp, ol
        self.nope, self.numerics = d - args.rope_dim, numerics
        self.wq_a = Linear(D, q, numerics, "fp8", dtype=dtype)
        self.q_norm = RMSNorm(q, self.eps)
        self.wq_b = ColumnParallelLinear(q, H * d, numerics, mapping, "fp8", dtype=dtype)
        self.wkv = Linear(D, d, numerics, "fp8", dtype=dtype)
        self.kv_norm = RMSNorm(d, self.eps)
        # FP8 on disk; used only through .weight in an einsum (no act quant), as the reference's BF16 einsum
        self.wo_a = ColumnParallelLinear(H * d // g, g * ol, numerics, mapping, "fp8", dtype=dtype)
        self.wo_b = RowParallelLinear(g * ol, D, numerics, mapping, comm, "fp8", dtype=dtype)
        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads))
        self.fused_wo_a = False   # set by an engine loader: `_project` runs the WO-A plugin
        self.wqkv_a_plugin: nn.Module | None = None   # dispatch.FP8Linear over [wq_a; wkv], attached likewise
        self.qkv_norm_plugin: nn.Module | None = None   # dispatch.FusedRMSNormPair (q_norm, kv_norm), likewise
        self.compressor = Compressor(args, self.ratio, d, numerics, "kv", dtype) if self.ratio else None
        self.indexer = Indexer(args, numerics, mapping, comm, dtype) if self.ratio == OVERLAP_RATIO else None
        self.rope = (args.rope_dim, args.compress_rope_theta, args.yarn) if self.ratio else \
            (args.rope_dim, args.rope_theta, None)

    def init_state(self, st: dict, B: int, dtype: torch.dtype, device: torch.device) -> None:
        st["win"] = torch.zeros(B, self.window, self.head_dim, dtype=dtype, device=device)  # slot = pos % window
        if self.compressor is not None:
            self.compressor.init_state(st, "kv", B, dtype, device)
        if self.indexer is not None:
            self.indexer.compressor.init_state(st, "idx", B, dtype, device)

    def forward(self, x: torch.Tensor, states: list[dict], rag: Ragged, decode: DecodeRows | None = None
                ) -> torch.Tensor:
        """x [1,T,D] (`rag` lays out the chunks and their start positions; states[i]: chunk i's layer state) ->
        [1,T,D]: `prepare`, `core`, `finish`."""
        pos = rag.positions
        return self.finish(self.core(self.prepare(x, pos), states, rag, decode), pos)

    def prepare(self, x: torch.Tensor, pos: torch.Tensor) -> tuple:
        """The per-token part before the caches, once over all T rows of x [1,T,D] at positions [1,T]: (q [1,T,h,d],
        window rows kv [1,T,d], the compressor's projections or None, the indexer's compressor projections and
        queries or None). Reads only x, the positions and the weights (a decode step replays it as a CUDA graph)."""
        f = rope_table(*self.rope, x.device)
        qa, kva = stacked_or_each(self.wqkv_a_plugin, x, (self.wq_a, self.wkv))   # both read x: one GEMM if bound
        qr, kvn = norm_pair(self.qkv_norm_plugin, (self.q_norm, self.kv_norm), (qa, kva))   # one launch if bound
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))  # [1,T,h,d]
        q = apply_rope(rms_norm(q, self.eps).to(q.dtype), pos, f)  # per-head RMS, no weight
        kv = apply_rope(kvn, pos, f)  # [1,T,d]
        if self.numerics.deploy:
            kv = torch.cat([_fq_fp8(_bf16(kv[..., :self.nope]), KV_QUANT_BLOCK), kv[..., self.nope:]], -1)
        comp = None if self.compressor is None else self.compressor.project(x)
        idx = None
        if self.indexer is not None:
            idx = (self.indexer.compressor.project(x), self.indexer.queries(x, qr, pos, f))
        return q, kv, comp, idx

    def finish(self, o: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The per-token part after the caches: attention output o [1,T,h,d] -> [1,T,D] (`_project`)."""
        return self._project(o, pos, rope_table(*self.rope, o.device))

    def core(self, prepared: tuple, states: list[dict], rag: Ragged, decode: DecodeRows | None = None
             ) -> torch.Tensor:
        """What reads and writes the requests' caches, from `prepare`'s outputs -> attention output o [1,T,h,d]: the
        pooling, the indexer's TP all-reduce (once for all chunks), top-k and attention chunk by chunk, except for
        the single-token chunks of `decode` (the decode steps), which attend as one batch (`_attend_batch`)."""
        q, kv, comp_p, idx_p = prepared
        x_device = q.device
        f, pos = rope_table(*self.rope, x_device), rag.positions                                  # pos [1,T]
        none = [None] * len(states)
        comp = none if comp_p is None else list(zip(*map(rag.split, comp_p)))
        idx = none
        if idx_p is not None:
            idx = list(zip(zip(*map(rag.split, idx_p[0])), zip(*map(rag.split, idx_p[1]))))
        alone = [i for i in range(len(states)) if decode is None or i not in decode.index]
        in_slots = decode is not None and decode.slots is not None
        qs, kvs, poss = rag.split(q), rag.split(kv), rag.split(pos)
        windows, entries, partials = {}, {}, []
        for i in alone:
            p0, st = rag.starts[i], states[i]
            windows[i] = self._window_keys(p0, poss[i][0], st, kvs[i])
            if comp[i] is not None:
                entries[i] = self.compressor.pool(comp[i], p0, st, "kv", f)  # [B,T,d]
            if idx[i] is not None:
                k = self.indexer.compressor.pool(idx[i][0], p0, st, "idx", f)
                partials.append(self.indexer.partial_scores(*idx[i][1], k))
        entries_b = None
        if in_slots:
            members = decode.member_rows(prepared)
            part = self.slot_scores(members, decode.slot_ids, decode.positions, decode.slots)
            if part is not None:
                partials.append(part)
        elif decode is not None:
            states_b = [states[i] for i in decode.members]
            if self.compressor is not None:
                entries_b = self.compressor.pool_decode(decode.stack(comp), decode, states_b, "kv", f)
            if self.indexer is not None:
                keys = self.indexer.compressor.pool_decode(decode.stack([c for c, _ in idx]), decode, states_b, "idx",
                                                           f)
                partials.append(self.indexer.partial_scores(*decode.stack([qw for _, qw in idx]), _padded(keys)))
        scores = iter(all_reduce_each(self.indexer.comm, partials) if partials else ())
        out = [None] * len(states)
        for i in alone:
            (keys, allowed), ckv, q_i = windows[i], entries.get(i), qs[i]
            if ckv is not None:
                B, S, T = *q_i.shape[:2], ckv.shape[1]
                if self.indexer is not None:
                    sel = self.indexer.select(next(scores), poss[i][0])
                else:  # HCA: every complete group
                    sel = (torch.arange(T, device=x_device) < ((poss[i][0] + 1) // self.ratio).unsqueeze(-1)
                           ).expand(B, S, T)
                keys = torch.cat([keys, ckv.to(keys.dtype)], 1)
                allowed = torch.cat([allowed, sel], -1)
            out[i] = sink_attention(q_i, keys, allowed, self.attn_sink, self.head_dim ** -0.5)
        if in_slots:
            o = self.slot_attend(members, decode.slot_ids, decode.positions, decode.slots, next(scores, None))
        elif decode is not None:
            o = self._attend_batch(decode, states_b, entries_b, torch.cat([qs[i] for i in decode.members]),
                                   torch.cat([kvs[i] for i in decode.members]), next(scores, None))
        if decode is not None:
            for k, i in enumerate(decode.members):
                out[i] = o[k:k + 1]
        return rag.join(out)

    # -- decode steps in fixed slots (decode_slots.py): fixed shapes, no host sync, so a CUDA graph captures them --
    def core_slots(self, members: tuple, slot_ids: torch.Tensor, pos: torch.Tensor, slots) -> torch.Tensor:
        """`core` for N single-token requests whose caches sit in `slots`: `prepare`'s outputs as [N, 1, ...]
        (`members`), their slots [N] and positions [N, 1] -> o [N, 1, h, d]."""
        part = self.slot_scores(members, slot_ids, pos, slots)
        scores = None if part is None else self.indexer.comm.all_reduce(part)
        return self.slot_attend(members, slot_ids, pos, slots, scores)

    def slot_scores(self, members: tuple, slot_ids: torch.Tensor, pos: torch.Tensor, slots) -> torch.Tensor | None:
        """The part before the indexer's all-reduce: both compressors' pooling into the slots and the indexer's
        partial scores over every entry row [N, 1, E] (`Indexer.select` masks the rows not yet visible)."""
        _, _, comp, idx = members
        st, f = slots.layers[self.layer], rope_table(*self.rope, slot_ids.device)
        if comp is not None:
            self.compressor.pool_slots(comp, st, "kv", slot_ids, pos[:, 0], f)
        if idx is None:
            return None
        self.indexer.compressor.pool_slots(idx[0], st, "idx", slot_ids, pos[:, 0], f)
        return self.indexer.partial_scores(*idx[1], st["idx.cache"][slot_ids])

    def slot_attend(self, members: tuple, slot_ids: torch.Tensor, pos: torch.Tensor, slots,
                    scores: torch.Tensor | None) -> torch.Tensor:
        """The part after the indexer's all-reduce (`_attend_batch` over the slots): keys = the window ring, the new
        row (then written into the ring) and every entry row of the compressed cache, masked -> o [N, 1, h, d]."""
        q, kv = members[:2]
        st = slots.layers[self.layer]
        rings = st["win"][slot_ids]                                                               # [N,W,d]
        ckv = None if self.compressor is None else st["kv.cache"][slot_ids]                       # [N,E,d]
        keys, allowed = self._decode_keys(pos, rings, kv, ckv, scores)
        st["win"][slot_ids, pos[:, 0] % self.window] = kv[:, 0].to(rings.dtype)
        return sink_attention(q, keys, allowed, self.attn_sink, self.head_dim ** -0.5)

    def _decode_keys(self, pos: torch.Tensor, rings: torch.Tensor, kv: torch.Tensor, ckv: torch.Tensor | None,
                     scores: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and mask of N decode rows at positions pos [N,1]: their window rings [N,W,d] and new rows kv [N,1,d],
        then (compressing layers) their compressed entries ckv [N,T,d] (rows past a query's visible count masked;
        the indexer's top-k of `scores` on ratio-4 layers) -> keys [N, W+1(+T), d], allowed [N, 1, W+1(+T)]."""
        W = self.window
        ring_pos = (pos - 1) - (pos - 1 - torch.arange(W, device=pos.device)) % W   # [N,W] (< 0: empty slot)
        kpos = torch.cat([ring_pos, pos], 1)                                                      # [N,W+1]
        allowed = ((kpos >= 0) & (kpos > pos - W)).unsqueeze(1)                                   # [N,1,W+1]
        keys = torch.cat([rings, kv.to(rings.dtype)], 1)
        if ckv is not None:
            if self.indexer is not None:
                sel = self.indexer.select(scores, pos)
            else:  # HCA: every complete group
                sel = (torch.arange(ckv.shape[1], device=pos.device) < ((pos + 1) // self.ratio)).unsqueeze(1)
            keys = torch.cat([keys, ckv.to(keys.dtype)], 1)
            allowed = torch.cat([allowed, sel], -1)
        return keys, allowed

    def _attend_batch(self, batch: DecodeRows, states: list[dict], entries: list[torch.Tensor] | None,
                      q: torch.Tensor, kv: torch.Tensor, scores: torch.Tensor | None) -> torch.Tensor:
        """The decode rows at once: q [N,1,h,d], kv [N,1,d] (their window rows), their layer states and compressed
        caches (`entries`, [1,T_i,d] each), scores [N,1,T_max] (the indexer's, summed over the ranks) -> [N,1,h,d].
        Keys: each request's window ring and new row, then its compressed entries, padded to the longest cache
        (padding is never visible)."""
        pos = batch.positions                                                                     # [N,1]
        rings = torch.cat([st["win"] for st in states])                                           # [N,W,d]
        keys, allowed = self._decode_keys(pos, rings, kv, None if entries is None else _padded(entries), scores)
        written = rings.index_put((torch.arange(len(states), device=pos.device), pos[:, 0] % self.window),
                                  kv[:, 0].to(rings.dtype))
        for k, st in enumerate(states):
            st["win"] = written[k:k + 1]
        return sink_attention(q, keys, allowed, self.attn_sink, self.head_dim ** -0.5)

    def _window_keys(self, pos0: int, pos: torch.Tensor, st: dict,
                     kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A chunk's window keys (the ring, positions < pos0 at slot pos % W, then its own kv [B,S,d] at positions
        pos [S]) and their mask [B,S,W+S]; writes the chunk's last rows into the ring."""
        B, S, _ = kv.shape
        W, dev = self.window, kv.device
        slot = torch.arange(W, device=dev)
        ring_pos = (pos0 - 1) - (pos0 - 1 - slot) % W  # latest position held by each slot (< 0: empty)
        kpos = torch.cat([ring_pos, pos])
        allowed = (kpos >= 0) & (kpos <= pos.unsqueeze(-1)) & (kpos > pos.unsqueeze(-1) - W)  # [S, W+S]
        keys = torch.cat([st["win"], kv.to(st["win"].dtype)], 1)
        n = min(S, W)
        ring = st["win"].clone()
        ring[:, pos[-n:] % W] = kv[:, -n:].to(ring.dtype)
        st["win"] = ring
        return keys, allowed.expand(B, S, -1)

    def _project(self, o, positions, inv):
        """Attention output o [B,S,h,d] -> [B,S,D]: inverse RoPE at the query positions, `wo_a`, `wo_b`."""
        if self.fused_wo_a:   # inverse RoPE + grouped projection in one kernel (the WO-A plugin)
            return self.wo_b(dispatch.wo_a_inverse_rope(o, positions, inv, self.wo_a.weight))
        o = apply_rope(o, positions, inv, inverse=True)
        o = o.flatten(2).unflatten(-1, (self.n_groups, -1))  # [B,S,g,h/g*d]
        wo_a = self.wo_a.weight.view(self.n_groups, self.o_lora_rank, -1)
        z = torch.einsum("bsgi,goi->bsgo", o, wo_a.to(o.dtype))
        return self.wo_b(z.flatten(2))


class Gate(nn.Module):
    """Router: sqrt(softplus(x·Wᵀ)) scores in fp32; top-k of score + bias, or `tid2eid[token]` on hash layers;
    weights = the unbiased scores of the picks, normalized, × routed_scaling_factor."""

    def __init__(self, args: V4Args, layer: int):
        super().__init__()
        self.topk, self.route_scale = args.num_experts_per_tok, args.routed_scaling_factor
        self.hash = layer < args.num_hash_layers
        self.weight = nn.Parameter(torch.zeros(args.n_routed_experts, args.hidden_size))
        if self.hash:
            self.register_buffer("tid2eid", torch.zeros(args.vocab_size, self.topk, dtype=torch.int64))
        else:
            self.bias = nn.Parameter(torch.zeros(args.n_routed_experts))

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = sqrtsoftplus(F.linear(_acc(x), self.weight.to(_acc(x).dtype)))  # [N,E]
        idx = self.tid2eid[ids] if self.hash else (s + self.bias).topk(self.topk, -1).indices
        w = s.gather(1, idx)
        return w / (w.sum(-1, keepdim=True) + 1e-20) * self.route_scale, idx  # 1e-20: as transformers


class MoE(nn.Module):
    """Routed experts (MXFP4, this rank's EP range, MoE-TP slice of the intermediate dim) + one shared expert.

    Routed outputs accumulate in fp32 and are summed over the TP group; the shared expert is replicated. The routing
    weight scales h before w2 (official order; transformers scales w2's output: equal up to rounding)."""

    def __init__(self, args: V4Args, layer: int, numerics: Numerics, mapping: Mapping | None, comm: Comm,
                 dtype: torch.dtype):
        super().__init__()
        E, D, I, lim = args.n_routed_experts, args.hidden_size, args.moe_intermediate_size, args.swiglu_limit
        local, (lo, hi) = range(E), (0, I)
        if mapping is not None:
            local, (lo, hi) = mapping.ep_experts(E), split_range(I, mapping.moe_tp_size, mapping.moe_tp_rank)
        self.comm, self.tp = comm, tp_of(mapping)[0]
        self.gate = Gate(args, layer)
        self.experts = nn.ModuleList([Expert(D, hi - lo, numerics, "fp4", lim, dtype) if e in local else None
                                      for e in range(E)])
        self.shared_experts = Expert(D, I, numerics, "fp8", lim, dtype)
        self.plugin: nn.Module | None = None   # dispatch.MXFP4MoE (qblock 128), attached by an engine loader

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x, ids = x.reshape(-1, shape[-1]), ids.reshape(-1)
        if self.plugin is not None:
            return self._forward_plugin(x, ids).to(x.dtype).view(shape)
        w, idx = self.gate(x, ids)
        y = torch.zeros_like(_acc(x))
        for e in idx.unique().tolist():
            if self.experts[e] is None:
                continue
            tok, k = torch.where(idx == e)
            y.index_add_(0, tok, self.experts[e](x[tok], w[tok, k]).to(y.dtype))
        if self.tp > 1:
            y = self.comm.all_reduce(y)
        y = y + self.shared_experts(x).to(y.dtype)
        return y.to(x.dtype).view(shape)

    def _forward_plugin(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The MoE plugin (fp32 out): hash-routed layers pass their picks (`tid2eid` of the tokens). The replicated
        shared expert joins the routed sum inside the op without TP, after the all-reduce with it; with the plugin's
        `overlap_shared` it runs on a side stream beside the op and joins after it (and after the all-reduce)."""
        g = self.gate
        hash_ids, bias = (g.tid2eid[ids].to(torch.int32), None) if g.hash else (None, g.bias)
        forked = dispatch.shared_expert_forked(self.plugin, self.shared_experts, x)
        shared = self.shared_experts(x) if forked is None else None
        y = self.plugin(x, g.weight, bias, shared if self.tp == 1 else None, hash_ids)
        if self.tp > 1:
            y = self.comm.all_reduce(y)
        if forked is not None:
            y += forked.join()
        elif self.tp > 1:
            y = y + shared.float()
        return y


class Block(nn.Module):
    """X → hc_pre(attn) → attn_norm → Attention → hc_post → hc_pre(ffn) → ffn_norm → MoE → hc_post (§2.8)."""

    def __init__(self, args: V4Args, layer: int, numerics: Numerics, mapping: Mapping | None, comm: Comm,
                 dtype: torch.dtype):
        super().__init__()
        D, n = args.hidden_size, args.hc_mult
        self.n, self.iters, self.hc_eps, self.eps = n, args.hc_sinkhorn_iters, args.hc_eps, args.rms_norm_eps
        self.attn = Attention(args, layer, numerics, mapping, comm, dtype)
        self.ffn = MoE(args, layer, numerics, mapping, comm, dtype)
        self.attn_norm = RMSNorm(D, self.eps)
        self.ffn_norm = RMSNorm(D, self.eps)
        for site in ("attn", "ffn"):
            setattr(self, f"hc_{site}_fn", nn.Parameter(torch.zeros((2 + n) * n, n * D)))
            setattr(self, f"hc_{site}_base", nn.Parameter(torch.zeros((2 + n) * n)))
            setattr(self, f"hc_{site}_scale", nn.Parameter(torch.zeros(3)))
        self.hc_plugin: nn.Module | None = None   # dispatch.FusedHC, attached by an engine loader

    def _hc(self, X: torch.Tensor, site: str):
        return hc_mix(X.flatten(-2), getattr(self, f"hc_{site}_fn"), getattr(self, f"hc_{site}_base"),
                      getattr(self, f"hc_{site}_scale"), self.n, self.iters, self.hc_eps, self.eps)

    def forward(self, X: torch.Tensor, ids: torch.Tensor, attend) -> torch.Tensor:
        """X [B,S,n,D], ids [B,S] (hash routing) -> X'. `attend(x [B,S,D]) -> [B,S,D]` runs the attention."""
        x, site = self.open_attn(X)
        return self.close_attn(site, attend(x), ids)

    def open_attn(self, X: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        """The attention site up to the attention: X [B,S,n,D] -> (x [B,S,D] its input, `site`: what `close_attn`
        needs). With the mHC plugin's kernels: the coefficients, then the collapse + norm. V4's sites use their own
        `pre` (no lag), computed from the streams the previous expand wrote, so neither the next collapse fuses into
        the expand nor the coefficients move off the critical path (V4.1's `fused_overlap`)."""
        if self.hc_plugin is None:
            pre, post, comb = self._hc(X, "attn")
            return self.attn_norm(hc_collapse(X, pre)), (X, post, comb)
        b, s, n, d = X.shape
        Xf = X.reshape(b * s, n, d).to(torch.bfloat16).contiguous()            # [T, n, D]
        x, post, comb = self._fused_pre(Xf, "attn", self.attn_norm)
        return x.view(b, s, d).to(X.dtype), (Xf, post, comb, X.dtype)

    def close_attn(self, site: tuple, fx: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The rest of the block: `open_attn`'s site, the attention output fx [B,S,D], ids [B,S] -> X'."""
        if self.hc_plugin is None:
            X, post, comb = site
            X = hc_expand(X, fx, post, comb)
            pre, post, comb = self._hc(X, "ffn")
            return hc_expand(X, self.ffn(self.ffn_norm(hc_collapse(X, pre)), ids), post, comb)
        op = dispatch.ops()
        Xf, post, comb, dtype = site
        t, n, d = Xf.shape
        b, s = fx.shape[:2]
        Xf = op.hc_post(Xf, fx.reshape(t, d).to(torch.bfloat16).contiguous(), post, comb)
        x, post, comb = self._fused_pre(Xf, "ffn", self.ffn_norm)
        fx = self.ffn(x.view(b, s, d).to(dtype), ids).reshape(t, d).to(torch.bfloat16).contiguous()
        return op.hc_post(Xf, fx, post, comb).view(b, s, n, d).to(dtype)

    def _fused_pre(self, Xf: torch.Tensor, site: str, norm: RMSNorm):
        """A site's coefficients and collapse + norm with the mHC plugin: Xf [T, n, D] -> (x [T, D], post, comb)."""
        op, hc = dispatch.ops(), self.hc_plugin
        t, n, d = Xf.shape
        pre, post, comb = op.hc_mix(Xf.view(t, n * d), getattr(self, f"hc_{site}_fn"), getattr(hc, f"{site}_split"),
                                    getattr(self, f"hc_{site}_base"), getattr(self, f"hc_{site}_scale"), self.iters,
                                    self.hc_eps, self.eps)
        return op.hc_pre(Xf, pre, norm.weight, self.eps), post, comb


def hc_head(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float,
            norm_eps: float) -> torch.Tensor:
    """Final stream collapse: pre = sigmoid(scale·(x·fnᵀ)·rsqrt(mean x²) + base) + eps; Σ pre_j X_j. [..,n,D]->[..,D]"""
    xf = _acc(X.flatten(-2))
    r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + norm_eps)
    pre = torch.sigmoid((xf @ fn.to(xf.dtype).t()) * r * scale + base) + hc_eps
    return hc_collapse(X, pre)


class MTPBlock(Block):
    """Multi-token prediction block `mtp.{j}` (§2.11): x = e_proj(enorm(embed(next_ids))) + h_proj(hnorm(X_main))
    per stream, one SWA block, its own hc_head + norm, the shared head. embed/head are the main model's."""

    def __init__(self, args: V4Args, layer: int, numerics: Numerics, mapping: Mapping | None, comm: Comm,
                 dtype: torch.dtype, shared: tuple[nn.Module, nn.Module]):
        super().__init__(args, layer, numerics, mapping, comm, dtype)
        D, n = args.hidden_size, args.hc_mult
        self.e_proj = Linear(D, D, numerics, "fp8", dtype=dtype)
        self.h_proj = Linear(D, D, numerics, "fp8", dtype=dtype)
        self.enorm = RMSNorm(D, self.eps)
        self.hnorm = RMSNorm(D, self.eps)
        self.norm = RMSNorm(D, self.eps)
        self.hc_head_fn = nn.Parameter(torch.zeros(n, n * D))
        self.hc_head_base = nn.Parameter(torch.zeros(n))
        self.hc_head_scale = nn.Parameter(torch.zeros(1))
        self._shared = shared  # (embed, head) of the main model; a tuple, so not registered as submodules

    def forward(self, X_main: torch.Tensor, next_ids: torch.Tensor, pos0: int,
                st: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (draft logits [B,S,V] fp32, the block's output streams [B,S,n,D]); a chained draft feeds them back."""
        embed, head = self._shared
        e = self.enorm(embed(next_ids))
        X = self.e_proj(e).unsqueeze(2) + self.h_proj(self.hnorm(X_main))  # [B,S,n,D]
        rag = Ragged([tuple(next_ids.shape)], [pos0], next_ids.device)
        X = super().forward(X, next_ids, lambda x: rag.split(self.attn(rag.join([x]), [st], rag))[0])
        x = self.norm(hc_head(X, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, self.hc_eps, self.eps))
        return head(x).float(), X


class DeepseekV4Model(SlotModel, nn.Module):
    """DeepSeek-V4-Flash with MTP; parameter names are the HF checkpoint keys (`tensor_table`)."""

    def __init__(self, args: V4Args, numerics: Numerics, mapping: Mapping | None = None, comm: Comm | None = None,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        numerics = _RaggedNumerics(numerics.mode, numerics.act_block)
        comm = comm or LocalComm()
        D, n = args.hidden_size, args.hc_mult
        self.args, self.numerics, self.dtype = args, numerics, dtype
        self.embed = nn.Embedding(args.vocab_size, D, dtype=dtype)
        self.layers = nn.ModuleList([Block(args, i, numerics, mapping, comm, dtype) for i in range(args.n_layers)])
        self.norm = RMSNorm(D, args.rms_norm_eps)
        self.head = VocabParallelHead(D, args.vocab_size, numerics, mapping, comm, False, dtype)
        self.hc_head_fn = nn.Parameter(torch.zeros(n, n * D))
        self.hc_head_base = nn.Parameter(torch.zeros(n))
        self.hc_head_scale = nn.Parameter(torch.zeros(1))
        self.mtp = nn.ModuleList([MTPBlock(args, args.n_layers + j, numerics, mapping, comm, dtype,
                                           (self.embed, self.head)) for j in range(args.n_draft)])
        self.comm = comm
        self.cuda_graphs = None   # a decode step's pieces as CUDA graphs (serve/runtime/cuda_graphs.py)
        self.decode_slots: V4DecodeSlots | None = None   # fixed decode caches (`enable_decode_slots`)

    def new_state(self, batch_size: int) -> V4State:
        layers, mtp = [{} for _ in self.layers], [{} for _ in self.mtp]
        for blk, st in zip(list(self.layers) + list(self.mtp), layers + mtp):
            blk.attn.init_state(st, batch_size, self.dtype, self.embed.weight.device)
        return V4State(layers, mtp)

    @torch.no_grad()
    def streams(self, input_ids: torch.Tensor, state: V4State) -> torch.Tensor:
        """Run new tokens through the main layers; returns the final streams X [B,S,n,D] (before hc_head)."""
        rag, X = self._streams([Chunk(input_ids, state)])
        return rag.split(X)[0]

    @torch.no_grad()
    def step_chunks(self, chunks: list[Chunk]) -> list[torch.Tensor]:
        """One forward over several requests' chunks (each its own state and position, see ragged.py) -> the
        logits of each chunk's last position [B_i, V] fp32; every state advances by its chunk."""
        return self._forward(chunks, head=True)

    def _streams(self, chunks: list[Chunk]) -> tuple[Ragged, torch.Tensor]:
        """-> (the chunks' layout, final streams [1,T,n,D])."""
        return self._forward(chunks, head=False)

    def _forward(self, chunks: list[Chunk], head: bool):
        """The forward as pieces (as V4.1's, model_def/v41.py `_forward`): piece k runs everything per token between
        layer k − 1's and layer k's attention cores (`_piece`), the cores (the requests' own caches) between them;
        a decode step of a captured size replays the pieces as CUDA graphs (`cuda_graphs`, set by the serving
        runtime). head: -> each chunk's last-position logits; else (the layout, the final streams [1,T,n,D])."""
        rag = Ragged.of(chunks)
        slots = self.decode_slots
        # the single-token chunks, attended as one batch (two or more; one with decode slots, which hold their caches
        # when there is room)
        decode = DecodeRows.of(rag, min_size=2 if slots is None else 1)
        if decode is not None:
            decode.take_slots(slots, [chunks[i].state for i in decode.members])
        in_slots = decode is not None and decode.slots is not None
        graphs = None if self.cuda_graphs is None or not head else self.cuda_graphs.pieces_for(rag, None)
        pad = (lambda t: t) if graphs is None else graphs.pad_rows
        n = rag.total
        last = None if graphs is not None or not head else rag.last_rows(chunks[0].ids.device)
        common = {"ids": pad(rag.join([c.ids for c in chunks])), "positions": pad(rag.positions), "last": last}
        run = graphs.run if graphs is not None else (lambda k, fn, inputs: fn(inputs))
        if in_slots and decode.rows is None and head:
            # every chunk decodes in a slot: the whole forward is one piece, attention cores included
            slot_ids = decode.padded_slot_ids(n if graphs is None else graphs.size)
            out = run("slots", self._slot_forward, {**common, "slot_ids": slot_ids})
        else:
            held = [in_slots and i in decode.index for i in range(len(chunks))]   # (never read as lists)
            out = run(0, lambda i: self._piece(0, i, head), common)
            for k, blk in enumerate(self.layers):
                states = [None if h else c.state.layers[k] for c, h in zip(chunks, held)]
                o = blk.attn.core(ragged.first_rows(out["attn"], n), states, rag, decode)
                out = run(k + 1, lambda i, k=k: self._piece(k + 1, i, head),
                          {"site": out["site"], "o": pad(o), **common})
        for c in chunks:
            c.state.pos += c.ids.shape[1]
        if not head:
            return rag, out["X"]
        logits = out["logits"]
        if graphs is not None:   # the graph's output buffer is rewritten by the next replay
            logits = logits[:, :n].clone()
        return rag.split_rows(logits[0])

    def _slot_forward(self, inputs: dict) -> dict:
        """A decode step of single tokens whose caches sit in decode slots, as one piece: the pieces of `_piece` with
        each layer's `Attention.core_slots` between them (fixed shapes: a CUDA graph holds all of it) -> {"logits"}."""
        common = {k: inputs[k] for k in ("ids", "positions", "last")}
        pos = inputs["positions"].transpose(0, 1)                                       # [T, 1]
        out = self._piece(0, common, True)
        for k, blk in enumerate(self.layers):
            o = blk.attn.core_slots(ragged.member_rows(out["attn"]), inputs["slot_ids"], pos, self.decode_slots)
            out = self._piece(k + 1, {"site": out["site"], "o": o.transpose(0, 1), **common}, True)
        return out

    def _new_decode_slots(self, n: int, max_seq_len: int, device) -> V4DecodeSlots:
        return V4DecodeSlots(self, n, max_seq_len, device or self.embed.weight.device)

    def _piece(self, k: int, inputs: dict, head: bool) -> dict:
        """Piece k over T rows: k = 0 embeds `ids`; 0 < k ≤ L finishes layer k − 1 (its attention output `o`
        through `wo_a` / `wo_b`, then its FFN site, hash-routed by `ids`); k < L enters layer k (the attention site's
        mHC collapse + norm, the attention's per-token projections); k = L ends with the head on the `last` rows
        (all when None), or returns the streams. -> {"site", "attn"}, {"logits"} or {"X"}."""
        ids, pos = inputs["ids"], inputs["positions"]
        if k == 0:
            X = self.embed(ids).unsqueeze(2).expand(-1, -1, self.args.hc_mult, -1)
        else:
            blk = self.layers[k - 1]
            X = blk.close_attn(inputs["site"], blk.attn.finish(inputs["o"], pos), ids)
        if k == len(self.layers):
            if not head:
                return {"X": X}
            if inputs["last"] is not None:   # only the rows that are sampled from pay for the vocabulary head
                X = X[:, inputs["last"]]
            return {"logits": self.head_logits(X)}
        x, site = self.layers[k].open_attn(X)
        return {"site": site, "attn": self.layers[k].attn.prepare(x, pos)}

    def head_logits(self, X: torch.Tensor) -> torch.Tensor:
        x = hc_head(X, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, self.args.hc_eps,
                    self.args.rms_norm_eps)
        return self.head(self.norm(x))

    @torch.no_grad()
    def step(self, input_ids: torch.Tensor, state: V4State) -> torch.Tensor:
        """Incremental forward of input_ids [B,S_new] (prefill chunk or decode) -> logits [B,S_new,V] fp32."""
        return self.head_logits(self.streams(input_ids, state))

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full causal forward without a cache -> [B,S,V] fp32."""
        return self.step(input_ids, self.new_state(input_ids.shape[0]))

    @torch.no_grad()
    def mtp_logits(self, X_main: torch.Tensor, next_ids: torch.Tensor, state: V4State | None = None,
                   j: int = 0) -> torch.Tensor:
        """Draft logits of MTP block j from the main streams X_main [B,S,n,D] at positions mtp_pos[j].. and the
        tokens that follow them, next_ids [B,S] (fresh state when None)."""
        return self.mtp_draft(X_main, next_ids, state or self.new_state(X_main.shape[0]), j)[0]

    @torch.no_grad()
    def mtp_draft(self, X_main: torch.Tensor, next_ids: torch.Tensor, state: V4State,
                  j: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """`mtp_logits` that also returns the block's output streams [B,S,n,D] (a chained draft feeds them back)."""
        out = self.mtp[j](X_main, next_ids, state.mtp_pos[j], state.mtp[j])
        state.mtp_pos[j] += next_ids.shape[1]
        return out

    @torch.no_grad()
    def generate_greedy(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Prefill, then greedy decode one token per forward -> [B, S + max_new_tokens]."""
        return ragged.generate_greedy(self, input_ids, max_new_tokens)
