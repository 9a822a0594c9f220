"""Models whose learning coefficient is known in closed form, at the point it is known for:
each a model at w₀, its minibatches, the batch-mean NLL and the theoretical λ.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from sgrld.slt.theory import (
    deep_linear_network_llc,
    localized_quadratic_llc,
    reduced_rank_regression_llc,
    regular_llc,
)

Batch = tuple[Tensor, Tensor]


@dataclass(frozen=True)
class Target:
    """A model at w₀ with its data and its λ.

    Attributes:
        name: e.g. ``"logistic"``, ``"rrr(4,4,3,1)"``.
        model: the model at w₀ (float64).
        loss: ``loss(model, batch)``, the batch-mean negative log-likelihood.
        batches: the data cut into minibatches (one epoch, fixed order).
        num_data: n.
        theory: λ.
        hessian_eigenvalues: of ∇²L_n(w₀), where the model is regular (else ``None``): the
            localised posterior's exact λ̂ is then :func:`localized_quadratic_llc`.
    """

    name: str
    model: nn.Module
    loss: Any
    batches: list[Batch]
    num_data: int
    theory: float
    hessian_eigenvalues: list[float] | None = None

    def exact(self, nbeta: float, localization: float) -> float:
        """λ̂ of the localised tempered posterior where it is known exactly (regular targets),
        else λ."""
        if self.hessian_eigenvalues is None:
            return self.theory
        return localized_quadratic_llc(self.hessian_eigenvalues, nbeta, localization)


def _cut(x: Tensor, y: Tensor, batch_size: int) -> list[Batch]:
    return [(x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, len(x), batch_size)]


def _bce(model: nn.Module, batch: Batch) -> Tensor:
    x, y = batch
    return nn.functional.binary_cross_entropy_with_logits(model(x).squeeze(-1), y)


def _half_squared_error(model: nn.Module, batch: Batch) -> Tensor:
    x, y = batch  # the Gaussian NLL with σ = 1, less its constant
    return 0.5 * (model(x) - y).square().sum(-1).mean()


def logistic(
    num_data: int = 10_000, features: int = 10, batch_size: int = 500, seed: int = 0
) -> Target:
    """A logistic regression (``features`` weights and a bias) at its MLE, found by Newton's
    method to machine precision: regular, λ = d/2 with d = features + 1."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_data, features, generator=g, dtype=torch.float64)
    truth = torch.randn(features, generator=g, dtype=torch.float64)
    y = torch.bernoulli(torch.sigmoid(x @ truth), generator=g)
    xb = torch.cat([x, torch.ones(num_data, 1, dtype=x.dtype)], 1)
    w = torch.zeros(features + 1, dtype=x.dtype)
    for _ in range(30):
        p = torch.sigmoid(xb @ w)
        hess = (xb * (p * (1 - p))[:, None]).T @ xb
        w = w - torch.linalg.solve(hess, xb.T @ (p - y))
    model = nn.Linear(features, 1, dtype=torch.float64)
    with torch.no_grad():
        model.weight.copy_(w[:features])
        model.bias.copy_(w[features:])
    p = torch.sigmoid(xb @ w)
    hess = (xb * (p * (1 - p))[:, None]).T @ xb / num_data
    eig = torch.linalg.eigvalsh(hess).tolist()
    return Target(
        "logistic", model, _bce, _cut(x, y, batch_size), num_data, regular_llc(features + 1), eig
    )


