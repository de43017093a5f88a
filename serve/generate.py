"""`dsflash generate`: greedy generation from an HF checkpoint (reference model) or a built engine, optionally
speculative (`--speculative-algorithm dspark|mtp`, serve/spec_decode.py)."""
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


def _check_ids(input_ids: list[int], vocab: int) -> None:
    if any(not 0 <= t < vocab for t in input_ids):
        raise ValueError(f"input ids must lie in [0, {vocab})")


def generate_from_hf(hf_dir: str, input_ids: list[int], max_new_tokens: int, numerics: str) -> list[int]:
    from dsflash.model_def import load_reference
    model = load_reference(hf_dir, numerics=numerics)
    _check_ids(input_ids, model.args.vocab_size)
    with torch.no_grad():
        out = model.generate_greedy(torch.tensor([input_ids]), max_new_tokens)
    return out[0, len(input_ids):].tolist()


def speculative_config(a: argparse.Namespace, args):
    """The validated SpecConfig of the parsed `--speculative-*` flags for a model with `args`."""
    from dsflash.serve.spec_decode import SpecConfig
    n = a.speculative_num_draft_tokens
    if n is None:   # DSpark: the block it was trained for; MTP: one draft per nextn layer
        n = getattr(args, "dspark_block_size", 1) if a.speculative_algorithm == "dspark" else max(args.n_draft, 1)
    cfg = SpecConfig(a.speculative_algorithm, n, confidence_threshold=a.speculative_confidence_threshold,
                     seed=a.seed, simulate_acceptance_length=a.simulate_acceptance_length)
    cfg.validate(args)
    return cfg


def speculative_generate_from_model(model, cfg, input_ids: list[int], max_new_tokens: int):
    """-> (new tokens, SpecResult.report() dict)."""
    from dsflash.serve.spec_decode import speculative_generate
    _check_ids(input_ids, model.args.vocab_size)
    res = speculative_generate(model, torch.tensor([input_ids], device=model.head.weight.device), max_new_tokens,
                               cfg)
    return res.tokens[0].tolist(), res.report()


def model_args(a: argparse.Namespace):
    """The model args of --hf / --engine without loading weights."""
    if a.hf:
        from dsflash.model_def import load_args
        return load_args(a.hf)
    from dsflash.build.engine import open_engine
    return open_engine(a.engine).args


def load_spec_model(a: argparse.Namespace):
    """The model that runs a speculative `generate` (--hf: reference; --engine: single-rank engines)."""
    if a.hf:
        from dsflash.model_def import load_reference
        return load_reference(a.hf, numerics=a.numerics)
    from dsflash.build.engine import load_engine_model, open_engine
    eng = open_engine(a.engine)
    if eng.world_size != 1:
        raise ValueError(f"{a.engine}: speculative decoding runs on single-rank engines only "
                         f"(this one has {eng.world_size} ranks)")
    return load_engine_model(a.engine, 0)[0]


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
    p.add_argument("--json", action="store_true",
                   help='print one JSON line {"output_ids": [...], "text": "..."} (+ acceptance_length, '
                        'draft_acceptance_rate, ... when speculative)')
    s = p.add_argument_group("speculative decoding (lossless for greedy; engines: single rank)")
    s.add_argument("--speculative-algorithm", choices=("dspark", "mtp"),
                   help="drafter: dspark (V4.1 built-in DSpark) or mtp (V4 MTP block, chained)")
    s.add_argument("--speculative-num-draft-tokens", type=int,
                   help="tokens drafted per step (dspark: 1..dspark_block_size, default the block size; "
                        "mtp: >= 1, default num_nextn_predict_layers)")
    s.add_argument("--speculative-confidence-threshold", type=float, default=0.0,
                   help="dspark: end a draft at the first position whose confidence is below this (0 = off)")
    s.add_argument("--simulate-acceptance-length", type=float, metavar="L",
                   help="benchmark aid: accept drafts so that the mean acceptance length is L (output is then NOT "
                        "the model's greedy output; reported as simulated)")
    s.add_argument("--seed", type=int, default=0, help="RNG seed of simulated acceptance")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    from dsflash.serve.tokenization import DeepseekTokenizer
    model_dir = a.hf or a.engine
    spec = None
    try:
        if a.max_new_tokens < 1:
            raise ValueError("--max-new-tokens must be >= 1")
        if a.speculative_algorithm is None and (a.speculative_num_draft_tokens is not None
                                                or a.simulate_acceptance_length is not None
                                                or a.speculative_confidence_threshold):
            raise ValueError("--speculative-num-draft-tokens / --speculative-confidence-threshold / "
                             "--simulate-acceptance-length need --speculative-algorithm")
        cfg = speculative_config(a, model_args(a)) if a.speculative_algorithm else None   # fail before loading
        tok = DeepseekTokenizer(model_dir)
        ids = parse_input_ids(a.input_ids) if a.input_ids else tok.encode(a.prompt)
        t0 = time.perf_counter()
        if cfg is not None:
            out, spec = speculative_generate_from_model(load_spec_model(a), cfg, ids, a.max_new_tokens)
        elif a.hf:
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
        print(json.dumps({"output_ids": out, "text": text, **(spec or {})}))
    else:
        print(f"input_ids ({len(ids)}): {ids}")
        print(f"output_ids ({len(out)}): {out}")
        print(f"text: {text!r}")
        print(f"[{len(out)} tokens in {elapsed:.2f} s]")
        if spec:
            sim = (f" — SIMULATED acceptance (L={spec['simulated_acceptance_length']}), not the model's output"
                   if spec.get("simulated_acceptance") else "")
            print(f"[speculative {spec['speculative_algorithm']} N={spec['speculative_num_draft_tokens']}: "
                  f"AL {spec['acceptance_length']:.3f}, DAR {spec['draft_acceptance_rate']:.3f}{sim}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
