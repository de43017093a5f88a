"""One decode step of N requests: fused (one `step_chunks` forward for all) vs a forward per request.

    python3 benchmarks/step_chunks.py --engine out/demo/v41-tiny/engine-cpu-tp1 [--requests 1,8,32]
        [--context 100] [--steps 20] [--json F] [--kernel-time] [--host-profile] [--simulate-rank R]

Each request first gets a prompt of --context tokens (its own state), then every timed step feeds each request one
token: "fused" runs them as one forward (what `dsflash serve` does), "per request" as N forwards (what
`--batch-invariant` does). The best of three rounds of --steps steps is reported, in ms per step. On a GPU,
--kernel-time also reports the kernel time and count of a fused step (profiler), against its wall time (with
--decode-slots, also of a slot step replayed as one graph).
--host-profile (any device) reports where a fused step's host time goes: the torch ops it calls (count and self
CPU µs per step) and the Python functions that take the most time of their own (cProfile).
--decode-slots (V4.1) also times the fused steps with the caches in decode slots, eager and as one graph per step
(model_def/decode_slots.py), and compares their logits with the list caches'.
--cuda-graph (V4.1 engines) also times the fused steps with their pieces replayed as graphs
(serve/runtime/cuda_graphs.py; real CUDA graphs on a GPU, the stand-in on CPU) and checks that the graph steps give
the eager steps' logits.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from dsflash.build.engine import load_engine_model
from dsflash.convert.atomic import write_text_atomic
from dsflash.model_def.ragged import Chunk


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _decoding(model, n: int, context: int, seed: int):
    """n request states, each after a prompt of `context` tokens; -> (states, next_ids(steps) -> token tensors)."""
    device = model.head.weight.device
    g = torch.Generator().manual_seed(seed)
    states = [model.new_state(1) for _ in range(n)]
    _sync(device)
    t = time.perf_counter()
    model.step_chunks([Chunk(torch.randint(3, 1000, (1, context), generator=g).to(device), s) for s in states])
    _sync(device)
    print(f"prefill of {n} × {context} tokens: {(time.perf_counter() - t) * 1e3:.1f} ms", flush=True)
    return states, lambda steps: [torch.randint(3, 1000, (1, 1), generator=g).to(device) for _ in range(steps * n)]


def time_steps(model, n: int, context: int, steps: int, fused: bool) -> float:
    """Best-of-three ms per decode step of n requests."""
    device = model.head.weight.device
    states, next_ids = _decoding(model, n, context, seed=n)
    best = float("inf")
    for _ in range(3):
        ids = next_ids(steps)
        _sync(device)
        t = time.perf_counter()
        for i in range(steps):
            chunks = [Chunk(ids[i * n + j], s) for j, s in enumerate(states)]
            if fused:
                model.step_chunks(chunks)
            else:
                for c in chunks:
                    model.step_chunks([c])
        _sync(device)
        best = min(best, (time.perf_counter() - t) / steps * 1e3)
    return best


def kernel_time(model, n: int, context: int, steps: int) -> dict:
    """Fused decode steps of n requests under the CUDA profiler: the GPU's kernel time and kernel count per step
    (how much of a step's wall time the device is busy; the rest is the host's Python and launches)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    states, next_ids = _decoding(model, n, context, seed=100 + n)
    ids = next_ids(steps + 1)
    model.step_chunks([Chunk(ids[j], s) for j, s in enumerate(states)])
    _sync(model.head.weight.device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(1, steps + 1):
            model.step_chunks([Chunk(ids[i * n + j], s) for j, s in enumerate(states)])
        _sync(model.head.weight.device)
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    busy_us = sum(e.time_range.elapsed_us() for e in kernels)
    top: dict[str, float] = {}
    count: dict[str, int] = {}
    for e in kernels:
        top[e.name] = top.get(e.name, 0.0) + e.time_range.elapsed_us() / steps
        count[e.name] = count.get(e.name, 0) + 1
    return {"kernel_ms": round(busy_us / steps / 1e3, 3), "kernels": round(len(kernels) / steps, 1),
            "top_kernels_us": {k: round(v, 1) for k, v in sorted(top.items(), key=lambda kv: -kv[1])[:30]},
            "top_kernels_by_count": {k[:160]: round(v / steps, 1)
                                     for k, v in sorted(count.items(), key=lambda kv: -kv[1])[:25]}}


def host_profile(model, n: int, context: int, steps: int, top: int = 25) -> dict:
    """Fused decode steps of n requests under cProfile and the CPU profiler: per step, the torch ops called (count,
    self CPU µs) and the Python functions with the most time of their own (calls, own µs)."""
    import cProfile
    import pstats
    from torch.profiler import ProfilerActivity, profile
    states, next_ids = _decoding(model, n, context, seed=200 + n)
    ids = next_ids(2 * steps + 1)
    device = model.head.weight.device
    model.step_chunks([Chunk(ids[j], s) for j, s in enumerate(states)])
    _sync(device)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(1, steps + 1):
            model.step_chunks([Chunk(ids[i * n + j], s) for j, s in enumerate(states)])
        _sync(device)
    # top-level ops only (an op's own children, e.g. aten::copy_ under aten::to, are in its self time's parent)
    ops = sorted(((e.key, e.count / steps, e.self_cpu_time_total / steps) for e in prof.key_averages()),
                 key=lambda r: -r[2])
    prof_py = cProfile.Profile()
    prof_py.enable()
    for i in range(steps + 1, 2 * steps + 1):
        model.step_chunks([Chunk(ids[i * n + j], s) for j, s in enumerate(states)])
    _sync(device)
    prof_py.disable()
    st = pstats.Stats(prof_py).stats   # {(file, line, fn): (prim calls, calls, own s, cumulative s, callers)}
    funcs = sorted(((f"{k[0].rsplit('/', 2)[-1] if '/' in k[0] else k[0]}:{k[1]}:{k[2]}", v[1] / steps,
                     v[2] / steps * 1e6) for k, v in st.items()), key=lambda r: -r[2])
    ours = ("/model_def/", "/plugins/", "/serve/", "/build/")
    cum = sorted(((f"{k[0].rsplit('/', 2)[-1]}:{k[1]}:{k[2]}", v[1] / steps, v[3] / steps * 1e6)
                  for k, v in st.items() if any(d in k[0] for d in ours)), key=lambda r: -r[2])
    return {"torch_ops_per_step": round(sum(r[1] for r in ops), 1),
            "top_ours_cumulative_us": [{"fn": k, "calls": round(c, 1), "cum_us": round(us, 1)}
                                       for k, c, us in cum[:40]],
            "top_torch_ops": [{"op": k, "calls": round(c, 1), "self_us": round(us, 1)} for k, c, us in ops[:top]],
            "top_python_own_us": [{"fn": k, "calls": round(c, 1), "own_us": round(us, 1)}
                                  for k, c, us in funcs[:top]]}


def graph_parity(model, n: int, context: int, steps: int) -> dict:
    """The same decode steps (same prompts, same fed tokens) eager twice and with graphs: whether the eager steps
    repeat bit for bit (the baseline: the MoE sums its experts' outputs with fp32 atomics, in arrival order, so
    several tokens' steps need not) and ‖Δ‖/‖ref‖ between them; whether the graph steps give the eager logits, ‖Δ‖ /
    ‖ref‖ and max |Δ|."""
    runs = []
    for graphs in (None, None, model.cuda_graphs):
        saved, model.cuda_graphs = model.cuda_graphs, graphs
        try:
            states, next_ids = _decoding(model, n, context, seed=300 + n)
            ids = next_ids(steps)
            runs.append([torch.cat(model.step_chunks([Chunk(ids[i * n + j], s) for j, s in enumerate(states)]))
                         for i in range(steps)])
        finally:
            model.cuda_graphs = saved
    eager, again, graph = runs

    def rel(xs, ys):
        return max(float((x - y).norm() / y.norm()) for x, y in zip(xs, ys))
    return {"eager_repeat_equal": all(torch.equal(a, b) for a, b in zip(eager, again)),
            "eager_repeat_rel": rel(again, eager), "graph_rel": rel(graph, eager),
            "graph_logits_equal": all(torch.equal(a, b) for a, b in zip(graph, eager)),
            "graph_max_abs_diff": max(float((a - b).abs().max()) for a, b in zip(graph, eager)),
            "graph_argmax_equal": all(torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in zip(graph, eager))}


def backend_for(model):
    """Real CUDA graphs on a GPU, the stand-in backend on the CPU."""
    from dsflash.serve.runtime.cuda_graphs import StandInBackend
    return None if torch.device(model.head.weight.device).type == "cuda" else StandInBackend()


def slot_rows(model, n: int, a, backend) -> dict:
    """The fused steps with the requests' caches in decode slots (model_def/decode_slots.py), eager and as one CUDA
    graph per step, and how the graph steps' logits compare with the list caches' eager steps."""
    from dsflash.serve.runtime.cuda_graphs import CudaGraphConfig, DecodeGraphs
    lists = _steps_logits(model, n, a.context, 4)
    noise = alone_vs_batched(model, a.context, 4) if n == 1 else None
    model.enable_decode_slots(n, a.slot_max_seq_len or a.context + 4 * a.steps + 16)
    try:
        row = {"slot_ms": round(time_steps(model, n, a.context, a.steps, True), 2)}
        eager = _steps_logits(model, n, a.context, 4)
        model.cuda_graphs = DecodeGraphs(model, CudaGraphConfig([n]), backend)
        row["slot_graph_ms"] = round(time_steps(model, n, a.context, a.steps, True), 2)
        if a.kernel_time:   # the kernels of the replayed graphs: where one-graph step time goes
            row["slot_graph_kernels"] = kernel_time(model, n, a.context, a.steps)
        graphs = model.cuda_graphs
        for flag in a.without_flag:   # A/B in one process: bound plugins' module flags off (e.g. fused_rope)
            mods = [(m, f) for f in flag.split(",") for m in model.modules() if getattr(m, f, False)]
            for m, f in mods:
                setattr(m, f, False)
            try:
                model.cuda_graphs = DecodeGraphs(model, CudaGraphConfig([n]), backend)
                row[f"slot_graph_ms_without_{flag}"] = round(time_steps(model, n, a.context, a.steps, True), 2)
                if a.kernel_time:
                    row[f"slot_graph_kernels_without_{flag}"] = kernel_time(model, n, a.context, a.steps)
            finally:
                for m, f in mods:
                    setattr(m, f, True)
                model.cuda_graphs = graphs   # (the graphs captured with the flag off are dropped)
        got = _steps_logits(model, n, a.context, 4)

        def rels(xs, ys):   # per step ‖Δ‖/‖ref‖
            return [round(float((x - y).norm() / y.norm()), 6) for x, y in zip(xs, ys)]
        if noise is not None:
            row["lists_alone_vs_batched_rel_per_step"] = noise
        row |= {"slot_graph_counts": model.cuda_graphs.counts, "slot_graph_disabled": model.cuda_graphs.disabled,
                "slot_eager_vs_lists_rel_per_step": rels(eager, lists),
                "slot_graph_vs_slot_eager_rel_per_step": rels(got, eager),
                "slot_graph_vs_lists_rel": max(rels(got, lists)),
                "slot_graph_vs_lists_argmax_equal": all(torch.equal(x.argmax(-1), y.argmax(-1))
                                                        for x, y in zip(got, lists))}
    finally:
        model.cuda_graphs = model.decode_slots = None
    return row


def alone_vs_batched(model, context: int, steps: int) -> list[float]:
    """The scale of the model's own numerical noise: one request's per-step ‖Δ‖/‖ref‖ between decoding alone and
    decoding next to a second request (same prompt, same fed tokens; only the batch shapes differ)."""
    device = model.head.weight.device
    g = torch.Generator().manual_seed(400)
    prompt, other = (torch.randint(3, 1000, (1, context), generator=g).to(device) for _ in range(2))
    alone, pair = model.new_state(1), [model.new_state(1), model.new_state(1)]
    model.step_chunks([Chunk(prompt, alone)])
    model.step_chunks([Chunk(prompt, pair[0]), Chunk(other, pair[1])])
    rels = []
    for _ in range(steps):
        tok, tok2 = (torch.randint(3, 1000, (1, 1), generator=g).to(device) for _ in range(2))
        a = model.step_chunks([Chunk(tok, alone)])[0]
        b = model.step_chunks([Chunk(tok, pair[0]), Chunk(tok2, pair[1])])[0]
        rels.append(round(float((b - a).norm() / a.norm()), 6))
    return rels


def _steps_logits(model, n: int, context: int, steps: int) -> list[torch.Tensor]:
    states, next_ids = _decoding(model, n, context, seed=300 + n)
    ids = next_ids(steps)
    return [torch.cat(model.step_chunks([Chunk(ids[i * n + j], s) for j, s in enumerate(states)]))
            for i in range(steps)]


class _Without:
    """Session 37's host-side savings switched off in this process, for an A/B in one run (`--without-host-fixes`):
    config lookups re-derived on every call, plugin ops through the torch.ops dispatcher, window KV rows
    quantized by the reference's ops. (The Gluon layouts made once per shape stay.)"""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        from dsflash.model_def import dispatch
        from dsflash.model_def.csa2 import Attention
        from dsflash.plugins import tuning
        self.saved = (tuning.ConfigTable.get, dispatch._eager_ops)
        get = tuning.ConfigTable.get
        tuning.ConfigTable.get = lambda table, key, default, tag, args=None: get(table, key, default, tag)
        dispatch.use_eager_ops(None)
        self.kv = [m for m in self.model.modules() if isinstance(m, Attention) and m.fused_kv_quant]
        for m in self.kv:
            m.fused_kv_quant = False
        return self

    def __exit__(self, *exc):
        from dsflash.model_def import dispatch
        from dsflash.plugins import tuning
        tuning.ConfigTable.get = self.saved[0]
        dispatch.use_eager_ops(self.saved[1])
        for m in self.kv:
            m.fused_kv_quant = True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", required=True)
    p.add_argument("--requests", default="1,8,32", help="comma list of request counts")
    p.add_argument("--context", type=int, default=100, help="prompt tokens per request before the timed steps")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--simulate-rank", type=int, default=None,
                   help="a multi-rank engine: this rank alone, its all-reduces local no-ops (design.md §5)")
    p.add_argument("--fused-only", action="store_true", help="skip the per-request forwards (large models)")
    p.add_argument("--kernel-time", action="store_true",
                   help="on a GPU, also profile the fused steps: kernel ms and kernels per step")
    p.add_argument("--host-profile", action="store_true",
                   help="also profile a fused step's host side: torch ops and Python functions per step")
    p.add_argument("--without-host-fixes", action="store_true",
                   help="also time the fused steps with session 37's host-side savings switched off (same process)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="also time the fused steps as piecewise graphs (V4.1), and check their logits")
    p.add_argument("--decode-slots", action="store_true",
                   help="also time the fused steps with the caches in decode slots (V4.1), eager and as one graph "
                        "per step, and compare their logits with the list caches'")
    p.add_argument("--slot-max-seq-len", type=int, default=0,
                   help="the decode slots' max_seq_len (their fixed entry rows, which every slot step reads; default: "
                        "just what the timed steps reach)")
    p.add_argument("--without-flag", action="append", default=[], metavar="FLAG",
                   help="with --decode-slots: also time the one-graph slot steps with these plugin flags of the "
                        "model's modules off (comma list, e.g. fused_rope,fused_attention), same process; repeatable")
    a = p.parse_args(argv)
    t_load = time.perf_counter()
    if a.simulate_rank is None:
        model = load_engine_model(a.engine)[0]
    else:
        from dsflash.serve.llm_engine import _simulated_comm
        comm = _simulated_comm(a.engine, a.simulate_rank, None)
        model = load_engine_model(a.engine, a.simulate_rank, comm=comm)[0]
    load_s = time.perf_counter() - t_load
    load_peak_gib = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    print(f"loaded in {load_s:.1f} s" + (f", peak {load_peak_gib:.1f} GiB allocated" if load_peak_gib else ""),
          flush=True)
    meta = {"engine": a.engine, "simulate_rank": a.simulate_rank, "context": a.context, "steps": a.steps,
            "device": str(model.head.weight.device), "torch": torch.__version__,
            "load_s": round(load_s, 1), "load_peak_gib": load_peak_gib and round(load_peak_gib, 2)}
    rows = []
    for n in (int(v) for v in a.requests.split(",")):
        fused = time_steps(model, n, a.context, a.steps, fused=True)
        rows.append({"requests": n, "fused_ms": round(fused, 2)})
        if a.without_host_fixes:
            with _Without(model):
                rows[-1]["fused_ms_without_host_fixes"] = round(time_steps(model, n, a.context, a.steps, True), 2)
        if a.cuda_graph:
            from dsflash.serve.runtime.cuda_graphs import CudaGraphConfig, DecodeGraphs
            model.cuda_graphs = DecodeGraphs(model, CudaGraphConfig([n]), backend_for(model))
            try:
                rows[-1]["graph_ms"] = round(time_steps(model, n, a.context, a.steps, True), 2)
                rows[-1] |= graph_parity(model, n, a.context, 4) | {"graph_counts": model.cuda_graphs.counts,
                                                                     "graph_disabled": model.cuda_graphs.disabled}
            finally:
                model.cuda_graphs = None
        if a.decode_slots:
            rows[-1] |= slot_rows(model, n, a, backend_for(model))
        if not a.fused_only:
            alone = time_steps(model, n, a.context, a.steps, fused=False)
            rows[-1] |= {"per_request_ms": round(alone, 2), "speedup": round(alone / fused, 2)}
        if a.kernel_time:
            rows[-1] |= kernel_time(model, n, a.context, min(a.steps, 5))
        if a.host_profile:
            rows[-1] |= host_profile(model, n, a.context, min(a.steps, 5))
        if a.json:   # after every row: a run cut off by its time limit keeps the rows it finished
            write_text_atomic(a.json, json.dumps({"meta": meta, "rows": rows}, indent=1))
        print({k: v for k, v in rows[-1].items() if not k.startswith(("top_", "slot_graph_kernels"))}, flush=True)
        for name, us in list(rows[-1].get("top_kernels_us", {}).items())[:10]:
            print(f"  kernel: {us} µs {name[:100]}", flush=True)
        for key in [k for k in rows[-1] if k.startswith("slot_graph_kernels")]:
            print(f"  {key}: {rows[-1][key]['kernel_ms']} kernel ms, {rows[-1][key]['kernels']} kernels per step")
        slot_k = rows[-1].get("slot_graph_kernels", {})
        for name, us in list(slot_k.get("top_kernels_us", {}).items())[:30]:
            print(f"  slot graph kernel: {us} µs {name[:100]}", flush=True)
        for name, c in list(rows[-1].get("top_kernels_by_count", {}).items())[:25]:
            print(f"  kernel: {c} per step {name[:100]}", flush=True)
        for key in ("top_torch_ops", "top_python_own_us", "top_ours_cumulative_us"):
            for r in rows[-1].get(key, [])[:25]:
                print(f"  {key}: {r}", flush=True)
    print("| requests | fused ms/step | CUDA graphs ms/step | slots ms/step | slots + one graph ms/step | "
          "without host fixes | per-request ms/step | speedup | GPU kernel ms/step | kernels/step |\n"
          "|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['requests']} | {r['fused_ms']} | {r.get('graph_ms', '-')} | {r.get('slot_ms', '-')} | "
              f"{r.get('slot_graph_ms', '-')} | "
              f"{r.get('fused_ms_without_host_fixes', '-')} | "
              f"{r.get('per_request_ms', '-')} | {r.get('speedup', '-')} | {r.get('kernel_ms', '-')} | "
              f"{r.get('kernels', '-')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
