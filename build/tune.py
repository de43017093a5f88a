"""Build-time autotuning and the `tuned.json` format; serve only looks configs up (never tunes).

tuned.json: {"version": 1, "arch", "gpu", "versions": {torch, python, triton?},
  "entries": [{"op", "bucket", "config", "time_us", "candidates": {config-key: time_us}, "failed"?: {config-key: error}}],
  "skipped": [{"op", "reason", "buckets"?}]}.
Shapes are bucketed (token counts rounded up to the bucket list); a lookup that finds no entry returns the op's
fallback config and logs that once per (op, bucket) — never silently. A candidate that fails to compile, launch or
match the reference is listed under "failed" and never chosen. "skipped" names what was not tuned and why: an op whose
device this machine lacks (e.g. an sm90 engine built on a CPU machine), buckets left when the time budget ran out,
or buckets where every candidate failed; serve then uses the defaults and logs each fallback.

Ops (sm90; CPU and sm100 engines have none to tune): "fp8_gemm": the FP8 GEMM per local dense linear shape, bucket {"n", "k", "m", "bf16_cache"; "group": 128 for V4's 1×128 / 128×128 scale groups},
config {"path": "fp8", "config": GemmConfig dict} or {"path": "bf16cache"} (the BF16-cache GEMM, a candidate where
the engine holds `.weight_bf16`).
`gemm_table(tuned)` turns these entries into `plugins.tuning.set_table` input. And for sm90 engines that bind the
MoE plugin, "moe": the MXFP4 expert kernels' tiles per local expert shape, bucket {"e", "inter" (padded), "inter_valid",
"d", "topk", "swiglu_limit", "m"; "ep" under expert parallelism; "qblock": 128 for V4's 1×128 activations}, config
a `plugins.moe_config.MoeConfig` dict (`moe_table(tuned)` -> `moe_config.set_table`).
"""
from __future__ import annotations

import functools
import importlib.util
import json
import logging
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from dsflash.build.gemm_shapes import dense_gemm_shapes
from dsflash.model_def.config import args_from_hf_dict
from dsflash.model_def.dispatch import MOE_PLUGINS
from dsflash.model_def.mapping import Mapping

TUNED_FILE = "tuned.json"
M_BUCKETS = (1, 8, 64, 512, 4096)
TUNE_BUDGET_S = 600.0  # whole tune() run; build_config["tune_budget_s"] overrides
log = logging.getLogger("dsflash.tune")


@dataclass(frozen=True)
class TunableOp:
    name: str
    buckets: Callable[[dict], list[dict]]  # engine meta -> shape buckets to tune
    candidates: Callable[[dict], list[dict]]  # bucket -> candidate configs
    make: Callable[[dict, dict], Callable[[], object]]  # (bucket, config) -> runnable (raises: candidate failed)
    fallback: dict
    device: str = "cpu"  # "cuda": timed on the GPU, and only on a GPU of the engine's arch
    cleanup: Callable[[], None] | None = field(default=None, compare=False)  # after the op: free cached inputs


def m_bucket(m: int) -> int:
    return next((b for b in M_BUCKETS if m <= b), M_BUCKETS[-1])


# -- fp8_gemm: group-32 FP8 GEMM configs vs the BF16-cache GEMM, per local dense linear shape ------------------------
GEMM_REL_TOL = 1e-2    # both paths multiply exactly and accumulate in fp32: only the BF16 output rounds


def _m_buckets_for(engine: dict) -> list[int]:
    """M_BUCKETS up to the build's max_num_tokens (1 always): serve never runs a larger M."""
    limit = engine.get("build_config", {}).get("max_num_tokens", M_BUCKETS[-1])
    return [m for m in M_BUCKETS if m <= limit or m == 1]


def _fp8_gemm_buckets(engine: dict) -> list[dict]:
    if engine.get("plugins", {}).get("gemm") == "reference":   # `--disable-plugin gemm`: nothing will look it up
        return []
    # rank 0 stands for all: TP cuts are even (split_range), so every rank runs the same dense shapes
    shapes = dense_gemm_shapes(engine, 0)
    # by M first: decode buckets, the most config-sensitive, are tuned before a time budget can run out
    # "group" only where it is not V4.1's 32, so V4.1 buckets keep their tuned.json form
    return [{"n": s["n"], "k": s["k"], "m": m, "bf16_cache": s["bf16_cache"],
             **({"group": s["group"]} if s["group"] != 32 else {})}
            for m in _m_buckets_for(engine) for s in shapes]


