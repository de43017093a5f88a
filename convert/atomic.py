"""Output directories that appear only when complete: work in `<out>.<tag>` next to it, rename at the end."""
from __future__ import annotations

import contextlib
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
