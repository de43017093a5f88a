"""Decode steps as CUDA graphs, piece by piece (TRT-LLM's `cuda_graph_config`; nano-vllm's static input buffers and
one graph memory pool).

A forward (V4.1: model_def/v41.py `_forward`; V4: v4.py `_forward`) is a chain of pieces: piece k holds
everything per token between layer k − 1's and layer k's attention cores (the output projection, mHC, the MoE, the
next layer's norms and projections), and the last piece the head. The cores read and write each request's own
caches, whose sizes change every step, so they stay eager between the pieces. A decode step (every chunk one token,
no image tokens) of a batch size in the ladder replays each piece as a CUDA graph made for that size: one launch for
a piece's ~100 kernels instead of ~100 host launches. A decode step whose requests all hold decode slots
(model_def/decode_slots.py: caches of fixed shape at fixed addresses; both families) is a single piece, attention
cores included: one replay per step.

Per (batch size, piece): the first step runs the piece eagerly (the warm-up: Triton compiles, tuned lookups, lazy
initialisation; nothing of that may happen inside a capture), the second captures it into the shared pool and
replays it, later steps copy the new inputs into the captured buffers and replay. A single process runs those
steps at start-up for every size up to the engine's max_batch_size, largest first, with dummy requests
(`warm_up`); several ranks capture each size on its second real step. An input that is the previous
piece's captured output (the mHC streams and coefficients) is already in place and is not copied. With
`enable_padding` a batch of n requests runs in the smallest size ≥ n; its extra rows are zeros whose outputs are
dropped (the kernels then see the padded row count, so tokens may differ in the last bits from an eager step).
Collectives counted in Python (the TP-rank simulation's `SimulatedComm`) are counted at capture and added again
at every replay. A capture that fails (an op that syncs with the host, e.g. a reference op bound in a GPU engine)
turns graphs off for the model, logged once; the step goes on eagerly.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

log = logging.getLogger("dsflash.serve")

DEFAULT_MAX_BATCH_SIZE = 128   # TRT-LLM: max_batch_size 0 -> 128


@dataclass
class CudaGraphConfig:
    """TRT-LLM's `cuda_graph_config`: explicit `batch_sizes`, or a ladder up to `max_batch_size` (0 -> 128);
    `enable_padding` runs a batch in the next captured size up instead of eagerly."""
    batch_sizes: list[int] | None = None
    max_batch_size: int = 0
    enable_padding: bool = False

    def __post_init__(self) -> None:
        if self.batch_sizes is not None and (not self.batch_sizes or min(self.batch_sizes) < 1):
            raise ValueError(f"--cuda-graph-batch-sizes (cuda_graph_config.batch_sizes) must be positive integers, "
                             f"got {self.batch_sizes}")
        if self.max_batch_size < 0:
            raise ValueError(f"--cuda-graph-max-batch-size (cuda_graph_config.max_batch_size) must be >= 0, got "
                             f"{self.max_batch_size}")

    def sizes(self) -> list[int]:
        """The captured batch sizes, ascending. The ladder (TRT-LLM's `_generate_cuda_graph_batch_sizes`): without
        padding 1..31, 32, 64, 128; with padding 1, 2, 4, then 8..128 in steps of 8; then powers of two from 256,
        and the max itself; none above the max."""
        if self.batch_sizes is not None:
            return sorted(set(self.batch_sizes))
        top = self.max_batch_size or DEFAULT_MAX_BATCH_SIZE
        ladder = [1, 2, 4, *range(8, 129, 8)] if self.enable_padding else [*range(1, 32), 32, 64, 128]
        p = 256
        while p <= top:
            ladder.append(p)
            p *= 2
        return sorted({s for s in ladder if s <= top} | {top})

    @classmethod
    def parse(cls, text: str | None, max_batch_size: int = 0, enable_padding: bool = False) -> "CudaGraphConfig":
        """`--cuda-graph-batch-sizes 1,2,4,8` (None: the ladder)."""
        sizes = None
        if text:
            try:
                sizes = [int(v) for v in text.split(",") if v.strip()]
            except ValueError:
                raise ValueError(f"--cuda-graph-batch-sizes: comma-separated integers expected, got {text!r}") from None
        return cls(sizes, max_batch_size, enable_padding)


class CudaBackend:
    """Real CUDA graphs, all in one memory pool (pieces replay in capture order and never concurrently)."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream()   # captures cannot run on the default stream

    def capture(self, fn):
        """`torch.cuda.graph` without its gc.collect() and empty_cache() per capture (a model has ~L pieces)."""
        graph, main = torch.cuda.CUDAGraph(), torch.cuda.current_stream()
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                out = fn()
            except BaseException:
                self._abandon(graph)
                raise
            graph.capture_end()
        main.wait_stream(self.stream)
        return graph, out

    @staticmethod
    def replay(graph) -> None:
        graph.replay()

    def _abandon(self, graph) -> None:
        """End a capture that raised: side streams forked into it are joined first (a capture cannot end with a
        stream still in it, and a stream left capturing would drop the kernels queued on it later)."""
        from dsflash.model_def import dispatch
        for side in dispatch.side_streams():
            try:
                self.stream.wait_stream(side)
            except RuntimeError:
                pass   # not part of this capture
        try:
            graph.capture_end()
        except RuntimeError:
            pass   # the capture was invalidated by the error being raised


class StandInBackend:
    """A CPU stand-in with a graph's buffer semantics (tests): a replay reruns the captured call on the captured
    input buffers and writes its results into the captured output buffers."""

    def capture(self, fn):
        out = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, fn())   # own buffers
        return (fn, out), out

    @staticmethod
    def replay(graph) -> None:
        fn, out = graph
        for kept, new in zip(tree_flatten(out)[0], tree_flatten(fn())[0], strict=True):
            if isinstance(kept, torch.Tensor):
                kept.copy_(new)


