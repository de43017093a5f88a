"""`dsflash demo` (`make demo`): the main job on the embedded default, a tiny synthetic V4.1-Flash checkpoint.

synth (real HF format) -> greedy generation from a real tokenized prompt -> tokens and text printed.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_PROMPT = "The three primary colors are"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dsflash demo", description=__doc__)
    p.add_argument("--workdir", default="out/demo", help="where the synthetic checkpoint is kept (reused if present)")
    p.add_argument("--family", choices=("v41", "v4"), default="v41")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=24)
    a = p.parse_args(argv)

    from dsflash.convert.synth import synthesize
    from dsflash.model_def import get_preset
    from dsflash.serve import generate

    hf = Path(a.workdir) / f"hf-{a.family}-{a.preset}"
    if not (hf / "config.json").is_file():
        print(f"[demo] synthesizing a {a.family}/{a.preset} checkpoint in the real HF format -> {hf}")
        synthesize(get_preset(a.family, a.preset), hf, seed=0, progress=True)
    else:
        print(f"[demo] reusing {hf}")
    print(f"[demo] greedy generation with the reference model (deploy numerics), prompt {a.prompt!r}")
    cmd = ["--hf", str(hf), "--prompt", a.prompt, "--max-new-tokens", str(a.max_new_tokens)]
    print("[demo] $ dsflash generate " + " ".join(repr(c) if " " in c else c for c in cmd))
    return generate.main(cmd)


if __name__ == "__main__":
    sys.exit(main())
