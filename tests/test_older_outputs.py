"""Outputs written by main before the redesign of ``experiments/`` (commit 7e6ae7c) still read,
and its checkpoints still resume: ``tests/data/run_of_main_7e6ae7c`` is a 2-epoch run of that
commit (``sgrld sample --sampler monge --lr 0.05 --width 16 --epochs 2 --subset 300
--eval-subset 100 --burn-in 5 --thinning 3 --threads 1`` on real MNIST)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from sgrld.cli import main
from sgrld.experiments.run.config import RunConfig
from sgrld.experiments.run.results import impossible_values, read_results

OLD = Path(__file__).parent / "data" / "run_of_main_7e6ae7c"
ARGV = ["--threads", "1", "--no-progress", "--no-plot"]


def test_results_of_the_old_main_read_and_tabulate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = read_results(OLD / "results.json")
    assert results["format"] == "sgrld-sample-results/1" and not impossible_values(dict(results))
    config = RunConfig.from_dict(results["config"])
    assert config.to_dict() == results["config"]  # no field added by this version appears
    assert main(["table", str(OLD), "--layout", "long", "--include-partial"]) == 0
    assert f"{results['final']['test']['lp']:.4f}" in capsys.readouterr().out


def test_a_checkpoint_of_the_old_main_resumes_as_a_fresh_run(
    tmp_path: Path, mnist_dir: Path
) -> None:
    old = tmp_path / "old"
    shutil.copytree(OLD, old)
    data = ["--data-dir", str(mnist_dir)]
    assert main(["sample", "--resume", "--out", str(old), "--epochs", "3", *data, *ARGV]) == 0
    fresh = ["sample", "--sampler", "monge", "--lr", "0.05", "--width", "16", "--epochs", "3"]
    fresh += ["--subset", "300", "--eval-subset", "100", "--burn-in", "5", "--thinning", "3"]
    assert main([*fresh, *data, *ARGV, "--out", str(tmp_path / "new")]) == 0
    a, b = (json.loads((p / "results.json").read_text()) for p in (old, tmp_path / "new"))
    assert a["config"] == b["config"] and a["curves"] == b["curves"] and a["final"] == b["final"]
