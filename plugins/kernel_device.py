"""Where the Triton kernels run: CUDA tensors, or CPU tensors under Triton's interpreter (TRITON_INTERPRET=1 runs
each program with numpy). The interpreter is how the kernels' semantics are checked on a machine without a GPU; it
says nothing about their speed. Imports no Triton: the test conftests ask it before any kernel module loads."""
from __future__ import annotations

import importlib.util
import os

import torch


def interpreting() -> bool:
    """True when Triton is installed and its @jit builds interpreted functions (TRITON_INTERPRET=1, read when a kernel
    module is first imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1" and importlib.util.find_spec("triton") is not None


def on_kernel_device(*tensors: torch.Tensor | None) -> bool:
    """Whether a Triton kernel can take these tensors (None entries are optional inputs and are skipped)."""
    ts = [t for t in tensors if t is not None]
    if all(t.is_cuda for t in ts):
        return True
    return interpreting() and all(t.device.type == "cpu" for t in ts)