def _fp8_gemm_candidates(bucket: dict) -> list[dict]:
    from dsflash.plugins import tuning
    # engines hold the plain [N, K] weight, not a per-config re-tiled copy: `tiled_w` configs cannot run in serve
    out = [{"path": "fp8", "config": c.to_dict()}
           for c in tuning.candidates(bucket["n"], bucket["k"], bucket["m"], bucket.get("group", 32)) if not c.tiled_w]
    if bucket["bf16_cache"]:
        out.append({"path": "bf16cache"})
    return out


class _GemmInputs:
    """Random CUDA inputs of one (N, K, M), enough sets to stream the weights from HBM (`timing.input_sets`):
    quantized weights, BF16 activations, and lazily the BF16 weight copies and the fp32 reference output (shared by
    all candidates of a bucket)."""

    def __init__(self, n: int, k: int, m: int, group: int = 32):
        from dsflash.plugins import refs
        from dsflash.plugins.timing import input_sets
        sets = input_sets(n * k + m * k)
        gen = torch.Generator(device="cuda").manual_seed(0)
        self.group = group
        self.ws = [refs.quant_weight_fp8_ref(torch.randn(n, k, device="cuda", generator=gen) * 0.02, group)
                   for _ in range(sets)]
        self.xs = [(torch.randn(m, k, device="cuda", generator=gen) * 2).to(torch.bfloat16) for _ in range(sets)]
        self._w16: list[torch.Tensor] | None = None
        self._ws_t: list[torch.Tensor] | None = None
        self._ref: torch.Tensor | None = None

    def w16(self) -> list[torch.Tensor]:
        from dsflash.plugins.fp8_gemm import bf16_cache_weight
        if self._w16 is None:
            self._w16 = [bf16_cache_weight(*w) for w in self.ws]
        return self._w16

    def ws_t(self) -> list[torch.Tensor]:
        """The weight scales as the sm90 CUDA GEMM reads them (an `FP8Linear` holds them from bind time)."""
        from dsflash.plugins.fp8_gemm_sm90 import weight_scales_f32
        if self._ws_t is None:
            self._ws_t = [weight_scales_f32(s, tma=True) for _, s in self.ws]
        return self._ws_t

    def ref(self) -> torch.Tensor:
        from dsflash.plugins import refs
        if self._ref is None:
            self._ref = refs.fp8_gemm_ref(*refs.act_quant_ref(self.xs[0], block=self.group), *self.ws[0],
                                          torch.float32)
        return self._ref


@functools.lru_cache(maxsize=1)  # one bucket's inputs at a time: full-size weights are hundreds of MB per set
def _gemm_inputs(n: int, k: int, m: int, group: int = 32) -> _GemmInputs:
    return _GemmInputs(n, k, m, group)


class _Rotation:
    """One runnable per input set; the CUDA timer captures them round-robin (calling it runs the first set)."""

    def __init__(self, calls: list[Callable[[], object]]):
        self.calls = calls

    def __call__(self):
        return self.calls[0]()


def _fp8_gemm_make(bucket: dict, cand: dict) -> _Rotation:
    from dsflash.plugins.fp8_gemm import bf16_cache_gemm
    from dsflash.plugins.tuning import GemmConfig
    group = bucket.get("group", 32)
    inp = _gemm_inputs(bucket["n"], bucket["k"], bucket["m"], group)
    # both paths timed as `dsflash::fp8_linear` runs them in serve: from the BF16 activation, quantization included
    if cand["path"] == "bf16cache":
        calls = [functools.partial(bf16_cache_gemm, x, w, act_block=group) for x, w in zip(inp.xs, inp.w16())]
    else:
        from dsflash.plugins.registry import fp8_linear_config
        cfg = GemmConfig.from_dict(cand["config"])
        ws_t = inp.ws_t() if cfg.sm90 else [None] * len(inp.ws)
        calls = [functools.partial(fp8_linear_config, x, *w, cfg, group, w_t)
                 for x, w, w_t in zip(inp.xs, inp.ws, ws_t)]
    return _verified(calls, inp.ref, GEMM_REL_TOL)


