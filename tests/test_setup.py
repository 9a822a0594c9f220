"""The Makefile's set-up keeps a torch that is already installed and installs the pin otherwise."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _fake_setup(tmp_path: Path, *, has_torch: bool) -> Path:
    """A copy of the Makefile beside a fake interpreter, venv and pip that log their calls."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    shutil.copy(REPO / "Makefile", tmp_path / "Makefile")
    (tmp_path / "pyproject.toml").write_text("")
    log = tmp_path / "calls.log"
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    scripts = {
        tmp_path / "python3": f'echo "python3 $*" >> {log}\n',
        bin_dir / "pip": f'echo "pip $*" >> {log}\n',
        bin_dir / "python": (
            f'case "$*" in *print*) echo "torch 2.13.0+cu126";; '
            f'*"import torch"*) exit {0 if has_torch else 1};; esac\n'
        ),
    }
    for path, body in scripts.items():
        path.write_text("#!/bin/sh\n" + body)
        path.chmod(0o755)
    return log


def _make(tmp_path: Path, *args: str) -> str:
    run = subprocess.run(
        ["make", "venv", f"PYTHON={tmp_path / 'python3'}", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    return run.stdout


def test_setup_keeps_an_installed_torch(tmp_path: Path) -> None:
    log = _fake_setup(tmp_path, has_torch=True)
    out = _make(tmp_path)
    calls = log.read_text()
    assert "keeping the installed torch 2.13.0+cu126" in out
    assert "torch==" not in calls and "pip install --quiet -e .[dev]" in calls


def test_setup_installs_the_pin_or_the_chosen_build(tmp_path: Path) -> None:
    log = _fake_setup(tmp_path, has_torch=False)
    _make(tmp_path)
    assert "pip install --quiet torch==2.13.0\n" in log.read_text()
    log.unlink()
    (tmp_path / ".venv" / "bin" / ".installed").unlink()
    cpu = "TORCH_PIN=torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
    _make(tmp_path, cpu, "VENV_FLAGS=--system-site-packages")
    calls = log.read_text()
    assert "python3 -m venv --system-site-packages .venv" in calls
    assert "--index-url https://download.pytorch.org/whl/cpu" in calls


def test_devinterp_is_installed_for_the_tests_only(tmp_path: Path) -> None:
    """``make venv`` (and so ``make demo``) leaves devinterp and the hf extra out; the test
    targets add them."""
    log = _fake_setup(tmp_path, has_torch=True)
    _make(tmp_path)
    assert "devinterp" not in log.read_text() and "hf]" not in log.read_text()
    subprocess.run(
        ["make", ".venv/bin/.test-deps", f"PYTHON={tmp_path / 'python3'}"],
        cwd=tmp_path, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert "pip install --quiet --no-deps devinterp==2.0.1" in log.read_text()
    assert "pip install --quiet -e .[dev,hf]" in log.read_text()