@dataclass
class _Piece:
    graph: object
    inputs: list                       # flattened captured inputs (tensors: the buffers new inputs are copied into)
    spec: object
    out: dict
    comm_calls: list[tuple[object, list[int]]]   # per counter (CommCounts): message sizes of a replay's calls


@dataclass
class _Size:
    """The pieces of one batch size: how often each ran eagerly, the captured ones, and every captured output (an
    input that is one of them is already in place)."""
    eager_runs: dict[int, int] = field(default_factory=dict)
    pieces: dict[int, _Piece] = field(default_factory=dict)
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)


class DecodeGraphs:
    """A model's decode pieces as CUDA graphs (`model.cuda_graphs`); `pieces_for` answers each forward."""

    def __init__(self, model, config: CudaGraphConfig, backend=None):
        self.sizes = config.sizes()
        self.padding = config.enable_padding
        self.backend = backend if backend is not None else CudaBackend()
        self.counters = _comm_counters(model)
        self._by_size: dict[int, _Size] = {}
        self.disabled: str | None = None
        self.counts = {"eager": 0, "captured": 0, "replayed": 0}

    def warm_up(self, model, max_batch_size: int | None = None) -> list[int]:
        """Capture every size up to max_batch_size now (nano-vllm's and TRT-LLM's start-up capture), largest first:
        the pool's blocks freed by a larger size's temporaries serve the smaller ones. Each size runs three
        decode-shaped steps of dummy one-token requests (warm-up, capture, replay), whose states are dropped
        after. A single process only: on several ranks every rank would have to run them in step (their pieces
        hold the all-reduces), so multi-rank engines capture lazily. -> the sizes captured."""
        from dsflash.model_def.ragged import Chunk
        sizes = [s for s in self.sizes if max_batch_size is None or s <= max_batch_size]
        ids = torch.zeros(1, 1, dtype=torch.long, device=model.head.weight.device)
        with torch.no_grad():
            for size in sorted(sizes, reverse=True):
                states = [model.new_state(1) for _ in range(size)]
                for _ in range(3):
                    model.step_chunks([Chunk(ids, st) for st in states])
                if self.disabled is not None:
                    return []
        return sizes

    def size_for(self, n: int) -> int | None:
        """The captured batch size a decode step of n requests runs in (None: eager)."""
        if n in self.sizes:
            return n
        if self.padding:
            return next((s for s in self.sizes if s >= n), None)
        return None

    def pieces_for(self, rag, image_mask) -> "_Step | None":
        """The piece runner of a forward (`rag`: its chunk layout) when it is a decode step of a captured size."""
        if self.disabled is not None or image_mask is not None or any(s != (1, 1) for s in rag.shapes):
            return None
        size = self.size_for(rag.total)
        if size is None:
            return None
        return _Step(self, self._by_size.setdefault(size, _Size()), size)

    def _disable(self, k: int, size: int, err: Exception) -> None:
        self.disabled = f"piece {k} at batch size {size}: {type(err).__name__}: {err}"
        log.warning("CUDA graphs off for this engine (decode steps run eagerly): capturing %s", self.disabled)