def _verified(calls: list[Callable[[], torch.Tensor]], ref: Callable[[], torch.Tensor], tol: float) -> _Rotation:
    """The calls as a `_Rotation`, once the first (which compiles) matches the reference: a config that launches but
    computes wrong must not win on speed."""
    from dsflash.plugins import refs
    err = refs.rel_err(calls[0](), ref())
    if not err <= tol:
        raise ValueError(f"wrong result: rel err {err:.3g} > {tol}")
    return _Rotation(calls)


def _cuda_cleanup(cached_inputs) -> Callable[[], None]:
    """After an op: drop its cached inputs (an lru_cache'd builder) and return their memory to the GPU."""
    def cleanup() -> None:
        cached_inputs.cache_clear()
        torch.cuda.empty_cache()
    return cleanup


FP8_GEMM = TunableOp("fp8_gemm", _fp8_gemm_buckets, _fp8_gemm_candidates, _fp8_gemm_make, {"path": "fp8"},
                     device="cuda", cleanup=_cuda_cleanup(_gemm_inputs))


# -- moe: the MXFP4 expert kernels' tiles, per local expert shape and token bucket -----------------------------------
MOE_REL_TOL = 1e-2        # the decode GEMVs sum each 32-block in f16: measured 1.4e-3 .. 9.6e-3 against moe_ref
MOE_ROUTE_SCALE = 1.5     # timing inputs; any value routes the same way
MOE_DECODE_SETS = 8       # random routings per timed replay (decode reads only the routed experts' bytes)


def _moe_buckets(engine: dict) -> list[dict]:
    """One bucket per token count of `_m_buckets_for`, where the engine binds the MoE plugin (`build.bind._bind_moe`:
    not with norm_topk_prob=false). Under expert parallelism the shape is one rank's block of experts (`e` local,
    `ep` ranks: the routing spreads over e·ep)."""
    if engine.get("plugins", {}).get("moe") not in MOE_PLUGINS:
        return []
    args = args_from_hf_dict(engine["model"], "engine.json")
    if not args.norm_topk_prob:
        return []
    ep = Mapping.from_dict(engine["mapping"]).moe_ep_size
    shape = {"e": args.n_routed_experts // ep, "inter": engine["expert_inter_padded"],
             "inter_valid": engine["expert_inter_local"], "d": args.hidden_size, "topk": args.num_experts_per_tok,
             "swiglu_limit": args.swiglu_limit}
    if ep > 1:   # (buckets of engines without EP keep their keys)
        shape["ep"] = ep
    if args.act_block != 32:   # V4's 1×128 expert activations (V4.1's buckets keep their keys)
        shape["qblock"] = args.act_block
    return [{**shape, "m": m} for m in _m_buckets_for(engine)]


def _moe_candidates(bucket: dict) -> list[dict]:
    from dsflash.plugins.moe_config import moe_candidates
    b = bucket
    return [c.to_dict() for c in moe_candidates(b["m"], b["topk"], b["e"], b["inter"], b["d"], b.get("ep", 1),
                                                b.get("qblock", 32), "sm90")]   # (tuned on sm90 only: TUNABLE_OPS)


