"""`dsflash <command> ...`: the one entry point; each command lives in its own module, imported lazily."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# command -> (module whose `main(argv)` runs it, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "synth": ("dsflash.convert.synth", "write a synthetic tiny HF checkpoint (V4.1 / V4 format)"),
    "convert": ("dsflash.convert.cli", "HF checkpoint -> canonical checkpoint (--layout reference|hopper|blackwell)"),
    "build": ("dsflash.build.cli", "canonical checkpoint + topology + limits -> engine dir"),
    "generate": ("dsflash.serve.generate", "generate text offline from a checkpoint or engine"),
    "serve": ("dsflash.serve.server", "serve an engine dir over HTTP (run under mpirun -n N for N ranks)"),
    "bench": ("dsflash.serve.bench.cli", "trtllm-bench-style benchmarks: prepare-dataset, throughput, latency"),
    "triton-repo": ("dsflash.serve.triton_repo", "write a Triton Inference Server model repository for an engine"),
    "demo": ("dsflash.serve.demo", "end-to-end demo on a synthetic tiny model (CPU)"),
}


def build_parser() -> argparse.ArgumentParser:
    """Top-level parser: used for `--help` and for rejecting unknown commands; never parses command flags."""
    parser = argparse.ArgumentParser(
        prog="dsflash",
        description="DeepSeek-V4.1-Flash / V4-Flash toolchain: synth -> convert -> build -> serve.",
        epilog="Run `dsflash <command> --help` for the options of one command.",
    )
    parser.add_argument("--version", action="version", version=f"dsflash {package_version()}")
    sub = parser.add_subparsers(dest="command", metavar="<command>", required=True)
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def package_version() -> str:
    try:
        from importlib.metadata import version

        return version("dsflash")
    except Exception:  # not installed (e.g. running from a copied tree)
        return "unknown"


def _load_main(module_name: str):
    """Return `module.main`, or None when the module (or its `main`) is not part of this build."""
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        # Only the command's own module being absent means "not available"; a missing dependency
        # inside an existing module is a real error and propagates.
        if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
            return None
        raise
    return getattr(module, "main", None)


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch `argv[0]` to its module's `main(argv[1:])`; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        build_parser().parse_args(argv)  # prints help/version or a usage error, and exits
        return 2  # unreachable in practice: parse_args exits for anything that is not a command
    command, rest = argv[0], argv[1:]
    target = _load_main(COMMANDS[command][0])
    if target is None:
        print(f"dsflash {command}: not available in this build", file=sys.stderr)
        return 2
    rc = target(rest)
    return rc if isinstance(rc, int) else 0


if __name__ == "__main__":
    sys.exit(main())
