"""A regression data set (scikit-learn's diabetes, Gaussian likelihood) through `sgrld sample`,
`sweep`, `table` and `report`, as MNIST runs through them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sgrld.cli import main
from sgrld.experiments.run.results import impossible_values

pytest.importorskip("sklearn")

TINY = ["--dataset", "diabetes", "--width", "16", "--epochs", "6", "--batch-size", "64"]
TINY += ["--burn-in", "10", "--thinning", "2", "--threads", "1", "--no-progress", "--no-plot"]


def _results(folder: Path) -> dict:
    return json.loads((folder / "results.json").read_text())


def test_sample_reports_the_regression_scores_in_the_targets_units(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert main(["sample", *TINY, "--sampler", "monge", "--lr", "0.01", "--out", str(out)]) == 0
    r = _results(out)
    assert r["status"] == "completed" and r["num_samples"] == 10
    assert set(r["final"]["test"]) == {"lp", "rmse", "coverage_50", "coverage_90"}
    test = r["final"]["test"]
    # diabetes targets have a std of about 77: an RMSE in standardised units would be ~1
    assert 30.0 < test["rmse"] < 200.0
    assert 0.0 <= test["coverage_50"] <= test["coverage_90"] <= 1.0
    assert "likelihood_scale" not in r["config"]  # σ learned: the default
    assert r["curves"]["test_rmse"] and "test_accuracy" not in r["curves"]
    assert impossible_values(r) == []


def test_a_fixed_likelihood_scale_is_recorded_and_refused_for_classification(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "fixed"
    argv = ["sample", *TINY, "--sampler", "identity", "--lr", "0.01", "--out", str(out)]
    assert main([*argv, "--likelihood-scale", "0.5"]) == 0
    assert _results(out)["config"]["likelihood_scale"] == 0.5
    bad = ["sample", "--dataset", "mnist", "--sampler", "identity", "--lr", "0.1"]
    assert main([*bad, "--likelihood-scale", "0.5", "--out", str(tmp_path / "x")]) == 2
    assert "--likelihood-scale is for regression data" in capsys.readouterr().err


def test_a_regression_log_density_may_exceed_zero_but_a_coverage_not_one() -> None:
    final = {"lp": 1.5, "rmse": 0.1, "coverage_50": 0.5, "coverage_90": 1.2}
    results = {"status": "completed", "final": {"val": final, "test": final}}
    assert impossible_values(results) == [
        "val coverage_90 1.2 outside [0, 1]",
        "test coverage_90 1.2 outside [0, 1]",
    ]


def test_sweep_table_and_report_of_a_regression(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    argv = ["sweep", *TINY, "--sampler", "identity,adam", "--lr", "0.01", "--seeds", "0-1"]
    assert main([*argv, "--jobs", "1", "--out", str(out)]) == 0
    markdown = tmp_path / "table.md"
    assert main(["table", str(out), "--markdown", str(markdown)]) == 0
    text = markdown.read_text()
    assert "| sampler | G LP | G RMSE | G cov50 | G cov90 | G s/epoch | G ℓ |" in text
    assert "| Adam |" in text  # a metric the paper does not name: its capitalised name
    report = tmp_path / "report"
    assert main(["report", str(out), "--out", str(report), "--no-figures"]) == 0
    table = (report / "table11.md").read_text()
    assert "regression" in table and "RMSE" in table and "Identity" in table


def test_a_resumed_regression_run_equals_the_uninterrupted_one(tmp_path: Path) -> None:
    """The Gaussian ensemble keeps a component per sample: its saved total grows, and a
    checkpoint after 3 epochs must still fit the run that continues it."""
    argv = ["sample", *TINY, "--sampler", "rmsprop", "--lr", "0.01"]
    short = [a if a != "6" else "3" for a in argv]  # --epochs 3
    assert main([*short, "--out", str(tmp_path / "a")]) == 0
    assert main([*argv, "--out", str(tmp_path / "a"), "--resume"]) == 0
    assert main([*argv, "--out", str(tmp_path / "b")]) == 0
    a, b = _results(tmp_path / "a"), _results(tmp_path / "b")
    assert a["epochs_completed"] == b["epochs_completed"] == 6
    assert a["curves"] == b["curves"] and a["final"] == b["final"]


def test_chains_and_curvature_of_a_regression(tmp_path: Path) -> None:
    """What MNIST runs do, a regression does: K chains in one process, the curvature C(θ)."""
    argv = ["sample", *TINY, "--sampler", "rmsprop", "--lr", "0.01"]
    assert main([*argv, "--chains", "2", "--out", str(tmp_path / "chains")]) == 0
    chains = sorted((tmp_path / "chains").glob("*/results.json"))
    assert len(chains) == 2
    assert all("rmse" in json.loads(p.read_text())["final"]["test"] for p in chains)
    curv = ["--curvature", "--curvature-points", "20"]
    assert main([*argv, *curv, "--out", str(tmp_path / "curv")]) == 0
    c = _results(tmp_path / "curv")["curvature"]
    assert c["num_samples"] == 10 and c["mean"] > 0
