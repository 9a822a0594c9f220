"""Faults of the second round (issue 24): sweep supervision, honest reports, safe outputs, bad
configs and seeds, one lock per run, one exit-status table (``docs/experiments.md``)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from sgrld.cli import COMMANDS, main
from sgrld.experiments.base import exits
from sgrld.experiments.base import files as _io
from sgrld.experiments.commands import sweep
from sgrld.experiments.run.results import impossible_values
from sgrld.experiments.sweep import grid
from sgrld.experiments.sweep.jobs import RunOutcome, _locked, run_state

REPO = Path(__file__).resolve().parents[1]
TINY = ["--width", "8", "--epochs", "1", "--subset", "200", "--eval-subset", "50"]
TINY += ["--batch-size", "50", "--burn-in", "2", "--thinning", "2", "--eval-batch-size", "50"]
TINY += ["--threads", "1", "--no-progress"]
RUN = "mnist-fc8-gaussian/identity/lr0.05-seed0"


def code_of(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's own errors
        return int(exc.code or 0)


def one_line_error(err: str, *words: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in lines[0], (word, lines[0])


def fake(seed: int) -> dict[str, Any]:
    """A finished run's results.json (identity, ℓ 0.1, Gaussian prior)."""
    from test_report import fake_run

    return fake_run("identity", 0.1, seed, -0.1, prior="gaussian")


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sweep.add_arguments(parser)
    return parser.parse_args([*argv, "--out", "unused"])


# --- one exit-status table ----------------------------------------------------------------------


def docs_exit_table() -> dict[int, tuple[str, set[str]]]:
    """The exit-status table of docs/experiments.md: status → (meaning, commands)."""
    text = (REPO / "docs" / "experiments.md").read_text(encoding="utf-8")
    section = text[text.index("## Exit statuses") :]
    table = {}
    for line in section.splitlines():
        match = re.match(r"^\| (\d+) \| (.+) \| (.+) \|$", line)
        if match:
            commands = {c.strip() for c in match.group(3).split(",")}
            table[int(match.group(1))] = (match.group(2).strip(), commands)
        elif table and not line.startswith("|"):
            break
    return table


def test_one_exit_status_table_for_every_command_in_docs_and_help() -> None:
    table = docs_exit_table()
    assert table == {code: (text, set(cmds)) for code, (text, cmds) in exits.STATUSES.items()}
    for command, (module, _) in COMMANDS.items():
        parser = argparse.ArgumentParser()
        __import__(module, fromlist=["add_arguments"]).add_arguments(parser)
        assert parser.epilog == exits.epilog(command), command
        for code in exits.statuses(command):
            assert f"{code} {exits.STATUSES[code][0]}" in parser.epilog


