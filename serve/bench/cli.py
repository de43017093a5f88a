"""`dsflash bench`: trtllm-bench's verbs over a dsflash engine (conventions.md §3).

  dsflash bench prepare-dataset --tokenizer DIR --output data.jsonl token-norm-dist --num-requests 64 \\
      --input-mean 8192 --input-stdev 0 --output-mean 1024 --output-stdev 0
  dsflash bench throughput --engine DIR --dataset data.jsonl --concurrency 1,4,8,16,32,64 --streaming \\
      --report-json report.json --plot sweep.svg
  dsflash bench latency --engine DIR --dataset data.jsonl
  dsflash bench throughput --load-format dummy --model-preset v41/tiny --dataset data.jsonl
  dsflash bench serving --base-url http://127.0.0.1:8000 --dataset data.jsonl --max-concurrency 1,4,16
  dsflash bench collectives --world-size 2 --output allreduce.json
  dsflash bench throughput --engine TP8_ENGINE --simulate-rank 0 --collective-cost allreduce.json --dataset ...

`throughput` runs the dataset through the in-flight batching engine at each `--concurrency` (-1: every request at
once) after `--warmup` untimed requests, and reports trtllm-bench's metrics (request and token throughput, per-user
and per-GPU throughput, latency percentiles; TTFT / TPOT / generation speed with `--streaming`, a sweep or
`--plot`), as its console sections and, with `--report-json`, its JSON keys. Several concurrencies also print one
table of the seed post's figures (tok/s/user = 1000 / median TPOT, tok/s/GPU) and, with `--plot`, draw them.
`latency` is `throughput` at concurrency 1 with streaming metrics. Warm-up and failed requests are never counted;
failed ones are reported, and a run where any request failed exits 1. Multi-rank engines relaunch the command under
`mpirun -n <world>`. `serving` does the same against a running OpenAI-compatible server (streamed completions),
reporting trtllm-serve's `benchmark_serving` keys.

TP-rank simulation (design.md §5): `--simulate-rank R` runs rank R of a multi-rank engine alone, its all-reduces
local no-ops, and labels every figure simulated; `--collective-cost FILE` adds each all-reduce's time as measured
by `dsflash bench collectives --world-size N --output FILE` on the ranks at hand. Per-GPU figures divide by the
engine's world size. Every multi-rank report counts the all-reduces (calls, bytes) it made.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
from pathlib import Path

from dsflash.convert.atomic import write_text_atomic
from dsflash.serve.bench.collectives import DEFAULT_SIZES, CollectiveCost, measure_all_reduce
from dsflash.serve.bench.dataset import (DatasetError, dataset_metadata, load_dataset, token_norm_dist,
                                         token_unif_dist, warmup_requests, write_dataset)
from dsflash.serve.runtime.cuda_graphs import add_cli_args as add_cuda_graph_args, config_from_cli
from dsflash.serve.server import add_speculative_args, speculative_config

DUMMY_ROOT = Path("out/bench")
MODEL_NAMES = {"v41": "DeepSeek-V4.1-Flash", "v4": "DeepSeek-V4-Flash"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsflash bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True,
                           metavar="{prepare-dataset,throughput,latency,serving,collectives}")

    d = sub.add_parser("prepare-dataset", help="write a synthetic dataset (JSON Lines)")
    d.add_argument("--tokenizer", required=True,
                   help="engine, canonical or HF checkpoint dir (its vocabulary size and EOS id)")
    out = d.add_mutually_exclusive_group(required=True)
    out.add_argument("--output", help="dataset file to write")
    out.add_argument("--stdout", action="store_true", help="print the dataset instead")
    d.add_argument("--random-seed", "--random_seed", type=int, default=420)
    dist = d.add_subparsers(dest="dist", required=True, metavar="{token-norm-dist,token-unif-dist}")
    n = dist.add_parser("token-norm-dist", help="normally distributed lengths (stdev 0: fixed)")
    u = dist.add_parser("token-unif-dist", help="uniformly distributed lengths, bounds included")
    for q in (n, u):
        q.add_argument("--num-requests", "--num_requests", type=int, required=True)
    for flag in ("--input-mean", "--input-stdev", "--output-mean", "--output-stdev"):
        n.add_argument(flag, flag.replace("-", "_").replace("__", "--"), type=float, required=True)
    for flag in ("--input-min", "--input-max", "--output-min", "--output-max"):
        u.add_argument(flag, flag.replace("-", "_").replace("__", "--"), type=int, required=True)

    for name, help_text in (("throughput", "throughput at one or several concurrencies"),
                            ("latency", "single-request latency (concurrency 1, streaming metrics)")):
        r = sub.add_parser(name, help=help_text)
        src = r.add_mutually_exclusive_group(required=True)
        src.add_argument("--engine", "--engine_dir", dest="engine", help="engine directory made by `dsflash build`")
        src.add_argument("--load-format", "--load_format", choices=("dummy",),
                         help="dummy: random weights of --model-preset, synthesized and built here")
        r.add_argument("--model-preset", help="family/name of the dummy model (e.g. v41/tiny)")
        r.add_argument("--tp", type=int, default=1, help="dummy engines: tensor-parallel size")
        r.add_argument("--ep", type=int, default=None, help="dummy engines: MoE expert-parallel size")
        r.add_argument("--tune-budget-s", type=float, default=None,
                       help="dummy engines: wall-clock cap of the build's kernel tuning (default: build's, 600 s)")
        r.add_argument("--workspace", "-w", default=str(DUMMY_ROOT),
                       help=f"where dummy engines are built and kept (default {DUMMY_ROOT})")
        r.add_argument("--dataset", required=True, help="JSON Lines dataset (dsflash bench prepare-dataset)")
        r.add_argument("--num-requests", "--num_requests", type=int, default=0,
                       help="use the first N requests (0: all)")
        r.add_argument("--warmup", type=int, default=2, help="untimed requests before each run (default 2)")
        if name == "throughput":
            r.add_argument("--concurrency", default="-1",
                           help="requests in flight: one value or a comma list (a sweep); -1 = all at once")
            r.add_argument("--streaming", action="store_true",
                           help="also report TTFT, TPOT and generation speed (implied by a sweep and by --plot)")
        r.add_argument("--eos-id", "--eos_id", type=int, default=-1,
                       help="-1 (default): ignore EOS, every request generates exactly its output_tokens")
        r.add_argument("--max-batch-size", "--max_batch_size", type=int, default=None)
        r.add_argument("--max-num-tokens", "--max_num_tokens", type=int, default=None)
        r.add_argument("--max-seq-len", "--max_seq_len", type=int, default=None,
                       help="limits: lower the engine's (dummy engines: build with these; defaults 64, 8192, 8192)")
        r.add_argument("--batch-invariant", action="store_true",
                       help="one forward per request and step (as `dsflash serve --batch-invariant`)")
        kv = r.add_mutually_exclusive_group()
        kv.add_argument("--kv-cache-free-gpu-mem-fraction", "--kv_cache_free_gpu_mem_fraction", type=float,
                        default=0.9, help="KV-cache pool as a fraction of free device memory (default 0.9)")
        kv.add_argument("--kv-cache-bytes", type=int, default=None, help="KV-cache pool size in bytes")
        r.add_argument("--report-json", "--report_json", help="write the report (trtllm-bench keys) here")
        r.add_argument("--request-json", "--request_json", help="write one record per request here")
        r.add_argument("--plot", help="throughput sweep: write tok/s/GPU against tok/s/user here (SVG)")
        r.add_argument("--no-progress", action="store_true", help="no progress bars")
        sim = r.add_argument_group("TP-rank simulation (design.md §5): one rank of a multi-rank engine alone")
        sim.add_argument("--simulate-rank", type=int, default=None, metavar="R",
                         help="run rank R's shard and work in this process, its all-reduces local no-ops (the "
                              "outputs are not the model's; the report is labelled simulated)")
        sim.add_argument("--collective-cost", metavar="FILE",
                         help="add each all-reduce's measured time (a `dsflash bench collectives` file)")
        add_speculative_args(r)
        add_cuda_graph_args(r)

    v = sub.add_parser("serving", help="benchmark a running OpenAI-compatible server (as benchmark_serving does)")
    v.add_argument("--base-url", default="http://127.0.0.1:8000", help="server address (default %(default)s)")
    v.add_argument("--model", default=None, help="model id to request (default: the server's first)")
    v.add_argument("--dataset", required=True, help="JSON Lines dataset (dsflash bench prepare-dataset)")
    v.add_argument("--tokenizer", default=None, help="engine or checkpoint dir to tokenize `prompt` lines with")
    v.add_argument("--num-prompts", "--num-requests", dest="num_requests", type=int, default=0,
                   help="use the first N requests (0: all)")
    v.add_argument("--max-concurrency", default="-1",
                   help="requests open at once: one value or a comma list (a sweep); -1 = all at once")
    v.add_argument("--warmup", type=int, default=2, help="untimed requests before each run (default 2)")
    v.add_argument("--num-gpus", type=int, default=1, help="GPUs behind the server, for tok/s/GPU (default 1)")
    v.add_argument("--api-key", default=None, help="Bearer key (default: env DSFLASH_API_KEY)")
    v.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request (default 600)")
    v.add_argument("--save-result", "--report-json", dest="report_json",
                   help="write benchmark_serving's result keys (and the trtllm-bench sections) here")
    v.add_argument("--plot", help="a sweep: write tok/s/GPU against tok/s/user here (SVG)")
    v.add_argument("--no-progress", action="store_true", help="no progress bars")

    c = sub.add_parser("collectives", help="measure TP all-reduce time by message size (for --collective-cost)")
    c.add_argument("--world-size", type=int, default=2, help="ranks to measure on (default 2; mpirun -n)")
    c.add_argument("--output", required=True, help="JSON file to write")
    c.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)),
                   help="message sizes in bytes, comma-separated (default 1 KiB .. 64 MiB, x4)")
    c.add_argument("--iters", type=int, default=20, help="all-reduces per timed round (fewer for large messages)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    try:
        if a.command == "prepare-dataset":
            return prepare_dataset(a)
        if a.command == "collectives":
            return collectives(a, argv)
        if a.command == "serving":
            return serving(a)
        return benchmark(a, argv)
    except (DatasetError, ValueError, OSError) as e:
        print(f"dsflash bench {a.command}: {e}", file=sys.stderr)
        return 2


# -- prepare-dataset --------------------------------------------------------------------------------------------------
def model_args_of(path: str):
    """Model args of an engine dir (engine.json) or a checkpoint dir (config.json)."""
    from dsflash.build.engine import open_engine
    from dsflash.model_def import load_args
    if (Path(path) / "engine.json").is_file():
        return open_engine(path, check_arch=False).args
    return load_args(path)


def prepare_dataset(a: argparse.Namespace) -> int:
    args = model_args_of(a.tokenizer)
    eos = args.eos_token_id
    if a.dist == "token-norm-dist":
        reqs = token_norm_dist(a.num_requests, a.input_mean, a.input_stdev, a.output_mean, a.output_stdev,
                               args.vocab_size, eos, a.random_seed)
    else:
        reqs = token_unif_dist(a.num_requests, a.input_min, a.input_max, a.output_min, a.output_max,
                               args.vocab_size, eos, a.random_seed)
    write_dataset(reqs, None if a.stdout else a.output)
    if not a.stdout:
        meta = dataset_metadata(reqs, a.output)
        print(f"wrote {meta['num_requests']} requests to {a.output} (avg ISL {meta['avg_isl']:.1f}, "
              f"avg OSL {meta['avg_osl']:.1f})")
    return 0


# -- throughput / latency ---------------------------------------------------------------------------------------------
def concurrencies(text: str, flag: str = "--concurrency") -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be integers separated by commas, got {text!r}") from None
    if not values or any(v == 0 or v < -1 for v in values):
        raise ValueError(f"{flag} values must be >= 1 or -1 (all at once), got {text!r}")
    return values


def dummy_engine(a: argparse.Namespace) -> str:
    """Build (once; kept under --workspace) an engine of --model-preset for this machine whose weights are drawn at
    load time (`build.dummy`: no checkpoint, no rank files)."""
    from dsflash.build.dummy import write_dummy_engine
    from dsflash.build.engine import current_arch, is_current_engine
    from dsflash.build.plan import BuildConfig
    from dsflash.model_def import get_preset
    from dsflash.model_def.mapping import Mapping
    if not a.model_preset or "/" not in a.model_preset:
        raise ValueError("--load-format dummy needs --model-preset family/name (e.g. v41/tiny)")
    family, name = a.model_preset.split("/", 1)
    args = get_preset(family, name)
    arch = current_arch()
    tune = {} if a.tune_budget_s is None else {"tune_budget_s": a.tune_budget_s}
    limits = BuildConfig(max_batch_size=a.max_batch_size or 64, max_num_tokens=a.max_num_tokens or 8192,
                         max_seq_len=a.max_seq_len or 8192, **tune)
    tag = f"{arch}-tp{a.tp}" + (f"-ep{a.ep}" if a.ep else "") + \
          f"-b{limits.max_batch_size}-t{limits.max_num_tokens}-s{limits.max_seq_len}" + \
          (f"-tune{limits.tune_budget_s:g}" if tune else "")
    engine = Path(a.workspace) / f"{family}-{name}" / f"engine-{tag}"
    if not is_current_engine(engine):
        if engine.exists():   # kept from another dsflash version: this workspace is ours to rebuild in
            print(f"{engine}: built by another dsflash version (engine format); rebuilding it", file=sys.stderr)
            shutil.rmtree(engine)
        write_dummy_engine(args, engine, Mapping(world_size=a.tp, rank=0, tp_size=a.tp, moe_ep_size=a.ep), arch,
                           limits)
    return str(engine)


def benchmark(a: argparse.Namespace, argv: list[str]) -> int:
    from dsflash.build.engine import EngineError, open_engine
    from dsflash.serve.mpi_launch import relaunch, under_mpi
    if a.load_format == "dummy":
        a.engine = dummy_engine(a)
    elif a.model_preset or a.tune_budget_s is not None:
        raise ValueError("--model-preset and --tune-budget-s go with --load-format dummy")
    try:
        eng = open_engine(a.engine)
    except EngineError as e:
        raise ValueError(str(e)) from None
    levels = [1] if a.command == "latency" else concurrencies(a.concurrency)
    # TTFT / TPOT come with every run here (the engine is in-process); a sweep and a plot need them for tok/s/user
    streaming = a.command == "latency" or a.streaming or len(levels) > 1 or bool(a.plot)
    reqs = _requests(a, eng)            # a bad dataset fails here, before any weight is loaded
    spec = speculative_config(a, eng.args)
    config_from_cli(a)
    if a.collective_cost and a.simulate_rank is None:
        raise ValueError("--collective-cost goes with --simulate-rank")
    if a.simulate_rank is not None:
        cost = CollectiveCost.load(a.collective_cost) if a.collective_cost else None
        return _run_rank0(a, eng, reqs, levels, streaming, spec, cost)
    if spec is not None and eng.world_size != 1:
        raise ValueError(f"speculative decoding runs on single-rank engines only; {a.engine} has "
                         f"{eng.world_size} ranks")
    if eng.world_size > 1 and not under_mpi():
        # the ranks re-run this command (a dummy engine is built by now, so they find it in the workspace)
        rc = relaunch(eng.world_size, "dsflash.serve.bench.cli", argv)
        if rc != 0:
            print(f"dsflash bench: the MPI job exited with status {rc} (see the rank logs above)", file=sys.stderr)
        return rc
    if under_mpi():
        from mpi4py import MPI
        if MPI.COMM_WORLD.Get_rank() > 0:
            from dsflash.serve.llm_engine import worker_loop
            return worker_loop(a.engine) or 0
    return _run_rank0(a, eng, reqs, levels, streaming, spec)


def _requests(a: argparse.Namespace, eng) -> list:
    """The dataset's first --num-requests requests, checked against the engine's vocabulary and max_seq_len."""
    from dsflash.serve.tokenization import DeepseekTokenizer, TokenizerError
    if a.num_requests < 0:
        raise ValueError(f"--num-requests must be >= 0, got {a.num_requests}")
    args = eng.args
    try:
        encode = DeepseekTokenizer(a.engine, bos_token_id=args.bos_token_id).encode
    except TokenizerError:
        encode = None
    reqs = load_dataset(a.dataset, args.vocab_size, encode)
    reqs = reqs[:a.num_requests] if a.num_requests else reqs
    built = int(eng.meta["build_config"]["max_seq_len"])
    max_seq_len = min(a.max_seq_len, built) if a.max_seq_len else built
    for r in reqs:
        if len(r.input_ids) + r.output_tokens > max_seq_len:
            raise DatasetError(f"{a.dataset}: task_id {r.task_id!r} needs {len(r.input_ids)} + {r.output_tokens} "
                               f"tokens; the engine's max_seq_len is {max_seq_len}")
    return reqs


def _run_rank0(a: argparse.Namespace, eng, reqs: list, levels: list[int], streaming: bool, spec,
               cost: CollectiveCost | None = None) -> int:
    from dsflash.serve.bench.report import format_report
    from dsflash.serve.bench.runner import run_requests, warm_up
    from dsflash.serve.bench.stats import headline
    from dsflash.serve.llm_engine import LLMEngine
    engine = None
    try:
        device = "cpu" if eng.meta["arch"] == "cpu" else "cuda"
        wait = (lambda nbytes: cost.wait(nbytes, device)) if cost is not None else None
        engine = LLMEngine(a.engine, kv_cache_bytes=a.kv_cache_bytes, max_batch_size=a.max_batch_size,
                           max_num_tokens=a.max_num_tokens, max_seq_len=a.max_seq_len, max_queue=1 << 20,
                           kv_cache_free_gpu_memory_fraction=a.kv_cache_free_gpu_mem_fraction, speculative=spec,
                           simulate_rank=a.simulate_rank, comm_wait=wait, batch_invariant=a.batch_invariant,
                           cuda_graph=config_from_cli(a))
        reports, rows, records_out, any_failed = [], [], [], False
        for c in levels:
            warm_up(engine, reqs, a.warmup, c, a.eos_id)
            before = _comm_snapshot(engine, cost)
            done, failed = run_requests(engine, reqs, c, a.eos_id, progress=not a.no_progress)
            any_failed |= bool(failed)
            for f in failed:
                print(f"dsflash bench: request {f.task_id!r} failed (not counted): {f.error}", file=sys.stderr)
            rep = _report(a, eng, engine, reqs, done, failed, c, streaming, spec)
            if eng.world_size > 1:
                rep["collectives"] = _collectives(engine, cost, before)
            if a.simulate_rank is not None:
                rep["simulation"] = _simulation(a, eng, cost)
            print(format_report(rep))
            reports.append(rep)
            rows.append(headline(rep))
            records_out += [{"concurrency": c, **r.to_json()} for r in done + failed]
    finally:
        if engine is not None:
            engine.shutdown()
    title = f"{Path(a.engine).name}: {reports[0]['request_info']['avg_input_length']:.0f} in / " \
            f"{reports[0]['dataset']['avg_osl']:.0f} out"
    if a.simulate_rank is not None:
        title += f" (SIMULATED: rank {a.simulate_rank} of {eng.world_size})"
    _write_sweep(a, rows, reports, title, "GPUs")
    if a.request_json:
        write_text_atomic(a.request_json, json.dumps(records_out) + "\n")
    return 1 if any_failed else 0


def _write_sweep(a: argparse.Namespace, rows: list[dict], runs: list[dict], title: str, gpus: str) -> None:
    """A sweep's table on stdout; the report (one run's, or the sweep's) to --report-json, the plot to --plot."""
    from dsflash.serve.bench.report import format_sweep, sweep_svg
    if len(runs) > 1:
        print(f"\nsweep (tok/s/user = 1000 / median TPOT; tok/s/GPU = output throughput incl. prefill / {gpus}):")
        print(format_sweep(rows))
    if a.report_json:
        doc = runs[0] if len(runs) == 1 else {"sweep": rows, "runs": runs}
        write_text_atomic(a.report_json, json.dumps(doc, indent=2) + "\n")
    if a.plot:
        write_text_atomic(a.plot, sweep_svg(rows, title))


