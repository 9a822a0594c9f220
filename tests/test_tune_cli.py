"""``sgrld tune`` on diabetes: tune.json and tune.png; ``--lr tuned:DIR`` in sample and sweep;
``sgrld report --tuned`` and the tuning table."""

from __future__ import annotations

import argparse
import json
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
    assert "sgrld tune chooses --lr" in capsys.readouterr().err
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
    assert (config.lr, config.alpha2) == (result.lr, alpha2)
    given = _sample_args(*RUN, "--sampler", "monge", "--lr", f"tuned:{tmp_path}", "--alpha2", "3")
    assert config_from_args(given).alpha2 == 3.0
    other = _sample_args(*RUN, "--sampler", "monge", "--lr", f"tuned:{tmp_path}",
                         "--alpha2-rule", "normalized")  # fmt: skip
    with pytest.raises(ValueError, match=r"tuned with alpha2_rule = fixed, not normalized"):
        config_from_args(other)
