"""The wheel carries every subpackage (an unlisted sub-subpackage is silently dropped; style-anchors §4b)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SUBPACKAGES = ("convert", "model_def", "plugins", "build", "serve")
# Copied tree excludes: environments, build outputs, VCS, caches, and what .gitignore keeps out.
_IGNORE = shutil.ignore_patterns(
    ".venv", ".git", ".pybuild", "out", ".whl", ".gl", "__pycache__", "*.egg-info", ".pytest_cache"
)


def _expected_inits() -> set[str]:
    expected = set()
    for sub in SUBPACKAGES:
        root = REPO / sub
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            if "__init__.py" in filenames:
                rel = Path(dirpath).relative_to(root)
                expected.add((Path("dsflash") / sub / rel / "__init__.py").as_posix())
    return expected


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> tuple[Path, Path]:
    # Build from a copy so stale .pybuild/ output or a concurrent build cannot leak into the wheel.
    src = tmp_path_factory.mktemp("src") / "dsflash"
    shutil.copytree(REPO, src, ignore=_IGNORE)
    (src / ".pybuild").mkdir()  # egg-base must exist before setuptools runs (see pyproject.toml)
    out = tmp_path_factory.mktemp("wheel")
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out), "."],
        cwd=src, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    wheels = list(out.glob("dsflash-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0], src


@pytest.mark.slow
def test_every_subpackage_init_is_in_wheel(wheel):
    path, _ = wheel
    names = set(zipfile.ZipFile(path).namelist())
    expected = _expected_inits()
    assert {f"dsflash/{sub}/__init__.py" for sub in SUBPACKAGES} <= expected
    missing = sorted(expected - names)
    assert not missing, f"missing from the wheel (add them to [tool.setuptools] packages): {missing}"


@pytest.mark.slow
def test_wheel_has_only_dsflash_and_entry_point(wheel):
    path, _ = wheel
    zf = zipfile.ZipFile(path)
    tops = {n.split("/", 1)[0] for n in zf.namelist()}
    assert tops == {"dsflash", "dsflash-0.1.0.dist-info"}, tops
    entry_points = zf.read("dsflash-0.1.0.dist-info/entry_points.txt").decode()
    assert "dsflash = dsflash.serve.cli:main" in entry_points


@pytest.mark.slow
def test_setuptools_output_stays_out_of_build_package(wheel):
    _, src = wheel
    assert (src / ".pybuild").is_dir()
    assert not (src / "build" / "lib").exists()
    assert not list((src / "build").glob("bdist.*"))
