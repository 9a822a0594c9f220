"""Faults of the third round (issue 33): a foreign checkpoint, links and special files, one-line
errors and options that silently won (items 5 to 12; items 1 to 4 are in ``tests/test_health.py``,
``tests/test_warmup.py`` and ``tests/test_precision.py``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from sgrld.cli import main
from sgrld.experiments.base import exits
from test_faults import TINY, code_of, one_line_error


def test_resume_refuses_a_checkpoint_of_another_run_naming_both(
    mnist_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # item 5: a Shampoo or ℓ = 0.02 checkpoint copied into a Monge run's folder (a width-32 one
    # differs in a field as ℓ does: the same comparison of every config field)
    data = ["--data-dir", str(mnist_dir.parent), "--no-plot"]
    monge = tmp_path / "monge"
    base = ["sample", "--sampler", "monge", "--lr", "0.01", "--alpha2", "1", *TINY, *data]
    assert main([*base, "--out", str(monge)]) == 0
    precious = (monge / "results.json").read_text()
    foreign = {
        "shampoo": ["--sampler", "shampoo", "--lr", "0.01"],
        "lr": ["--sampler", "monge", "--lr", "0.02", "--alpha2", "1"],
    }
    for name, flags in foreign.items():
        other = tmp_path / name
        argv = ["sample", *TINY, *flags, *data, "--out", str(other)]
        assert main(argv) == 0
        shutil.copy(other / "checkpoint.pt", monge / "checkpoint.pt")
        capsys.readouterr()
        code = code_of(["sample", "--resume", "--out", str(monge), "--epochs", "2", *data])
        assert code == exits.USAGE, name
        err = capsys.readouterr().err
        one_line_error(err, "checkpoint.pt is not the run of results.json", "monge")
        assert (monge / "results.json").read_text() == precious
