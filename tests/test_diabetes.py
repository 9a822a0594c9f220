"""The diabetes regression data and the Gaussian likelihood against the exact linear posterior."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import sgrld
from linear_gaussian import linear_posterior, lyapunov
from sgrld.data import DATASET_NAMES, dataset_info, load_dataset
from sgrld.evaluation import EnsemblePredictive
from sgrld.evaluation.chain_ensemble import ChainEnsemble, evaluate_chains
from sgrld.likelihoods import Gaussian
from sgrld.models import BayesianModel, build_model, potential
from sgrld.priors import PriorConfig

sklearn_datasets = pytest.importorskip("sklearn.datasets")

Z = 5.0


def _raw() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = sklearn_datasets.load_diabetes(return_X_y=True)
    return torch.tensor(x), torch.tensor(y)


def _indices(
    x: torch.Tensor, raw: torch.Tensor, mean: torch.Tensor, std: torch.Tensor
) -> list[int]:
    """The raw row of every standardised row (the rows of the diabetes data are distinct)."""
    distance = torch.cdist(x.double() * std + mean, raw)
    assert float(distance.min(1).values.max()) < 1e-5 * float(raw.abs().max())
    return distance.argmin(1).tolist()


def test_the_registry_declares_each_data_sets_likelihood_and_shapes() -> None:
    assert "diabetes" in DATASET_NAMES
    info = dataset_info("diabetes")
    assert (info.likelihood, info.input_shape, info.num_outputs) == ("gaussian", (10,), 1)
    assert dataset_info("mnist").likelihood == dataset_info("cifar10").likelihood == "categorical"
    with pytest.raises(ValueError, match="valid names"):
        dataset_info("boston")


def test_diabetes_splits_are_disjoint_deterministic_and_standardised_on_train_only() -> None:
    splits = load_dataset("diabetes")
    raw_x, raw_y = _raw()
    sizes = [len(splits.x_train), len(splits.x_val), len(splits.x_test)]
    assert sizes == [310, 44, 88] and splits.x_train.shape[1:] == (10,)
    assert splits.y_train.dtype == torch.float32 and splits.likelihood == "gaussian"
    with pytest.raises(ValueError, match="has targets, not classes"):
        _ = splits.num_classes
    # every split is an affine image of raw rows: recover the map from all 442, then the rows
    whole = torch.cat([splits.x_train, splits.x_val, splits.x_test]).double()
    std = raw_x.std(0) / whole.std(0)
    mean = raw_x.mean(0) - std * whole.mean(0)
    rows = [_indices(getattr(splits, f"x_{s}"), raw_x, mean, std) for s in ("train", "val", "test")]
    assert sorted(rows[0] + rows[1] + rows[2]) == list(range(442))  # disjoint and complete
    train = torch.tensor(rows[0])
    # standardised with the training rows' statistics, not the whole data's
    torch.testing.assert_close(mean, raw_x[train].mean(0), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(std, raw_x[train].std(0), rtol=1e-5, atol=1e-7)
    assert float((raw_x[train].mean(0) - raw_x.mean(0)).abs().max()) > 1e-4
    assert splits.target_mean == pytest.approx(float(raw_y[train].mean()))
    assert splits.target_scale == pytest.approx(float(raw_y[train].std()))
    test_rows = torch.tensor(rows[2])
    original = splits.y_test.double() * splits.target_scale + splits.target_mean
    torch.testing.assert_close(original, raw_y[test_rows], rtol=1e-6, atol=1e-4)
    again = load_dataset("diabetes")
    assert torch.equal(again.x_val, splits.x_val) and torch.equal(again.y_test, splits.y_test)
    assert not torch.equal(load_dataset("diabetes", seed=2).y_test, splits.y_test)


def test_diabetes_without_scikit_learn_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'sgrld\[regression\]'"):
        load_dataset("diabetes")


def test_fc_for_diabetes_gives_mean_and_log_sigma() -> None:
    splits = load_dataset("diabetes")
    model = build_model("fc", width=50, in_features=10, likelihood=Gaussian(0.5))
    eta = model(splits.x_test)
    assert eta.shape == (88, 2)
    assert torch.equal(eta[:, 1], torch.full((88,), math.log(0.5)))
    assert potential(model, splits.x_train, splits.y_train, splits.num_train).isfinite()


def test_chains_sample_a_learned_sigma_and_stream_the_mixture_per_chain() -> None:
    """log σ is stacked and stepped per chain; the chain ensemble equals one ensemble per chain.

    Alone this takes ~10 s: the first Philox step of a process compiles its noise kernel (paid
    once per session, by test_chains.py too); the test's own work is a few milliseconds.
    """
    splits = load_dataset("diabetes")
    k, n, x_test = 3, splits.num_train, splits.x_test

    def make(seed: int) -> BayesianModel:
        gen = torch.Generator().manual_seed(seed)
        likelihood = Gaussian(None, target_scale=splits.target_scale)
        return build_model("fc", width=16, in_features=10, generator=gen, likelihood=likelihood)

    sampler = sgrld.build("identity", lr=1e-2, num_data=n, noise="philox")
    chains = sgrld.Chains(make, sampler, seeds=[0, 1, 2])
    assert chains.params["likelihood.log_scale"].shape == (k,)
    batch = (splits.x_train[:64].expand(k, 64, 10), splits.y_train[:64].expand(k, 64))
    likelihood = make(0).likelihood
    ensemble = ChainEnsemble(k, len(x_test), likelihood=likelihood)
    singles = [EnsemblePredictive(len(x_test), likelihood=likelihood) for _ in range(k)]
    for _ in range(3):
        chains.step(lambda m, u, v: potential(m, u, v, n), *batch)
        evaluate_chains(lambda v: chains(v, shared=True), ensemble, x_test)
        with torch.no_grad():
            for i, single in enumerate(singles):
                single.add(chains.module(i)(x_test))
    log_scale = chains.params["likelihood.log_scale"]
    assert bool((log_scale != 0).all()) and len(set(log_scale.tolist())) == k
    for metrics, single in zip(ensemble.metrics(splits.y_test), singles, strict=True):
        assert metrics == pytest.approx(single.metrics(splits.y_test), rel=1e-5)
        assert 0 < metrics["rmse"] < 3 * splits.target_scale


def test_the_documented_regression_example_runs() -> None:
    docs = (Path(__file__).resolve().parents[1] / "docs" / "likelihoods.md").read_text("utf-8")
    block = re.search(r"## Data and models\n.*?```python\n(.*?)```", docs, re.S)
    assert block is not None, "docs/likelihoods.md lost its regression example"
    scope: dict[str, Any] = {}
    exec(compile(block.group(1), "likelihoods.md", "exec"), scope)
    assert scope["u"].isfinite() and scope["u"].requires_grad


NOISE_VAR, K, LR, STEPS = 0.5, 400, 0.1, 400


def _exact_law(
    a: torch.Tensor, start_mean: torch.Tensor, start_cov: torch.Tensor, n: int, mu: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and covariance after STEPS full-batch SGLD steps θ ← θ − ℓ(Aθ − b) + √(2ℓ/n) ξ.

    A linear Gaussian chain: the mean is μ + Bᵀ(m₀ − μ) and the covariance C + Bᵀ(C₀ − C)Bᵀᵀ,
    with B = I − ℓA and C the stationary solution of C = B C Bᵀ + (2ℓ/n) I.
    """
    d = len(mu)
    b = torch.eye(d, dtype=torch.float64) - LR * a
    stationary = lyapunov(b[None], (2 * LR / n) * torch.eye(d, dtype=torch.float64)[None])[0]
    power = torch.linalg.matrix_power(b, STEPS)
    mean = mu + power @ (start_mean - mu)
    return mean, stationary + power @ (start_cov - stationary) @ power.T


