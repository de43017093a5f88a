"""MPI control plane: rank 0 sends each step's plan; ranks > 0 mirror the request states and run the same steps.

Messages (mpi4py, pickled, tag PLAN_TAG, rank 0 -> every worker): {"op": "step", "free": [request ids whose state
to drop], "run": [(request id, token ids, reset), ...]} and {"op": "shutdown"}. Tensors never travel here: the TP
all-reduces inside the model go through torch.distributed (gloo on CPU, NCCL on GPU). Any exception on any rank
aborts the whole MPI job (COMM_WORLD.Abort) after a clear log line, so a dead rank stops the server instead of
leaving the others blocked in a collective.
"""
from __future__ import annotations

import sys
import time
import traceback

PLAN_TAG = 41


def connect(engine_dir: str):
    """(rank, world, mpi comm | None, model comm | None) for this process and engine."""
    from dsflash.build.engine import EngineError, open_engine
    from dsflash.serve.mpi_launch import init_distributed, under_mpi
    eng = open_engine(engine_dir)
    n = eng.world_size
    if n == 1:
        return 0, 1, None, None
    if not under_mpi():
        raise EngineError(f"{engine_dir}: engine has {n} ranks; run it under `mpirun -n {n}` "
                          f"(`dsflash serve` relaunches itself)")
    rank, world, mpi = init_distributed()
    if world != n:
        raise EngineError(f"{engine_dir}: engine has {n} ranks but {world} processes are running")
    import torch.distributed as dist
    from dsflash.model_def.layers import DistComm
    return rank, world, mpi, DistComm(eng.mapping(rank), dist.group.WORLD)


def abort_job(rank: int, what: str, exc: BaseException) -> None:
    """Log the failure of this rank and take the whole MPI job down."""
    traceback.print_exception(exc, file=sys.stderr)
    print(f"[dsflash rank {rank}] {what}: {type(exc).__name__}: {exc}; aborting the MPI job", file=sys.stderr,
          flush=True)
    from mpi4py import MPI
    MPI.COMM_WORLD.Abort(1)


class ControlPlane:
    """Rank 0's end of the control messages."""

    def __init__(self, mpi):
        self.mpi, self.world = mpi, mpi.Get_size()

    def _send(self, msg: dict) -> None:
        for r in range(1, self.world):
            self.mpi.send(msg, dest=r, tag=PLAN_TAG)

    def agree_capacity(self, cfg: dict, local_bytes: int) -> int:
        """Tell the workers the cache settings; the pool is the smallest any rank can hold."""
        from mpi4py import MPI
        self.mpi.bcast(cfg, root=0)
        return self.mpi.allreduce(local_bytes, op=MPI.MIN)

    def send_step(self, free: list[str], run: list[tuple[str, list[int], bool]]) -> None:
        self._send({"op": "step", "free": list(free), "run": run})

    def shutdown(self) -> None:
        self._send({"op": "shutdown"})


def _recv(mpi):
    """Wait for rank 0's next message without spinning a core at 100% while the server is idle."""
    since = time.monotonic()
    while not mpi.iprobe(source=0, tag=PLAN_TAG):
        time.sleep(0 if time.monotonic() - since < 0.05 else 0.001)
    return mpi.recv(source=0, tag=PLAN_TAG)


def worker_loop(engine_dir: str) -> int:
    """Entry point of ranks > 0: load this rank's shard, then run rank 0's plans until shutdown."""
    from mpi4py import MPI
    from dsflash.serve.runtime.block_manager import kv_cache_capacity
    from dsflash.serve.runtime.cuda_graphs import CudaGraphConfig
    from dsflash.plugins.moe_config import set_deterministic
    from dsflash.serve.runtime.model_runner import ModelRunner, run_segments
    rank = MPI.COMM_WORLD.Get_rank()
    try:
        rank, _, mpi, comm = connect(engine_dir)
        runner = ModelRunner(engine_dir, rank=rank, comm=comm)
        cfg = mpi.bcast(None, root=0)
        set_deterministic(cfg["batch_invariant"])   # as rank 0's runner: the same MoE reduction on every rank
        runner.enable_cuda_graphs(CudaGraphConfig(**cfg["cuda_graph"]) if cfg["cuda_graph"] else None,
                                  cfg["max_batch_size"], cfg["max_seq_len"], slots=cfg["decode_slots"])
        mpi.allreduce(kv_cache_capacity(cfg["kv_cache_bytes"], cfg["free_fraction"], runner.device), op=MPI.MIN)
        states = {}
        while True:
            msg = _recv(mpi)
            if msg["op"] == "shutdown":
                break
            for rid in msg["free"]:
                runner.release(states.pop(rid, None))
            work = []
            for rid, ids, reset in msg["run"]:
                if reset:
                    runner.release(states.get(rid))
                    states[rid] = runner.model.new_state(1)
                elif rid not in states:
                    raise RuntimeError(f"plan continues request {rid!r}, but this rank holds no state for it")
                work.append((states[rid], ids))
            run_segments(runner.model, runner.device, work, cfg["batch_invariant"])
    except Exception as e:  # noqa: BLE001 - any failure must stop the job, not hang rank 0 in a collective
        abort_job(rank, "worker failed", e)
        return 1
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0
