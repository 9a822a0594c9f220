"""Independent Normal prior N(0, σ²) on every element ("Gaussian")."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from sgrld.priors.base import Prior, PriorConfig, register, standard_normal

HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


def normal_log_prob_sum(value: Tensor, scale: Tensor | float) -> Tensor:
    """Σ_i log N(value_i; 0, scale²) for a scalar ``scale`` (float or 0-d tensor)."""
    log_scale = torch.log(scale) if isinstance(scale, Tensor) else math.log(scale)
    return -0.5 * value.square().sum() / scale**2 - value.numel() * (log_scale + HALF_LOG_2PI)


@register
class GaussianPrior(Prior):
    """w_i ~ N(loc, scale²) i.i.d.

    Args:
        scale: standard deviation σ > 0.
        loc: mean (0 in every experiment).
    """

    name = "gaussian"

    def __init__(self, scale: float, loc: float = 0.0) -> None:
        super().__init__()
        if not scale > 0:
            raise ValueError(f"scale must be > 0, got {scale}")
        self.scale = float(scale)
        self.loc = float(loc)

    def log_prob(self, value: Tensor) -> Tensor:
        """Σ log N(value; loc, scale²)."""
        return normal_log_prob_sum(value - self.loc if self.loc else value, self.scale)

    def sample(self, shape: torch.Size, generator: torch.Generator | None = None) -> Tensor:
        """Independent draws from N(loc, scale²) (on the generator's device, else the CPU)."""
        device = generator.device if generator is not None else torch.device("cpu")
        return self.loc + self.scale * standard_normal(shape, generator, device)

    @classmethod
    def for_parameter(cls, shape: torch.Size, scale: float, config: PriorConfig) -> Prior:
        """N(0, scale²) whatever the shape."""
        return cls(scale)

    def extra_repr(self) -> str:
        return f"loc={self.loc}, scale={self.scale:.4g}"
