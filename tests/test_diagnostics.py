"""ESS, split R-hat and MCSE against known answers (iid and AR(1) chains)."""

from __future__ import annotations

import numpy as np
import pytest

from sgrld.evaluation.diagnostics import (
    autocorrelation,
    effective_sample_size,
    mcse_mean,
    split_rhat,
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


def _sokal_sd(tau: float, window: int, total_draws: int) -> float:
    """Relative sd of an integrated-autocorrelation-time estimate, sqrt(2(2M+1)/N) (Sokal 1997)."""
    return float(np.sqrt(2.0 * (2 * window + 1) / total_draws))


@pytest.mark.parametrize(("phi", "num_draws"), [(0.0, 1000), (0.5, 2000)])
def test_ess_matches_ar1_theory(phi: float, num_draws: int) -> None:
    rng = np.random.default_rng(1)
    chains = 4
    x = _ar1(phi, chains, num_draws, rng)
    total = chains * num_draws
    expected = total * (1.0 - phi) / (1.0 + phi)  # τ = (1+φ)/(1−φ)
    ratio = effective_sample_size(x) / expected
    assert ratio.shape == (NUM_COMPONENTS,)
    # Geyer's window stops within a few τ; take M = 5τ + 2 lags as a conservative window.
    tau = (1.0 + phi) / (1.0 - phi)
    sd = _sokal_sd(tau, window=int(5 * tau) + 2, total_draws=total)
    assert np.all(np.abs(ratio - 1.0) < 5 * sd), (ratio.min(), ratio.max(), sd)
    assert abs(ratio.mean() - 1.0) < sd  # the mean of 50 estimates is much tighter still


def test_ess_of_antithetic_chain_exceeds_draws() -> None:
    x = _ar1(-0.5, 4, 2000, np.random.default_rng(2))
    ratio = effective_sample_size(x) / (4 * 2000 * 3.0)  # (1-φ)/(1+φ) = 3
    assert abs(ratio.mean() - 1.0) < 0.1


def test_autocorrelation_of_ar1_is_geometric() -> None:
    x = _ar1(0.8, 4, 4000, np.random.default_rng(3))
    rho = autocorrelation(x).mean(axis=-1)
    np.testing.assert_allclose(rho[:6], 0.8 ** np.arange(6), atol=0.02)
    assert rho[0] == 1.0


def test_split_rhat_near_one_for_iid_and_large_for_disagreeing_chains() -> None:
    rng = np.random.default_rng(4)
    x = rng.standard_normal((4, 1000, NUM_COMPONENTS))
    rhat = split_rhat(x)
    assert rhat.shape == (NUM_COMPONENTS,)
    assert np.all(np.abs(rhat - 1.0) < 0.01)
    shifted = x.copy()
    shifted[0] += 2.0  # one chain stuck two sd away
    assert np.all(split_rhat(shifted) > 1.2)
    # A single drifting chain is caught only because the chains are split in halves.
    drift = rng.standard_normal((1, 1000)) + np.linspace(0.0, 4.0, 1000)
    assert float(split_rhat(drift)) > 1.2


def test_mcse_matches_ar1_theory_and_covers_the_mean() -> None:
    phi, chains, draws = 0.5, 4, 2000
    x = _ar1(phi, chains, draws, np.random.default_rng(5))
    tau = (1.0 + phi) / (1.0 - phi)
    mcse = mcse_mean(x)
    np.testing.assert_allclose(mcse, np.sqrt(tau / (chains * draws)), rtol=0.2)
    covered = np.abs(x.mean(axis=(0, 1))) < 2.5 * mcse  # true mean is 0
    assert covered.mean() >= 0.9


def test_scalar_chains_and_validation() -> None:
    x = np.random.default_rng(6).standard_normal((2, 100))
    assert effective_sample_size(x).shape == ()
    assert split_rhat(x).shape == ()
    assert np.isnan(effective_sample_size(np.ones((2, 10))))
    with pytest.raises(ValueError, match="chain, draw"):
        effective_sample_size(np.zeros(10))
    with pytest.raises(ValueError, match="at least 4"):
        split_rhat(np.zeros((2, 3)))
