"""Horseshoe prior with one sampled scale per tensor, as in bnn_priors.

Reference variant (default): s = σ · softplus(p), w_i ~ N(0, s²),
log p = Σ log N(w_i; 0, s²) + log HC(s; γ), without Jacobian. Textbook variant
(``jacobian=True``): λ = softplus(p) ~ HC(0, γ), w_i ~ N(0, σ² λ²), plus log sigmoid(p).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sgrld.priors.base import Prior, PriorConfig, register, standard_normal
from sgrld.priors.gaussian import normal_log_prob_sum

#: softplus⁻¹(1) = log(e − 1) ≈ 0.5413, the initial raw scale
INIT_RAW_SCALE = math.log(math.e - 1.0)


def half_cauchy_log_prob(value: Tensor, scale: float = 1.0) -> Tensor:
    """log HC(value; scale) = log 2 − log π − log scale − log(1 + (value/scale)²), value ≥ 0."""
    return math.log(2.0 / (math.pi * scale)) - torch.log1p((value / scale).square())


@register
class HorseshoePrior(Prior):
    """Per-tensor horseshoe with a sampled, unconstrained scale parameter ``raw_scale`` (0-d).

    Args:
        scale: base standard deviation σ (1.41/sqrt(fan_in) for weights, 1 for biases).
        jacobian: use the textbook variant (module docstring) instead of the reference one.
        hyperscale: γ of the half-Cauchy hyper-prior (1 in the reference).
    """

    name = "horseshoe"

    def __init__(self, scale: float, *, jacobian: bool = False, hyperscale: float = 1.0) -> None:
        super().__init__()
        if not (scale > 0 and hyperscale > 0):
            raise ValueError(f"scale and hyperscale must be > 0, got {scale}, {hyperscale}")
        self.scale = float(scale)
        self.hyperscale = float(hyperscale)
        self.jacobian = jacobian
        self.raw_scale = nn.Parameter(torch.tensor(INIT_RAW_SCALE))

    def reset_parameters(self) -> None:
        """raw_scale ← softplus⁻¹(1), so the effective scale starts at σ."""
        with torch.no_grad():
            self.raw_scale.fill_(INIT_RAW_SCALE)

    @property
    def effective_scale(self) -> Tensor:
        """s = σ · softplus(raw_scale), the current standard deviation of the weights."""
        return self.scale * F.softplus(self.raw_scale)

    def log_prob(self, value: Tensor) -> Tensor:
        """Σ log N(value; 0, s²) plus the log hyper-prior of the chosen variant."""
        lam = F.softplus(self.raw_scale)
        log_lik = normal_log_prob_sum(value, self.scale * lam)
        if self.jacobian:
            return (
                log_lik + half_cauchy_log_prob(lam, self.hyperscale) - F.softplus(-self.raw_scale)
            )
        return log_lik + half_cauchy_log_prob(self.scale * lam, self.hyperscale)

    def sample(self, shape: torch.Size, generator: torch.Generator | None = None) -> Tensor:
        """Draws from N(0, s²) at the current scale s."""
        noise = standard_normal(shape, generator, self.raw_scale.device)
        return self.effective_scale.detach() * noise

    @classmethod
    def for_parameter(cls, shape: torch.Size, scale: float, config: PriorConfig) -> Prior:
        """One horseshoe per tensor; the variant comes from ``config.horseshoe_jacobian``."""
        return cls(scale, jacobian=config.horseshoe_jacobian)

    def extra_repr(self) -> str:
        return f"scale={self.scale:.4g}, jacobian={self.jacobian}"
