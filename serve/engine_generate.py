"""Greedy generation from an engine dir on one or several ranks (`dsflash generate --engine`)."""
from __future__ import annotations

import argparse
import json
import sys

import torch

from dsflash.serve.mpi_launch import init_distributed, relaunch, under_mpi


def _run_ranks(engine_dir: str, input_ids: list[int], max_new_tokens: int) -> list[int] | None:
    """Inside MPI (or a single process): every rank runs its shard; rank 0 returns the new tokens."""
    from dsflash.build.engine import load_engine_model, open_engine
    from dsflash.model_def.layers import DistComm
    rank, world, mpi = init_distributed() if under_mpi() else (0, 1, None)
    eng = open_engine(engine_dir)
    if eng.world_size != world:
        raise ValueError(f"{engine_dir}: engine has {eng.world_size} ranks but {world} processes are running")
    comm = None
    if world > 1:
        import torch.distributed as dist
        comm = DistComm(eng.mapping(rank), dist.group.WORLD)
        input_ids = mpi.bcast(input_ids, root=0)
    model, eng = load_engine_model(engine_dir, rank, comm=comm)
    vocab = eng.args.vocab_size
    if any(not 0 <= t < vocab for t in input_ids):
        raise ValueError(f"input ids must lie in [0, {vocab})")
    with torch.no_grad():
        ids = torch.tensor([input_ids], device=model.head.weight.device)   # a GPU engine's model lives on its GPU
        out = model.generate_greedy(ids, max_new_tokens)[0, len(input_ids):].tolist()
    return out if rank == 0 else None


def generate_from_engine(engine_dir: str, input_ids: list[int], max_new_tokens: int) -> list[int]:
    from dsflash.build.engine import open_engine
    eng = open_engine(engine_dir)
    if eng.world_size == 1 or under_mpi():
        return _run_ranks(engine_dir, input_ids, max_new_tokens)
    import tempfile
    from pathlib import Path
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "out.json"
        rc = relaunch(eng.world_size, "dsflash.serve.engine_generate",
                      ["--engine", engine_dir, "--input-ids", ",".join(map(str, input_ids)),
                       "--max-new-tokens", str(max_new_tokens), "--result", str(out)])
        if rc != 0 or not out.is_file():
            raise OSError(f"mpirun -n {eng.world_size} failed (exit {rc}); see the rank logs above")
        return json.loads(out.read_text())["output_ids"]


def main(argv: list[str] | None = None) -> int:
    """Rank entry point under mpirun: rank 0 writes {"output_ids": [...]} to --result."""
    p = argparse.ArgumentParser(prog="python -m dsflash.serve.engine_generate")
    p.add_argument("--engine", required=True)
    p.add_argument("--input-ids", required=True)
    p.add_argument("--max-new-tokens", type=int, required=True)
    p.add_argument("--result", required=True)
    a = p.parse_args(argv)
    ids = [int(t) for t in a.input_ids.split(",")]
    try:
        out = _run_ranks(a.engine, ids, a.max_new_tokens)
    except Exception as e:  # a failing rank must take the job down with a clear message, not hang the others
        print(f"[rank error] {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        from mpi4py import MPI
        MPI.COMM_WORLD.Abort(1)
        return 1
    if out is not None:
        with open(a.result, "w") as f:
            json.dump({"output_ids": out}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