def _comm_snapshot(engine, cost) -> tuple[int, int, float]:
    counts = getattr(engine.comm, "counts", None)
    return ((counts.calls, counts.bytes) if counts else (0, 0)) + ((cost.waited_us,) if cost else (0.0,))


def _collectives(engine, cost: CollectiveCost | None, before: tuple[int, int, float]) -> dict:
    """The run's TP all-reduces as rank 0 (or the simulated rank) made them, and the time added for them."""
    calls, nbytes, waited = (x - y for x, y in zip(_comm_snapshot(engine, cost), before))
    return {"all_reduce_calls": calls, "all_reduce_bytes": nbytes,
            "added_collective_ms": waited / 1e3 if cost else None}


def _simulation(a, eng, cost: CollectiveCost | None) -> dict:
    """The report's `simulation` section: which rank stood for the engine and how its collectives were treated."""
    return {"simulated": True, "simulated_rank": a.simulate_rank, "world_size": eng.world_size,
            "collectives": "all-reduces as local no-ops" + (" + their measured time" if cost else
                                                            " (their time not included)"),
            "collective_cost": None if cost is None else {"source": cost.source, **cost.meta}}


def collectives(a: argparse.Namespace, argv: list[str]) -> int:
    """Measure fp32 all-reduce time by size on --world-size ranks (relaunching under mpirun) into --output."""
    from dsflash.serve.mpi_launch import init_distributed, relaunch, under_mpi
    try:
        sizes = [int(v) for v in a.sizes.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--sizes must be byte counts separated by commas, got {a.sizes!r}") from None
    if not sizes or min(sizes) < 4:
        raise ValueError(f"--sizes must be byte counts >= 4, got {a.sizes!r}")
    if a.world_size < 2 or a.iters < 1:
        raise ValueError("--world-size must be >= 2 and --iters >= 1")
    if not under_mpi():
        rc = relaunch(a.world_size, "dsflash.serve.bench.cli", argv)
        if rc != 0:
            print(f"dsflash bench collectives: the MPI job exited with status {rc}", file=sys.stderr)
        return rc
    import torch
    import torch.distributed as dist
    rank, world, _ = init_distributed()
    if world != a.world_size:
        raise ValueError(f"--world-size {a.world_size}, but {world} MPI processes are running")
    device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    points = measure_all_reduce(sizes, a.iters, device)
    if rank == 0:
        doc = {"backend": dist.get_backend(), "world_size": world, "device": device.split(":")[0],
               "machine": _machine(), "dtype": "float32", "all_reduce_us": [[b, round(us, 3)] for b, us in points]}
        write_text_atomic(a.output, json.dumps(doc, indent=2) + "\n")
        print(f"all-reduce ({doc['backend']}, {world} ranks, fp32):")
        for b, us in points:
            print(f"  {b:>12} B  {us:10.1f} us  {b / us / 1e3:8.2f} GB/s")
    dist.destroy_process_group()
    return 0


def serving(a: argparse.Namespace) -> int:
    """Stream the dataset's requests to a running server at each --max-concurrency; benchmark_serving's report."""
    from dsflash.serve.bench.report import format_serving
    from dsflash.serve.bench.serving import run_serving, server_model
    from dsflash.serve.bench.stats import headline, serving_result, summarize
    levels = concurrencies(a.max_concurrency, "--max-concurrency")
    if a.num_requests < 0 or a.num_gpus < 1:
        raise ValueError("--num-prompts must be >= 0 and --num-gpus >= 1")
    encode = None
    if a.tokenizer:
        from dsflash.serve.tokenization import DeepseekTokenizer
        encode = DeepseekTokenizer(a.tokenizer, bos_token_id=model_args_of(a.tokenizer).bos_token_id).encode
    reqs = load_dataset(a.dataset, 1 << 31, encode)      # the server checks the ids against its vocabulary
    reqs = reqs[:a.num_requests] if a.num_requests else reqs
    base = a.base_url.rstrip("/")
    key = a.api_key or os.environ.get("DSFLASH_API_KEY") or None
    model = a.model or server_model(base, key)
    results, rows, any_failed = [], [], False
    for c in levels:
        if a.warmup > 0:
            run_serving(base, model, warmup_requests(reqs, a.warmup), c, key, a.request_timeout, tag="warmup",
                        progress=False)
        done, failed, gaps = run_serving(base, model, reqs, c, key, a.request_timeout, progress=not a.no_progress)
        for f in failed:
            print(f"dsflash bench serving: request {f.task_id!r} failed (not counted): {f.error}", file=sys.stderr)
        any_failed |= bool(failed)
        res = {"base_url": base, "model": model, **serving_result(done, failed, gaps, c)}
        trt = summarize(done, a.num_gpus, streaming=True)
        res["trtllm_bench"] = {"request_info": trt["request_info"], "performance": trt["performance"],
                               "streaming_metrics": trt["streaming_metrics"]}
        print(format_serving(res))
        results.append(res)
        rows.append(headline({"world_info": {"concurrency": c}, **trt}))
    _write_sweep(a, rows, results, f"{model} at {base}", "--num-gpus")
    return 1 if any_failed else 0


def _report(a, eng, engine, reqs, done, failed, concurrency: int, streaming: bool, spec) -> dict:
    from dsflash.build.engine import default_dtype
    from dsflash.serve.bench.stats import decoding_stats, summarize
    from dsflash.serve.cli import package_version
    meta, mapping = eng.meta, eng.meta["mapping"]
    built = meta["build_config"]
    s = summarize(done, eng.world_size, streaming)
    rep = {
        "engine": {"model": MODEL_NAMES.get(eng.args.family, eng.args.family),
                   "model_path": meta.get("source"), "engine_dir": str(Path(a.engine).resolve()),
                   "version": package_version(), "backend": "dsflash", "arch": meta["arch"],
                   "dtype": built.get("dtype") or default_dtype(meta["arch"]),
                   "kv_cache_dtype": built.get("kv_cache_dtype", "auto"),
                   "quantization": _quantization(meta), "max_sequence_length": engine.max_seq_len},
        "machine": _machine(),
        "world_info": {"tp_size": mapping["tp_size"], "pp_size": mapping.get("pp_size", 1),
                       "ep_size": mapping.get("moe_ep_size") or 1, "world_size": eng.world_size,
                       "max_batch_size": engine.max_batch_size, "max_num_tokens": engine.max_num_tokens,
                       "scheduling_policy": "fcfs (chunked prefill, preemption by recompute)",
                       "kv_cache_percentage": None if a.kv_cache_bytes else a.kv_cache_free_gpu_mem_fraction,
                       "kv_cache_bytes": engine.cache.total_blocks * engine.cache.layout.bytes_per_block,
                       "issue_rate": s["issue_rate"], "concurrency": concurrency, "warmup_requests": a.warmup},
        "request_info": {**s["request_info"], "num_failed_requests": len(failed)},
        "performance": s["performance"],
        **({"streaming_metrics": s["streaming_metrics"]} if streaming else {}),
        **({"decoding_stats": decoding_stats(done, spec.algorithm, spec.num_draft_tokens)} if spec else {}),
        "dataset": dataset_metadata(reqs, a.dataset),
    }
    return rep


def _quantization(meta: dict) -> str:
    q = meta["model"].get("quantization_config") or {}
    block = q.get("weight_block_size")
    dense = f"FP8 {block[0]}x{block[1]} blocks" if block else "none"
    return f"dense {dense}, experts {meta.get('expert_dtype') or 'bf16'} ({meta.get('layout')} layout)"


def _machine() -> dict:
    import torch
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        return {"name": p.name, "memory.total": round(p.total_memory / 2 ** 30, 2)}
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    return {"name": f"CPU {platform.processor() or platform.machine()} ({os.cpu_count()} cores)",
            "memory.total": round(mem / 2 ** 30, 2)}


if __name__ == "__main__":
    sys.exit(main())
