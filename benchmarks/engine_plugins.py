"""Engine-level plugin check on the GPU (issue 6): synthetic V4.1 engines built for sm90 run the plugin kernels.

For each preset (tiny, mid): synth -> convert --layout hopper -> build --arch sm90 (tuning on this GPU) -> load the
engine twice (plugins from engine.json, and `plugins="reference"`), then
  - site parity: every bound site (FP8 linears, MoE, mHC, WO-A) replayed on the activations of a real forward,
    plugin vs its fp32 reference (`build.bind.site_parity`), max ‖Δ‖/‖ref‖ per kind against 1e-2; once at the
    prompt's length and once with one token, the decode shape that takes the GEMV kernels;
  - end to end: logits rel. error and teacher-forced argmax agreement on a prompt, and the first position where
    free-running greedy generation diverges (reported: deploy numerics on random weights amplify rounding
    differences, see `site_parity`); with `--train-steps N` the checkpoint is first fitted to a token permutation
    on the GPU (convert/synth_train.py), and greedy tokens over 4 task prompts must be equal, plugins against
    references, and equal to the task's answer;
  - fallback: with tuned.json removed, each untuned GEMM shape is logged exactly once over two forwards;
  - eager decode step time, plugins vs references (no CUDA graphs yet).
Writes `--out` JSON and prints a table. Run from the repo root on the GPU machine:
    python3 benchmarks/engine_plugins.py --out engine_plugins_h200.json
"""
from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dsflash.build.bind import site_parity
from dsflash.build.engine import load_engine_model, write_engine
from dsflash.build.plan import BuildConfig
from dsflash.convert.synth import synthesize
from dsflash.convert.synth_train import PermutationTask
from dsflash.convert.writer import convert
from dsflash.model_def import get_preset
from dsflash.model_def.mapping import Mapping

THRESHOLD = 1e-2


class _Count(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _decode_ms(model, ids: torch.Tensor, steps: int = 12) -> float:
    state = model.new_state(ids.shape[0])
    logits = model.step(ids, state)
    times = []
    for _ in range(steps):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits = model.step(nxt, state)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[2:])


def _first_divergence(a: torch.Tensor, b: torch.Tensor) -> int | None:
    diff = (a != b).nonzero()
    return None if diff.numel() == 0 else int(diff[0, -1])


