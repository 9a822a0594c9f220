"""ArviZ-backed R-hat, bulk/tail ESS and export, against known answers (iid and AR(1) chains)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from sgrld.evaluation import SampleTrace, diagnostics_of, inference_data_of
from sgrld.evaluation.diagnostics import (
    import_arviz,
    split_chain,
    summarize,
    to_inference_data,
)

NUM_COMPONENTS = 50  # independent scalar components checked at once (the event axis)


def _ar1(phi: float, num_chains: int, num_draws: int, rng: np.random.Generator) -> np.ndarray:
    """Stationary AR(1) chains ``x_t = φ x_{t-1} + sqrt(1-φ²) ε_t`` with unit marginal variance."""
    noise = rng.standard_normal((num_chains, num_draws, NUM_COMPONENTS))
    x = np.empty_like(noise)
    x[:, 0] = noise[:, 0]
    scale = np.sqrt(1.0 - phi**2)
    for t in range(1, num_draws):
        x[:, t] = phi * x[:, t - 1] + scale * noise[:, t]
    return x


@pytest.mark.parametrize(("phi", "num_draws"), [(0.0, 1000), (0.5, 2000)])
def test_bulk_ess_matches_ar1_theory(phi: float, num_draws: int) -> None:
    rng = np.random.default_rng(1)
    chains = 4
    total = chains * num_draws
    expected = total * (1.0 - phi) / (1.0 + phi)  # τ = (1+φ)/(1−φ)
    stats = summarize({"x": _ar1(phi, chains, num_draws, rng)})["x"]
    ratio = np.asarray(stats["ess_bulk"]) / expected
    assert ratio.shape == (NUM_COMPONENTS,)
    # Relative sd of an autocorrelation-time estimate over a window M: sqrt(2(2M+1)/N) (Sokal);
    # Geyer's window stops within a few τ, so M = 5τ + 2 is conservative.
    tau = (1.0 + phi) / (1.0 - phi)
    sd = float(np.sqrt(2.0 * (2 * (5 * tau + 2) + 1) / total))
    assert np.all(np.abs(ratio - 1.0) < 5 * sd), (ratio.min(), ratio.max(), sd)
    assert abs(ratio.mean() - 1.0) < sd
    # Tail ESS (of the 5% and 95% quantile indicators): an indicator of an AR(1) is less
    # autocorrelated than the chain itself, so it lies between the chain's ESS and the draws.
    tail = np.asarray(stats["ess_tail"])
    assert np.all((tail > (1 - 5 * sd) * expected) & (tail < (1 + 5 * sd) * total)), tail


def test_rhat_near_one_when_chains_agree_and_large_when_not() -> None:
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 500, NUM_COMPONENTS))
    assert np.all(np.abs(np.asarray(summarize({"x": x})["x"]["rhat"]) - 1.0) < 0.02)
    shifted = x + np.arange(4)[:, None, None]  # chains centred at 0, 1, 2, 3
    assert np.all(np.asarray(summarize({"x": shifted})["x"]["rhat"]) > 1.2)


def test_split_chain_exposes_a_drifting_run() -> None:
    rng = np.random.default_rng(3)
    steady = rng.standard_normal(400)
    drift = steady + np.linspace(0.0, 6.0, 400)
    assert split_chain(steady).shape == (2, 200)
    assert split_chain(np.arange(5.0)).tolist() == [[0.0, 1.0], [3.0, 4.0]]  # middle dropped
    assert abs(summarize({"v": split_chain(steady)})["v"]["rhat"] - 1.0) < 0.02
    assert summarize({"v": split_chain(drift)})["v"]["rhat"] > 1.5


def test_too_few_draws_or_one_chain_give_nan_not_an_error() -> None:
    one_chain = summarize({"v": np.random.default_rng(0).standard_normal((1, 100))})["v"]
    assert np.isnan(one_chain["rhat"]) and one_chain["ess_bulk"] > 10
    short = summarize({"v": np.ones((2, 3))})["v"]
    assert all(np.isnan(short[k]) for k in ("rhat", "ess_bulk", "ess_tail"))
    with pytest.raises(ValueError, match=r"\(chain, draw, ...\)"):
        summarize({"v": np.zeros(10)})


def test_missing_arviz_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "arviz", None)  # import arviz now raises ImportError
    with pytest.raises(ImportError, match=r"sgrld\[diagnostics\]"):
        import_arviz()
    trace = {"num_probe": 1, "test_loglik": [0.0] * 8, "probe_logp": [[0.0]] * 8, "scalars": {}}
    result = diagnostics_of([trace])
    assert result["available"] is False and "sgrld[diagnostics]" in result["reason"]


def test_inference_data_export_works_with_arviz_functions() -> None:
    az = import_arviz()
    rng = np.random.default_rng(4)
    data = to_inference_data(
        {"test_loglik": rng.standard_normal((3, 50)), "probe": rng.standard_normal((3, 50, 2))},
        log_likelihood={"y": rng.standard_normal((3, 50, 7))},
        attrs={"sampler": "monge"},
    )
    assert data["posterior"]["probe"].shape == (3, 50, 2)
    assert data["log_likelihood"]["y"].shape == (3, 50, 7)
    assert data["posterior"].attrs["sampler"] == "monge"
    table = az.summary(data, kind="diagnostics")
    assert len(table) == 3  # test_loglik, probe[0], probe[1]


def _trace(values: np.ndarray) -> dict[str, object]:
    trace = SampleTrace(num_points=1, num_probe=1)
    for v in values:
        trace.test_loglik.append(float(v))
        trace.probe_logp.append([float(-v)])
        trace.scalars.setdefault("scale:w", []).append(float(v) ** 2)
    return trace.state_dict()


def test_diagnostics_of_runs_as_chains_and_of_one_run_split() -> None:
    rng = np.random.default_rng(5)
    agree = [_trace(rng.standard_normal(200)) for _ in range(3)]
    apart = [_trace(rng.standard_normal(200) + 3 * k) for k in range(3)]
    across = diagnostics_of(agree)
    assert across["chains"] == 3 and across["draws_per_chain"] == 200
    assert set(across["variables"]) == {"test_loglik", "probe_logp", "scale:w"}
    assert across["worst"]["rhat"] < 1.05 and across["worst"]["ess_bulk"] > 300
    assert diagnostics_of(apart)["worst"]["rhat"] > 1.5
    within = diagnostics_of([_trace(np.linspace(0.0, 5.0, 100) + rng.standard_normal(100))])
    assert "split" in within["chains"] and within["worst"]["rhat"] > 1.5
    assert diagnostics_of([_trace(np.array([]))])["available"] is False


def test_runs_export_as_inference_data_with_seeds_as_chains() -> None:
    az = import_arviz()
    rng = np.random.default_rng(6)
    traces = [_trace(rng.standard_normal(n)) for n in (120, 100, 110)]
    data = inference_data_of(traces, attrs={"sampler": "monge"})
    posterior = data["posterior"]
    assert posterior["test_loglik"].shape == (3, 100)  # cut to the shortest run
    assert posterior["probe_logp"].shape == (3, 100, 1)
    assert posterior["scale:w"].shape == (3, 100)
    np.testing.assert_array_equal(posterior["test_loglik"][1], traces[1]["test_loglik"])
    assert len(az.summary(data, kind="diagnostics")) == 3
    with pytest.raises(ValueError, match="no traced samples"):
        inference_data_of([_trace(np.array([]))])
