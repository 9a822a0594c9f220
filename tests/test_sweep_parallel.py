"""``sgrld sweep --parallel ddp --tasks-per-node W``: each submitit job is one run over W ranks.

The runs are real: submitit's LocalExecutor starts each job's W tasks on this machine, gloo on
CPU, the bundled diabetes data set.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import signal
import time
from pathlib import Path

import pytest

from sgrld.cli import main
from sgrld.experiments.commands import sample, sweep
from sgrld.experiments.sweep import engines, grid

pytest.importorskip("sklearn")
pytest.importorskip("submitit")

TINY = ["--width", "16", "--epochs", "6", "--batch-size", "64", "--burn-in", "10"]
TINY += ["--thinning", "2", "--threads", "1", "--no-progress"]
GRID = ["--dataset", "diabetes", "--sampler", "identity,monge", "--lr", "0.01", *TINY]
DDP = ["--engine", "submitit-local", "--parallel", "ddp", "--tasks-per-node", "2"]


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str], *words: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err  # one line
    for word in words:
        assert word in err, err
    return err


def test_parallel_sweeps_are_validated_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    base = ["sweep", *GRID, "--out", str(out)]
    _refused([*base, "--parallel", "ddp"], capsys, "--engine submitit", "--engine local runs")
    _refused([*base, *DDP, "--nodes", "2"], capsys, "--nodes 2", "one node")
    _refused([*base, "--tasks-per-node", "2"], capsys, "need --parallel (ddp")
    _refused([*base, "--engine", "submitit", "--nodes", "2"], capsys, "need --parallel")
    _refused([*base, *DDP, "--chains", "2"], capsys, "drop --chains")
    _refused([*base, *DDP, "--tasks-per-node", "0"], capsys, ">= 1")
    _refused([*base, *DDP, "--device", "cuda:1"], capsys, "cuda:LOCAL_RANK")
    cuda = ["--engine", "submitit", "--parallel", "ddp", "--tasks-per-node", "4"]
    _refused([*base, *cuda, "--device", "cuda", "--gpus-per-job", "2"], capsys, "one GPU per rank")
    assert not out.exists()


def test_the_parallel_modes_are_sample_s() -> None:
    parser = argparse.ArgumentParser()
    sample.add_arguments(parser)
    assert sweep.parallel_modes() == ("ddp", "fsdp")
    assert {parser.parse_args(["--parallel", m]).parallel for m in sweep.parallel_modes()} == {
        "ddp",
        "fsdp",
    }
    for mode in sweep.parallel_modes():  # every one is a sweep value too
        parser = argparse.ArgumentParser()
        sweep.add_arguments(parser)
        args = parser.parse_args(["--out", "o", "--parallel", mode, "--tasks-per-node", "2"])
        assert args.parallel == mode and sweep.processes(args) == 2


def test_the_manifest_records_the_processes_and_a_rerun_with_others_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    sweep.add_arguments(parser)
    out = tmp_path / "out"
    args = parser.parse_args([*GRID, *DDP, "--out", str(out)])
    runs, source = sweep.plan(args)
    options = sweep.chain_options(args)
    assert options["parallel"] == "ddp" and options["processes"] == 2
    grid.write_manifest(out, runs, source, options)
    base = ["sweep", *GRID, "--out", str(out), "--engine", "submitit-local"]
    _refused([*base, "--parallel", "ddp", "--tasks-per-node", "3"], capsys, "2 there, 3 here")
    _refused(base, capsys, "--parallel 'ddp' there, None here")
    one = parser.parse_args([*GRID, "--out", str(out)])  # a one-process sweep's options: as ever
    assert set(sweep.chain_options(one)) == {"chains", "chain_batch", "threads", "device", "graph"}


def test_gpus_are_one_per_rank_on_cuda() -> None:
    parser = argparse.ArgumentParser()
    sweep.add_arguments(parser)
    argv = ["--out", "o", "--engine", "submitit", "--parallel", "ddp", "--tasks-per-node", "4"]
    assert sweep.gpus_per_node(parser.parse_args([*argv, "--device", "cuda"])) == 4
    assert sweep.gpus_per_node(parser.parse_args(argv)) == 0  # cpu
    local = ["--out", "o", "--engine", "submitit-local", "--device", "cuda"]
    assert sweep.gpus_per_node(parser.parse_args(local)) == 1  # its executor hides the others


def test_a_failed_job_s_ranks_are_told_in_one_line_the_cause_first() -> None:
    lines = {
        0: "RuntimeError: [../gloo/transport/tcp/pair.cc:537] Read error: Connection reset by "
        "peer. This is typically caused by a remote worker hanging " + "x" * 200,
        1: "ValueError: boom",
        2: "ValueError: boom",
    }
    text = engines.rank_failures(lines, 4)
    assert text.startswith("3 of 4 ranks failed (ranks 1, 2: ValueError: boom; rank 0 stopped")
    assert len(text) < 200 and "\n" not in text
    only_echoes = engines.rank_failures({1: "RuntimeError: rank 0 could not start r: E: x"}, 2)
    assert (
        only_echoes == "1 of 2 ranks failed (rank 1: RuntimeError: rank 0 could not start r: E: x)"
    )


def test_a_run_rank_0_cannot_start_fails_on_every_rank_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run folder planted as a symbolic link: rank 0 refuses it, the others stop with it
    (not left waiting for rank 0), nothing is written through the link."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    elsewhere.mkdir()
    (out / "diabetes-fc16-gaussian" / "identity").mkdir(parents=True)
    (out / "diabetes-fc16-gaussian" / "identity" / "lr0.01-seed0").symlink_to(elsewhere)
    argv = ["sweep", "--dataset", "diabetes", "--sampler", "identity", "--lr", "0.01", *TINY]
    assert main([*argv, *DDP, "--out", str(out)]) == 1
    line = next(x for x in capsys.readouterr().err.splitlines() if x.startswith("  failed "))
    assert "2 of 2 ranks failed (rank 0: sgrld.experiments.base.files.OutputError: " in line
    assert "symbolic link" in line and "rank 1 stopped with it: RuntimeError: rank 0 could" in line
    assert list(elsewhere.iterdir()) == []


def _finals(out: Path) -> dict[str, dict[str, dict[str, float]]]:
    return {
        p.parent.relative_to(out).as_posix(): json.loads(p.read_text())["final"]
        for p in sorted(out.rglob("results.json"))
    }


def _gap(a: dict[str, dict[str, float]], b: dict[str, dict[str, float]]) -> float:
    """max relative difference of the final scores of one run in two sweeps."""
    return max(
        abs(a[s][k] - b[s][k]) / max(abs(b[s][k]), 1e-12) for s in ("val", "test") for k in b[s]
    )


def _files(out: Path) -> list[str]:
    """The sweep folder's files, but submitit's logs and the locks."""
    return sorted(
        p.relative_to(out).as_posix()
        for p in out.rglob("*")
        if p.is_file() and not p.relative_to(out).parts[0].startswith(".")
    )


def _csv_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


@pytest.mark.slow
@pytest.mark.parametrize("mode", sweep.parallel_modes())
def test_a_two_process_sweep_equals_the_one_process_sweep(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """2 settings (SGLD, Monge) × 2 ranks per job, every mode of ``sample --parallel``: 3
    epochs, then --epochs 6 (every run resumes from rank 0's checkpoint) equal the one-process
    sweep's 6 epochs; the folders hold the same files, which ``sgrld table`` reads alike; a
    rerun does nothing."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    one, ddp = tmp_path / "one", tmp_path / mode
    spread = [*DDP]
    spread[spread.index("ddp")] = mode
    assert main(["sweep", *GRID, "--out", str(one)]) == 0  # the local engine: a process per job
    short = [a if a != "6" else "3" for a in GRID]
    assert main(["sweep", *short, *spread, "--out", str(ddp)]) == 0
    assert main(["sweep", *GRID, *spread, "--out", str(ddp)]) == 0  # extends: resumes both
    capsys.readouterr()
    ours, theirs = _finals(ddp), _finals(one)
    assert sorted(ours) == sorted(theirs) and len(ours) == 2
    gaps = {path: _gap(ours[path], theirs[path]) for path in ours}
    with capsys.disabled():
        print(f"{mode}: relative gaps of the final scores:", gaps)
    assert max(gaps.values()) < 1e-6  # float32; measured ≤ 5e-9
    assert _files(ddp) == _files(one)
    for path in ours:
        results = json.loads((ddp / path / "results.json").read_text())
        assert results["status"] == "completed" and results["epochs_completed"] == 6
        assert results["timing"]["processes"] == 2
        assert "processes" not in json.loads((one / path / "results.json").read_text())["timing"]
    manifest = json.loads((ddp / grid.MANIFEST_FILE).read_text())
    assert manifest["options"]["parallel"] == mode and manifest["options"]["processes"] == 2
    assert main(["sweep", *GRID, *spread, "--out", str(ddp)]) == 0
    assert "nothing to do" in capsys.readouterr().err
    for folder in (one, ddp):
        assert main(["table", "--layout", "long", str(folder), "--csv", str(folder) + ".csv"]) == 0
    rows = [_csv_rows(Path(str(folder) + ".csv")) for folder in (ddp, one)]
    for ours_row, theirs_row in zip(*rows, strict=True):
        for key, value in theirs_row.items():
            if "seconds" in key:
                continue
            try:
                number = float(value)
            except ValueError:
                assert ours_row[key] == value, key
                continue
            assert math.isclose(float(ours_row[key]), number, rel_tol=1e-6, abs_tol=0), key


def _rank_processes(folder: Path) -> dict[int, int]:
    """rank → pid of the submitit tasks running jobs of the sweep in ``folder``."""
    ranks = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            command = (proc / "cmdline").read_bytes().split(b"\0")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"submitit.core._submit" not in command or not any(
            str(folder).encode() in part for part in command
        ):
            continue
        for item in environ:
            if item.startswith(b"SUBMITIT_LOCAL_GLOBALID="):
                ranks[int(item.split(b"=", 1)[1])] = int(proc.name)
    return ranks


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc (Linux)")
def test_a_killed_rank_fails_the_job_and_the_rerun_resumes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGKILL of rank 1 (as the out-of-memory killer would) after the first checkpoint: rank 0
    stops at its next collective, the sweep reports both ranks in one line and exits 1; the
    rerun resumes the run from rank 0's checkpoint and ends as the one-process run."""
    import threading

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    argv = ["--dataset", "diabetes", "--sampler", "monge", "--lr", "0.01", *TINY]
    argv[argv.index("--epochs") + 1] = "30"
    out, one = tmp_path / "ddp", tmp_path / "one"
    killed: list[int] = []

    def kill_rank_1() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not killed:
            ranks = _rank_processes(out)
            if 1 in ranks and any(out.rglob("checkpoint.pt")):
                os.kill(ranks[1], signal.SIGKILL)
                killed.append(ranks[1])
            time.sleep(0.2)

    killer = threading.Thread(target=kill_rank_1, daemon=True)
    killer.start()
    assert main(["sweep", *argv, *DDP, "--out", str(out)]) == 1
    killer.join()
    assert killed
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if x.startswith("  failed "))
    assert "2 of 2 ranks failed (rank 1: its process died without a result" in line
    assert "; rank 0 stopped with it: " in line and "logs: " in line
    (partial,) = out.rglob("results.json")
    assert 0 < json.loads(partial.read_text())["epochs_completed"] < 30
    assert main(["sweep", *argv, *DDP, "--out", str(out)]) == 0
    assert "1 to resume" in capsys.readouterr().err
    assert main(["sweep", *argv, "--out", str(one)]) == 0
    (ours,), (theirs,) = _finals(out).values(), _finals(one).values()
    assert _gap(ours, theirs) < 1e-6
