"""`dsflash` entry point: help lists the commands, unknown commands fail, dispatch passes argv through."""

from __future__ import annotations

import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from dsflash.serve import cli

SUBCOMMANDS = ("synth", "convert", "build", "generate", "serve", "demo")


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in SUBCOMMANDS:
        assert name in out


def test_unknown_subcommand_fails(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["no-such-command"])
    assert exc.value.code != 0
    assert "invalid choice" in capsys.readouterr().err


def test_no_subcommand_fails():
    with pytest.raises(SystemExit) as exc:
        cli.main([])
    assert exc.value.code != 0


def test_dispatch_passes_remaining_argv(monkeypatch):
    seen = []
    fake = types.ModuleType("dsflash_test_fake_cmd")
    fake.main = lambda argv: seen.append(list(argv)) or 7
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    monkeypatch.setitem(cli.COMMANDS, "demo", (fake.__name__, "fake"))
    assert cli.main(["demo", "--tp", "2", "--help"]) == 7
    assert seen == [["--tp", "2", "--help"]]


def test_missing_module_is_not_available(monkeypatch, capsys):
    monkeypatch.setitem(cli.COMMANDS, "build", ("dsflash.build._no_such_module_", "missing"))
    assert cli.main(["build", "--x"]) == 2
    assert "dsflash build: not available in this build" in capsys.readouterr().err


def _console_script() -> list[str]:
    script = Path(sys.executable).parent / "dsflash"
    if script.exists():
        return [str(script)]
    found = shutil.which("dsflash")
    return [found] if found else [sys.executable, "-m", "dsflash.serve.cli"]


def test_console_script_help_and_unknown():
    cmd = _console_script()
    ok = subprocess.run([*cmd, "--help"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    for name in SUBCOMMANDS:
        assert name in ok.stdout
    bad = subprocess.run([*cmd, "no-such-command"], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0


def test_synth_refuses_a_full_size_checkpoint_without_force(tmp_path):
    from dsflash.convert.synth import main as synth_main
    assert synth_main(["--family", "v41", "--preset", "full", "--out", str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("flags,needle", [(["--tp", "0"], "--tp must be >= 1, got 0"),
                                          (["--moe-ep", "0"], "--moe-ep must be >= 1, got 0"),
                                          (["--tp", "8", "--moe-tp", "-1"], "--moe-tp must be >= 1, got -1")])
def test_build_refuses_non_positive_parallel_sizes(flags, needle, capsys):
    from dsflash.build.cli import main as build_main
    assert build_main(["--preset", "v41/full", "--arch", "sm90", "--dry-run", *flags]) == 2
    assert needle in capsys.readouterr().err
