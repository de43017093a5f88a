"""KV-cache accounting in pages: the engine's real per-request cache formats, in blocks of `block_size` tokens.

A request holds (a) growing caches — entries emitted every r-th token for a stream of compress ratio r — and (b)
fixed state that does not grow with the sequence (sliding-window rows, compressor partial-group buffers). Both come
out of one pool of `bytes_per_block`-byte pages: the fixed state takes `state_blocks` pages when the request is
admitted, the growing caches one page per `block_size` tokens (a ratio r > block_size stream counts block_size/r
of an entry per page, e.g. V4's ratio-128 entries half per 64-token page).

Formats (architecture.md §4):
- V4.1 (CSA2), per KV source: FP4 compressed latent = head_dim/2 packed e2m1 + head_dim/16 e4m3 scales (288 B at
  512), FP4 index key = index_head_dim/2 + index_head_dim/32 e8m0 (68 B at 128); per main layer `sliding_window`
  FP8 window rows of head_dim e4m3 + head_dim/32 ue8m0 (528 B); ratio-2 sources keep the open group's r-1 rows of
  fp32 kv + gate projections; Engram keeps max_ngram-1 int32 token ids. Full model: 890 B/token growing.
- V4: main/window entry = FP8 "footer" (nope e4m3 + BF16 RoPE + one ue8m0 per 64 nope channels, padded to 8 B:
  584 B), FP4 index key 68 B on ratio-4 (CSA) layers; per main layer `sliding_window` window rows; compressor state
  fp32 kv + score [coff*r, coff*d] (coff = 2 for the overlapping ratio-4 compressor), plus the indexer's for CSA.
  Full model: 3,514.25 B/token growing.
The latents are one shared head (MQA), replicated on every TP rank: per-rank bytes equal the TP1 bytes.

The pages account the deploy formats above: admission, preemption and the usage figures follow them. Neither runtime
stores its caches in them yet. The CPU reference keeps each request's state densely in its model state object
(`model.new_state`, fake-quantized values in the model dtype); a GPU engine keeps the same list caches while a
request prefills and, once it decodes, one of the model's decode slots (model_def/decode_slots.py: model-dtype
caches sized for max_seq_len, at most `model_runner.SLOT_SHARE` of the free memory, allocated before this pool is
sized, so that a pool sized by `kv_cache_free_gpu_memory_fraction` counts from the memory they leave). So on a
GPU this pool's bytes bound how many requests are admitted, not where their caches live.
"""
from __future__ import annotations

import math
import os
from collections import deque
from dataclasses import dataclass
from fractions import Fraction

FP32 = 4