@pytest.mark.slow  # 400 full-batch steps of 400 chains: about 15 s on a busy core
def test_sgld_through_the_gaussian_likelihood_samples_the_exact_linear_posterior() -> None:
    """SGLD on y ~ N(Xw + c, s²) with s² fixed and prior N(0, I) against the closed form.

    The chains start at exact posterior draws N(μ, Σ) (``tests/linear_gaussian.py``); with
    full-batch gradients the chain is linear Gaussian, so its law after STEPS steps is known
    exactly (:func:`_exact_law`): mean μ, covariance between Σ and the discretised stationary
    one. The sample mean must be within Z standard errors of μ and the sample covariance within
    |law − Σ| (the discretisation, exact) plus Z standard errors of Σ.
    """
    splits = load_dataset("diabetes")
    x, y = splits.x_train.double(), splits.y_train.double()
    n = len(y)
    design = torch.cat([x, torch.ones(n, 1, dtype=x.dtype)], 1)
    a, _, mu, sigma = linear_posterior(design, y, NOISE_VAR)  # A μ = b
    root = torch.linalg.cholesky(sigma)
    # prior N(0, I): weight σ = weight_scale/√(in_features) = 1, bias σ = 1
    config = PriorConfig(weight_scale=math.sqrt(10), bias_scale=1.0)

    def make(seed: int) -> nn.Module:
        gen = torch.Generator().manual_seed(seed)
        draw = mu + root @ torch.randn(11, dtype=torch.float64, generator=gen)
        linear = nn.Linear(10, 1, dtype=torch.float64)
        with torch.no_grad():
            linear.weight.copy_(draw[None, :10])
            linear.bias.copy_(draw[10:])
        gaussian = Gaussian(math.sqrt(NOISE_VAR))
        return BayesianModel(linear, config=config, init=False, likelihood=gaussian)

    sampler = sgrld.build("identity", lr=LR, num_data=n, noise="philox")
    chains = sgrld.Chains(make, sampler, seeds=list(range(K)))
    batch = (x.expand(K, n, 10), y.expand(K, n))
    for _ in range(STEPS):
        chains.step(lambda m, u, v: potential(m, u, v, n), *batch)
    theta = torch.cat([chains.params["net.weight"][:, 0], chains.params["net.bias"]], 1)

    mean, cov = _exact_law(a, mu, sigma, n, mu)  # the mean stays μ
    mean_se = torch.sqrt(torch.diag(cov) / K)
    mean_err = float(((theta.mean(0) - mean) / mean_se).abs().max())
    assert mean_err < Z, f"mean off the exact posterior mean by {mean_err:.2f} s.e."
    var = torch.diag(cov)
    se = torch.sqrt((var[:, None] * var[None, :] + cov**2) / K)
    emp = (theta - mu).T @ (theta - mu) / K
    discretisation = (cov - sigma).abs()
    excess = float(((emp - sigma).abs() - discretisation - Z * se).max())
    assert excess < 0, f"covariance beyond discretisation + {Z} s.e. by {excess:.3g}"
    # the test would see a 50 % error in the posterior covariance, and a potential that forgot
    # the prior's 1/n (its drift moves the chains' mean by many standard errors in STEPS steps)
    assert float(((emp - 1.5 * sigma).abs() - discretisation - Z * se).max()) > 0
    wrong_a = a + (1 - 1 / n) * torch.eye(11, dtype=torch.float64)
    wrong_mean, _ = _exact_law(wrong_a, mu, sigma, n, torch.linalg.solve(wrong_a, a @ mu))
    assert float(((wrong_mean - mu) / mean_se).abs().max()) > 3 * Z
