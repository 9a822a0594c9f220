"""A metric plug-in registered after the experiments were imported: its tuned option is read from
the registry when used (``TUNED_FIELDS``), so runs, files, labels, chains, the command line, a
sweep's keys and folders and a report's tables take it."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest

from sgrld.core import contract
from sgrld.experiments.commands import sample, sweep
from sgrld.experiments.commands.options import configs_from_args
from sgrld.experiments.report.selection import select_cell
from sgrld.experiments.report.tables import (
    WITHIN_SETTING,
    Group,
    aggregate,
    markdown_long_layout,
    setting_key,
)
from sgrld.experiments.run.chains import PER_CHAIN_FIELDS, check_chain_configs
from sgrld.experiments.run.choices import SAMPLERS
from sgrld.experiments.run.config import TUNED_FIELDS, RunConfig
from sgrld.experiments.run.naming import cli_names, flag_of, run_label, setting_name
from sgrld.experiments.run.options import OPTIONS
from sgrld.experiments.sweep import grid
from sgrld.metrics import IdentityMetric


@dataclass(frozen=True, kw_only=True)
class _GainMetric(IdentityMetric):
    """G = I with an option ``gain`` tuned with ℓ (the metric ignores it: only its declaration
    matters here)."""

    name = "gainy"
    aliases = ()
    tuned = ("gain",)
    identity_at: ClassVar[Mapping[str, float]] = {"gain": 0.0}  # G = I there
    symbols: ClassVar[Mapping[str, str]] = {"gain": "γ"}
    gain: float = 1.0


@pytest.fixture
def plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_GainMetric`` in the registry for one test (after every import above)."""
    monkeypatch.setitem(contract._REGISTRY, "gainy", _GainMetric)


def _config(**values: object) -> RunConfig:
    fixed = {"dataset": "mnist", "model": "fc", "prior": "gaussian", "lr": 0.1, "epochs": 4}
    return RunConfig(**fixed, **values)  # type: ignore[arg-type]


def test_a_tuned_option_registered_after_import_is_a_field(plugin: None) -> None:
    assert "gainy" in SAMPLERS and tuple(TUNED_FIELDS) == ("gain", "alpha2")  # registry order
    assert "gain" in PER_CHAIN_FIELDS and repr(TUNED_FIELDS) == "('gain', 'alpha2')"
    config = _config(sampler="gainy", tuned={"gain": 0.5})
    written = config.to_dict()
    assert written["gain"] == 0.5 and written["alpha2"] is None  # a key of its own
    assert RunConfig.from_dict(written) == config
    table = {k: v for k, v in written.items() if k not in TUNED_FIELDS}
    assert RunConfig.from_dict({**table, "tuned": {"gain": 0.5}}) == config
    assert config.metric_options == {"gain": 0.5}
    assert run_label(written) == "lr0.1-gain0.5-seed0"
    assert cli_names("gain=2 is too large") == "--gain 2 is too large"
    assert _config(sampler="monge", tuned={"alpha2": 1.0}).to_dict()["gain"] is None
    with pytest.raises(ValueError, match="gainy needs gain"):
        _config(sampler="gainy")
    with pytest.raises(ValueError, match="gain is a Gainy option"):
        _config(sampler="identity", tuned={"gain": 0.5})
    # chains of one process may differ in it, as in α²
    check_chain_configs([config, _config(sampler="gainy", tuned={"gain": 2.0}, seed=1)])


def _parser(command: Any) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sgrld", formatter_class=lambda prog: argparse.HelpFormatter(prog, width=9999)
    )
    command.add_arguments(parser)
    return parser


def test_the_plugin_s_option_is_a_flag_of_sample_and_sweep(plugin: None) -> None:
    """``--gain`` after ``--lr`` and before ``--alpha2`` (registry order), a comma list of chains
    in ``sample``, an axis in ``sweep``."""
    assert list(OPTIONS)[5:8] == ["lr", "gain", "alpha2"] and flag_of("gain") == "--gain"
    help_text = OPTIONS["gain"].help
    assert help_text.startswith("Gainy's γ; default: the paper's for the setting, else 1.0")
    assert help_text in _parser(sample).format_help()
    argv = ["--sampler", "gainy", "--lr", "0.1", "--gain", "0.5,2", "--epochs", "4"]
    configs = configs_from_args(_parser(sample).parse_args(argv))
    assert [(c.tuned, c.seed) for c in configs] == [({"gain": 0.5}, 0), ({"gain": 2.0}, 0)]
    assert _parser(sweep).parse_args(["--out", "x", *argv]).gain == [0.5, 2.0]
    assert "gain" in grid.KEYS and "gain" in grid.AXES


def _sweep(argv: list[str]) -> list[grid.PlannedRun]:
    return sweep.plan(_parser(sweep).parse_args(["--out", "x", "--dataset", "mnist", *argv]))[0]


