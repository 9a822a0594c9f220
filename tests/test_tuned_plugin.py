"""A metric plug-in registered after the experiments were imported: its tuned option is read from
the registry when used (``TUNED_FIELDS``), so runs, files, labels and chains take it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import pytest

from sgrld.core import contract
from sgrld.experiments.report.selection import select_cell
from sgrld.experiments.report.tables import Group
from sgrld.experiments.run.chains import PER_CHAIN_FIELDS, check_chain_configs
from sgrld.experiments.run.choices import SAMPLERS
from sgrld.experiments.run.config import TUNED_FIELDS, RunConfig
from sgrld.experiments.run.naming import cli_names, run_label
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


def test_without_the_plugin_the_fields_are_the_registry_s() -> None:
    assert tuple(TUNED_FIELDS) == ("alpha2",) and "gainy" not in SAMPLERS
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
