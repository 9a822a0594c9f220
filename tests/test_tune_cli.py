"""``sgrld tune`` on diabetes: tune.json and tune.png; ``--lr tuned:DIR`` in sample and sweep;
``sgrld report --tuned`` and the tuning table."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from sgrld.cli import main
from sgrld.experiments.base import exits
from sgrld.experiments.commands import sample, sweep
from sgrld.experiments.commands.options import config_from_args
from sgrld.experiments.report.tuning import tuning_table
from sgrld.experiments.run.tuned import TUNE_FILE

pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")

RUN = ["--dataset", "diabetes", "--model", "fc", "--width", "4", "--epochs", "120"]
RUN += ["--likelihood-scale", "0.7"]
RUN += ["--batch-size", "32", "--threads", "1"]


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tuned")
    argv = ["tune", *RUN, "--sampler", "sgld", "--budget", "7600", "--out", str(out)]
    assert main(argv) == exits.OK
    return out


def test_tune_writes_each_samplers_result_and_the_figure(tuned: Path) -> None:
    data = json.loads((tuned / TUNE_FILE).read_text())
    assert data["config"]["dataset"] == "diabetes" and data["config"]["budget"] == 7600
    assert set(data["samplers"]) == {"identity"}
    for result in data["samplers"].values():
        assert result["spent"] <= 7600 and result["options"]["lr"] > 0
        assert result["grid"] is None  # the paper has no diabetes grid
        assert [r["name"] for r in result["rounds"]][:2] == ["probe", "bracket"]
    assert (tuned / "tune.png").read_bytes()[:4] == b"\x89PNG"
    table = tuning_table(data)
    assert "| identity |" in table and "no paper grid" in table


def _sample_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sample.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_sample_and_sweep_take_the_tuned_lr(tuned: Path) -> None:
    lrs = {s: r["options"]["lr"] for s, r in json.loads((tuned / TUNE_FILE).read_text())[
        "samplers"].items()}  # fmt: skip
    args = _sample_args(*RUN, "--sampler", "identity", "--lr", f"tuned:{tuned}")
    assert config_from_args(args).lr == lrs["identity"]
    parser = argparse.ArgumentParser()
    sweep.add_arguments(parser)
    argv = [*RUN, "--sampler", "identity", "--lr", f"tuned:{tuned},0.5", "--out", "unused"]
    runs = sweep.plan(parser.parse_args(argv))[0]
    assert sorted(r.config["lr"] for r in runs) == sorted([lrs["identity"], 0.5])


def test_a_tuned_folder_without_the_sampler_or_the_file_is_refused(
    tuned: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _sample_args(*RUN, "--sampler", "monge", "--lr", f"tuned:{tuned}")
    with pytest.raises(ValueError, match=r"has no tuned ℓ for monge \(it has identity\)"):
        config_from_args(args)
    with pytest.raises(SystemExit):
        _sample_args(*RUN, "--sampler", "monge", "--lr", f"tuned:{tmp_path}")
    err = capsys.readouterr().err
    assert f"no {tmp_path / TUNE_FILE} (run sgrld tune --out DIR)" in err


def test_tune_refuses_an_lr_and_a_budget_too_small(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["tune", *RUN, "--sampler", "sgld", "--out", str(tmp_path)]
    assert main([*argv, "--lr", "0.1"]) == exits.USAGE
    assert "sgrld tune takes no --lr (it chooses ℓ)" in capsys.readouterr().err
    assert main([*argv, "--budget", "100"]) == exits.USAGE
    err = capsys.readouterr().err.strip()
    assert err.startswith("sgrld tune: error: budget=100 cannot compare two candidates")
    assert "\n" not in err


def test_a_tuned_alpha2_is_shown_and_taken_by_sample(tmp_path: Path) -> None:
    """Monge's α², searched (no --alpha2 given), reaches tune.json, the figure (a panel of its
    own), the report's table and ``sample --lr tuned:DIR``; a run with another α² rule than the
    one it was chosen for is refused, and a given --alpha2 wins."""
    import sgrld
    import tune_problems as tp
    from sgrld.experiments.commands.tune import plot

    x, y, _, _ = tp.diabetes()
    n = len(y)
    result = sgrld.tune(
        "monge", tp.model(), lambda m, b: tp.potential(m, b, n), tp.loader(x, y), num_data=n,
        steps=2_000, budget=7_000, points=8, alpha2_rule="fixed",
    )  # fmt: skip
    assert result.searched == ("lr", "alpha2")
    assert {r.option for r in result.rounds} == {"lr", "alpha2"}
    alpha2 = result.options["alpha2"]
    data = {"config": {"dataset": "diabetes", "model": "fc", "width": 4, "prior": "gaussian",
                       "epochs": 120, "score": "ksd", "seed": 0},
            "samplers": {"monge": {**result.to_dict(), "grid": None}}}  # fmt: skip
    (tmp_path / TUNE_FILE).write_text(json.dumps(data))
    figure = tmp_path / "tune.png"
    with figure.open("wb") as target:
        plot(data["samplers"], target)
    assert figure.read_bytes()[:4] == b"\x89PNG"
    assert f"ℓ {result.lr:.3g}, alpha2 {alpha2:.3g}" in tuning_table(data)
    config = config_from_args(_sample_args(*RUN, "--sampler", "monge", "--lr",
                                                  f"tuned:{tmp_path}"))  # fmt: skip
    assert (config.lr, config.tuned) == (result.lr, {"alpha2": alpha2})
    given = _sample_args(*RUN, "--sampler", "monge", "--lr", f"tuned:{tmp_path}", "--alpha2", "3")
    assert config_from_args(given).tuned == {"alpha2": 3.0}
    other = _sample_args(*RUN, "--sampler", "monge", "--lr", f"tuned:{tmp_path}",
                         "--alpha2-rule", "normalized")  # fmt: skip
    with pytest.raises(ValueError, match=r"tuned with alpha2_rule = fixed, not normalized"):
        config_from_args(other)


@pytest.mark.parametrize(
    ("flags", "words"),
    [(["--resume"], "takes no --resume (it is not a sampling run)"),
     (["--no-plot"], "takes no --no-plot"), (["--parallel", "ddp"], "takes no --parallel"),
     (["--threads", "0"], "--threads must be >= 1, got 0")],
)  # fmt: skip
def test_tune_refuses_sample_options_it_would_ignore(
    flags: list[str], words: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 42 items 10 and 14: --threads 0 was a traceback; --resume, --no-plot and
    --parallel were accepted and ignored. One line each, exit 2, nothing written."""
    out = tmp_path / "out"
    assert main(["tune", *RUN, "--sampler", "sgld", "--out", str(out), *flags]) == exits.USAGE
    err = capsys.readouterr().err.strip()
    assert err.startswith("sgrld tune: error: ") and words in err and "\n" not in err
    assert not out.exists()


