"""Diagonal Adam-style metric: pSGLD's G with Adam's bias-corrected second moment."""

from __future__ import annotations

from dataclasses import dataclass

from sgrld.core.contract import register
from sgrld.metrics.rmsprop import SecondMomentMetric


@register
@dataclass(frozen=True, kw_only=True)
class AdamMetric(SecondMomentMetric):
    """G = diag(√v̂ + max(ε, floor·s)), v ← β₂·v + (1−β₂)·g², v̂ = v/(1−β₂ᵗ) (v from zeros,
    current g included), s = √mean(v̂) over the group.

    Adam's second moment without its first moment (the drift stays −ℓ G⁻¹ĝ): bias-corrected, so a
    slow β₂ is usable from step 1, where pSGLD's G⁻¹ is huge. The same chain as
    ``RMSpropMetric(decay=beta2, eps=eps, bias_correction=True)``, with Adam's defaults.

    Args:
        beta2: EMA weight β₂ in [0, 1) of the squared gradients.
        eps: ε ≥ 0 added to √v̂ (outside the square root, as in Adam).
        floor: in [0, 1), the least added to √v̂ relative to the statistics' scale (0: Adam's
            absolute ε alone): see :class:`~sgrld.metrics.RMSpropMetric`.

    References:
        Kingma & Ba (2015), Algorithm 1; Li et al. (2016).
    """

    name = "adam"
    key = "exp_avg_sq"
    decay_option = "beta2"
    bias_correction = True  # not an option: v̂ = v/(1−β₂ᵗ), in float64 on every path
    beta2: float = 0.999
    eps: float = 1e-8
    floor: float = 0.1
