"""Tests of sgrld.priors against torch.distributions oracles."""

from __future__ import annotations

import math

import pytest
import torch
from torch import distributions as D
from torch.nn import functional as F

from sgrld.priors import (
    ConvCorrelatedNormal,
    GaussianPrior,
    HorseshoePrior,
    PriorConfig,
    exponential_correlation,
    get_prior,
    prior_names,
)


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def test_gaussian_matches_normal(gen: torch.Generator) -> None:
    value = torch.randn(7, 5, generator=gen, dtype=torch.float64)
    for loc, scale in ((0.0, 0.0705), (0.3, 1.0)):
        expected = D.Normal(loc, scale).log_prob(value).sum()
        torch.testing.assert_close(GaussianPrior(scale, loc).log_prob(value), expected)


@pytest.mark.parametrize("raw", [-3.0, 0.0, math.log(math.e - 1), 2.5])
def test_horseshoe_reference_density(gen: torch.Generator, raw: float) -> None:
    sigma = 1.41 / 28
    prior = HorseshoePrior(sigma).double()
    with torch.no_grad():
        prior.raw_scale.fill_(raw)
    value = torch.randn(30, 4, generator=gen, dtype=torch.float64) * 0.05
    s = sigma * F.softplus(torch.tensor(raw, dtype=torch.float64))
    # HC evaluated at s = σ·softplus(p), no Jacobian
    expected = D.Normal(0.0, s).log_prob(value).sum() + D.HalfCauchy(1.0).log_prob(s)
    torch.testing.assert_close(prior.log_prob(value), expected)


@pytest.mark.parametrize("raw", [-2.0, 0.3, 4.0])
def test_horseshoe_textbook_density(gen: torch.Generator, raw: float) -> None:
    sigma = 0.07
    prior = HorseshoePrior(sigma, jacobian=True).double()
    with torch.no_grad():
        prior.raw_scale.fill_(raw)
    value = torch.randn(12, generator=gen, dtype=torch.float64)
    p = torch.tensor(raw, dtype=torch.float64, requires_grad=True)
    lam = F.softplus(p)
    (dlam_dp,) = torch.autograd.grad(lam, p)
    lam = lam.detach()
    expected = (
        D.Normal(0.0, sigma * lam).log_prob(value).sum()
        + D.HalfCauchy(1.0).log_prob(lam)
        + torch.log(dlam_dp)
    )
    torch.testing.assert_close(prior.log_prob(value), expected)


def test_horseshoe_hyperprior_in_p() -> None:
    """Textbook variant is a proper density over p; the reference one is flat as p → −∞."""
    empty = torch.zeros(0, dtype=torch.float64)
    grid = torch.linspace(-40.0, 40.0, 200_001, dtype=torch.float64)
    textbook = HorseshoePrior(1.0, jacobian=True).double()
    reference = HorseshoePrior(0.05).double()

    def log_hyper(prior: HorseshoePrior, raw: float) -> float:
        with torch.no_grad():
            prior.raw_scale.fill_(raw)
            return float(prior.log_prob(empty))

    for raw in (-10.0, 0.0, 7.0):  # vectorised formula below equals the module
        expected = D.HalfCauchy(1.0).log_prob(F.softplus(torch.tensor(raw))) + F.logsigmoid(
            torch.tensor(raw)
        )
        assert log_hyper(textbook, raw) == pytest.approx(float(expected), rel=1e-6)
    density = (D.HalfCauchy(1.0).log_prob(F.softplus(grid)) + F.logsigmoid(grid)).exp()
    # mass on [a, b] = P(softplus(a) < λ < softplus(b)) for λ ~ HC(0, 1): (2/π)·Δ arctan
    lam_lo, lam_hi = F.softplus(grid[[0, -1]])
    exact = 2 / math.pi * (torch.arctan(lam_hi) - torch.arctan(lam_lo))
    torch.testing.assert_close(torch.trapezoid(density, grid), exact, atol=1e-6, rtol=0)
    # reference: log HC(σ softplus(p)) → log(2/π) as p → −∞ (improper)
    assert log_hyper(reference, -40.0) == pytest.approx(math.log(2 / math.pi), abs=1e-12)