class _Step:
    """One forward's piece runner: `pad_rows` its [1, n, ...] inputs to the size's rows, `run` each piece."""

    def __init__(self, owner: DecodeGraphs, state: _Size, size: int):
        self.owner, self.state, self.size = owner, state, size

    def pad_rows(self, t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None or t.shape[1] == self.size:
            return t
        return torch.cat([t, t.new_zeros(1, self.size - t.shape[1], *t.shape[2:])], 1)

    def run(self, k: int, fn, inputs: dict) -> dict:
        owner, st = self.owner, self.state
        piece = st.pieces.get(k)
        if owner.disabled is not None or (piece is None and st.eager_runs.get(k, 0) < 1):
            st.eager_runs[k] = st.eager_runs.get(k, 0) + 1
            owner.counts["eager"] += 1
            return fn(inputs)
        if piece is None:
            try:
                piece = self._capture(k, fn, inputs)
            except RuntimeError as e:
                owner._disable(k, self.size, e)
                return fn(inputs)
            st.pieces[k] = piece
            owner.counts["captured"] += 1
        else:
            leaves, spec = tree_flatten(inputs)
            if spec != piece.spec:
                raise RuntimeError(f"CUDA graph piece {k} (batch size {self.size}) was captured for inputs "
                                   f"{piece.spec}, got {spec}")
            for new, kept in zip(leaves, piece.inputs):
                if isinstance(kept, torch.Tensor):
                    if new is not kept:
                        kept.copy_(new)
                elif new != kept:
                    raise RuntimeError(f"CUDA graph piece {k} (batch size {self.size}): input {kept!r} became "
                                       f"{new!r}")
        with _counted_apart(owner.counters):   # a graph's replay counts nothing (the stand-in's reruns Python)
            owner.backend.replay(piece.graph)
        for counter, sizes in piece.comm_calls:
            for nbytes in sizes:
                counter.add(nbytes)
        owner.counts["replayed"] += 1
        return piece.out

    def _capture(self, k: int, fn, inputs: dict) -> _Piece:
        st = self.state
        leaves, spec = tree_flatten(inputs)
        kept = [x if not isinstance(x, torch.Tensor) or st.outputs.get(id(x)) is x else x.clone() for x in leaves]
        captured = tree_unflatten(kept, spec)
        # the capture counts its collectives once; the replay that follows counts them as every replay does
        with _counted_apart(self.owner.counters) as calls:
            graph, out = self.owner.backend.capture(lambda: fn(captured))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st.outputs[id(t)] = t
        return _Piece(graph, kept, spec, out, calls)


@contextmanager
def _counted_apart(counters: list):
    """Collectives counted inside the block are taken back out of `counters`; yields a list that then holds, per
    counter, (counter, the message sizes the block counted)."""
    before = [(c, c.calls, dict(c.by_size)) for c in counters]
    made: list = []
    yield made
    for counter, calls, by_size in before:
        sizes = [size for size, n in counter.by_size.items() for _ in range(n - by_size.get(size, 0))]
        assert len(sizes) == counter.calls - calls
        counter.calls, counter.by_size = calls, by_size
        made.append((counter, sizes))


def _comm_counters(model) -> list:
    """The collective counters (`CommCounts`: all-reduces, gathers) of the distinct comms of a model."""
    seen: dict[int, object] = {}
    for m in [model, *model.modules()]:
        comm = getattr(m, "comm", None)
        for name in ("counts", "gathers"):
            counter = getattr(comm, name, None)
            if counter is not None:
                seen.setdefault(id(counter), counter)
    return list(seen.values())


def add_cli_args(p) -> None:
    """The CUDA-graph flags of `dsflash serve` and `dsflash bench`; `config_from_cli` reads them."""
    g = p.add_argument_group("CUDA graphs (TRT-LLM's cuda_graph_config; GPU engines: a decode step replayed as one "
                             "graph, its requests' caches in max_batch_size decode slots)")
    g.add_argument("--cuda-graph-batch-sizes", "--cuda_graph_batch_sizes", default=None, metavar="N,N,...",
                   help="decode batch sizes to capture (default: TRT-LLM's ladder up to --cuda-graph-max-batch-size)")
    g.add_argument("--cuda-graph-max-batch-size", "--cuda_graph_max_batch_size", type=int, default=0,
                   help="largest size of the default ladder (default 0: 128)")
    g.add_argument("--cuda-graph-padding", "--cuda_graph_padding", action="store_true",
                   help="enable_padding: a batch of another size runs in the next captured size up (padded rows)")
    g.add_argument("--disable-cuda-graph", "--disable_cuda_graph", action="store_true",
                   help="run every step eagerly (cuda_graph_config: null)")


def config_from_cli(a) -> CudaGraphConfig | None:
    """The CudaGraphConfig of `add_cli_args`' flags (None with --disable-cuda-graph); ValueError names the flag."""
    if a.disable_cuda_graph:
        return None
    return CudaGraphConfig.parse(a.cuda_graph_batch_sizes, a.cuda_graph_max_batch_size, a.cuda_graph_padding)
