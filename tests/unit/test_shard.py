"""`--shard I/N` (tests/conftest.py): the N slices partition the collected tests, and a bad spec is a usage error."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"


def _collect(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           str(tmp_path), *args], capture_output=True, text=True, cwd=tmp_path, timeout=120)


def _ids(out: str) -> list[str]:
    return [line for line in out.splitlines() if re.match(r"\S+::", line)]


def test_shards_partition_the_collection(tmp_path: Path):
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "test_a.py").write_text(
        "import pytest\n\n@pytest.mark.parametrize('k', range(7))\ndef test_a(k):\n    pass\n\n"
        "def test_b():\n    pass\n")
    every = _ids(_collect(tmp_path).stdout)
    assert len(every) == 8
    slices = [_ids(_collect(tmp_path, "--shard", f"{i}/3").stdout) for i in (1, 2, 3)]
    assert sorted(sum(slices, [])) == sorted(every)
    assert [len(s) for s in slices] == [3, 3, 2]
    bad = _collect(tmp_path, "--shard", "4/3")
    assert bad.returncode != 0 and "I must be in 1..N" in bad.stderr
