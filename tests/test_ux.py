"""Issue 13, as a new user meets it: each rough edge as a regression test (items 3-12, 14)."""

from __future__ import annotations

import io
import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import sgrld.data
from sgrld.cli import main
from sgrld.data import ChecksumError, load_dataset
from sgrld.data.download import DATASET_FILES

REPO = Path(__file__).resolve().parents[1]
BASE = ["sample", "--dataset", "mnist", "--prior", "horseshoe", "--sampler", "identity"]
MNIST_NAMES = [
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
]


def _no_data(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_work(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("data were loaded")

    monkeypatch.setattr(sgrld.data, "load_dataset", no_work)


# --- 3: a run that collects no sample is refused before any work ------------------------------


def test_run_without_samples_is_refused_before_any_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _no_data(monkeypatch)
    argv = [*BASE, "--lr", "0.1", "--subset", "2000", "--epochs", "5", "--out", str(tmp_path / "o")]
    assert main([*argv, "--data-dir", str(tmp_path)]) == 2  # 5 x 20 = 100 updates < 1,100
    err = capsys.readouterr().err
    assert "collect no sample" in err
    for flag in ("--burn-in 1000", "--thinning 100", "--epochs 5", "100 updates"):
        assert flag in err, err
    assert (
        "first sample after update 1100" in err
        and "set --epochs 55 or more, or lower --burn-in" in err
    )
    assert not (tmp_path / "o").exists()


def test_sampling_run_refuses_data_too_small_for_any_sample() -> None:
    from sgrld.experiments.run.loop import SamplingRun
    from test_runner import synthetic_splits, tiny_config

    config = tiny_config(burnin=100, thinning=10, epochs=2)  # fine on official MNIST ...
    with pytest.raises(ValueError, match=r"no sample: burnin=100 .* only 20 updates"):
        SamplingRun(config, synthetic_splits())  # ... but 200 points make 2 x 10 updates


# --- 4 and 5: data directories -----------------------------------------------------------------


def _partial_mnist(mnist_dir: Path, target: Path, missing: str) -> Path:
    target.mkdir()
    for name in MNIST_NAMES:
        if name != missing:
            (target / name).symlink_to(mnist_dir / name)
    return target


@pytest.mark.parametrize("missing", [MNIST_NAMES[0], MNIST_NAMES[3]])
def test_missing_mnist_file_is_named_alone(mnist_dir: Path, tmp_path: Path, missing: str) -> None:
    directory = _partial_mnist(mnist_dir, tmp_path / "mnist", missing)
    with pytest.raises(FileNotFoundError) as info:
        load_dataset("mnist", directory)
    message = str(info.value)
    assert f"MNIST file {missing} not found" in message
    assert all(name not in message for name in MNIST_NAMES if name != missing), message


def test_data_dir_that_is_a_file_is_called_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _no_data(monkeypatch)
    regular = tmp_path / "mnist.tar"
    regular.write_bytes(b"not a directory")
    assert main([*BASE, "--lr", "0.1", "--data-dir", str(regular)]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err
    monkeypatch.undo()
    with pytest.raises(NotADirectoryError, match="is a file"):
        load_dataset("mnist", regular)


@pytest.fixture
def local_mirror(mnist_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The official MNIST file list, served from the shared copy through a file:// URL."""
    url = mnist_dir.resolve().as_uri() + "/"
    mirrored = tuple(replace(f, base_urls=(url,)) for f in DATASET_FILES["mnist"])
    monkeypatch.setitem(DATASET_FILES, "mnist", mirrored)


@pytest.mark.usefixtures("local_mirror")
def test_download_completes_a_partial_directory(mnist_dir: Path, tmp_path: Path) -> None:
    directory = _partial_mnist(mnist_dir, tmp_path / "mnist", MNIST_NAMES[1])
    splits = load_dataset("mnist", directory, download=True)
    assert (directory / MNIST_NAMES[1]).is_file() and splits.num_train == 50_000


@pytest.mark.usefixtures("local_mirror")
def test_download_verifies_the_files_already_there(mnist_dir: Path, tmp_path: Path) -> None:
    directory = _partial_mnist(mnist_dir, tmp_path / "mnist", MNIST_NAMES[2])
    (directory / MNIST_NAMES[3]).unlink()
    (directory / MNIST_NAMES[3]).write_bytes(b"\x1f\x8b corrupt")
    with pytest.raises(ChecksumError, match="t10k-labels"):
        load_dataset("mnist", directory, download=True)


# --- 6 and 14: a breakdown always reaches stderr and results.json -----------------------------


def test_breakdown_reported_without_progress_bar(
    mnist_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    argv = [*BASE, "--width", "8", "--lr", "1e9", "--subset", "400", "--eval-subset", "50"]
    argv += ["--epochs", "3", "--burn-in", "0", "--thinning", "1", "--data-dir", str(mnist_dir)]
    argv += ["--out", str(out), "--no-progress", "--no-plot", "--threads", "1"]
    assert main(argv) == 3
    captured = capsys.readouterr()
    results = json.loads((out / "results.json").read_text())
    broken = results["broken_down"]
    assert broken["update"] == results["global_steps"] + 1  # the failing update, not the last good
    assert f"broke down at update {broken['update']} (epoch {broken['epoch'] + 1})" in captured.err
    assert broken["reason"] in captured.err
    # 14: ℓ is per datum, so the subset's step is 125x the full data's at the same --lr.
    assert "ℓ scales with n: each step is h = ℓ/n" in broken["hint"]
    assert "--subset 400" in captured.err and "125x larger" in captured.err
    assert "--lr 8e+06 keeps the full data's step size" in captured.err
    assert "only 4 updates per epoch" in captured.err and '"A first run"' in captured.err
    # Seconds per epoch from a handful of steps are reported as an estimate.
    basis = results["timing"]["seconds_per_epoch_basis"]
    assert basis.startswith(f"estimated from only {results['global_steps']} step times")
    # The summary does not pass warm-up time off as a rate.
    assert "s/epoch not measured" in captured.out


def test_conventions_explain_the_subset_step() -> None:
    text = (REPO / "docs" / "conventions.md").read_text(encoding="utf-8")
    assert "ℓ is per datum, so a subset needs a smaller ℓ" in text and "ℓ × N/n" in text


# --- 7: the progress bar during burn-in ------------------------------------------------------


def test_progress_bar_says_burning_in_instead_of_nan() -> None:
    from sgrld.experiments.run.loop import SamplingRun
    from sgrld.experiments.run.observers import ProgressBar
    from test_runner import synthetic_splits, tiny_config

    stream = io.StringIO()
    config = tiny_config(epochs=3, burnin=15, thinning=5)  # first sample after update 20
    SamplingRun(config, synthetic_splits(), observer=ProgressBar(stream)).run()
    lines = stream.getvalue().splitlines()
    assert "burning in (first sample after update 20)" in lines[0]
    assert "nan" not in stream.getvalue()
    assert "val LP" in lines[2] and "burning in" not in lines[2]


# --- 8: curves.png with a single sampled epoch ------------------------------------------------


def _results(epochs: int, sampled: bool) -> dict[str, Any]:
    value = 0.5 if sampled else None
    curves: dict[str, Any] = {"epoch": list(range(epochs))}
    for split in ("val", "test"):
        for metric in ("lp", "accuracy", "ece", "confidence"):
            curves[f"{split}_{metric}"] = [value] * epochs
    config = {"dataset": "mnist", "model": "fc", "prior": "gaussian", "sampler": "identity"}
    config |= {"lr": 0.1, "alpha2": None, "seed": 0}
    return {
        "curves": curves,
        "timing": {"sampling_seconds": [1.0] * epochs},
        "config": config,
        "status": "completed",
        "num_samples": int(sampled),
    }


def test_curves_of_one_sampled_epoch_are_drawn_as_points(tmp_path: Path) -> None:
    from sgrld.experiments.run.plots import plot_run_curves, run_curves_figure

    fig = run_curves_figure(_results(1, sampled=True))
    for ax in fig.axes[:3]:
        val, _ = ax.get_lines()
        assert val.get_marker() == "o" and list(val.get_xdata()) == [1.0]
    empty = run_curves_figure(_results(1, sampled=False))
    assert all("nothing to draw" in ax.texts[0].get_text() for ax in empty.axes[:3])
    plot_run_curves(_results(1, sampled=True), tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size > 5_000


# --- 9: sgrld table with a single seed -------------------------------------------------------


def test_table_of_one_seed_says_seed_and_shows_no_spread() -> None:
    from sgrld.experiments.report.tables import (
        aggregate,
        csv_table,
        markdown_long_layout,
        markdown_paper_layout,
    )
    from test_sample_cli import fake_results

    groups = aggregate([fake_results("gaussian", "identity", 0.1, 0, -0.1, -0.1)])
    for text in (markdown_paper_layout(groups), markdown_long_layout(groups)):
        assert "1 seed per cell" in text and "1 seeds" not in text
        assert "(0.0000)" not in text and "no spread with one seed" in text
    row = list(csv_table(groups).splitlines()[1].split(","))
    assert "" in row  # the std columns are empty, not 0
    two = aggregate([fake_results("gaussian", "identity", 0.1, s, -0.1, -0.1) for s in (0, 1)])
    assert "2 seeds per cell" in markdown_paper_layout(two)
    assert "(0.0000)" in markdown_paper_layout(two)


# --- 10: the demo's table separates compile time ---------------------------------------------


def _funnel_run(thinned: np.ndarray) -> Any:
    from sgrld.experiments.funnel.run import SamplerRun

    return SamplerRun(
        name="identity",
        settings={},
        wall_seconds=30.0,
        compile_seconds=12.5,
        distances={"wasserstein1": [0.1], "ks": [0.01], "frac_v_below_minus5": [0.28]}
        | {"min_v": [-20.0]},
        thinned=thinned,
        scatter=np.zeros((2, 2)),
        hist_density=np.zeros(30),
        hist_edges=np.zeros(31),
    )


def test_funnel_table_reports_compile_seconds_ksd_and_ess_per_second() -> None:
    import torch

    from sgrld.data.funnel import FunnelTarget
    from sgrld.experiments.funnel.run import FunnelConfig, print_table, results_json

    exact = FunnelTarget().sample(4000, generator=torch.Generator().manual_seed(0)).numpy()
    narrow = exact * np.array([1.0, 0.3])  # v under-dispersed: the neck never reached
    stream = io.StringIO()
    print_table({"identity": _funnel_run(exact), "narrow": _funnel_run(narrow)}, file=stream)
    header, good, bad = stream.getvalue().splitlines()[:3]
    assert header.split()[-6:] == ["KSD(v)", "ESS/s", "run", "s", "compile", "s"]
    assert good.split()[-2:] == ["17.5", "12.5"]  # 30 s wall = 17.5 s sampling + 12.5 compiling
    assert float(bad.split()[-4]) > 3 * float(good.split()[-4])  # KSD sees the narrow v
    entry = results_json({"identity": _funnel_run(exact)}, FunnelConfig(steps=40_000))
    sampler = json.loads(json.dumps(entry, allow_nan=False))["samplers"]["identity"]
    assert sampler["run_seconds"] == 17.5
    assert 3000 < sampler["ess_bulk_v"] < 5000  # independent draws: ESS ≈ 4000
    assert sampler["ess_bulk_per_second"] == pytest.approx(sampler["ess_bulk_v"] / 17.5)
    assert float(good.split()[-3]) == pytest.approx(sampler["ess_bulk_per_second"], abs=0.06)
    assert sampler["ksd_v"] < 0.05


# --- 11: messages name the user's flags ------------------------------------------------------


@pytest.mark.parametrize(
    "extra, expected, internal",
    [
        (["--eval-batch-size", "0"], "--eval-batch-size must be an integer >= 1", "eval_"),
        (["--num-val", "0"], "--num-val must be an integer >= 1", "num_val"),
        (["--batch-size", "0"], "--batch-size must be an integer >= 1", "batch_size"),
        (["--curvature-points", "0"], "--curvature-points must be", "curvature_points"),
        (["--eval-subset", "0"], "--eval-subset must be", "max_eval"),
    ],
)
def test_config_errors_name_the_flag(
    extra: list[str],
    expected: str,
    internal: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _no_data(monkeypatch)
    assert main([*BASE, "--lr", "0.1", "--data-dir", str(tmp_path), *extra]) == 2
    err = capsys.readouterr().err
    assert expected in err and internal not in err, err


def test_oversized_validation_split_names_the_flag(
    mnist_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [*BASE, "--lr", "0.1", "--num-val", "60000", "--data-dir", str(mnist_dir)]
    assert main([*argv, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "--num-val 60000" in err and "between 1 and 59999" in err and "num_val" not in err


# --- 12: performance claims name their hardware ----------------------------------------------


def test_documented_philox_claims_name_the_hardware() -> None:
    usage = (REPO / "docs" / "usage.md").read_text(encoding="utf-8")
    section = usage[usage.index("## Noise sources") : usage.index("## Beyond the paper")]
    assert "AVX2" in section and "AVX-512" in section and "default stays" in section
    assert not re.search(r"philox[^.|]*\bis faster\b", section)
    gpu = (REPO / "docs" / "gpu.md").read_text(encoding="utf-8")
    assert "cu126" in gpu and "no GPU figure in this repository is measured" in gpu


def test_run_results_carry_trace_and_within_run_diagnostics(tmp_path: Path) -> None:
    from sgrld.experiments.run.loop import run_sampling
    from sgrld.experiments.run.results import RESULTS_FILE
    from test_runner import synthetic_splits, tiny_config

    results = run_sampling(tiny_config(epochs=6), synthetic_splits(), tmp_path)[0]
    on_disk = json.loads((tmp_path / RESULTS_FILE).read_text())  # strict JSON
    trace, diagnostics = on_disk["trace"], on_disk["diagnostics"]
    assert len(trace["test_loglik"]) == results["num_samples"] == 11
    assert len(trace["probe_logp"][0]) == 4 and len(trace["scalars"]) == 6  # 3 layers x (w, b)
    assert all(v < 0 for v in trace["test_loglik"])
    assert diagnostics["available"] and "split" in diagnostics["chains"]
    assert set(diagnostics["variables"]) == {"test_loglik", "probe_logp", *trace["scalars"]}
    assert diagnostics["worst"]["ess_bulk"] > 0 and diagnostics["worst"]["rhat"] > 0.9


# --- diagnostics across seeds in sgrld table --------------------------------------------------


def _traced(seed: int, shift: float) -> dict[str, Any]:
    from test_sample_cli import fake_results

    rng = np.random.default_rng(seed)
    values = rng.standard_normal(200) + shift
    results = fake_results("horseshoe", "monge", 0.25, seed, -0.1, -0.1)
    results["trace"] = {
        "num_probe": 2,
        "test_loglik": (values - 5).tolist(),
        "probe_logp": np.stack([values, -values], axis=1).tolist(),
        "scalars": {"scale:net.fc1.weight": np.exp(values / 10).tolist()},
    }
    return results


def test_table_reports_rhat_and_ess_with_seeds_as_chains(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from test_sample_cli import write_runs

    agree = [_traced(seed, 0.0) for seed in range(3)]
    apart = [
        {**_traced(seed, 4.0 * seed), "config": {**agree[0]["config"], "lr": 0.5, "seed": seed}}
        for seed in range(3)
    ]
    write_runs(tmp_path, agree + apart)
    assert main(["table", str(tmp_path), "--layout", "long", "--csv", str(tmp_path / "t.csv")]) == 0
    text = capsys.readouterr().out
    block = text[text.index("MCMC diagnostics") :]
    rows = [line for line in block.splitlines() if line.startswith("| fc400")]
    assert len(rows) == 2
    good, bad = (row.split(" | ") for row in rows)
    assert good[1:3] == ["3", "200"] and abs(float(good[3]) - 1.0) < 0.05 and float(good[4]) > 300
    assert float(bad[3]) > 1.5 and float(bad[6]) > 1.5
    header, *lines = (tmp_path / "t.csv").read_text().splitlines()
    assert header.endswith("rhat_test_loglik,rhat_max,ess_bulk_min,ess_tail_min")
    assert all(line.split(",")[-1] for line in lines)


def test_table_without_traces_has_no_diagnostics_block(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from test_sample_cli import fake_results, write_runs

    write_runs(tmp_path, [fake_results("gaussian", "identity", 0.1, s, -0.1, -0.1) for s in (0, 1)])
    assert main(["table", str(tmp_path)]) == 0
    assert "MCMC diagnostics" not in capsys.readouterr().out


def test_progress_bar_reports_a_breakdown_with_its_update() -> None:
    from sgrld.experiments.run.loop import SamplingRun
    from sgrld.experiments.run.observers import ProgressBar
    from test_runner import synthetic_splits, tiny_config

    splits = synthetic_splits()
    splits.x_train[:] = float("nan")
    stream = io.StringIO()
    SamplingRun(tiny_config(), splits, observer=ProgressBar(stream)).run()
    assert stream.getvalue() == "the chain broke down at update 1 (epoch 1): potential is nan\n"
    quiet = io.StringIO()
    SamplingRun(tiny_config(), splits, observer=ProgressBar(quiet, report_breakdown=False)).run()
    assert quiet.getvalue() == ""


def test_breakdown_message_of_results_written_before_the_update_field() -> None:
    from sgrld.experiments.run.observers import breakdown_message

    old = {"epoch": 2, "global_step": 41, "reason": "potential is inf"}
    assert breakdown_message(old) == "the chain broke down at update 42 (epoch 3): potential is inf"


def _traced_short(seed: int, draws: int) -> dict[str, Any]:
    results = _traced(seed, 0.0)
    results["trace"] = {
        key: value[:draws] if isinstance(value, list) else value
        for key, value in results["trace"].items()
    }
    results["trace"]["scalars"] = {k: v[:draws] for k, v in results["trace"]["scalars"].items()}
    return results


def test_table_shows_no_rhat_or_ess_from_a_handful_of_draws(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from test_sample_cli import write_runs

    write_runs(tmp_path, [_traced_short(seed, 7) for seed in range(3)])
    assert main(["table", str(tmp_path), "--layout", "long"]) == 0
    text = capsys.readouterr().out
    row = next(line for line in text.splitlines() if line.startswith("| fc400"))
    assert row.split(" | ")[1:3] == ["3", "7"]
    assert row.split(" | ")[3:].count("–") == 5 and row.endswith("– |")
    assert "fewer than 20 draws per chain, too few for R̂ and ESS" in text


def test_table_says_when_diagnostics_need_arviz(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from sgrld.evaluation import diagnostics
    from test_sample_cli import write_runs

    def missing() -> None:
        raise ImportError("MCMC diagnostics need ArviZ (No module named 'arviz'); install ...")

    monkeypatch.setattr(diagnostics, "import_arviz", missing)
    write_runs(tmp_path, [_traced(seed, 0.0) for seed in range(2)])
    assert main(["table", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "MCMC diagnostics (R̂, ESS) left out: they need ArviZ" in out
    assert 'pip install "sgrld[diagnostics]"' in out


def test_top_level_help_imports_no_command_and_no_torch() -> None:
    """Issue 44 item 14: `sgrld --help` took 3 s importing every command (and torch)."""
    import subprocess
    import sys

    code = (
        "import sys, contextlib, io\n"
        "from sgrld.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "    try: main(['--help'])\n"
        "    except SystemExit: pass\n"
        "assert 'sample' in out.getvalue() and 'tune' in out.getvalue()\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or '.commands.' in m))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "[]", run.stdout


def test_a_non_integer_num_data_is_refused() -> None:
    """Issue 44 item 14: n counts the training data; 64.5 was taken silently."""
    import torch

    import sgrld

    w = [torch.zeros(2, requires_grad=True)]
    sgrld.SGLD(w, lr=0.1, num_data=64.0)  # a float that is a whole number is one
    for make in (
        lambda: sgrld.SGLD(w, lr=0.1, num_data=64.5),
        lambda: sgrld.build("identity", lr=0.1, num_data=64.5),
    ):
        with pytest.raises(ValueError, match=r"64\.5 \(expected a whole number num_data >= 1"):
            make()


def test_optimizer_masks_keyed_by_parameter_name() -> None:
    """Issue 44 item 3: devinterp keys masks by name; given named parameters, so may we."""
    import torch

    import sgrld

    model = torch.nn.Linear(3, 2)
    mask = torch.tensor([[True, False, False], [False, False, False]])
    before = model.weight.detach().clone()
    opt = sgrld.SGLD(model.named_parameters(), lr=0.1, num_data=10, masks={"weight": mask})
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    moved = model.weight.detach() != before
    assert torch.equal(moved, mask)
    with pytest.raises(ValueError, match="no parameter named 'wieght'"):
        sgrld.SGLD(model.named_parameters(), lr=0.1, num_data=10, masks={"wieght": mask})
