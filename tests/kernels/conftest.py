"""Kernel tests run on a CUDA GPU, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1): there the
interpreter's gaps are mended first (interpreter_fixes.py), before any kernel runs."""
from __future__ import annotations

import os
import sys

from dsflash.plugins.kernel_device import interpreting

if interpreting():
    sys.path.insert(0, os.path.dirname(__file__))
    import interpreter_fixes

    interpreter_fixes.apply()
