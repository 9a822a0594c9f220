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
