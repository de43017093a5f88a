"""`dsflash generate`: greedy generation from an HF checkpoint (reference model) or a built engine."""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def parse_input_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--input-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise ValueError("--input-ids is empty")
    return ids


def generate_from_hf(hf_dir: str, input_ids: list[int], max_new_tokens: int, numerics: str) -> list[int]:
    from dsflash.model_def import load_reference
    model = load_reference(hf_dir, numerics=numerics)
    vocab = model.args.vocab_size
    if any(not 0 <= t < vocab for t in input_ids):
        raise ValueError(f"input ids must lie in [0, {vocab})")
    with torch.no_grad():
        out = model.generate_greedy(torch.tensor([input_ids]), max_new_tokens)
    return out[0, len(input_ids):].tolist()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsflash generate", description="Greedy generation (prints the new tokens).")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--engine", help="engine directory made by `dsflash build`")
    src.add_argument("--hf", help="Hugging Face checkpoint directory (reference model)")
    inp = p.add_mutually_exclusive_group(required=True)
    inp.add_argument("--input-ids", help="comma-separated token ids")
    inp.add_argument("--prompt", help="prompt text (tokenized with the checkpoint's tokenizer, BOS prepended)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--numerics", choices=("hf", "deploy"), default="deploy",
                   help="reference-model numerics for --hf (engines always run deploy numerics)")
    p.add_argument("--json", action="store_true", help='print one JSON line {"output_ids": [...], "text": "..."}')
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    from dsflash.serve.tokenization import DeepseekTokenizer
    model_dir = a.hf or a.engine
    try:
        if a.max_new_tokens < 1:
            raise ValueError("--max-new-tokens must be >= 1")
        tok = DeepseekTokenizer(model_dir)
        ids = parse_input_ids(a.input_ids) if a.input_ids else tok.encode(a.prompt)
        t0 = time.perf_counter()
        if a.hf:
            out = generate_from_hf(a.hf, ids, a.max_new_tokens, a.numerics)
        else:
            from dsflash.serve.engine_generate import generate_from_engine
            out = generate_from_engine(a.engine, ids, a.max_new_tokens)
        elapsed = time.perf_counter() - t0
    except (ValueError, OSError) as e:
        print(f"dsflash generate: {e}", file=sys.stderr)
        return 2
    text = tok.decode(out)
    if a.json:
        print(json.dumps({"output_ids": out, "text": text}))
    else:
        print(f"input_ids ({len(ids)}): {ids}")
        print(f"output_ids ({len(out)}): {out}")
        print(f"text: {text!r}")
        print(f"[{len(out)} tokens in {elapsed:.2f} s]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
