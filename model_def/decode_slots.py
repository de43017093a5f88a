"""Decode caches in fixed slots: what lets a decode step's attention run inside a CUDA graph.

A request's list caches (`V41State`: window rows and compressed entries grown by `torch.cat`; V4's compressed
caches likewise) change shape every step, so the attention cores that read and write them cannot be captured. Once
a request decodes, its caches move into one of `n` preallocated slots (TRT-LLM / vLLM's static KV pool, gpt-fast's
`max_batch_size × max_seq_len` cache), where every decode step reads and writes tensors of fixed shape at addresses
that never change. V4.1 (`DecodeSlots`):

- window[layer]: a ring of the last `sliding_window` K = V rows, row p % W holding position p;
- per KV source: its compressed entries kv [n + 1, E + 1, d] (E = ceil(max_seq_len / ratio); row E stays zero:
  what an empty top-k slot reads), index keys [n + 1, E, d_index], and the open group's projections
  [n + 1, ratio, d] (fp32), entry t of a slot at row t, a group's token at position p in row p % ratio.

V4 (`V4DecodeSlots`): each layer's state dict over n + 1 rows, its compressed caches [n + 1, E, d].

Which entries a query may read follows from its position alone, so nothing else is kept; an entry whose group is
still open is computed from it every step and stays invisible until the group completes. Slot n is scratch: the
padded rows of a CUDA-graph batch write there. A state moves in (`pack`) on its first decode step; any other use of
its caches moves it back out first (the states' cache properties), which frees the slot; a slot is also freed when
the serving runtime releases the request (`drop`) or its state is dropped.
"""
from __future__ import annotations

import math
import weakref
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from dsflash.model_def.csa2 import SourceCache, wide_dtype


@dataclass
class SlotSource:
    """One KV source's compressed caches over all slots (see the module docstring)."""
    kv: torch.Tensor         # [n + 1, E + 1, head_dim]; row E is zero
    index_k: torch.Tensor    # [n + 1, E, index_head_dim]
    buf_kv: torch.Tensor     # [n + 1, ratio, head_dim] wide
    buf_gate: torch.Tensor   # [n + 1, ratio, head_dim] wide
    ratio: int

    @property
    def entries(self) -> int:
        return self.index_k.shape[1]


class SlotPool(ABC):
    """n slots and a scratch slot on `device`; which state holds which (the families' caches: `DecodeSlots`,
    `V4DecodeSlots`)."""

    def __init__(self, n: int, max_seq_len: int, device):
        if n < 1 or max_seq_len < 1:
            raise ValueError(f"decode slots need n >= 1 and max_seq_len >= 1, got n={n}, max_seq_len={max_seq_len}")
        self.n, self.max_seq_len, self.scratch, self.device = n, max_seq_len, n, torch.device(device)
        self._free = list(range(n - 1, -1, -1))      # pop() hands out slot 0 first
        self._finalizers: dict[int, weakref.finalize] = {}

    @abstractmethod
    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the slots hold."""

    @abstractmethod
    def pack(self, state, slot: int) -> None:
        """Copy a batch-1 state's list caches into `slot`."""

    @abstractmethod
    def unpack_into(self, state, slot: int) -> None:
        """Give `state` its caches back as lists, read from `slot`."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @property
    def free(self) -> int:
        return len(self._free)

    def fits(self, state) -> bool:
        """Whether `state`'s next token can decode in a slot: one request, position below max_seq_len, and a slot
        of its own or a free one."""
        return (state.batch == 1 and state.pos < self.max_seq_len
                and (state.slot is not None or bool(self._free)))

    def slot_of(self, state) -> int:
        """The slot of `state` (moving its caches in first when they are still lists; `fits` must hold)."""
        if state.slot is None:
            slot = self._free.pop()
            self.pack(state, slot)
            state.forget_caches()   # the slot holds them now (`unpack` rebuilds them)
            state.slot, state.slots = slot, self
            self._finalizers[slot] = weakref.finalize(state, self._release, slot)
        return state.slot

    def slot_tensor(self, states: list) -> torch.Tensor:
        """[N] long slot indices of `states` (every one `fits`)."""
        return torch.tensor([self.slot_of(s) for s in states], dtype=torch.long, device=self.device)

    def unpack(self, state) -> None:
        """Move `state`'s caches back into lists (the form every other path reads) and free its slot."""
        self.unpack_into(state, state.slot)
        self.drop(state)

    def drop(self, state) -> None:
        """Free `state`'s slot without moving its caches out (a finished request: its caches are gone, any later
        use of them fails; or `unpack`, which moved them out first)."""
        slot = state.slot
        state.slot, state.slots = None, None
        self._finalizers.pop(slot).detach()
        self._release(slot)

    def _release(self, slot: int) -> None:
        self._finalizers.pop(slot, None)
        self._free.append(slot)


