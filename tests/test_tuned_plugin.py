"""A metric plug-in registered after the experiments were imported: its tuned option is read from
the registry when used (``TUNED_FIELDS``), so runs, files, labels and chains take it."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from sgrld.core import contract
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
