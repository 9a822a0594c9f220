"""``sgrld sweep``: grid expansion, shipped configs, bad input, resuming, engines, on real MNIST."""

from __future__ import annotations

import argparse
import contextlib
import csv
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import mnist_path
from sgrld.cli import main
from sgrld.experiments.base import exits
from sgrld.experiments.base.files import DirectoryLock
from sgrld.experiments.commands import sample, sweep
from sgrld.experiments.run.options import OPTIONS
from sgrld.experiments.sweep import grid
from sgrld.experiments.sweep.jobs import Machine, SweepJob

REPO = Path(__file__).resolve().parents[1]
TINY = ["--width", "16", "--epochs", "2", "--subset", "1000", "--eval-subset", "500"]
TINY += ["--burn-in", "5", "--thinning", "5", "--threads", "1", "--no-progress"]
#: The mini grid of the issue: 2 samplers x 3 ℓ x 2 seeds on real MNIST.
MINI = ["--sampler", "identity,wenzel", "--lr", "0.05,0.1,0.2", "--seeds", "0-1", *TINY]
MINI[MINI.index("--epochs") + 1] = "3"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sweep.add_arguments(parser)
    return parser.parse_args([*argv, "--out", "unused"])


def planned(*argv: str) -> list[grid.PlannedRun]:
    return sweep.plan(parse(*argv))[0]


# --- grid expansion and shipped configs -------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seeds"),
    [("0-9", list(range(10))), ("0,3,5", [0, 3, 5]), ("0-2,7", [0, 1, 2, 7]), ("4", [4])],
)
def test_seed_ranges(text: str, seeds: list[int]) -> None:
    assert grid.parse_seeds(text) == seeds


@pytest.mark.parametrize("text", ["5-2", "a", "1,,2", "-1", "0-"])
def test_bad_seed_ranges(text: str) -> None:
    with pytest.raises(grid.GridError):
        grid.parse_seeds(text)


def test_every_sample_flag_is_a_sweep_flag() -> None:
    sample_parser, sweep_parser = argparse.ArgumentParser(), argparse.ArgumentParser()
    sample.add_arguments(sample_parser)
    sweep.add_arguments(sweep_parser)
    texts = {"int": "1", "float": "0.5", "str": "x", "table": "decay=0.9"}
    for name, option in OPTIONS.items():
        text = {"sampler": "identity", "adapt": "always"}.get(name, texts.get(option.kind))
        text = option.choices[0] if option.choices else text
        argv = [option.flags[0]] + ([text] if option.kind != "bool" else [])
        sample_parser.parse_args(argv)  # SystemExit if refused
        swept = vars(sweep_parser.parse_args([*argv, "--out", "o"]))
        assert ("seeds" if name == "seed" else name) in swept, name  # given: not suppressed


def test_alpha2_multiplies_monge_runs_only() -> None:
    runs = planned("--sampler", "identity,monge", "--lr", "0.1,0.2", "--alpha2", "0.5,1")
    assert len(runs) == 2 + 2 * 2  # identity: ℓ; monge: ℓ x α²
    assert {r.config["alpha2"] for r in runs if r.sampler == "identity"} == {None}
    assert {r.path for r in runs} >= {
        "mnist-fc400-gaussian/identity/lr0.1-seed0",
        "mnist-fc400-gaussian/monge/lr0.2-alpha0.5-seed0",
    }


def test_other_varying_fields_name_the_setting(tmp_path: Path) -> None:
    path = tmp_path / "grid.toml"
    path.write_text('[[grid]]\nsampler = "identity"\nlr = 0.1\nepochs = 3\n[[grid]]\nepochs = 4\n')
    runs = planned("--config", str(path), "--sampler", "identity")
    assert len({r.path for r in runs}) == len(runs) == 2
    assert all("-epochs" in r.path for r in runs)


@pytest.mark.parametrize(
    ("name", "runs"),
    [
        ("paper/mnist_table1", 3160),
        ("paper/cifar_table3", 710),
        ("paper/mnist_figure4", 590),
        ("paper/mnist_table10", 15),
    ],
)
def test_shipped_paper_configs(name: str, runs: int) -> None:
    assert name in grid.shipped_configs()
    plan = planned("--config", name)
    assert len(plan) == runs
    assert {r.config["epochs"] for r in plan} == {400}
    assert len({r.path for r in plan}) == runs


