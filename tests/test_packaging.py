"""The built wheel: what a user's ``pip install sgrld`` gets (PEP 561 marker, configs, command)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_wheel_ships_py_typed_the_configs_and_the_command(tmp_path: Path) -> None:
    """Built offline from a copy of the tree (``pip wheel --no-deps --no-build-isolation``)."""
    source = tmp_path / "source"
    shutil.copytree(
        REPO / "src", source / "src", ignore=shutil.ignore_patterns("*.egg-info", "__pycache__")
    )
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    offline = ["--no-deps", "--no-build-isolation", "--no-index", "--quiet"]
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", *offline, "-w", str(tmp_path / "dist"), str(source)],
        check=True,
        capture_output=True,
    )
    (wheel,) = (tmp_path / "dist").glob("sgrld-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (entry_points,) = (n for n in names if n.endswith(".dist-info/entry_points.txt"))
        scripts = archive.read(entry_points).decode()
    assert "sgrld/py.typed" in names
    configs = {
        str(p.relative_to(REPO / "src"))
        for p in (REPO / "src" / "sgrld" / "configs").rglob("*")
        if p.suffix in (".toml", ".csv")
    }
    assert configs and configs <= names, configs - names
    assert "[console_scripts]" in scripts and "sgrld = sgrld.cli:main" in scripts
