"""Bayesian linear regression on scikit-learn's diabetes data, exact posterior, for the tuner.

The 442 standardised patients with an intercept column, likelihood N(y | Xθ, s²) with s² = 0.5,
prior N(0, I) (``tests/linear_gaussian.py``); ``scale`` multiplies every feature (not the
intercept), as a change of units would: the exact posterior moves with it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from linear_gaussian import linear_posterior

NOISE_VAR = 0.5
BATCH = 32


def diabetes(scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Features ``(442, 10)`` (standardised, times ``scale``), targets, exact μ and Σ of
    (weights, intercept)."""
    from sklearn.datasets import load_diabetes

    x, y = load_diabetes(return_X_y=True)
    x, y = torch.tensor(x), torch.tensor(y)
    x = scale * (x - x.mean(0)) / x.std(0, correction=0)
    y = (y - y.mean()) / y.std(correction=0)
    design = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1)
    _, _, mu, sigma = linear_posterior(design, y, NOISE_VAR)
    return x, y, mu, sigma


def potential(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], n: int) -> torch.Tensor:
    """The per-datum potential: Gaussian nll (up to a constant) − log prior / n."""
    x, y = batch
    nll = 0.5 * ((y - model(x)[..., 0]) ** 2).mean() / NOISE_VAR
    return nll + 0.5 * sum((p**2).sum() for p in model.parameters()) / n


def model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(10, 1, dtype=torch.float64)


def loader(x: torch.Tensor, y: torch.Tensor) -> DataLoader:
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True)


def sample(
    x: torch.Tensor, y: torch.Tensor, name: str, options: dict, steps: int, chains: int = 8
) -> torch.Tensor:
    """``chains`` chains of ``steps`` steps with the tuned options, each its own data order; the
    second halves' draws (every 10th step) pooled, ``(draws, 11)``."""
    import sgrld
    from sgrld.chains import chain_batches

    n = len(y)
    sampler = sgrld.build(name, num_data=n, noise="philox", **options)
    runs = sgrld.Chains(lambda s: model(1000 + s), sampler, seeds=list(range(chains)))
    generators = [torch.Generator().manual_seed(100 + k) for k in range(chains)]
    draws, step = [], 0
    while step < steps:
        for index in chain_batches(n, BATCH, generators):
            runs.step(lambda m, u, v: potential(m, (u, v), n), x[index], y[index])
            step += 1
            if step > steps // 2 and step % 10 == 0:
                draws.append(torch.cat([runs.params["weight"][:, 0], runs.params["bias"]], 1))
            if step == steps:
                break
        if sampler.metric.refresh_per_epoch:
            runs.refresh()
    runs.check()
    return torch.cat(draws)