def test_table1_config_cells() -> None:
    plan = planned("--config", "paper/mnist_table1", "--seeds", "0")
    cells: dict[tuple[int, str, str], set[tuple[float, float | None]]] = {}
    for r in plan:
        c = r.config
        cells.setdefault((c["width"], c["prior"], c["sampler"]), set()).add((c["lr"], c["alpha2"]))
    assert len(cells) == 3 * 2 * 5
    hs400_monge = cells[400, "horseshoe", "monge"]
    assert len(hs400_monge) == 5 * 14 and (0.25, 1.25) in hs400_monge  # the paper's choice
    assert {a for _, a in cells[1200, "gaussian", "monge"]} == {1.0, 0.75, 0.5, 0.25, 0.1}
    assert len(cells[1200, "gaussian", "shampoo"]) == 7
    assert {lr for lr, _ in cells[400, "gaussian", "rmsprop"]} == {
        7.5e-5,
        1e-4,
        2.5e-4,
        5e-4,
        7.5e-4,
    }


def test_flags_narrow_a_config() -> None:
    plan = planned("--config", "paper/mnist_table1", "--width", "400", "--prior", "horseshoe")
    assert len(plan) == (5 + 6 + 5 + 5 * 14 + 5) * 10
    plan = planned("--config", "paper/mnist_table10", "--sampler", "monge", "--epochs", "3")
    assert [r.config["epochs"] for r in plan] == [3, 3, 3]
    assert {r.config["alpha2"] for r in plan} == {1.25}


def test_config_by_path(tmp_path: Path) -> None:
    path = tmp_path / "g.toml"
    path.write_text(
        'description = "x"\n[defaults]\nseeds = "0-2"\nburn-in = 5\n'
        '[[grid]]\nsampler = ["identity", "monge"]\nlr = [0.1, 0.2]\nalpha2 = [1.0]\n'
    )
    plan = planned("--config", str(path))
    assert len(plan) == 2 * 2 * 3 and {r.config["burnin"] for r in plan} == {5}


# --- bad input: exit 2 before any work --------------------------------------------------------


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str], *words: str) -> None:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = int(exc.code or 0)
    assert code == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err


def test_bad_input_is_refused_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    base = ["sweep", "--data-dir", str(tmp_path), "--out", str(out)]
    _refused([*base, "--sampler", "identity", "--seeds", "5-2"], capsys, "5-2", "empty")
    empty = tmp_path / "empty.toml"
    empty.write_text('[[grid]]\nsampler = "identity"\nlr = []\n')
    _refused([*base, "--config", str(empty)], capsys, "grid is empty")
    _refused([*base, "--config", "paper/mnist_table10", "--lr", "0.3"], capsys, "grid is empty")
    unknown = tmp_path / "unknown.toml"
    unknown.write_text('[[grid]]\nsampler = "identity"\nlearning_rate = 0.1\n')
    _refused([*base, "--config", str(unknown)], capsys, "learning_rate", "valid keys")
    _refused([*base, "--config", "paper/no_such_grid"], capsys, "not a shipped config")
    _refused([*base, "--lr", "0.1"], capsys, "no sampler")
    _refused([*base, "--sampler", "identity", "--alpha2", "1"], capsys, "Monge")
    _refused([*base, "--sampler", "identity", "--lr", "-1"], capsys, "--lr")
    _refused([*base, "--sampler", "identity", "--jobs", "0"], capsys, "--jobs")
    _refused([*base, "--sampler", "identity", "--device", "nonsense"], capsys, "not a device")
    assert not out.exists()


def test_a_folder_of_another_grid_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    args = parse("--sampler", "identity", "--lr", "0.1,0.2")
    runs, source = sweep.plan(args)
    grid.write_manifest(out, runs, source, sweep.chain_options(args))
    before = (out / grid.MANIFEST_FILE).read_bytes()
    argv = ["sweep", "--sampler", "identity", "--lr", "0.1", "--data-dir", str(tmp_path)]
    _refused([*argv, "--out", str(out)], capsys, "another grid", "1 of its 2 runs")
    assert (out / grid.MANIFEST_FILE).read_bytes() == before
    assert sorted(p.name for p in out.iterdir()) == [grid.MANIFEST_FILE]
    foreign = tmp_path / "foreign"
    (foreign / "run").mkdir(parents=True)
    (foreign / "run" / "results.json").write_text("{}")
    _refused([*argv, "--out", str(foreign)], capsys, "no sweep manifest")


