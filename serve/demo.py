"""`dsflash demo` (`make demo`): the main job on the embedded default, a tiny synthetic V4.1-Flash checkpoint.

synth (real HF format) -> convert (reference layout) -> build (cpu engine) -> greedy generation from a real tokenized
prompt -> tokens and text printed. Each stage runs through the same CLI a user would type; outputs are kept in
--workdir and reused on the next run.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_PROMPT = "The three primary colors are"


def _stage(title: str, argv: list[str]) -> None:
    from dsflash.serve.cli import main as cli
    print(f"\n[demo] {title}\n[demo] $ dsflash " + " ".join(repr(a) if " " in a else a for a in argv), flush=True)
    rc = cli(argv)
    if rc:
        raise SystemExit(rc)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dsflash demo", description=__doc__)
    p.add_argument("--workdir", default="out/demo", help="where checkpoint and engine are kept (reused if present)")
    p.add_argument("--family", choices=("v41", "v4"), default="v41")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=16)
    a = p.parse_args(argv)

    base = Path(a.workdir) / f"{a.family}-{a.preset}"
    hf, ckpt, engine = base / "hf", base / "ckpt-reference", base / "engine-cpu-tp1"
    if not (hf / "config.json").is_file():
        _stage("synthesize a tiny checkpoint in the real HF format",
               ["synth", "--family", a.family, "--preset", a.preset, "--out", str(hf)])
    if not (ckpt / "manifest.json").is_file():
        _stage("convert to the canonical reference layout", ["convert", "--hf", str(hf), "--out", str(ckpt),
                                                              "--layout", "reference"])
    if not (engine / "engine.json").is_file():
        _stage("build a CPU engine (TP1)", ["build", "--ckpt", str(ckpt), "--out", str(engine), "--arch", "cpu"])
    _stage("greedy generation from the engine", ["generate", "--engine", str(engine), "--prompt", a.prompt,
                                                  "--max-new-tokens", str(a.max_new_tokens)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
