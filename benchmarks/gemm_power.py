"""Sustained large-M GEMM throughput next to the card's SM clock and power draw: the group-32 FP8 kernel, its probes
and `torch._scaled_mm` on the same e4m3 codes.

The bench's timing (`graph_time_us`) replays a few milliseconds of calls fifteen times: about 50 ms, at whatever
clock the card is at when it starts. An FP8 GEMM at M = 4096 draws the card to its power limit, and the driver then
lowers the SM clock within tens of milliseconds, by an amount that depends on the kernel's energy per FLOP. A ratio of
two such timings then depends on what ran before each (session 26's two harnesses disagreed by 19 % on one kernel).
Here every kernel runs alone for `--seconds` of back-to-back graph replays after `--idle` seconds of rest, while
`nvidia-smi` samples the clock, power and throttle reasons every 20 ms. Per kernel: the median µs of the replays in
its first 50 ms ("burst") and of its last half ("sustained"), the sustained mean SM clock and power, and the share
of samples throttled by the power cap. The kernel order is run forwards, then backwards.

    python3 benchmarks/gemm_power.py [--shapes 'wo_b[tp1],wq_a[tp1/tp8]'] [--variants 1x4d4c2h2tw,...]
                                     [--seconds 2] [--idle 1] [--out gemm_power_h200.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gemm_sm90 import parse_variants, tag, weight  # noqa: E402

from dsflash.plugins import refs  # noqa: E402
from dsflash.plugins.bench import GEMM_SHAPES  # noqa: E402
from dsflash.plugins.fp8_gemm_sm90 import fp8_gemm_sm90, weight_scales_f32  # noqa: E402
from dsflash.plugins.timing import input_sets, replayable  # noqa: E402

DEV = "cuda"
FIELDS = ["timestamp", "clocks.sm", "power.draw", "temperature.gpu", "clocks_event_reasons.sw_power_cap",
          "clocks_event_reasons.hw_slowdown", "clocks_event_reasons.sw_thermal_slowdown"]
BURST_S = 0.05


class Telemetry:
    """`nvidia-smi --query-gpu ... -lms 20` in the background: (epoch s, SM MHz, W, °C, power-capped, hw slowdown,
    thermal slowdown) samples."""

    def __init__(self, index: int, period_ms: int = 20):
        self.samples: list[tuple] = []
        self.fields = FIELDS
        for fields in (FIELDS, FIELDS[:4]):   # older drivers lack the event-reason names
            probe = subprocess.run(["nvidia-smi", "-i", str(index), f"--query-gpu={','.join(fields)}",
                                    "--format=csv,noheader,nounits"], capture_output=True, text=True)
            if probe.returncode == 0 and "Field" not in probe.stdout:
                self.fields = fields
                break
        self.proc = subprocess.Popen(["nvidia-smi", "-i", str(index), f"--query-gpu={','.join(self.fields)}",
                                      "--format=csv,noheader,nounits", "-lms", str(period_ms)],
                                     stdout=subprocess.PIPE, text=True, bufsize=1)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) != len(self.fields):
                continue
            try:
                t = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                vals = [float(p) if p.replace(".", "", 1).isdigit() else (p.lower() == "active") for p in parts[1:]]
            except ValueError:
                continue
            self.samples.append((t, *vals))

    def window(self, t0: float, t1: float) -> list[tuple]:
        return [s for s in self.samples if t0 <= s[0] <= t1]

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait()


def sustained(calls: list, seconds: float, idle: float, tele: Telemetry) -> dict:
    """Graph-replay `calls` (one per input set, round robin, ~5 ms per replay) for `seconds` after `idle` s of rest."""
    run, inner, _ = replayable(calls, 5000.0, max_rounds=64, max_calls=1024)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    run()
    e1.record()
    e1.synchronize()
    per_replay = e0.elapsed_time(e1)   # ms
    time.sleep(idle)
    n = max(8, int(seconds * 1000 / per_replay))
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    t0 = time.time()
    ev[0].record()
    for i in range(n):
        run()
        ev[i + 1].record()
        if i % 16 == 15:   # keep the host near the device, so wall time maps onto the replays
            ev[i - 7].synchronize()
    ev[n].synchronize()
    t1 = time.time()
    us = [ev[i].elapsed_time(ev[i + 1]) * 1000 / inner for i in range(n)]
    ends = [ev[0].elapsed_time(ev[i + 1]) / 1000 for i in range(n)]   # s since the first replay started
    burst = [u for u, e in zip(us, ends) if e <= BURST_S] or us[:1]
    half = us[n // 2:]
    time.sleep(0.1)   # the last samples arrive
    t_mid = t0 + ends[n // 2 - 1] if n > 1 else t0
    late = tele.window(t_mid, t1)
    row = {"burst_us": statistics.median(burst), "sustained_us": statistics.median(half), "replays": n,
           "calls_per_replay": inner, "seconds": t1 - t0}
    if late:
        cols = list(zip(*late))
        row |= {"sm_mhz": statistics.fmean(cols[1]), "power_w": statistics.fmean(cols[2]),
                "temp_c": statistics.fmean(cols[3]), "samples": len(late)}
        if len(cols) > 4:
            row |= {"power_capped": statistics.fmean(float(v) for v in cols[4]),
                    "hw_slowdown": statistics.fmean(float(v) for v in cols[5]),
                    "thermal_slowdown": statistics.fmean(float(v) for v in cols[6])}
        first = tele.window(t0, t0 + BURST_S + 0.04)
        if first:
            row["burst_sm_mhz"] = statistics.fmean(s[1] for s in first)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="wo_b[tp1],shexp_w13[tp1],wq_a[tp1/tp8]")
    ap.add_argument("--variants", default="1x4d4c2h2tw,1x4d4c2h2tw:NO_FOLD,1x4d4c2h2tw:NO_MMA,2x4d4h2tw")
    ap.add_argument("--m", type=int, default=4096)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--idle", type=float, default=1.0)
    ap.add_argument("--no-bf16", action="store_true", help="skip the BF16 matmul row")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    idx = torch.cuda.current_device()
    tele = Telemetry(idx)
    q = subprocess.run(["nvidia-smi", "-i", str(idx), "--query-gpu=name,power.limit,clocks.max.sm,clocks.sm",
                        "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    print(f"card: {q}; telemetry fields: {tele.fields[1:]}", flush=True)
    variants = parse_variants(args.variants)
    gen = torch.Generator(device=DEV).manual_seed(0)
    one = torch.ones((), device=DEV)
    rows = []
    wanted = set(args.shapes.split(","))
    for name, n, k, tp in GEMM_SHAPES:
        shape = f"{name}[{tp}]"
        if shape not in wanted:
            continue
        m = args.m
        flops = 2 * m * n * k
        n_sets = input_sets(n * k + m * k)
        ws = [weight(n, k, gen, quantized=True) for _ in range(n_sets)]   # as the converter writes them
        sw = {t: [weight_scales_f32(s, t) for _, s in ws] for t in (False, True)}
        acts = [refs.act_quant_ref((torch.randn(m, k, device=DEV, generator=gen) * 2).to(torch.bfloat16), "e8m0")
                for _ in range(n_sets)]
        acts = [(a, refs.scale_to_fp32(s)) for a, s in acts]
        kernels = {"scaled_mm": [lambda i=i: torch._scaled_mm(acts[i][0], ws[i][0].t(), scale_a=one, scale_b=one,
                                                              out_dtype=torch.bfloat16) for i in range(n_sets)]}
        for v in variants:
            kernels[f"sm90_{tag(v)}"] = [lambda i=i, v=v: fp8_gemm_sm90(*acts[i], ws[i][0], sw[v["tma"]][i], **v)
                                         for i in range(n_sets)]
        if not args.no_bf16:
            x16 = [a.to(torch.bfloat16) for a, _ in acts]
            w16 = [w.to(torch.bfloat16) for w, _ in ws]
            kernels["bf16_matmul"] = [lambda i=i: torch.matmul(x16[i], w16[i].t()) for i in range(n_sets)]
        ref = refs.fp8_gemm_ref(*acts[0], *ws[0])
        for v in variants:
            if not v["probe"]:
                err = refs.rel_err(fp8_gemm_sm90(*acts[0], ws[0][0], sw[v["tma"]][0], **v), ref)
                assert err < 1e-2, (shape, tag(v), err)
        names = list(kernels)
        for rnd, order in enumerate((names, names[::-1])):
            for kname in order:
                r = sustained(kernels[kname], args.seconds, args.idle, tele)
                r |= {"shape": shape, "M": m, "N": n, "K": k, "kernel": kname, "round": rnd,
                      "sustained_TFLOPs": flops / r["sustained_us"] / 1e6, "burst_TFLOPs": flops / r["burst_us"] / 1e6}
                rows.append(r)
                print(f"{shape:18s} r{rnd} {kname:34s} burst {r['burst_us']:8.1f} µs"
                      f" ({r.get('burst_sm_mhz', 0):5.0f} MHz) sustained {r['sustained_us']:8.1f} µs"
                      f" {r['sustained_TFLOPs']:6.0f} TF {r.get('sm_mhz', 0):5.0f} MHz {r.get('power_w', 0):5.0f} W"
                      f" capped {r.get('power_capped', float('nan')):.2f}", flush=True)
        del ws, sw, acts, kernels
        torch.cuda.empty_cache()
    tele.close()
    # the table: per shape and kernel, the two rounds' mean; ratio to _scaled_mm in time and in SM cycles
    print(f"\n{'shape':18s} {'kernel':34s} {'burst µs':>9s} {'sust. µs':>9s} {'MHz':>6s} {'W':>5s} "
          f"{'vs smm':>7s} {'vs smm @clk':>11s}")
    summary = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        per = {}
        for r in rows:
            if r["shape"] == shape:
                per.setdefault(r["kernel"], []).append(r)
        mean = {kn: {key: statistics.fmean(x[key] for x in rs) for key in ("burst_us", "sustained_us", "sm_mhz",
                                                                             "power_w") if all(key in x for x in rs)}
                for kn, rs in per.items()}
        smm = mean["scaled_mm"]
        for kn, v in mean.items():
            ratio = smm["sustained_us"] / v["sustained_us"]
            # in SM cycles: t·f of _scaled_mm over t·f of the kernel
            cyc = (ratio * smm["sm_mhz"] / v["sm_mhz"]) if "sm_mhz" in v and "sm_mhz" in smm else float("nan")
            summary.append({"shape": shape, "kernel": kn, **v, "ratio_to_scaled_mm": ratio,
                            "ratio_in_cycles": cyc, "burst_ratio": smm["burst_us"] / v["burst_us"]})
            print(f"{shape:18s} {kn:34s} {v['burst_us']:9.1f} {v['sustained_us']:9.1f} {v.get('sm_mhz', 0):6.0f} "
                  f"{v.get('power_w', 0):5.0f} {ratio:7.2f} {cyc:11.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"card": q, "command": " ".join(sys.argv[1:]), "rows": rows, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
