"""CDF and quantiles of equal-weight Gaussian mixtures (the regression posterior predictive):
quantiles by bisection inside the bracket of the components' own quantiles.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["mixture_cdf", "mixture_quantile"]


def mixture_cdf(x: Tensor, means: Tensor, scales: Tensor) -> Tensor:
    """F(x) = (1/S) Σ_s Φ((x − μ_s)/σ_s): ``x`` ``(…)``, ``means``/``scales`` ``(…, S)``."""
    return torch.special.ndtr((x[..., None] - means) / scales).mean(dim=-1)


def mixture_quantile(means: Tensor, scales: Tensor, q: float, *, iterations: int = 64) -> Tensor:
    """The q-quantile of (1/S) Σ_s N(μ_s, σ_s²) for every leading index, ``(…)``.

    Args:
        means: component means μ, ``(…, S)``.
        scales: component standard deviations σ > 0, ``(…, S)``.
        q: the level, in (0, 1).
        iterations: bisection steps; each halves the bracket (64 reach float64 resolution).

    Examples:
        >>> import torch
        >>> float(mixture_quantile(torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2), 0.5))
        0.0
    """
    if not 0.0 < q < 1.0:
        raise ValueError(f"q must be in (0, 1), got {q!r}")
    component = means + scales * torch.special.ndtri(torch.tensor(q, dtype=means.dtype))
    low, high = component.min(dim=-1).values, component.max(dim=-1).values
    for _ in range(iterations):
        mid = (low + high) / 2
        below = mixture_cdf(mid, means, scales) < q
        low, high = torch.where(below, mid, low), torch.where(below, high, mid)
    return (low + high) / 2
