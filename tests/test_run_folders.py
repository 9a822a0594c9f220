"""One run-folder discipline for every command (issues 41, 42 and 44): each command creates,
locks, writes and reads its folder through ``experiments/base/files.py``.

Three tables, each a line per case, so that a new command, output or input is one line:

- :data:`OUT_COMMANDS`: every command that owns an ``--out`` folder. An ``--out`` that is a file
  exits 2 with sample's message; a folder held by another run exits 2 naming it.
- :data:`READS`: every file a command reads. A FIFO, a link (to a good file or to ``/dev/zero``),
  an oversized (sparse) file, malformed or mistyped content: exit 2 in one clear line, no hang,
  no traceback.
- :data:`WRITES`: every file a command writes. A link planted at its name is never written
  through.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sgrld.experiments.base import exits
from sgrld.experiments.base.files import (
    LOCK_FILE,
    MAX_JSON_BYTES,
    DirectoryLock,
    locked_out_dir,
)
from test_faults import code_of, fake

pytest.importorskip("sklearn")

#: the run options ``sgrld tune`` takes too; ``DIABETES`` adds the sampling run's thinning
DIABETES_RUN = ["--dataset", "diabetes", "--width", "4", "--epochs", "1", "--burn-in", "0"]
DIABETES_RUN += ["--threads", "1", "--no-progress"]
DIABETES = [*DIABETES_RUN, "--thinning", "1"]

# --- every command's --out -----------------------------------------------------------------

#: command name → its argv for an ``--out`` (refused before any work in every case below)
OUT_COMMANDS: dict[str, Callable[[Path, Path], list[str]]] = {
    "sample": lambda out, tmp: ["sample", "--sampler", "identity", "--lr", "0.01", *DIABETES,
                                "--no-plot", "--out", str(out)],
    "sample --resume": lambda out, tmp: ["sample", "--resume", "--out", str(out),
                                        "--data-dir", str(tmp)],
    "funnel": lambda out, tmp: ["funnel", "--steps", "100", "--chains", "1", "--out", str(out)],
    "demo": lambda out, tmp: ["demo", "--steps", "100", "--out", str(out)],
    "geodesics": lambda out, tmp: ["geodesics", "--directions", "2", "--out", str(out)],
    "report": lambda out, tmp: ["report", str(tmp / "runs"), "--no-figures", "--out", str(out)],
}  # fmt: skip
#: sweep: a folder of runs, each locked by the job that runs it (two sweeps of one grid share
#: the work: ``test_sweep.py``); only its ``--out`` being a file is a case here
OUT_COMMANDS["sweep"] = lambda out, tmp: ["sweep", "--sampler", "identity", "--lr", "0.01",
                                          *DIABETES, "--dry-run", "--out", str(out)]  # fmt: skip
NOT_LOCKED = {"sweep"}
OUT_COMMANDS["tune"] = lambda out, tmp: ["tune", "--sampler", "sgld", *DIABETES_RUN, "--budget",
                                         "7600", "--out", str(out)]  # fmt: skip
OUT_COMMANDS["llc"] = lambda out, tmp: ["llc", "logistic", "--steps", "10", "--out", str(out)]


def _runs(tmp: Path) -> Path:
    """A folder holding one finished run's results.json (what report and table read)."""
    run = tmp / "runs" / "run"
    run.mkdir(parents=True)
    (run / "results.json").write_text(json.dumps(fake(0)))
    return tmp / "runs"


def _run(argv: list[str], seconds: int = 60) -> int:
    """The command's exit status, or a TimeoutError if it blocks (a FIFO opened)."""

    def hung(*_: object) -> None:
        raise TimeoutError(f"{argv[0]}: blocked (a FIFO opened for reading?)")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        return code_of(argv)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _error_lines(err: str) -> list[str]:
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if "error:" in line]