@dataclass(frozen=True)
class CacheLayout:
    """Bytes of one request's cache: growing streams (name, ratio, entry bytes) and fixed parts (name, bytes)."""
    family: str
    block_size: int
    streams: tuple[tuple[str, int, int], ...]
    fixed: tuple[tuple[str, int], ...]

    @property
    def bytes_per_token(self) -> Fraction:
        return sum((Fraction(b, r) for _, r, b in self.streams), Fraction(0))

    @property
    def bytes_per_block(self) -> int:
        return max(1, math.ceil(self.bytes_per_token * self.block_size))

    @property
    def fixed_bytes(self) -> int:
        return sum(b for _, b in self.fixed)

    @property
    def state_blocks(self) -> int:
        return -(-self.fixed_bytes // self.bytes_per_block)

    def blocks_for(self, n_tokens: int) -> int:
        """Pages of a request whose caches hold n_tokens tokens (its fixed state included)."""
        return self.state_blocks + -(-n_tokens // self.block_size)


def v41_entry_bytes(head_dim: int, index_head_dim: int) -> tuple[int, int, int]:
    """(compressed latent, index key, window row) bytes of V4.1: FP4/16-e4m3, FP4/32-e8m0, FP8/32-ue8m0."""
    return head_dim // 2 + head_dim // 16, index_head_dim // 2 + index_head_dim // 32, head_dim + head_dim // 32


def v4_entry_bytes(head_dim: int, rope_dim: int, index_head_dim: int) -> tuple[int, int]:
    """(main/window entry, index key) bytes of V4: FP8 footer layout padded to 8 B, FP4 index key."""
    nope = head_dim - rope_dim
    main = nope + 2 * rope_dim + -(-nope // 64)
    return -(-main // 8) * 8, index_head_dim // 2 + index_head_dim // 32


def cache_layout(args, block_size: int = 64) -> CacheLayout:
    """The cache layout of a model (V4.1 or V4 args)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    streams, fixed = [], []
    if args.family == "v41":
        kv, idx, row = v41_entry_bytes(args.head_dim, args.index_head_dim)
        fixed.append(("window", args.n_layers * args.sliding_window * row))
        for s in args.kv_source_layer_ids:
            r = args.ratio(s)
            streams += [(f"layers.{s}.kv", r, kv), (f"layers.{s}.index_k", r, idx)]
            if r > 1:
                fixed.append((f"layers.{s}.partial_group", 2 * (r - 1) * args.head_dim * FP32))
        if args.engram_layer_ids:
            fixed.append(("engram_history", (args.engram_max_ngram_size - 1) * 4))
    else:
        main, idx = v4_entry_bytes(args.head_dim, args.rope_dim, args.index_head_dim)
        fixed.append(("window", args.n_layers * args.sliding_window * main))
        for i in range(args.n_layers):
            r = args.ratio(i)
            if r == 0:
                continue
            coff = 2 if r == 4 else 1
            streams.append((f"layers.{i}.kv", r, main))
            fixed.append((f"layers.{i}.compressor", 2 * coff * r * coff * args.head_dim * FP32))
            if r == 4:
                streams.append((f"layers.{i}.index_k", r, idx))
                fixed.append((f"layers.{i}.indexer.compressor", 2 * coff * r * coff * args.index_head_dim * FP32))
    return CacheLayout(args.family, block_size, tuple(streams), tuple(fixed))


def kv_cache_capacity(kv_cache_bytes: int | None = None, free_memory_fraction: float = 0.9,
                      device: str = "cpu") -> int:
    """Bytes for the cache pool: `kv_cache_bytes` when given, else `free_memory_fraction` of the free memory of the
    device (GPU: torch.cuda.mem_get_info after the weights are loaded; CPU: available physical memory)."""
    if kv_cache_bytes is not None:
        if kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be > 0, got {kv_cache_bytes}")
        return int(kv_cache_bytes)
    if not 0 < free_memory_fraction <= 1:
        raise ValueError(f"--kv-cache-free-gpu-memory-fraction must be in (0, 1], got {free_memory_fraction}")
    if str(device).startswith("cuda"):
        import torch
        free, _ = torch.cuda.mem_get_info(torch.device(device))
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(free * free_memory_fraction)


class BlockManager:
    """Page tables of the running requests over a pool of `capacity_bytes // bytes_per_block` pages."""

    def __init__(self, layout: CacheLayout, capacity_bytes: int):
        self.layout = layout
        self.total_blocks = capacity_bytes // layout.bytes_per_block
        if self.total_blocks < layout.blocks_for(1):
            raise ValueError(f"KV cache of {capacity_bytes} B holds {self.total_blocks} blocks of "
                             f"{layout.bytes_per_block} B; one request needs at least {layout.blocks_for(1)} "
                             f"({layout.fixed_bytes} B of fixed state + one block)")
        self.free_ids: deque[int] = deque(range(self.total_blocks))
        self.tables: dict[str, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    @property
    def num_used(self) -> int:
        return self.total_blocks - len(self.free_ids)

    @property
    def usage(self) -> float:
        return self.num_used / self.total_blocks

    def needed(self, key: str, n_tokens: int) -> int:
        """Extra pages `key` needs for its caches to hold n_tokens tokens."""
        return max(0, self.layout.blocks_for(n_tokens) - len(self.tables.get(key, ())))

    def can_hold(self, key: str, n_tokens: int, reserve: int = 0) -> bool:
        return self.needed(key, n_tokens) <= self.num_free - reserve

    def grow(self, key: str, n_tokens: int) -> list[int]:
        """Allocate what `key` needs to hold n_tokens tokens; returns its page table."""
        n = self.needed(key, n_tokens)
        if n > self.num_free:
            raise RuntimeError(f"cache pool exhausted: {key} needs {n} pages, {self.num_free} free")
        table = self.tables.setdefault(key, [])
        table.extend(self.free_ids.popleft() for _ in range(n))
        return table

    def trim(self, key: str, n_tokens: int) -> None:
        """Give back the pages past what n_tokens tokens need (a speculative verify's rejected drafts)."""
        table = self.tables.get(key)
        if table is None:
            return
        keep = self.layout.blocks_for(n_tokens)
        while len(table) > keep:
            self.free_ids.append(table.pop())

    def free(self, key: str) -> None:
        self.free_ids.extend(self.tables.pop(key, ()))
