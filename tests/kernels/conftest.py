"""Kernel tests run on a CUDA GPU, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1): there the
interpreter's cast and BF16-dot gaps are mended first (interpreter_fixes.py), before any kernel runs."""
from __future__ import annotations

import importlib.util
import os
import sys

import torch

if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton"):
    sys.path.insert(0, os.path.dirname(__file__))
    import interpreter_fixes

    interpreter_fixes.apply()