def run_preset(name: str, work: Path, prompt_len: int, new_tokens: int, tune_budget_s: float,
               max_num_tokens: int = 64, train_steps: int = 0) -> dict:
    res: dict = {"preset": f"v41/{name}", "train_steps": train_steps}
    t0 = time.time()
    hf = synthesize(get_preset("v41", name), work / "hf", seed=7, train_steps=train_steps, train_device="cuda")
    if train_steps:
        task, res["training"] = PermutationTask.load(hf)
    convert(hf, work / "hop", "hopper")
    res["synth_convert_s"] = round(time.time() - t0, 1)
    t0 = time.time()
    cfg = BuildConfig(max_num_tokens=max_num_tokens, tune_budget_s=tune_budget_s)
    eng = write_engine(work / "hop", work / "eng", Mapping(world_size=1, tp_size=1), "sm90", cfg, progress=False)
    res["build_s"] = round(time.time() - t0, 1)
    tuned = json.loads((eng / "tuned.json").read_text())
    gemm = [e for e in tuned.get("entries", []) if e["op"] == "fp8_gemm"]
    res["tuned_gemm_entries"] = len(gemm)
    res["tuned_paths"] = sorted({f"{e['bucket'].get('n')}x{e['bucket'].get('k')}@{e['bucket'].get('m')}:"
                                 f"{e['config'].get('path')}" for e in gemm})
    res["tuned_sm90_entries"] = sum(bool(e["config"].get("config", {}).get("sm90")) for e in gemm)
    res["tuned_skipped"] = tuned.get("skipped", [])

    plug, _ = load_engine_model(eng, device="cuda", dense_experts=True)
    ref, _ = load_engine_model(eng, device="cuda", plugins="reference")
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, plug.args.vocab_size, (1, prompt_len), generator=gen).cuda()

    # prefill shape (prompt_len tokens at every site) and decode shape (one token: the GEMV/decode kernels)
    for key, inp in (("site_parity", ids), ("site_parity_decode", ids[:, :1])):
        sites = site_parity(plug, inp)
        kinds: dict[str, dict] = {}
        for s in sites:
            k = kinds.setdefault(s["kind"], {"sites": 0, "max_rel": 0.0, "worst": None})
            k["sites"] += 1
            if s["rel"] > k["max_rel"]:
                k["max_rel"], k["worst"] = s["rel"], s["site"]
        res[key] = kinds
        res[key + "_pass"] = bool(sites) and all(k["max_rel"] <= THRESHOLD for k in kinds.values())

    lp, lr = plug.logits(ids)[0].float(), ref.logits(ids)[0].float()
    res["logits_rel"] = float((lp - lr).norm() / lr.norm())
    res["teacher_forced_argmax_agree"] = float((lp.argmax(-1) == lr.argmax(-1)).float().mean())
    if train_steps:   # the task's prompts: 4 at once, so decode runs the kernels at M = 4
        prompts = task.prompts(4, 16, seed=5).cuda()
        gp, gr = (m.generate_greedy(prompts, new_tokens)[:, 16:] for m in (plug, ref))
        expected = task.continuation(prompts[:, -1], new_tokens)
        res["greedy_task_correct_plugins"] = int((gp == expected).sum())
        res["greedy_task_correct_reference"] = int((gr == expected).sum())
    else:
        gp, gr = (m.generate_greedy(ids[:, :16], new_tokens)[:, 16:] for m in (plug, ref))
    res["greedy_first_divergence"] = _first_divergence(gp.flatten(), gr.flatten())
    res["greedy_equal_tokens"] = int((gp == gr).sum())
    res["greedy_tokens"] = gp.numel()

    res["decode_ms_plugins"] = round(_decode_ms(plug, ids[:, :32]), 2)
    res["decode_ms_reference"] = round(_decode_ms(ref, ids[:, :32]), 2)
    del plug

    # visible fallback: no tuned.json -> every GEMM shape logs once, and only once
    (eng / "tuned.json").unlink()
    counter = _Count()
    logging.getLogger().addHandler(counter)
    try:
        bare, _ = load_engine_model(eng, device="cuda", dense_experts=True)
        bare.logits(ids[:, :8])
        first = len([m for m in counter.messages if "no tuned entry" in m])
        bare.logits(ids[:, :8])
        second = len([m for m in counter.messages if "no tuned entry" in m])
    finally:
        logging.getLogger().removeHandler(counter)
    res["fallback_logged"] = first
    res["fallback_logged_again"] = second - first
    res["fallback_pass"] = first > 0 and second == first
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", default="tiny,mid")
    p.add_argument("--out", default="engine_plugins.json")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--tune-budget-s", type=float, default=60)
    p.add_argument("--max-num-tokens", type=int, default=64,
                   help="the engine's token budget: > 64 adds the large-M GEMM buckets (a prompt that long runs them)")
    p.add_argument("--train-steps", type=int, default=0,
                   help="fit each checkpoint to a token permutation first (on the GPU): greedy tokens must then match")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    results = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "threshold": THRESHOLD, "runs": []}
    for name in a.presets.split(","):
        work = Path(tempfile.mkdtemp(prefix=f"dsf-{name}-"))
        try:
            results["runs"].append(run_preset(name, work, a.prompt_len, a.new_tokens, a.tune_budget_s,
                                              a.max_num_tokens, a.train_steps))
        except Exception as e:   # one preset failing must not hide the other's figures
            import traceback
            results["runs"].append({"preset": f"v41/{name}", "error": f"{type(e).__name__}: {e}",
                                    "trace": traceback.format_exc()[-3000:]})
        finally:
            shutil.rmtree(work, ignore_errors=True)
        Path(a.out).write_text(json.dumps(results, indent=2))
    print(f"{'preset':10} {'kind':6} {'M':>3} {'sites':>5} {'max rel':>9}  pass")
    for r in results["runs"]:
        if "error" in r:
            print(f"{r['preset']:10} ERROR {r['error'][:200]}")
            continue
        for key, tag in (("site_parity", "T"), ("site_parity_decode", "T=1")):
            for kind, k in r[key].items():
                print(f"{r['preset']:10} {kind:6} {tag:>3} {k['sites']:>5} {k['max_rel']:>9.2e}  "
                      f"{k['max_rel'] <= THRESHOLD}")
        print(f"{r['preset']:10} e2e logits rel {r['logits_rel']:.3f}, teacher-forced argmax agree "
              f"{r['teacher_forced_argmax_agree']:.2f}, greedy equal {r['greedy_equal_tokens']}/{r['greedy_tokens']}"
              + (f" (task answer: plugins {r['greedy_task_correct_plugins']}, references "
                 f"{r['greedy_task_correct_reference']})" if r["train_steps"] else "") + "; "
              f"fallback logged {r['fallback_logged']} (+{r['fallback_logged_again']} on rerun); decode "
              f"{r['decode_ms_plugins']} ms plugins vs {r['decode_ms_reference']} ms reference; "
              f"tuned GEMM entries {r['tuned_gemm_entries']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