def test_job_requeues_itself_on_preemption() -> None:
    from submitit.helpers import DelayedSubmission

    job = SweepJob([], "out", Machine(data_dir="data"))
    delayed = job.checkpoint()
    assert isinstance(delayed, DelayedSubmission) and delayed.function is job


# --- real MNIST -------------------------------------------------------------------------------


def _digests(out: Path) -> dict[str, tuple[str, int]]:
    """sha256 and mtime of every finished run's files."""
    found = {}
    for results in out.rglob("results.json"):
        if json.loads(results.read_text())["status"] != "completed":
            continue
        for path in (results, results.with_name("checkpoint.pt")):
            found[str(path)] = (
                hashlib.sha256(path.read_bytes()).hexdigest(),
                path.stat().st_mtime_ns,
            )
    return found


def _sweep_process(argv: list[str]) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    return subprocess.Popen(
        [sys.executable, "-m", "sgrld", "sweep", *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own process group: the kill reaches the pool's workers
    )


def _completed(out: Path) -> int:
    count = 0
    for path in out.rglob("results.json"):
        with contextlib.suppress(ValueError):  # a file being replaced
            count += json.loads(path.read_text())["status"] == "completed"
    return count


@pytest.fixture(scope="module")
def mini_sweep(tmp_path_factory: pytest.TempPathFactory, mnist_dir_module: Path) -> Iterator[Path]:
    """The mini grid swept locally with 2 processes, killed part-way, then run again."""
    out = tmp_path_factory.mktemp("mini") / "sweep"
    argv = [*MINI, "--data-dir", str(mnist_dir_module), "--out", str(out), "--jobs", "2"]
    process = _sweep_process(argv)
    deadline = time.monotonic() + 300
    while _completed(out) < 4 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)
    process.communicate()
    killed_with = _completed(out)
    assert 4 <= killed_with < 12, "the kill came too late to test resuming"
    before = _digests(out)
    started = time.perf_counter()
    assert main(["sweep", *argv]) == 0
    print(f"\nmini grid: resumed sweep ran in {time.perf_counter() - started:.1f} s")
    after = _digests(out)
    assert {k: after[k] for k in before} == before  # finished runs untouched
    assert len(after) == 2 * 12
    yield out


@pytest.fixture(scope="module")
def mnist_dir_module() -> Path:
    path = mnist_path()
    if not (path / "t10k-labels-idx1-ubyte.gz").is_file():
        pytest.skip(f"real MNIST not found in {path} (set SGRLD_DATA_DIR)")
    return path


