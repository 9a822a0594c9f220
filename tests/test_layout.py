"""The layout is a map of the architecture: imports only run down, one module per command."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import sgrld
import sgrld.experiments.commands as commands
from sgrld.cli import HELP

ROOT = Path(__file__).resolve().parents[1]


def test_no_import_circle_and_no_arrow_up() -> None:
    """Modules and packages (rooms) alike, lazy imports included (they hide circles)."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "import_graph.py"), "--rooms"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 circles, 0 arrows up" in done.stdout.splitlines()[0]


def test_every_command_is_one_module_of_commands() -> None:
    modules = {m.name for m in pkgutil.iter_modules(commands.__path__)} - {"common", "options"}
    assert modules == set(HELP)
    for name in modules:
        module = importlib.import_module(f"sgrld.experiments.commands.{name}")
        assert callable(module.add_arguments) and callable(module.run), name


def test_the_experiment_rooms_import_no_command() -> None:
    """Below commands/, nothing parses a command line of another command."""
    rooms = ROOT / "src" / "sgrld" / "experiments"
    for path in rooms.rglob("*.py"):
        if path.parent.name != "commands":
            assert "experiments.commands" not in path.read_text(), path


def test_no_sampler_name_is_compared_outside_the_metrics() -> None:
    """What a run, a sweep or a report needs of a metric it reads from the metric's declaration
    (its fields, ``Metric.tuned``, ``Metric.identity_at``): only metrics/ compares its names."""
    names = set(sgrld.metric_names())
    package = ROOT / "src" / "sgrld"
    found = []
    for path in package.rglob("*.py"):
        if path.relative_to(package).parts[0] == "metrics":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            values = [e for s in sides for e in getattr(s, "elts", [s])]
            if any(isinstance(v, ast.Constant) and v.value in names for v in values):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, found