class _MoeInputs:
    """Random CUDA inputs of one bucket: stacked MXFP4 experts (padded columns zero, as the engine stores them), a
    router over all e·ep experts (this rank's block is the first: expert_start 0), and token sets; lazily the
    reference output of the first set (shared by all candidates)."""

    def __init__(self, b: dict):
        from dsflash.plugins import refs
        e, ipad, inter, d, m = b["e"], b["inter"], b["inter_valid"], b["d"], b["m"]
        gen = torch.Generator(device="cuda").manual_seed(0)
        self.w13_q, self.w13_s, self.w2_q, self.w2_s = refs.random_mxfp4_experts(e, d, inter, ipad, gen)
        e_all = e * b.get("ep", 1)
        self.gate_w = (torch.randn(e_all, d, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
        self.bias = torch.randn(e_all, device="cuda", generator=gen) * 0.05
        sets = MOE_DECODE_SETS if m <= 64 else 2
        self.xs = [(torch.randn(m, d, device="cuda", generator=gen) * 2).to(torch.bfloat16) for _ in range(sets)]
        self.shared = [torch.randn(m, d, device="cuda", generator=gen) for _ in range(sets)]
        self._ref: torch.Tensor | None = None

    def ref(self, b: dict) -> torch.Tensor:
        from dsflash.plugins import refs
        if self._ref is None:
            ipad = b["inter"]
            halves = (self.w13_q[:, :ipad], self.w13_s[:, :ipad], self.w13_q[:, ipad:], self.w13_s[:, ipad:])
            self._ref = refs.moe_ref(self.xs[0], self.gate_w, self.bias, b["topk"], MOE_ROUTE_SCALE, *halves,
                                     self.w2_q, self.w2_s, b["swiglu_limit"], b["inter_valid"], self.shared[0],
                                     qblock=b.get("qblock", 32))
        return self._ref


@functools.lru_cache(maxsize=1)  # one bucket's inputs at a time: full-size experts are gigabytes
def _moe_inputs(key: str) -> _MoeInputs:
    return _MoeInputs(json.loads(key))


def _moe_make(bucket: dict, cand: dict) -> _Rotation:
    """The whole plugin op as serve runs it (`plugins.moe.moe`: router, expert GEMMs, shared-expert add)."""
    from dsflash.plugins.moe import moe
    from dsflash.plugins.moe_config import MoeConfig
    inp, cfg, b = _moe_inputs(_key(bucket)), MoeConfig.from_dict(cand), bucket
    calls = [functools.partial(moe, x, inp.gate_w, inp.bias, b["topk"], MOE_ROUTE_SCALE, inp.w13_q, inp.w13_s,
                               inp.w2_q, inp.w2_s, b["swiglu_limit"], b["inter_valid"], sh, config=cfg,
                               qblock=b.get("qblock", 32))
             for x, sh in zip(inp.xs, inp.shared)]
    return _verified(calls, functools.partial(inp.ref, b), MOE_REL_TOL)


MOE = TunableOp("moe", _moe_buckets, _moe_candidates, _moe_make, {"rule": "default_moe_config"}, device="cuda",
                cleanup=_cuda_cleanup(_moe_inputs))
TUNABLE_OPS = {"cpu": [], "sm90": [FP8_GEMM, MOE], "sm100": []}


# -- timing -----------------------------------------------------------------------------------------------------------
CUDA_TARGET_US = 2000.0  # GPU time per timed replay: long enough that event resolution and jitter do not matter
CUDA_MAX_CALLS = 512
CUDA_REPS = 7


def _cpu_time_us(fn, reps: int = 2) -> float:
    fn()  # warm-up, not counted
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, (time.perf_counter() - t0) * 1e6)
    return best


def _cuda_times_us(fns: list) -> list[float]:
    """Median per-call times of CUDA graphs of back-to-back calls (serve replays graphs too, so no launch gaps
    count), each rotating over the input sets of a `_Rotation`; the candidates' replays interleaved, so that none
    is timed on a card its predecessors heated (`timing.graph_time_many`)."""
    from dsflash.plugins.timing import graph_time_many
    sets = [getattr(fn, "calls", [fn]) for fn in fns]
    return [us for us, _ in graph_time_many(sets, CUDA_TARGET_US, CUDA_REPS, max_rounds=CUDA_MAX_CALLS,
                                            max_calls=CUDA_MAX_CALLS)]


# -- tuning -----------------------------------------------------------------------------------------------------------
def _key(config: dict) -> str:
    return json.dumps(config, sort_keys=True)


def _cannot_measure(op: TunableOp, arch: str) -> str | None:
    """Why `op` cannot be timed for an `arch` engine on this machine (None: it can)."""
    if op.device != "cuda":
        return None
    if not torch.cuda.is_available():
        return f"building {arch} on a machine without an {arch} GPU (no CUDA device)"
    major, minor = torch.cuda.get_device_capability(0)
    if f"sm{major}{minor}" != arch:
        return f"building {arch} on a machine without an {arch} GPU (device 0 is sm{major}{minor})"
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    return None


def _tune_bucket(op: TunableOp, bucket: dict) -> tuple[dict | None, dict[str, str]]:
    """The bucket's entry (None: no candidate ran) and the failed candidates' errors."""
    times: dict[str, float] = {}
    failed: dict[str, str] = {}
    made: dict[str, Callable] = {}
    for cand in op.candidates(bucket):
        key = _key(cand)
        try:
            fn = op.make(bucket, cand)
            if op.device == "cuda":
                made[key] = fn   # timed below, all together
            else:
                times[key] = _cpu_time_us(fn)
        except Exception as e:  # a config that fails to compile, launch or verify is recorded, never fatal
            failed[key] = f"{type(e).__name__}: {str(e)[:300]}"
    if made:
        try:
            times |= dict(zip(made, _cuda_times_us(list(made.values()))))
        except Exception:  # one of them fails on replay: time them one by one to find it
            for key, fn in made.items():
                try:
                    times[key] = _cuda_times_us([fn])[0]
                except Exception as e:
                    failed[key] = f"{type(e).__name__}: {str(e)[:300]}"
    if not times:
        return None, failed
    best = min(times, key=times.get)
    entry = {"op": op.name, "bucket": bucket, "config": json.loads(best), "time_us": times[best], "candidates": times}
    if failed:
        entry["failed"] = failed
    return entry, failed


def _tune_op(op: TunableOp, engine: dict, deadline: float, entries: list, skipped: list) -> None:
    buckets = op.buckets(engine)
    lost: list[dict] = []
    with tqdm(buckets, desc=f"tune {op.name}", unit="shape", disable=None) as bar:
        for i, bucket in enumerate(bar):
            if time.monotonic() > deadline:
                late = buckets[i:]
                log.warning("%s: tuning time budget spent; %d buckets not tuned (serve falls back for them): %s",
                            op.name, len(late), late)
                skipped.append({"op": op.name, "reason": "time budget spent", "buckets": late})
                break
            entry, failed = _tune_bucket(op, bucket)
            if entry is None:
                log.warning("%s at %s: every candidate failed, e.g. %s", op.name, bucket, next(iter(failed.values())))
                lost.append(bucket)
            else:
                entries.append(entry)
    if lost:
        skipped.append({"op": op.name, "reason": "every candidate failed", "buckets": lost})


def tune(engine: dict, arch: str, ops: list[TunableOp] | None = None) -> dict:
    budget = float(engine.get("build_config", {}).get("tune_budget_s", TUNE_BUDGET_S))
    deadline = time.monotonic() + budget
    entries: list[dict] = []
    skipped: list[dict] = []
    for op in ops if ops is not None else TUNABLE_OPS[arch]:
        reason = _cannot_measure(op, arch)
        if reason is not None:  # never record a timing that does not describe the target GPU
            log.warning("%s not tuned: %s; serve will use the default configs and log each fallback", op.name, reason)
            skipped.append({"op": op.name, "reason": reason})
            continue
        try:
            _tune_op(op, engine, deadline, entries, skipped)
        finally:
            if op.cleanup is not None:
                op.cleanup()
    versions = {"torch": torch.__version__, "python": platform.python_version()}
    try:
        import triton
        versions["triton"] = triton.__version__
    except ImportError:
        pass
    gpu = _this_gpu() or f"cpu:{platform.processor() or 'x86_64'}"
    return {"version": 1, "arch": arch, "gpu": gpu, "versions": versions, "entries": entries, "skipped": skipped}


def write_tuned(engine_dir: Path, engine: dict, arch: str) -> None:
    (Path(engine_dir) / TUNED_FILE).write_text(json.dumps(tune(engine, arch), indent=2))


# -- serve-side readers -------------------------------------------------------------------------------------------------
def _gemm_serve_entry(entry: dict) -> dict:
    """{"path", "config"} of one fp8_gemm entry. A "bf16cache" winner carries the bucket's fastest FP8 config, which
    linears of that shape without a `.weight_bf16` copy (e.g. `mtp.*`) run instead."""
    won = entry["config"]
    if won["path"] == "fp8":
        return {"path": "fp8", "config": won["config"]}
    fp8 = [(t, json.loads(k)) for k, t in entry.get("candidates", {}).items() if json.loads(k)["path"] == "fp8"]
    return {"path": won["path"], "config": min(fp8, key=lambda tc: tc[0])[1]["config"] if fp8 else {}}


def gemm_table(tuned: dict | None) -> dict:
    """tuned.json's fp8_gemm entries as `plugins.tuning.set_table` input {"NxK@B": {"path", "config"}}, B over the
    power-of-two buckets of `tuning.m_bucket`: a tuned M covers the buckets above the next smaller tuned M up to
    itself. Buckets above the largest tuned M stay out (the default config, logged once): a config tuned for few
    tokens may not run more (a GEMV takes at most 8), and a build tunes up to its max_num_tokens anyway."""
    from dsflash.plugins import tuning
    per_shape: dict[tuple[int, int], dict[int, dict]] = {}
    for e in (tuned or {}).get("entries", []):
        if e["op"] == FP8_GEMM.name:
            b = e["bucket"]
            per_shape.setdefault((b["n"], b["k"]), {})[b["m"]] = _gemm_serve_entry(e)
    return {tuning.key_str(n, k, b): v for (n, k), by_m in per_shape.items() for b, v in _pow2_cover(by_m).items()}


def moe_table(tuned: dict | None) -> dict:
    """tuned.json's moe entries as `plugins.moe_config.set_table` input {key_str: MoeConfig dict}, over the
    power-of-two token buckets the way `gemm_table` covers them."""
    from dsflash.plugins.moe_config import key_str
    per_shape: dict[tuple, dict[int, dict]] = {}
    for e in (tuned or {}).get("entries", []):
        if e["op"] == MOE.name:
            b = e["bucket"]
            per_shape.setdefault((b["e"], b["inter"], b["d"], b["topk"], b.get("ep", 1), b.get("qblock", 32)),
                                 {})[b["m"]] = e["config"]
    return {key_str(*shape[:4], b, *shape[4:]): v for shape, by_m in per_shape.items()
            for b, v in _pow2_cover(by_m).items()}


def _pow2_cover(by_m: dict[int, dict]) -> dict[int, dict]:
    """{tuned M: value} -> {power-of-two bucket: value}: a tuned M covers the buckets above the next smaller tuned M
    up to itself; buckets above the largest tuned M stay out."""
    from dsflash.plugins.tuning import m_bucket
    tuned_ms = sorted(by_m)
    out = {}
    for b in sorted({m_bucket(1 << i) for i in range(20)}):
        m = next((t for t in tuned_ms if t >= b), None)
        if m is not None:
            out[b] = by_m[m]
    return out


def _this_gpu() -> str | None:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def read_tuned(engine_dir: str | Path) -> dict | None:
    """An engine's tuned.json, checked: None when the build wrote none (every shape then falls back, logged once
    each); a file that is not JSON or whose entries lack "op", "bucket" or "config" is an EngineError naming it. Timings
    taken on another GPU model than this one are used, with one warning (rebuild to retune)."""
    from dsflash.build.engine import EngineError
    f = Path(engine_dir) / TUNED_FILE
    if not f.is_file():
        return None
    try:
        data = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EngineError(f"{f}: not valid JSON ({e})") from None
    entries = data.get("entries") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise EngineError(f"{f}: expected an object with an \"entries\" list (written by `dsflash build`)")
    for i, e in enumerate(entries):
        missing = [k for k in ("op", "bucket", "config") if not isinstance(e, dict) or k not in e]
        if missing:
            raise EngineError(f"{f}: entries[{i}] lacks {', '.join(repr(k) for k in missing)}")
    here = _this_gpu()
    if here is not None and data.get("gpu") not in (None, here):
        log.warning("%s: configs were timed on %s, this GPU is %s; they run, but rebuild the engine here to retune",
                    f, data["gpu"], here)
    return data