class DecodeSlots(SlotPool):
    """The decode slots of a V4.1 model (`DeepseekV41Model.enable_decode_slots`) for positions < max_seq_len."""

    def __init__(self, args, n: int, max_seq_len: int, dtype: torch.dtype, device):
        super().__init__(n, max_seq_len, device)
        self.window_size = args.sliding_window
        d, di, wide = args.head_dim, args.index_head_dim, wide_dtype(dtype)
        self.window = [torch.zeros(n + 1, self.window_size, d, dtype=dtype, device=device)
                       for _ in range(args.n_layers)]
        self.sources: dict[int, SlotSource] = {}
        for s in args.kv_source_layer_ids:
            r = args.ratio(s)
            e = math.ceil(max_seq_len / r)
            self.sources[s] = SlotSource(torch.zeros(n + 1, e + 1, d, dtype=dtype, device=device),
                                         torch.zeros(n + 1, e, di, dtype=dtype, device=device),
                                         torch.zeros(n + 1, r, d, dtype=wide, device=device),
                                         torch.zeros(n + 1, r, d, dtype=wide, device=device), r)

    def tensors(self) -> list[torch.Tensor]:
        return [*self.window, *(t for s in self.sources.values() for t in (s.kv, s.index_k, s.buf_kv, s.buf_gate))]

    def pack(self, state, slot: int) -> None:
        pos, w = state.pos, self.window_size
        for ring, rows in zip(self.window, state._window):
            n = rows.shape[1]
            if n:
                ring[slot, torch.arange(pos - n, pos, device=ring.device) % w] = rows[0].to(ring.dtype)
        for s, src in self.sources.items():
            cache = state._sources[s]
            count, m = cache.kv.shape[1], cache.buf_kv.shape[1]
            src.kv[slot, :count] = cache.kv[0]
            src.index_k[slot, :count] = cache.index_k[0]
            src.buf_kv[slot, :m] = cache.buf_kv[0]
            src.buf_gate[slot, :m] = cache.buf_gate[0]

    def unpack_into(self, state, slot: int) -> None:
        pos, w = state.pos, self.window_size
        windows = []
        for ring in self.window:
            n = min(pos, w - 1)   # the lists keep the last window − 1 rows (the next token's row makes W)
            windows.append(ring[slot, torch.arange(pos - n, pos, device=ring.device) % w].unsqueeze(0).clone())
        sources = {}
        for s, src in self.sources.items():
            count, m = pos // src.ratio, pos % src.ratio
            sources[s] = SourceCache(src.kv[slot, :count].unsqueeze(0).clone(),
                                     src.index_k[slot, :count].unsqueeze(0).clone(),
                                     src.buf_kv[slot, :m].unsqueeze(0).clone(),
                                     src.buf_gate[slot, :m].unsqueeze(0).clone())
        state._window, state._sources = windows, sources


class V4DecodeSlots(SlotPool):
    """The decode slots of a V4 model (`DeepseekV4Model.enable_decode_slots`): each main layer's state dict
    (`v4.Attention.init_state`: the window ring, the compressors' open and previous groups, already of fixed shape)
    over n + 1 rows, and its compressed caches ("kv.cache", "idx.cache") as [n + 1, E, d], E = ceil(max_seq_len /
    ratio), entry t at row t."""

    def __init__(self, model, n: int, max_seq_len: int, device):
        super().__init__(n, max_seq_len, device)
        template = [{k: t.to(device) for k, t in st.items()} for st in model.new_state(1).layers]
        self.ratios = [blk.attn.ratio for blk in model.layers]
        self.layers: list[dict[str, torch.Tensor]] = []
        for st, r in zip(template, self.ratios):
            d = {}
            for key, t in st.items():
                if key.endswith(".cache"):
                    d[key] = t.new_zeros(n + 1, math.ceil(max_seq_len / r), t.shape[-1])
                else:   # the initial values (zeros, −inf) in every slot
                    d[key] = t.expand(n + 1, *t.shape[1:]).clone()
            self.layers.append(d)

    def tensors(self) -> list[torch.Tensor]:
        return [t for d in self.layers for t in d.values()]

    def pack(self, state, slot: int) -> None:
        for d, st in zip(self.layers, state._layers):
            for key, t in st.items():
                d[key][slot, :t.shape[1]] = t[0]

    def unpack_into(self, state, slot: int) -> None:
        layers = []
        for d, r in zip(self.layers, self.ratios):
            layers.append({key: (t[slot, :state.pos // r] if key.endswith(".cache") else t[slot]).unsqueeze(0).clone()
                           for key, t in d.items()})
        state._layers = layers


class SlotModel(ABC):
    """What a model with decode slots offers the runtime (V4.1 and V4 models mix it in)."""

    @abstractmethod
    def _new_decode_slots(self, n: int, max_seq_len: int, device) -> SlotPool:
        """The family's slots on `device` (None: the model's)."""

    def enable_decode_slots(self, n: int, max_seq_len: int, device=None) -> SlotPool:
        """Decode steps of up to n requests at positions < max_seq_len read and write fixed slots, which lets a CUDA
        graph hold their attention too. device="meta": only size them (`nbytes`), nothing is enabled."""
        slots = self._new_decode_slots(n, max_seq_len, device)
        if device != "meta":
            self.decode_slots = slots
        return slots

    def release_state(self, state) -> None:
        """A finished request's state: its decode slot, if it holds one, is free from now on (on every rank at the
        same step of the plan, so that all ranks choose the same paths)."""
        if state.slot is not None:
            state.slots.drop(state)