def test_sigterm_of_a_sweep_exits_143(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from sgrld.experiments.sweep.jobs import SweepJob

    def terminated(self: SweepJob) -> list[RunOutcome]:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        raise AssertionError("SIGTERM did not end the job")

    monkeypatch.setattr(SweepJob, "__call__", terminated)
    (tmp_path / "data").mkdir()
    argv = ["sweep", "--sampler", "identity", "--lr", "0.05", *TINY]
    assert main([*argv, "--data-dir", str(tmp_path / "data"), "--out", str(tmp_path / "o")]) == 143
    assert capsys.readouterr().err.splitlines()[-1] == "terminated"


@pytest.mark.parametrize(
    "command", ["sample", "sweep", "funnel", "geodesics", "report", "table", "tune"]
)
def test_an_unwritable_out_exits_74_in_every_command(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    (tmp_path / "data").mkdir()
    blocker = tmp_path / "file"
    blocker.write_text("x")
    out = str(blocker / "sub")  # ENOTDIR: unwritable even for root
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "results.json").write_text(json.dumps(fake(0)))
    run = ["--sampler", "identity", "--lr", "0.05", *TINY, "--data-dir", str(tmp_path / "data")]
    argv = {
        "sample": ["sample", *run, "--out", out],
        "sweep": ["sweep", *run, "--out", out],
        "funnel": ["funnel", "--out", out, "--steps", "10", "--no-plot"],
        "geodesics": ["geodesics", "--out", out, "--directions", "2"],
        "report": ["report", str(runs), "--out", out, "--no-figures"],
        "table": ["table", str(runs), "--markdown", str(blocker / "t.md")],
        "tune": [
            "tune",
            "--dataset",
            "diabetes",
            "--model",
            "fc",
            "--sampler",
            "identity",
            "--epochs",
            "120",
            "--batch-size",
            "32",
            "--out",
            out,
        ],
    }[command]
    assert code_of(argv) == exits.IO_ERROR
    assert "Traceback" not in capsys.readouterr().err


# --- outputs never written through planted links ------------------------------------------------


def test_a_lock_never_follows_a_planted_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    for target in (victim, tmp_path / "created-elsewhere"):
        out = tmp_path / f"out-{target.name}"
        out.mkdir()
        (out / _io.LOCK_FILE).symlink_to(target)
        with pytest.raises(_io.OutputError, match="symbolic link"), _io.DirectoryLock(out, "x"):
            pass
    assert victim.read_text() == "precious\n"
    assert not (tmp_path / "created-elsewhere").exists()


def test_outputs_replace_a_planted_link_not_its_target(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    runs = tmp_path / "runs"
    runs.mkdir()
    for seed in (0, 1):
        folder = runs / f"run{seed}"
        folder.mkdir()
        (folder / "results.json").write_text(json.dumps(fake(seed)))
    report, table = tmp_path / "report", tmp_path / "table.md"
    report.mkdir()
    for name in ("table1.md", "report.md", "selection.csv"):
        (report / name).symlink_to(victim)
    table.symlink_to(victim)
    assert main(["report", str(runs), "--out", str(report), "--no-figures"]) == 0
    assert main(["table", str(runs), "--markdown", str(table)]) == 0
    assert victim.read_text() == "precious\n"
    assert not table.is_symlink() and "Identity" in table.read_text()
    assert not (report / "table1.md").is_symlink()


def test_a_sweep_never_writes_through_planted_links(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    out = tmp_path / "out"
    (out / RUN).mkdir(parents=True)
    (out / "sweep.json.tmp").symlink_to(victim)  # the temporary name of earlier versions
    (out / RUN / ".lock").symlink_to(victim)
    (out / RUN / ".write-test").symlink_to(tmp_path / "created-elsewhere")
    (tmp_path / "data").mkdir()  # no MNIST in it: the run fails after taking its locks
    argv = ["sweep", "--sampler", "identity", "--lr", "0.05", *TINY]
    assert main([*argv, "--data-dir", str(tmp_path / "data"), "--out", str(out)]) == 1
    (out / RUN / _io.LOCK_FILE).symlink_to(victim)
    assert main([*argv, "--data-dir", str(tmp_path / "data"), "--out", str(out)]) == 1
    assert "symbolic link" in capsys.readouterr().err
    assert victim.read_text() == "precious\n"
    assert not (tmp_path / "created-elsewhere").exists()
    assert json.loads((out / grid.MANIFEST_FILE).read_text())["num_runs"] == 1


# --- bad configs, seeds and folders: one line, exit 2, before any work --------------------------


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('[[grid]]\nsampler = "identity"\nlr = true\n', ["lr must be a number", "True"]),
        ('[[grid]]\nsampler = "identity"\nlr = "0.1"\n', ["lr must be a number", "'0.1'"]),
        ('[[grid]]\nsampler = "identity"\nlr = ["0.1", "0.2"]\n', ["lr must be a number"]),
        ('defaults = 3\n[[grid]]\nsampler = "identity"\n', ["[defaults] must be a table"]),
        ('[[grid]]\nsampler = "identity"\ndataset = ["mnist"]\n', ["dataset takes one value"]),
        ('[[grid]]\nsampler = "identity"\nepochs = 2.5\n', ["epochs must be an integer"]),
        ('[[grid]]\nsampler = "identity"\ncompile = 1\n', ["compile must be true or false"]),
        ('[[grid]]\nsampler = "sgld"\n', ["sampler must be one of"]),
        ("grid = [3]\n", ["must be a table"]),
    ],
)
def test_config_values_of_the_wrong_kind_are_refused(
    text: str, words: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "grid.toml"
    config.write_text(text)
    argv = ["sweep", "--config", str(config), "--data-dir", str(tmp_path), "--out", "o"]
    assert code_of(argv) == 2
    one_line_error(capsys.readouterr().err, *words)


def test_a_config_that_is_not_utf8_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "grid.toml"
    config.write_bytes(b'[[grid]]\nsampler = "identity"\n# \xff\xfe\n')
    assert code_of(["sweep", "--config", str(config), "--out", "o"]) == 2
    one_line_error(capsys.readouterr().err, "cannot read")


def test_a_huge_seed_range_is_refused_without_building_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    started = time.perf_counter()
    argv = ["sweep", "--sampler", "identity", "--seeds", "0-999999999999", "--out", "o"]
    assert code_of(argv) == 2
    assert time.perf_counter() - started < 5
    assert "at most" in capsys.readouterr().err
    with pytest.raises(grid.GridError, match="below 2"):
        grid.parse_seeds([2**64])


def test_two_runs_of_one_folder_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["sweep", "--sampler", "identity", "--lr", "0.1,0.1000001", "--out", "o"]
    assert code_of(argv) == 2
    one_line_error(capsys.readouterr().err, "share the folder", "lr0.1-seed0")


@pytest.mark.parametrize("manifest", ["[]", '{"format": "sgrld-sweep/2"}', "\xff", "{"])
def test_a_damaged_manifest_is_one_line(
    manifest: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / grid.MANIFEST_FILE).write_bytes(manifest.encode("latin-1"))
    argv = ["sweep", "--sampler", "identity", "--lr", "0.05", "--out", str(out), "--dry-run"]
    assert code_of(argv) == 2
    one_line_error(capsys.readouterr().err, "cannot read", "rebuild")


# --- the manifest records what shapes a chain ---------------------------------------------------


def fake_finished(out: Path, run: grid.PlannedRun) -> None:
    results = {**fake(0), "config": run.config}
    (out / run.path).mkdir(parents=True, exist_ok=True)
    (out / run.path / "results.json").write_text(json.dumps(results))


def test_a_rerun_with_other_chain_shaping_options_is_refused_by_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "data").mkdir()
    out = tmp_path / "out"
    base = ["sweep", "--sampler", "identity", "--lr", "0.05", *TINY]
    base += ["--data-dir", str(tmp_path / "data"), "--out", str(out)]
    assert main(base) == 1  # no data: the run fails, the manifest stays
    saved = json.loads((out / grid.MANIFEST_FILE).read_text())
    assert saved["format"] == "sgrld-sweep/2"
    assert saved["options"] == {
        "chains": 1,
        "chain_batch": None,
        "threads": 1,
        "device": "cpu",
        "graph": True,
    }
    capsys.readouterr()
    threads = base.index("--threads") + 1
    other_threads = [*base[:threads], "2", *base[threads + 1 :]]
    for flag, argv in (
        ("--threads", other_threads),
        ("--chains", [*base, "--chains", "2"]),
        ("--chain-batch", [*base, "--chain-batch", "1"]),
    ):
        assert main(argv) == 2
        one_line_error(capsys.readouterr().err, flag, "other options that shape its chains")
        assert main([*argv, "--dry-run"]) == 2  # the dry run refuses identically
        one_line_error(capsys.readouterr().err, flag)


def test_grown_epochs_extend_finished_runs_and_the_dry_run_agrees(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    args = parse("--sampler", "identity", "--lr", "0.05", *TINY)
    (run,) = sweep.plan(args)[0]
    grid.write_manifest(out, [run], "command line", sweep.chain_options(args))
    fake_finished(out, run)
    argv = ["sweep", "--sampler", "identity", "--lr", "0.05", *TINY, "--out", str(out)]
    assert main([*argv, "--dry-run"]) == 0
    assert capsys.readouterr().out.startswith("done")
    epochs = argv.index("--epochs") + 1
    grown = [*argv[:epochs], "3", *argv[epochs + 1 :]]
    assert main([*grown, "--dry-run"]) == 0
    out_text = capsys.readouterr().out
    assert out_text.startswith("todo") and "--epochs grew" in out_text
    assert grid._config_changes({"epochs": 3}, {"epochs": 2})[0] == ["--epochs 3 there, 2 here"]
    other = [*argv, "--batch-size", "25"]
    assert main([*other, "--dry-run"]) == 2
    one_line_error(capsys.readouterr().err, "--batch-size 50 there, 25 here")
    assert main(other) == 2  # the real sweep refuses identically
    one_line_error(capsys.readouterr().err, "--batch-size 50 there, 25 here")


def test_a_broken_down_run_stays_done_when_epochs_grow(tmp_path: Path) -> None:
    (run,) = sweep.plan(parse("--sampler", "identity", "--lr", "0.05", *TINY))[0]
    fake_finished(tmp_path, run)
    results_path = tmp_path / run.path / "results.json"
    results = json.loads(results_path.read_text())
    results["status"] = "broken_down"
    results_path.write_text(json.dumps(results))
    assert run_state(tmp_path / run.path, {**run.config, "epochs": 5}) == "done"


def test_a_lost_manifest_is_rebuilt_from_the_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    argv = ["sweep", "--sampler", "identity", "--lr", "0.05", *TINY, "--out", str(out)]
    (run,) = sweep.plan(parse("--sampler", "identity", "--lr", "0.05", *TINY))[0]
    fake_finished(out, run)
    (tmp_path / "data").mkdir()
    assert main([*argv, "--data-dir", str(tmp_path / "data")]) == 0  # done: nothing to run
    assert json.loads((out / grid.MANIFEST_FILE).read_text())["runs"][0]["path"] == run.path
    capsys.readouterr()
    other = ["sweep", "--sampler", "identity", "--lr", "0.07", *TINY, "--out", str(out)]
    (out / grid.MANIFEST_FILE).unlink()
    assert code_of([*other, "--dry-run"]) == 2
    one_line_error(capsys.readouterr().err, "rebuilds the manifest", run.path)


# --- results no run can have --------------------------------------------------------------------


def test_impossible_results_are_not_done(tmp_path: Path) -> None:
    (run,) = sweep.plan(parse("--sampler", "identity", "--lr", "0.05", *TINY))[0]
    fake_finished(tmp_path, run)
    assert run_state(tmp_path / run.path, run.config) == "done"
    path = tmp_path / run.path / "results.json"
    for lp, why in ((5.0, "> 0"), (None, "NaN")):
        results = json.loads(path.read_text())
        results["final"]["test"]["lp"] = lp
        path.write_text(json.dumps(results))
        assert run_state(tmp_path / run.path, run.config) == "todo"
        assert why in impossible_values(results)[0]


def write_runs(root: Path, runs: dict[str, dict[str, Any]]) -> None:
    for name, results in runs.items():
        (root / name).mkdir(parents=True)
        (root / name / "results.json").write_text(json.dumps(results))


@pytest.mark.parametrize("command", ["table", "report"])
def test_reports_leave_out_what_would_make_them_wrong(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def run(seed: int, test_lp: float = -0.1) -> dict[str, Any]:
        results = fake(seed)
        results["final"]["test"]["lp"] = test_lp
        return results

    runs = tmp_path / "runs"
    write_runs(
        runs,
        {
            "a/lr0.1-seed0": run(0),
            "a/lr0.1-seed1": run(1),
            "copy/lr0.1-seed0": run(0),  # the same run in another folder
            "a/lr0.2-seed2": run(2),  # its config says lr 0.1: not the run its folder names
            "a/lr0.1-seed3": run(3, test_lp=5.0),  # impossible: a probability above 1
            "a/lr0.1-seed4": {**run(4), "final": {"val": run(4)["final"]["val"], "test": {}}},
        },
    )
    nan = run(5)
    nan["final"]["test"]["lp"] = None  # NaN in a completed run
    write_runs(runs, {"a/lr0.1-seed5": nan})
    args = [command, str(runs)] + (
        ["--out", str(tmp_path / "r"), "--no-figures"] * (command == "report")
    )
    args += ["--csv", str(tmp_path / "t.csv")] * (command == "table")
    assert main(args) == 0
    err = capsys.readouterr().err
    for why in ("the same run", "not the lr0.2-seed2", "test lp 5.0 > 0", "test lp NaN"):
        assert why in err
    assert main([*args, "--strict"]) == exits.FAILED
    if command == "table":
        (row,) = (tmp_path / "t.csv").read_text().splitlines()[1:]
        assert ",2,2,0,0 1," in row  # 2 runs, seeds 0 and 1 (not "4 seeds, 0 0 1 1")
    else:
        report = (tmp_path / "r" / "report.md").read_text()
        assert "## Runs left out" in report and "test lp 5.0 > 0" in report


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (b"\xff\xfe{}", "not UTF-8"),
        (b"[1, 2]", "not a sgrld sample results file"),
        (b'{"format": "sgrld-sample-results/1", "config": {"seed": 0}}', "no valid status"),
        (b'{"format": "sgrld-sample-results/2", "status": "completed"}', "upgrade sgrld"),
        (b'{"format": "sgrld-sample-results/1", "status": "completed"}', "no valid config"),
    ],
)
@pytest.mark.parametrize("command", ["table", "report"])
def test_unreadable_results_are_one_line(
    command: str, content: bytes, words: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "results.json").write_bytes(content)
    args = [command, str(tmp_path)] + ["--out", str(tmp_path / "r")] * (command == "report")
    assert main(args) == 2
    one_line_error(capsys.readouterr().err, words)


# --- one lock per run ---------------------------------------------------------------------------


def test_one_lock_for_a_run_whoever_runs_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    import sgrld.data

    def no_work(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("data were loaded")

    monkeypatch.setattr(sgrld.data, "load_dataset", no_work)
    out = tmp_path / "out"
    with _locked(out, RUN) as mine:  # a sweep's job runs it
        assert mine
        argv = ["sample", "--sampler", "identity", "--lr", "0.05", *TINY, "--resume"]
        argv += ["--data-dir", str(tmp_path), "--out", str(out / RUN)]
        assert main(argv) == 2
        assert "in use by another run" in capsys.readouterr().err
        shutil.rmtree(out / RUN)  # a folder deleted mid-sweep
        with _locked(out, RUN) as second:
            assert not second  # a second sweep does not run it at once


def test_killed_writers_temporaries_are_removed_by_the_next_job(tmp_path: Path) -> None:
    folder = tmp_path / RUN
    folder.mkdir(parents=True)
    stale = folder / ".results.json.k1l2ed.sgrld-tmp"
    stale.write_text("half")
    with _locked(tmp_path, RUN) as mine:
        assert mine and not stale.exists()


def test_a_pack_never_rewrites_its_finished_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the pack's checkpoint (lost, or another --chains of an old sweep), only its
    open runs run: a finished results.json is never written again."""
    import sgrld.experiments.run.loop as loop
    from sgrld.experiments.sweep import jobs

    runs = sweep.plan(parse("--sampler", "identity", "--lr", "0.05", "--seeds", "0-2", *TINY))[0]
    fake_finished(tmp_path, runs[0])
    ran: list[list[str]] = []

    def run_sampling(configs: Any, splits: Any, out: Any, **kw: Any) -> list[dict[str, Any]]:
        ran.append([str(f) for f in kw["folders"]])
        return [{"status": "completed", "epochs_completed": 1} for _ in configs]

    monkeypatch.setattr(loop, "run_sampling", run_sampling)
    monkeypatch.setattr(jobs, "_splits", lambda *args: None)
    machine = jobs.Machine(data_dir="unused", threads=1)
    outcomes = jobs.execute_pack(runs, tmp_path, machine)
    assert ran == [[str(tmp_path / r.path) for r in runs[1:]]]
    assert [o.path for o in outcomes] == [r.path for r in runs[1:]]


# --- supervision of the local pool --------------------------------------------------------------


class DyingJob:
    """A job whose worker dies (SIGKILL, as from the OOM killer) ``deaths`` times, then runs."""

    def __init__(self, name: str, marker: Path, deaths: int) -> None:
        self.runs = [grid.PlannedRun({}, name)]
        self.name, self.marker, self.deaths = name, marker, deaths

    def __call__(self) -> list[RunOutcome]:
        died = len(list(self.marker.parent.glob(f"{self.marker.name}*")))
        if died < self.deaths:
            (self.marker.parent / f"{self.marker.name}{died}").touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return [RunOutcome(self.name, "completed", 1)]


@pytest.mark.slow
def test_a_dead_worker_is_retried_once_and_the_others_go_on(tmp_path: Path) -> None:
    from sgrld.experiments.sweep.engines import GridProgress, run_local

    jobs: list[Any] = [
        DyingJob("dies-once", tmp_path / "once", 1),
        DyingJob("dies-always", tmp_path / "always", 99),
        *(DyingJob(f"fine{i}", tmp_path / f"fine{i}", 0) for i in range(4)),
    ]
    progress = GridProgress(len(jobs), 0, enabled=False)
    run_local(jobs, 2, progress)
    tally = progress.tally
    assert tally.completed == 5
    assert [path for path, _ in tally.failed] == ["dies-always"]
    assert sorted(path for path, _ in tally.retried) == ["dies-always", "dies-once"]
    assert "worker process died" in tally.failed[0][1]


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the process tree from /proc")
def test_killing_a_sweep_with_sigkill_ends_its_workers(mnist_dir: Path, tmp_path: Path) -> None:
    from test_reliability import alive, descendants

    argv = [sys.executable, "-m", "sgrld.cli", "sweep", "--sampler", "identity"]
    argv += ["--lr", "0.01,0.02,0.03,0.04", *TINY, "--jobs", "2"]
    argv[argv.index("--epochs") + 1] = "400"
    argv += ["--data-dir", str(mnist_dir), "--out", str(tmp_path / "out")]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    parent = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 180
        while len(descendants(parent.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)  # the resource tracker and two workers
        children = descendants(parent.pid)
        assert len(children) >= 3, "the workers never started"
        time.sleep(2.0)
        parent.kill()  # the parent only: not its process group
        parent.communicate(timeout=30)
        deadline = time.monotonic() + 15
        while alive(children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(children), f"survived their sweep: {alive(children)}"
    finally:
        for pid in alive(descendants(parent.pid) | {parent.pid}):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        parent.wait()


@pytest.mark.slow
def test_a_grown_epochs_sweep_extends_its_runs_as_a_longer_sweep(
    mnist_dir: Path, tmp_path: Path
) -> None:
    """``--epochs`` 1 then 2 on one folder gives the runs of a straight 2-epoch sweep."""
    argv = ["sweep", "--sampler", "identity", "--lr", "0.05", *TINY, "--data-dir", str(mnist_dir)]
    epochs = argv.index("--epochs") + 1
    two = [*argv[:epochs], "2", *argv[epochs + 1 :]]
    assert main([*argv, "--out", str(tmp_path / "grown")]) == 0
    assert main([*two, "--out", str(tmp_path / "grown")]) == 0
    assert main([*two, "--out", str(tmp_path / "straight")]) == 0
    grown = json.loads((tmp_path / "grown" / RUN / "results.json").read_text())
    straight = json.loads((tmp_path / "straight" / RUN / "results.json").read_text())
    assert grown["epochs_completed"] == 2 and grown["config"] == straight["config"]
    assert grown["curves"] == straight["curves"] and grown["final"] == straight["final"]
    manifest = json.loads((tmp_path / "grown" / grid.MANIFEST_FILE).read_text())
    assert manifest["runs"][0]["config"]["epochs"] == 2


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the process tree from /proc")
def test_sigterm_of_a_submitit_local_sweep_is_one_line_and_143(
    mnist_dir: Path, tmp_path: Path
) -> None:
    pytest.importorskip("submitit")
    from test_reliability import alive, descendants

    out = tmp_path / "out"
    argv = [sys.executable, "-m", "sgrld.cli", "sweep", "--sampler", "identity", "--lr", "0.05"]
    argv += [*TINY, "--engine", "submitit-local", "--data-dir", str(mnist_dir), "--out", str(out)]
    argv[argv.index("--epochs") + 1] = "400"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    sweeping = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 180
        while not (out / RUN / "checkpoint.pt").exists() and time.monotonic() < deadline:
            time.sleep(0.1)  # the job runs its run
        children = descendants(sweeping.pid)
        sweeping.terminate()
        _, err = sweeping.communicate(timeout=60)
        deadline = time.monotonic() + 15
        while alive(children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(children), "the job outlived its cancelled sweep"
    finally:
        for pid in alive(descendants(sweeping.pid) | {sweeping.pid}):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        sweeping.wait()
    assert sweeping.returncode == 143
    assert b"Traceback" not in err and err.decode().splitlines()[-1] == "terminated"


def test_sample_with_an_unwritable_out_after_its_lock_exits_74(
    tmp_path: Path, mnist_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read-only --out whose lock file exists (root ignores permissions: the write probe is
    made to fail)."""
    import tempfile

    def read_only(*args: Any, **kwargs: Any) -> Any:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    argv = ["sample", "--sampler", "identity", "--lr", "0.05", *TINY, "--no-plot"]
    assert main([*argv, "--data-dir", str(mnist_dir), "--out", str(tmp_path / "o")]) == 74


@pytest.mark.slow
def test_sample_resume_with_other_threads_is_refused(
    tmp_path: Path, mnist_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["sample", "--sampler", "identity", "--lr", "0.05", *TINY, "--no-plot"]
    argv += ["--data-dir", str(mnist_dir), "--out", str(tmp_path / "run")]
    assert main(argv) == 0
    threads = argv.index("--threads") + 1
    other = [*argv[:threads], "2", *argv[threads + 1 :]]
    epochs = other.index("--epochs") + 1
    other[epochs] = "2"
    before = (tmp_path / "run" / "results.json").read_bytes()
    capsys.readouterr()
    assert main([*other, "--resume"]) == 2
    one_line_error(capsys.readouterr().err, "ran with --threads 1", "pass --threads 1")
    assert (tmp_path / "run" / "results.json").read_bytes() == before


def test_sweep_help_does_not_contradict_itself() -> None:
    parser = argparse.ArgumentParser()
    sweep.add_arguments(parser)
    text = parser.format_help()
    assert "chain per value" not in text and "a comma list sweeps it" not in text
    assert "--no-plot" not in text.split("usage:")[-1].split("options:")[1]
    assert "--resume" not in text and "--plot" in text
    assert parser.parse_args(["--out", "o", "--resume", "--no-plot"]).no_plot  # still accepted


def test_a_run_folder_planted_as_a_link_is_never_written_through(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "results.json").write_text("precious\n")
    out = tmp_path / "out"
    (out / RUN).parent.mkdir(parents=True)
    (out / RUN).symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(_io.OutputError, match="symbolic link"), _locked(out, RUN):
        pass
    assert sorted(p.name for p in elsewhere.iterdir()) == ["results.json"]


def test_runs_held_elsewhere_that_finished_meanwhile_are_done(tmp_path: Path) -> None:
    from sgrld.experiments.sweep.engines import Tally

    (run,) = sweep.plan(parse("--sampler", "identity", "--lr", "0.05", *TINY))[0]
    held = Tally(busy=[run.path])
    assert sweep._summary(held, [run], tmp_path, 1.0) == exits.BUSY
    fake_finished(tmp_path, run)  # the other sweep finished it before this one ended
    assert sweep._summary(held, [run], tmp_path, 1.0) == exits.OK
    failed = Tally(failed=[(run.path, "boom")])
    assert sweep._summary(failed, [run], tmp_path, 1.0) == exits.FAILED


def test_a_kill_between_geodesic_figures_never_leaves_a_listed_mixed_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sgrld.experiments.funnel import geodesics

    files = {"geodesics_neck.png": b"new neck", "geodesics_flat.png": b"new flat"}
    geodesics.write_set(tmp_path, {k: b"old" for k in files}, {"alpha2": 1.0})
    written = []

    def killed_after_one(path: Any, data: Any) -> None:
        if written:
            raise KeyboardInterrupt  # the kill
        written.append(path)
        _io.write_atomic(path, data)

    monkeypatch.setattr(geodesics, "write_atomic", killed_after_one)
    with pytest.raises(KeyboardInterrupt):
        geodesics.write_set(tmp_path, files, {"alpha2": 2.0})
    assert (tmp_path / "geodesics_neck.png").read_bytes() == b"new neck"
    assert not (tmp_path / geodesics.MANIFEST).exists()  # no listing beside a mixed set