def test_horseshoe_init_and_gradient() -> None:
    prior = HorseshoePrior(0.3)
    torch.testing.assert_close(prior.effective_scale, torch.tensor(0.3))
    assert prior.raw_scale.dim() == 0
    prior.log_prob(torch.ones(5)).backward()
    assert prior.raw_scale.grad is not None and prior.raw_scale.grad.abs() > 0
    with torch.no_grad():
        prior.raw_scale.fill_(3.0)
    prior.reset_parameters()
    assert prior.raw_scale.item() == pytest.approx(0.5413, abs=1e-4)


def test_exponential_correlation_first_row() -> None:
    row = exponential_correlation((3, 3))[0]
    expected = [1, 0.368, 0.135, 0.368, 0.243, 0.107, 0.135, 0.107, 0.059]
    torch.testing.assert_close(row, torch.tensor(expected, dtype=torch.float64), atol=6e-4, rtol=0)


@pytest.mark.parametrize("kernel", [(3, 3), (1, 3), (2, 2)])
def test_conv_correlated_matches_mvn(gen: torch.Generator, kernel: tuple[int, int]) -> None:
    sigma, ell = 1.41 / 4, 1.0
    prior = ConvCorrelatedNormal(kernel, sigma, lengthscale=ell).double()
    value = torch.randn(5, 4, *kernel, generator=gen, dtype=torch.float64)
    cov = sigma**2 * exponential_correlation(kernel, ell)
    mvn = D.MultivariateNormal(torch.zeros(len(cov), dtype=torch.float64), covariance_matrix=cov)
    torch.testing.assert_close(prior.log_prob(value), mvn.log_prob(value.reshape(20, -1)).sum())


def test_conv_correlated_1x1_is_normal(gen: torch.Generator) -> None:
    value = torch.randn(16, 8, 1, 1, generator=gen, dtype=torch.float64)
    prior = ConvCorrelatedNormal(1, 0.25).double()
    torch.testing.assert_close(prior.log_prob(value), D.Normal(0.0, 0.25).log_prob(value).sum())


def test_conv_correlated_caches_cholesky(monkeypatch: pytest.MonkeyPatch) -> None:
    prior = ConvCorrelatedNormal(3, 0.5)
    first = prior.log_prob(torch.ones(2, 2, 3, 3))

    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("Cholesky rebuilt inside log_prob")

    monkeypatch.setattr(torch.linalg, "cholesky", fail)
    monkeypatch.setattr(torch.linalg, "cholesky_ex", fail)
    torch.testing.assert_close(prior.log_prob(torch.ones(2, 2, 3, 3)), first)
    assert "scale_tril" not in prior.state_dict()  # derived, not checkpointed


def test_conv_correlated_sample_covariance(gen: torch.Generator) -> None:
    prior = ConvCorrelatedNormal(3, 0.5)
    draws = prior.sample(torch.Size((40_000, 1, 3, 3)), gen).reshape(-1, 9).double()
    cov = 0.25 * exponential_correlation((3, 3))
    emp = draws.T @ draws / len(draws)
    se = torch.sqrt((torch.outer(cov.diag(), cov.diag()) + cov**2) / len(draws))
    assert ((emp - cov).abs() < 5 * se).all()


def test_conv_correlated_rejects_wrong_kernel() -> None:
    with pytest.raises(ValueError, match="kernel"):
        ConvCorrelatedNormal(3, 1.0).log_prob(torch.zeros(2, 2, 5, 5))
    with pytest.raises(ValueError, match="scale"):
        ConvCorrelatedNormal(3, 0.0)


def test_registry_and_for_parameter() -> None:
    assert prior_names() == ["convcorrnormal", "gaussian", "horseshoe"]
    with pytest.raises(ValueError, match=r"valid names: \['convcorrnormal', 'gaussian'"):
        get_prior("laplace")
    config = PriorConfig(horseshoe_jacobian=True, lengthscale=2.0)
    conv = get_prior("convcorrnormal").for_parameter(torch.Size((8, 4, 3, 3)), 0.7, config)
    assert isinstance(conv, ConvCorrelatedNormal) and conv.lengthscale == 2.0
    dense = get_prior("convcorrnormal").for_parameter(torch.Size((8, 4)), 0.7, config)
    assert isinstance(dense, GaussianPrior) and dense.scale == 0.7
    hs = get_prior("horseshoe").for_parameter(torch.Size((8,)), 1.0, config)
    assert isinstance(hs, HorseshoePrior) and hs.jacobian
    with pytest.raises(ValueError, match="conv_scale"):
        PriorConfig(conv_scale="fan_out")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="weight_scale"):
        PriorConfig(weight_scale=0.0)