def reduced_rank_regression(
    inputs: int,
    outputs: int,
    hidden: int,
    rank: int,
    num_data: int = 10_000,
    batch_size: int = 500,
    seed: int = 0,
) -> Target:
    """y = B₀A₀x + N(0, I), x ~ N(0, I), with a rank-``rank`` truth B₀A₀ (A₀: hidden × inputs,
    B₀: outputs × hidden, their first ``rank`` rows/columns standard normal, the rest zero), and
    the model ``Linear(inputs, hidden) → Linear(hidden, outputs)`` without biases at (A₀, B₀):
    λ from :func:`reduced_rank_regression_llc` (Aoyagi & Watanabe 2005)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.zeros(hidden, inputs, dtype=torch.float64)
    b = torch.zeros(outputs, hidden, dtype=torch.float64)
    a[:rank] = torch.randn(rank, inputs, generator=g, dtype=torch.float64)
    b[:, :rank] = torch.randn(outputs, rank, generator=g, dtype=torch.float64)
    x = torch.randn(num_data, inputs, generator=g, dtype=torch.float64)
    y = x @ (b @ a).T + torch.randn(num_data, outputs, generator=g, dtype=torch.float64)
    first = nn.Linear(inputs, hidden, bias=False, dtype=torch.float64)
    second = nn.Linear(hidden, outputs, bias=False, dtype=torch.float64)
    with torch.no_grad():
        first.weight.copy_(a)
        second.weight.copy_(b)
    model = nn.Sequential(first, second)
    return Target(
        f"rrr({inputs},{outputs},{hidden},{rank})",
        model,
        _half_squared_error,
        _cut(x, y, batch_size),
        num_data,
        reduced_rank_regression_llc(inputs, outputs, hidden, rank),
    )


def deep_linear_network(
    widths: list[int] | tuple[int, ...],
    rank: int,
    num_data: int = 100_000,
    batch_size: int = 500,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> Target:
    """y = W_L⋯W₁x + N(0, I), x ~ N(0, I), at a rank-``rank`` truth, and the model (a chain of
    ``Linear`` layers without biases, widths H₁ → … → H_{L+1}) at it: W₁'s first ``rank`` rows
    standard normal over √H₁, W_L's first ``rank`` columns standard normal, each middle layer
    a random ``rank`` × ``rank`` rotation in its top-left corner, every other entry zero. λ from
    :func:`deep_linear_network_llc` (Aoyagi 2024); Furman & Lau (2024)'s known-answer model.
    """
    if len(widths) < 2 or not 0 < rank <= min(widths):
        raise ValueError(f"need >= 2 widths and 0 < rank <= min(widths), got {widths}, {rank}")
    g = torch.Generator().manual_seed(seed)
    layers = []
    for j, (fan_in, fan_out) in enumerate(itertools.pairwise(widths)):
        w = torch.zeros(fan_out, fan_in, dtype=torch.float64)
        if j == 0:
            w[:rank] = torch.randn(rank, fan_in, generator=g, dtype=w.dtype) / fan_in**0.5
        elif j == len(widths) - 2:
            w[:, :rank] = torch.randn(fan_out, rank, generator=g, dtype=w.dtype)
        else:
            q, _ = torch.linalg.qr(torch.randn(rank, rank, generator=g, dtype=w.dtype))
            w[:rank, :rank] = q
        if len(widths) == 2:  # one layer: a rank-``rank`` matrix
            w = (
                torch.randn(fan_out, rank, generator=g, dtype=w.dtype)
                @ torch.randn(rank, fan_in, generator=g, dtype=w.dtype)
                / fan_in**0.5
            )
        layer = nn.Linear(fan_in, fan_out, bias=False, dtype=dtype)
        with torch.no_grad():
            layer.weight.copy_(w)
        layers.append(layer)
    model = nn.Sequential(*layers)
    x = torch.randn(num_data, widths[0], generator=g, dtype=torch.float64)
    with torch.no_grad():
        truth = model.double()(x)
    y = truth + torch.randn(num_data, widths[-1], generator=g, dtype=torch.float64)
    model = model.to(dtype)
    return Target(
        f"dln({','.join(map(str, widths))};r={rank})",
        model,
        _half_squared_error,
        _cut(x.to(dtype), y.to(dtype), batch_size),
        num_data,
        deep_linear_network_llc(widths, rank),
    )
