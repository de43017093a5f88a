"""Outputs that appear only when complete: directories built in `<out>.<tag>` next to them, files written to
`<path>.part`, each renamed at the end."""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def atomic_dir(out: str | Path, tag: str) -> Iterator[Path]:
    """Yield a fresh temp dir beside `out`; rename it to `out` on success, remove it on any error."""
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out}: output directory already exists")
    tmp = out.with_name(f"{out.name}.{tag}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write a file whole or not at all: `<path>.part`, then a rename over `path` (its folder is created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    part.write_text(text)
    os.replace(part, path)