@pytest.mark.slow
def test_mini_grid_resumes_what_is_missing_and_a_finished_sweep_does_nothing(
    mini_sweep: Path, mnist_dir_module: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = json.loads((mini_sweep / grid.MANIFEST_FILE).read_text())
    assert manifest["num_runs"] == 12
    for run in manifest["runs"]:
        results = json.loads((mini_sweep / run["path"] / "results.json").read_text())
        assert results["status"] == "completed" and results["config"] == run["config"]
        assert results["epochs_completed"] == 3
    before = _digests(mini_sweep)
    capsys.readouterr()
    argv = ["sweep", *MINI, "--data-dir", str(mnist_dir_module), "--out", str(mini_sweep)]
    assert main(argv) == 0
    assert "nothing to do" in capsys.readouterr().err
    assert _digests(mini_sweep) == before


@pytest.mark.slow
def test_mini_grid_through_submitit_matches_the_local_sweep(
    mini_sweep: Path, mnist_dir_module: Path, tmp_path: Path
) -> None:
    out = tmp_path / "submitit"
    argv = ["sweep", *MINI, "--data-dir", str(mnist_dir_module), "--out", str(out)]
    assert main([*argv, "--engine", "submitit-local", "--jobs", "2"]) == 0
    for results in out.rglob("results.json"):
        ours = json.loads(results.read_text())
        local = json.loads((mini_sweep / results.relative_to(out)).read_text())
        assert ours["curves"]["val_lp"] == local["curves"]["val_lp"]  # resumed runs included
        assert ours["final"] == local["final"]
    assert _completed(out) == 12


def test_one_run_through_submitit_local(mnist_dir_module: Path, tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    argv = ["sweep", "--sampler", "identity", "--lr", "0.1", *TINY]
    argv += ["--data-dir", str(mnist_dir_module), "--out", str(out), "--engine", "submitit-local"]
    assert main(argv) == 0
    (results,) = out.rglob("results.json")
    assert results.parent.relative_to(out).as_posix() == "mnist-fc16-gaussian/identity/lr0.1-seed0"
    assert json.loads(results.read_text())["status"] == "completed"
    assert main(argv) == 0  # finished: nothing is submitted again
    jobs = [p for p in (out / ".submitit").iterdir() if p.name.isdigit()]  # one folder per job
    assert len(jobs) == 1


@pytest.mark.slow
def test_report_of_the_mini_grid_picks_the_best_mean_validation_lp(
    mini_sweep: Path, tmp_path: Path
) -> None:
    scores: dict[str, dict[float, list[float]]] = {}
    for path in mini_sweep.rglob("results.json"):
        results = json.loads(path.read_text())
        lr = results["config"]["lr"]
        sampler = scores.setdefault(results["config"]["sampler"], {})
        sampler.setdefault(lr, []).append(results["final"]["val"]["lp"])
    expected = {
        s: max(by_lr, key=lambda lr: sum(by_lr[lr]) / len(by_lr[lr])) for s, by_lr in scores.items()
    }
    out = tmp_path / "report"
    assert main(["report", str(mini_sweep), "--out", str(out), "--paper"]) == 0
    with open(out / "selection.csv", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    assert {r["sampler"]: float(r["chosen"]) for r in rows} == expected
    for row in rows:
        assert float(row["val_lp_mean"]) == pytest.approx(
            sum(scores[row["sampler"]][float(row["chosen"])]) / 2, rel=1e-12
        )
    for number in (1, 2, 4, 6, 8, 10):
        assert (out / f"table{number}.md").is_file() and (out / f"table{number}.csv").is_file()
    assert not (out / "table3.md").exists()  # no CIFAR-10 runs
    table4 = (out / "table4.md").read_text()
    for sampler, lr in expected.items():
        assert f"| {sampler.capitalize()} | {lr:g} |" in table4
    (figure,) = out.glob("figure3_*.png")
    assert figure.stat().st_size > 10_000


def test_a_failing_run_is_reported_and_the_others_go_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "data").mkdir()  # exists, but holds no MNIST: every run fails to load it
    argv = ["sweep", "--sampler", "identity", "--lr", "0.1,0.2", *TINY]
    argv += ["--data-dir", str(tmp_path / "data"), "--out", str(tmp_path / "out")]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "0 completed, 0 broke down, 2 failed" in err
    assert err.count("failed mnist-fc16-gaussian/identity/lr0.") == 2


def test_a_run_held_by_another_job_is_not_run_twice(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The run's lock is sample's own: a cluster job or a ``sample --resume`` holding the run
    folder keeps the sweep off it; the sweep says so with 75 (try again later), not 1."""
    out = tmp_path / "out"
    argv = ["sweep", "--sampler", "identity", "--lr", "0.1", *TINY]
    argv += ["--data-dir", str(tmp_path), "--out", str(out)]
    folder = out / "mnist-fc16-gaussian/identity/lr0.1-seed0"
    with DirectoryLock(folder, "sgrld sample"):  # e.g. sgrld sample --resume on this run
        assert main(argv) == exits.BUSY
    err = capsys.readouterr().err
    assert "1 running elsewhere" in err and "run this sweep again" in err
    assert not (folder / "checkpoint.pt").exists()


def test_choices_come_from_the_registries() -> None:
    from sgrld.experiments.run import choices
    from sgrld.metrics import metric_names
    from sgrld.priors import prior_names

    assert set(choices.SAMPLERS) == set(metric_names())
    assert sorted(choices.PRIORS.values()) == prior_names()
    assert choices.PRIORS["correlated"] == "convcorrnormal"
    every = ",".join(metric_names())
    assert {r.sampler for r in planned("--sampler", every, "--lr", "0.1")} == set(metric_names())


@pytest.mark.slow
def test_a_preempted_submitit_job_is_requeued_and_resumes(
    mnist_dir_module: Path, tmp_path: Path
) -> None:
    import submitit

    argv = ["--sampler", "identity", "--lr", "0.1", *TINY]
    argv[argv.index("--epochs") + 1] = "12"
    (run,) = planned(*argv)
    machine = Machine(data_dir=str(mnist_dir_module), threads=1)
    executor = submitit.LocalExecutor(folder=tmp_path / "logs")
    executor.update_parameters(timeout_min=10)
    job = executor.submit(SweepJob([run], str(tmp_path / "preempted"), machine))
    results = tmp_path / "preempted" / run.path / "results.json"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            if json.loads(results.read_text())["epochs_completed"] >= 1:
                break
        time.sleep(0.02)
    # SLURM signals the job's task on preemption; the local executor's task is the child of
    # its controller process.
    controller = job._process.pid
    (task,) = Path(f"/proc/{controller}/task/{controller}/children").read_text().split()
    os.kill(int(task), signal.SIGUSR2)
    (outcome,) = job.result()
    assert outcome.status == "completed" and outcome.epochs == 12
    log = job.stdout() or ""
    assert "Caught signal SIGUSR2" in log and "Calling checkpoint method" in log
    assert "Requeued job" in log and log.count("Loading pickle") == 2  # ran again, once
    # The requeued job resumed from its checkpoint: the same results as an uninterrupted run.
    (fresh,) = SweepJob([run], str(tmp_path / "fresh"), machine)()
    assert fresh.status == "completed"
    ours = json.loads(results.read_text())
    theirs = json.loads((tmp_path / "fresh" / run.path / "results.json").read_text())
    assert ours["curves"]["val_lp"] == theirs["curves"]["val_lp"]
    assert ours["final"] == theirs["final"]


def test_packed_sweep_runs_chains_that_equal_the_single_runs(
    mnist_dir_module: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--chains 4``: the 4 runs of a setting in one process, each results.json as the
    process-per-run sweep writes it; a rerun does nothing; a pack is refused torch noise."""
    grid_argv = ["--sampler", "identity", "--lr", "0.01,0.02", "--seeds", "0-1", *TINY]
    common = [*grid_argv, "--data-dir", str(mnist_dir_module)]
    assert main(["sweep", *common, "--out", str(tmp_path / "single")]) == 0
    assert main(["sweep", *common, "--out", str(tmp_path / "packed"), "--chains", "4"]) == 0
    capsys.readouterr()
    packs = list((tmp_path / "packed" / ".packs").iterdir())
    assert len(packs) == 1 and (packs[0] / "checkpoint.pt").is_file()
    found = sorted((tmp_path / "single").rglob("results.json"))
    assert len(found) == 4
    for path in found:
        single = json.loads(path.read_text())
        packed = json.loads(
            (tmp_path / "packed" / path.relative_to(tmp_path / "single")).read_text()
        )
        assert packed["config"] == single["config"] and packed["status"] == "completed"
        for metric in ("lp", "accuracy", "ece"):
            assert packed["final"]["test"][metric] == pytest.approx(
                single["final"]["test"][metric], abs=1e-4
            )
        assert packed["timing"]["chains_in_process"] == 4
    assert main(["sweep", *common, "--out", str(tmp_path / "packed"), "--chains", "4"]) == 0
    assert "nothing to do" in capsys.readouterr().err
    torch_noise = [*common, "--noise", "torch", "--chains", "2", "--out", str(tmp_path / "t")]
    assert main(["sweep", *torch_noise]) == 2
    assert "philox" in capsys.readouterr().err


def test_packs_are_formed_over_the_whole_grid(tmp_path: Path) -> None:
    """A pack stays the same pack when some of its runs are finished (its checkpoint holds all),
    and equal α² are neighbours."""
    from sgrld.experiments.sweep.jobs import make_jobs

    runs = planned("--sampler", "monge", "--alpha2", "1,2", "--lr", "0.1", "--seeds", "0-2")
    machine = Machine(data_dir="unused")
    jobs = make_jobs(runs, tmp_path, machine, chains=4)
    assert [len(j.runs) for j in jobs] == [4, 2] and all(j.pack for j in jobs)
    assert [r.config["alpha2"] for r in jobs[0].runs] == [1.0, 1.0, 1.0, 2.0]
    first = jobs[0].runs[0]
    (tmp_path / first.path).mkdir(parents=True)
    final = {split: {"lp": -0.3, "accuracy": 0.9} for split in ("val", "test")}
    results = {"config": first.config, "status": "completed", "final": final}
    (tmp_path / first.path / "results.json").write_text(json.dumps(results))
    again = make_jobs(runs, tmp_path, machine, chains=4)
    assert [j.runs for j in again] == [j.runs for j in jobs]
    assert [len(j.runs) for j in make_jobs(runs, tmp_path, machine)] == [1] * 5  # one per run