def test_tune_help_lists_its_own_options_only(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 44 item 9: ``sgrld tune --help`` was sample's (--lr, --resume, curves.png)."""
    with pytest.raises(SystemExit):
        main(["tune", "--help"])
    text = capsys.readouterr().out
    for own in ("--budget", "--score", "--sampler S[,S...]", "--epochs", "--no-progress"):
        assert own in text, own
    for other in ("--lr", "--resume", "--no-plot", "--parallel", "--thinning"):
        assert not re.search(rf"(^\s*|\[){other}\b", text, re.M), other  # usage, option line
    assert "curves.png" not in text


def test_tune_locks_its_folder_and_clears_a_killed_writes_temporaries(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 42 item 8: two tunes on one --out both wrote; a kill while writing left a
    ``.tune.png.*.sgrld-tmp``. A second tune is refused while the first holds the folder; the
    next tune removes what a killed one left."""
    from sgrld.experiments.base.files import DirectoryLock

    argv = ["tune", *RUN, "--sampler", "sgld", "--out", str(tmp_path), "--budget", "100"]
    with DirectoryLock(tmp_path, "sgrld tune"):
        assert main(argv) == exits.USAGE
    assert "is in use by another run" in capsys.readouterr().err
    stale = tmp_path / ".tune.png.abc123.sgrld-tmp"
    stale.write_bytes(b"half a figure")
    assert main(argv) == exits.USAGE  # the budget: refused after the lock and the clean-up
    assert not stale.exists() and not (tmp_path / ".sgrld.lock").exists()


@pytest.mark.slow  # a second small tune: ~15 s on one idle core
def test_tune_score_train_scores_the_log_predictive_of_training_data(tmp_path: Path) -> None:
    """Issue 40: ``--score train``, the log predictive of the training loader's first data (no
    validation split needed); what ``tune.json`` and the figure say is its score."""
    argv = ["tune", *RUN, "--sampler", "sgld", "--budget", "9000", "--score", "train"]
    assert main([*argv, "--out", str(tmp_path), "--no-progress"]) == exits.OK
    result = json.loads((tmp_path / TUNE_FILE).read_text())["samplers"]["identity"]
    assert result["score"] == "train" and 0 < result["spent"] <= 9000
    assert result["options"]["lr"] > 0
