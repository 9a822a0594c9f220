"""The likelihood plug-ins: oracles for each one's maths, the mixture quantiles, the ensembles."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.distributions import Categorical as TorchCategorical
from torch.distributions import MixtureSameFamily, Normal

from sgrld import likelihoods
from sgrld.evaluation import EnsemblePredictive
from sgrld.evaluation.chain_ensemble import ChainEnsemble
from sgrld.experiments.report.tables import Group, score_columns, table_columns
from sgrld.likelihoods import (
    COVERAGE_LEVELS,
    Categorical,
    Gaussian,
    get_likelihood,
    likelihood_names,
    mixture_cdf,
    mixture_quantile,
)
from sgrld.models import build_model, potential

Z = 5.0  # Monte-Carlo thresholds in standard errors


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_registry_lists_both_and_names_the_valid_ones() -> None:
    assert likelihood_names() == ["categorical", "gaussian"]
    assert get_likelihood("gaussian") is Gaussian
    with pytest.raises(ValueError, match=r"valid names: \['categorical', 'gaussian'\]"):
        get_likelihood("poisson")


def test_categorical_potential_is_bit_identical_to_the_cross_entropy_formula() -> None:
    model = build_model("fc", prior="horseshoe", width=16, generator=_gen())
    x, y = torch.randn(32, 784, generator=_gen(1)), torch.randint(10, (32,), generator=_gen(2))
    u = potential(model, x, y, 500)
    grads = torch.autograd.grad(u, list(model.parameters()))
    old = F.cross_entropy(model.net(x), y) - model.log_prior() / 500
    old_grads = torch.autograd.grad(old, list(model.parameters()))
    assert torch.equal(u, old)
    assert all(torch.equal(g, h) for g, h in zip(grads, old_grads, strict=True))
    # the categorical likelihood adds no parameter, buffer or state
    assert not any(name.startswith("likelihood") for name in model.state_dict())


@pytest.mark.parametrize("scale", [0.3, None])
def test_gaussian_log_prob_and_nll_match_torch_normal(scale: float | None) -> None:
    likelihood = Gaussian(scale, prior_loc=-0.5)
    f = torch.randn(40, 1, dtype=torch.float64, generator=_gen())
    y = torch.randn(40, dtype=torch.float64, generator=_gen(1))
    eta = likelihood(f)
    sigma = 0.3 if scale is not None else math.exp(-0.5)
    expected = Normal(f[:, 0], sigma).log_prob(y)
    torch.testing.assert_close(likelihood.log_prob(eta, y), expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(likelihood.nll(eta, y), -expected.mean(), rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="targets must have shape"):
        likelihood.nll(eta, y[:, None])  # (B, 1) would broadcast to (B, B)


def test_learned_sigma_is_a_model_parameter_with_its_prior_and_the_right_gradient() -> None:
    n, loc, prior_scale = 300, 0.2, 0.7
    learned = Gaussian(prior_loc=loc, prior_scale=prior_scale)
    model = build_model("fc", width=8, in_features=10, generator=_gen(), likelihood=learned)
    model = model.double()
    names = [name for name, _ in model.named_parameters()]
    assert names[-1] == "likelihood.log_scale" and names[:-1] == [
        "net." + name for name, _ in model.net.named_parameters()
    ]
    log_scale = learned.log_scale  # the model holds this module: .double() converted it
    assert log_scale is not None
    with torch.no_grad():
        log_scale.fill_(-0.4)
    x = torch.randn(25, 10, dtype=torch.float64, generator=_gen(1))
    y = torch.randn(25, dtype=torch.float64, generator=_gen(2))
    (grad,) = torch.autograd.grad(potential(model, x, y, n), [log_scale])
    # d/dρ of mean(½ z² + ρ) − log N(ρ; loc, s²)/n with z = (y − f)e^{−ρ}:
    # mean(1 − z²) + (ρ − loc)/(n s²)
    z = (y - model.net(x)[:, 0].detach()) * math.exp(0.4)
    expected = (1 - z.square()).mean() + (-0.4 - loc) / (n * prior_scale**2)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-14)
    prior_term = Normal(loc, prior_scale).log_prob(torch.tensor(-0.4, dtype=torch.float64))
    without = build_model("fc", width=8, in_features=10, generator=_gen(),
                          likelihood=Gaussian(0.5)).double()  # fmt: skip
    torch.testing.assert_close(model.log_prior() - without.log_prior(), prior_term)
    model.reset_parameters()
    assert float(log_scale.detach()) == pytest.approx(loc)


def test_mixture_quantile_closed_forms() -> None:
    means = torch.tensor([[0.3], [-2.0]], dtype=torch.float64)
    scales = torch.tensor([[1.7], [0.1]], dtype=torch.float64)
    for q in (0.05, 0.25, 0.5, 0.9):
        expected = means[:, 0] + scales[:, 0] * torch.special.ndtri(torch.tensor(q).double())
        torch.testing.assert_close(mixture_quantile(means, scales, q), expected)
    symmetric = mixture_quantile(torch.tensor([-3.0, 3.0]).double(), torch.ones(2).double(), 0.5)
    assert abs(float(symmetric)) < 1e-12
    with pytest.raises(ValueError, match="q must be in"):
        mixture_quantile(means, scales, 1.0)


def _skewed_mixture() -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.tensor([-2.0, -1.0, 5.0], dtype=torch.float64),
        torch.tensor([0.5, 0.7, 1.0], dtype=torch.float64),
    )


def test_mixture_quantile_matches_monte_carlo() -> None:
    means, scales = _skewed_mixture()
    draws = 400_000
    component = torch.randint(3, (draws,), generator=_gen())
    sample = means[component] + scales[component] * torch.randn(
        draws, dtype=torch.float64, generator=_gen(1)
    )
    density = MixtureSameFamily(TorchCategorical(torch.ones(3)), Normal(means, scales))
    for q in (0.05, 0.25, 0.5, 0.75, 0.95):
        x = mixture_quantile(means, scales, q)
        assert float(mixture_cdf(x, means, scales)) == pytest.approx(q, abs=1e-12)
        # the empirical quantile's standard error: √(q(1 − q)/N) / p(x_q)
        se = math.sqrt(q * (1 - q) / draws) / float(density.log_prob(x).exp())
        assert abs(float(torch.quantile(sample, q)) - float(x)) < Z * se


def test_coverage_is_exact_for_targets_from_the_predictive_and_a_gaussian_fit_is_not() -> None:
    """Targets drawn from the mixture itself land in its central p-interval with probability p."""
    means, scales = _skewed_mixture()
    points = 20_000
    component = torch.randint(3, (points,), generator=_gen(2))
    y = means[component] + scales[component] * torch.randn(
        points, dtype=torch.float64, generator=_gen(3)
    )
    ensemble = EnsemblePredictive(points, likelihood=Gaussian(1.0))
    for mean, scale in zip(means, scales, strict=True):  # three samples, each one component
        ensemble.add(torch.stack([mean.expand(points), scale.log().expand(points)], 1))
    scores = ensemble.metrics(y)
    moment_sd = math.sqrt(float((scales**2 + means**2).mean() - means.mean() ** 2))
    for level in COVERAGE_LEVELS:
        se = math.sqrt(level * (1 - level) / points)
        assert abs(scores[f"coverage_{round(100 * level)}"] - level) < Z * se
        # the moment-matched single Gaussian's interval holds another mass: the test would notice
        half = moment_sd * float(torch.special.ndtri(torch.tensor((1 + level) / 2)))
        ends = means.mean() + torch.tensor([-half, half], dtype=torch.float64)
        fit = float(mixture_cdf(ends[1], means, scales) - mixture_cdf(ends[0], means, scales))
        assert abs(fit - level) > Z * se


def test_gaussian_scores_in_original_units() -> None:
    """lp, rmse and coverage of standardised targets equal those computed in original units."""
    shift, unit = 150.0, 77.0
    s, n = 4, 50
    f = torch.randn(s, n, dtype=torch.float64, generator=_gen())
    log_sigma = 0.3 * torch.randn(s, 1, dtype=torch.float64, generator=_gen(1)) - 0.5
    y = torch.randn(n, dtype=torch.float64, generator=_gen(2))
    ensemble = EnsemblePredictive(n, likelihood=Gaussian(1.0, target_scale=unit))
    for k in range(s):
        ensemble.add_batch(0, torch.stack([f[k, :30], log_sigma[k].expand(30)], 1))
        ensemble.add_batch(30, torch.stack([f[k, 30:], log_sigma[k].expand(20)], 1))
        ensemble.commit()
    scores = ensemble.metrics(y)
    mixture = MixtureSameFamily(
        TorchCategorical(torch.ones(n, s, dtype=torch.float64)),
        Normal(shift + unit * f.T, unit * log_sigma.exp().T.expand(n, s)),
    )
    y_orig = shift + unit * y
    assert scores["lp"] == pytest.approx(float(mixture.log_prob(y_orig).mean()), rel=1e-12)
    rmse = float((shift + unit * f.mean(0) - y_orig).square().mean().sqrt())
    assert scores["rmse"] == pytest.approx(rmse, rel=1e-12)
    assert scores["num_samples"] == s
    empty = EnsemblePredictive(n, likelihood=Gaussian(1.0)).metrics(y)
    assert set(empty) == {"lp", "rmse", "coverage_50", "coverage_90", "num_samples"}
    assert math.isnan(empty["lp"])


def test_chain_ensemble_gaussian_equals_one_ensemble_per_chain_and_resumes() -> None:
    k, n, samples = 3, 11, 4
    likelihood = Gaussian(None)
    eta = torch.randn(samples, k, n, 2, generator=_gen())
    y = torch.randn(n, generator=_gen(1))
    chains = ChainEnsemble(k, n, likelihood=likelihood)
    singles = [EnsemblePredictive(n, likelihood=likelihood) for _ in range(k)]
    for step in range(samples):
        chains.add_batch(0, eta[step])
        chains.commit()
        for i, single in enumerate(singles):
            single.add(eta[step, i])
        if step == 1:
            resumed = ChainEnsemble(k, n, likelihood=likelihood)
            resumed.load_state_dict(chains.state_dict())
            chains = resumed
    assert chains.metrics(y) == [single.metrics(y) for single in singles]
    with pytest.raises(ValueError, match="log_sum_exp has shape"):
        ChainEnsemble(k, n + 1, likelihood=likelihood).load_state_dict(chains.state_dict())


def test_categorical_ensemble_keeps_its_defaults_and_checks_the_likelihood() -> None:
    logits = torch.randn(2, 6, 3, generator=_gen())
    labels = torch.tensor([0, 1, 2, 0, 1, 2])
    default, explicit = EnsemblePredictive(6, 3), EnsemblePredictive(6, likelihood=Categorical(3))
    for sample in logits:
        default.add(sample)
        explicit.add(sample)
    assert default.metrics(labels) == explicit.metrics(labels)
    with pytest.raises(ValueError, match="num_classes=4 but the likelihood has 3"):
        EnsemblePredictive(6, 4, likelihood=Categorical(3))
    with pytest.raises(ValueError, match="give num_classes"):
        EnsemblePredictive(6)


@pytest.mark.parametrize("name", likelihoods.likelihood_names())
def test_what_a_likelihood_declares_for_the_experiments_is_among_its_scores(name: str) -> None:
    """Headline, table scores and ranges name scores the likelihood computes; a results file's
    scores (or its curves' names) lead back to it."""
    cls = likelihoods.get_likelihood(name)
    scores = set(cls.score_names)
    assert cls.headline and set(cls.headline.values()) <= scores and cls.second() in scores
    assert set(cls.table_scores) == {"test", "val"}
    assert all(set(s) <= scores for s in cls.table_scores.values())
    assert set(cls.fractions) | set(cls.nonnegative) <= scores
    assert likelihoods.scored_by([*cls.score_names, "num_samples"]) is cls
    assert likelihoods.scored_by([f"test_{s}" for s in cls.score_names] + ["epoch"]) is cls


def test_the_tables_columns_come_from_the_declarations_in_their_layout() -> None:
    """The CSV tables' columns, from the likelihoods' declarations, in the layout the tables
    have always had: the paper's scores beside LP, the regression's after the common ones."""

    def group(name: str) -> Group:
        scores = dict.fromkeys(likelihoods.get_likelihood(name).score_names, 0.5)
        return Group({}, [{"final": {"test": scores, "val": scores}}])

    common = ["seconds_per_epoch", "curvature", "num_samples"]
    paper = ["test_lp", "test_accuracy", "test_ece", "test_confidence", "val_lp"]
    paper += ["val_accuracy", "val_ece", *common]
    regression = ["test_rmse", "test_coverage_50", "test_coverage_90", "val_rmse"]
    assert table_columns([group("categorical")]) == paper
    assert table_columns([group("gaussian")]) == ["test_lp", "val_lp", *common, *regression]
    assert table_columns([group("categorical"), group("gaussian")]) == paper + regression
    assert score_columns([group("categorical")]) == {"acc": "test_accuracy", "ECE": "test_ece"}
    assert list(score_columns([group("gaussian")])) == ["RMSE", "cov50", "cov90"]