def test_the_plugin_s_option_names_sweep_folders(plugin: None, tmp_path: Path) -> None:
    """A grid over ``gain`` (flags or a config file's key): each value a run folder of its own
    setting's, as α²'s, not a setting of its own."""
    config = tmp_path / "gain.toml"
    config.write_text('[[grid]]\nsampler = "gainy"\nlr = 0.1\ngain = [0.5, 2.0]\nepochs = 4\n')
    for argv in (["--sampler", "gainy", "--lr", "0.1", "--gain", "0.5,2", "--epochs", "4"],
                 ["--config", str(config)]):  # fmt: skip
        runs = _sweep(argv)
        setting = setting_name(runs[0].config, [])
        assert [r.path for r in runs] == [
            f"{setting}/gainy/lr0.1-gain0.5-seed0", f"{setting}/gainy/lr0.1-gain2-seed0"
        ]  # fmt: skip
    assert "gain" in grid.PATH_FIELDS
    with pytest.raises(grid.GridError, match="gain must be a number"):
        grid.check_value("gain", [0.5, "2"], "here")


def test_the_plugin_s_option_picks_a_row_of_its_setting_s_table(plugin: None) -> None:
    """The report groups runs that differ in ``gain`` into one setting, a row per value."""
    runs = [
        {"config": r.config, "seed": 0, "status": "completed", "seconds_per_epoch": 1.0,
         "final": {s: {"lp": -0.5 - g, "accuracy": 0.9, "ece": 0.02} for s in ("val", "test")}}
        for r, g in zip(_sweep(["--sampler", "gainy", "--lr", "0.1", "--gain", "0.5,2",
                                "--epochs", "4"]), (0.0, 0.1), strict=True)
    ]  # fmt: skip
    assert "gain" in WITHIN_SETTING
    assert setting_key(runs[0]["config"]) == setting_key(runs[1]["config"])
    groups = aggregate(runs)
    assert [g.config["gain"] for g in groups] == [0.5, 2.0]
    table = markdown_long_layout(groups)
    assert table.count("**mnist") == 1  # one setting
    assert "| gaussian | _Gain | 0.1, γ 0.5 | 1 | 0 | -0.5000 |" in table
    assert "| gaussian | _Gain | 0.1, γ 2 | 1 | 0 | -0.6000 |" in table


def test_without_the_plugin_the_fields_are_the_registry_s() -> None:
    assert tuple(TUNED_FIELDS) == ("alpha2",) and "gainy" not in SAMPLERS
    assert "gain" not in OPTIONS and "gain" not in grid.KEYS and "gain" not in grid.PATH_FIELDS
    assert "gain" not in WITHIN_SETTING and list(OPTIONS)[5:7] == ["lr", "alpha2"]
    with pytest.raises(ValueError, match="invalid tuned options"):
        _config(sampler="identity", tuned={"gain": 0.5})


def _group(sampler: str, lr: float, val_lp: float, **tuned: float) -> Group:
    run = {"seed": 0, "status": "completed", "final": {"val": {"lp": val_lp}}}
    return Group({"sampler": sampler, "lr": lr, "alpha2": None, **tuned}, [run])


def test_the_selection_reads_the_metric_s_tuned_option(plugin: None) -> None:
    """ℓ per value of the declared option, then the option; Identity counts as the metric at its
    ``identity_at``; messages write the option's symbol."""
    cell = [_group("gainy", lr, lp, gain=g) for lr, g, lp in
            [(0.1, 1.0, -0.5), (0.2, 1.0, -0.4), (0.1, 2.0, -0.3), (0.2, 2.0, -0.35)]]  # fmt: skip
    chosen, stages, identity = select_cell(cell)
    assert chosen is cell[2] and not identity
    assert [(s.kind, s.alpha2, s.value) for s in stages] == [
        ("lr", 1.0, 0.2), ("lr", 2.0, 0.1), ("gain", None, 2.0)
    ]  # fmt: skip
    assert stages[0].warning == "ℓ (for γ = 1) = 0.2 is the largest of its grid {0.1, 0.2}"
    assert stages[2].warning == "γ = 2 is the largest of its grid {1, 2}"
    chosen, stages, identity = select_cell(cell, identity_score=-0.1)
    assert chosen is None and identity and stages[-1].value == 0.0
    assert stages[-1].scores == {0.0: -0.1, 1.0: -0.4, 2.0: -0.3}


def test_monge_s_selection_is_the_paper_s() -> None:
    cell = [_group("monge", 0.1, -0.3 + a / 10, alpha2=a) for a in (0.5, 1.0)]
    chosen, stages, _ = select_cell(cell, identity_score=-0.4)
    assert chosen is cell[1] and stages[-1].kind == "alpha2"
    assert stages[-1].warning == "α² = 1 is the largest of its grid {0, 0.5, 1}"
    plain = [_group("identity", lr, -lr) for lr in (0.1, 0.2)]
    assert select_cell(plain)[0] is plain[0] and len(select_cell(plain)[1]) == 1