@pytest.mark.parametrize("command", sorted(OUT_COMMANDS))
def test_an_out_that_is_a_file_exits_2_with_one_message(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _runs(tmp_path)
    out = tmp_path / "out"
    out.write_text("precious\n")
    assert _run(OUT_COMMANDS[command](out, tmp_path)) == exits.USAGE
    (line,) = _error_lines(capsys.readouterr().err)
    assert f"--out {out} exists and is not a directory" in line, line
    assert out.read_text() == "precious\n"


@pytest.mark.parametrize("command", sorted(set(OUT_COMMANDS) - NOT_LOCKED))
def test_a_second_command_on_one_out_is_refused_naming_the_holder(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _runs(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text(json.dumps(fake(0)))  # for --resume: a finished run
    with DirectoryLock(out, "sgrld other"):  # flock: another open file description
        assert _run(OUT_COMMANDS[command](out, tmp_path)) == exits.USAGE
    (line,) = _error_lines(capsys.readouterr().err)
    assert "is in use by another run" in line and "sgrld other" in line, line
    assert sorted(p.name for p in out.iterdir()) == ["results.json"]


def test_the_lock_removes_what_killed_writers_left() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        out.mkdir()
        stale = [out / ".tune.png.x1.sgrld-tmp", out / ".llc.json.x2.sgrld-tmp"]
        for path in stale:
            path.write_bytes(b"half")
        (out / "keep.json").write_text("{}")
        with locked_out_dir(out, "sgrld test") as held:
            assert held == out and (out / LOCK_FILE).is_file()
            assert not any(p.exists() for p in stale)
        assert sorted(p.name for p in out.iterdir()) == ["keep.json"]


# --- every file a command reads -------------------------------------------------------------

TUNE = {
    "config": {"dataset": "diabetes", "model": "fc", "width": 4, "prior": "gaussian",
               "epochs": 1, "batch_size": 100, "seed": 0, "max_train": None, "num_train": 310,
               "budget": 7600, "score": "ksd"},
    "samplers": {"identity": {"options": {"lr": 0.01, "temperature": 1.0},
                              "searched": ["lr"], "spent": 10, "grid": None}},
}  # fmt: skip

#: name → (the file under tmp, its good content, argv, the words of the error)
READS: dict[str, tuple[str, Any, Callable[[Path], list[str]]]] = {
    "sample --lr tuned: tune.json": ("tune/tune.json", TUNE, lambda tmp: [
        "sample", "--sampler", "identity", "--lr", f"tuned:{tmp / 'tune'}", *DIABETES,
        "--no-plot", "--out", str(tmp / "out")]),
    "sweep --lr tuned: tune.json": ("tune/tune.json", TUNE, lambda tmp: [
        "sweep", "--sampler", "identity", "--lr", f"tuned:{tmp / 'tune'}", *DIABETES,
        "--dry-run", "--out", str(tmp / "out")]),
    "report --tuned tune.json": ("tune/tune.json", TUNE, lambda tmp: [
        "report", str(tmp / "runs"), "--no-figures", "--tuned", str(tmp / "tune"),
        "--out", str(tmp / "out")]),
    "table results.json": ("runs/run/results.json", None, lambda tmp: ["table", str(tmp / "runs")]),
    "report results.json": ("runs/run/results.json", None, lambda tmp: [
        "report", str(tmp / "runs"), "--no-figures", "--out", str(tmp / "out")]),
    "sweep sweep.json": ("out/sweep.json", None, lambda tmp: [
        "sweep", "--sampler", "identity", "--lr", "0.01", *DIABETES, "--dry-run",
        "--out", str(tmp / "out")]),
    "sample --resume checkpoint.pt": ("out/checkpoint.pt", None, lambda tmp: [
        "sample", "--resume", "--out", str(tmp / "out"), "--data-dir", str(tmp)]),
}  # fmt: skip

#: fault → the words its error says (``None``: any one clear line)
FAULTS: dict[str, str | None] = {
    "fifo": "not a regular file",
    "link to a good file": "symbolic link",
    "link to /dev/zero": "symbolic link",
    "oversized": "more than",
    "malformed": None,
    "wrong type": None,
}


def _plant(path: Path, fault: str, good: bytes, outside: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if fault == "fifo":
        os.mkfifo(path)
    elif fault == "link to a good file":
        outside.write_bytes(good)
        path.symlink_to(outside)
    elif fault == "link to /dev/zero":
        path.symlink_to("/dev/zero")
    elif fault == "oversized":  # sparse: no disk, but a reader that trusts it would take it all
        with path.open("wb") as handle:
            size = MAX_JSON_BYTES + 1 if path.suffix == ".json" else _memory() + 1
            handle.truncate(size)
    elif fault == "malformed":
        path.write_bytes(b'{"config": {"dataset": "diab')
    else:
        path.write_bytes(b"[1, 2, 3]\n")


def _manifest(argv: list[str]) -> Any:
    import argparse

    from sgrld.experiments.commands import sweep
    from sgrld.experiments.sweep import grid

    parser = argparse.ArgumentParser()
    sweep.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    runs, source = sweep.plan(args)
    out = Path(args.out)
    out.mkdir()
    grid.write_manifest(out, runs, source, sweep.chain_options(args))
    content = json.loads((out / grid.MANIFEST_FILE).read_text())
    (out / grid.MANIFEST_FILE).unlink()
    return content


def _memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.parametrize("name", sorted(READS))
def test_every_file_a_command_reads_is_refused_in_one_line_when_it_is_not_a_good_file(
    name: str, fault: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    where, content, argv = READS[name]
    runs = _runs(tmp_path)
    if name == "sweep sweep.json":  # the manifest the grid writes
        content = _manifest(argv(tmp_path))
    if content is None:
        content = json.loads((runs / "run" / "results.json").read_text())
    if where.startswith("runs/"):
        (tmp_path / where).unlink()
    good = json.dumps(content).encode()
    _plant(tmp_path / where, fault, good, tmp_path / "outside.json")
    capsys.readouterr()
    code = _run(argv(tmp_path))
    err = capsys.readouterr().err
    assert code == exits.USAGE, (code, err)
    lines = _error_lines(err)
    assert len(lines) == 1, err
    assert Path(where).name in lines[0], lines[0]
    words = FAULTS[fault]
    if words is not None:
        assert words in err, err
    if fault == "link to a good file":
        assert (tmp_path / "outside.json").read_bytes() == good


# --- every file a command writes ------------------------------------------------------------

#: name → (argv, the files it writes under --out)
WRITES: dict[str, tuple[Callable[[Path], list[str]], tuple[str, ...]]] = {
    "report": (lambda tmp: ["report", str(tmp / "runs"), "--no-figures", "--out",
                            str(tmp / "out")],
               ("report.md", "selection.csv", "table1.md", "table1.csv")),
    "report --tuned": (lambda tmp: ["report", str(tmp / "runs"), "--no-figures", "--tuned",
                                    str(tmp / "tune"), "--out", str(tmp / "out")],
                       ("tuning.md",)),
}  # fmt: skip


@pytest.mark.parametrize(
    ("name", "output"), [(name, output) for name, (_, outs) in WRITES.items() for output in outs]
)
def test_no_command_writes_through_a_link_planted_at_its_output(
    name: str, output: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv, _ = WRITES[name]
    _runs(tmp_path)
    (tmp_path / "tune").mkdir()
    (tmp_path / "tune" / "tune.json").write_text(json.dumps(TUNE))
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / output).symlink_to(victim)
    (tmp_path / "out" / f".{output}.x.sgrld-tmp").write_bytes(b"left by a killed writer")
    code = _run(argv(tmp_path))
    err = capsys.readouterr().err
    assert code in (exits.OK, exits.USAGE, exits.IO_ERROR), err
    assert "Traceback" not in err, err
    assert victim.read_text() == "precious\n"
    assert not (tmp_path / "out" / f".{output}.x.sgrld-tmp").exists()
    if code == exits.OK:  # replaced by a file of its own
        assert not (tmp_path / "out" / output).is_symlink()


@pytest.mark.slow  # the sweep's run: ~25 s on a loaded 2-core machine
def test_a_sweep_removes_what_a_killed_sweep_left_in_its_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import sgrld.experiments.commands.sweep as sweep_command

    argv = OUT_COMMANDS["sweep"](tmp_path / "out", tmp_path)
    argv.remove("--dry-run")
    (tmp_path / "out").mkdir()
    stale = tmp_path / "out" / ".sweep.json.x1.sgrld-tmp"
    stale.write_bytes(b"half a manifest")
    waits: list[float] = []

    def wait(seconds: float) -> None:  # the folder held: the sweep waits, then gives up
        waits.append(seconds)
        if len(waits) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(sweep_command.time, "sleep", wait)
    with DirectoryLock(tmp_path / "out", "sgrld other"):
        assert code_of(argv) == exits.INTERRUPTED
    assert waits == [0.1] * 3 and stale.exists()
    monkeypatch.undo()
    assert code_of(argv) == exits.OK, capsys.readouterr().err
    assert not stale.exists() and (tmp_path / "out" / "sweep.json").is_file()
