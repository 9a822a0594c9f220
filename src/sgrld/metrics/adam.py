"""Diagonal Adam-style metric: pSGLD's G with Adam's bias-corrected second moment."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from sgrld.core.contract import Metric, StatKind, Stats, check_range, register
from sgrld.core.layout import FlatLayout
from sgrld.metrics.rmsprop import (
    RMSpropMetric,
    init_second_moment,
    second_moment_sums_ahead,
    update_second_moment,
)


@register
@dataclass(frozen=True, kw_only=True)
class AdamMetric(Metric):
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
    compilable = True
    beta2: float = 0.999
    eps: float = 1e-8
    floor: float = 0.1

    def __post_init__(self) -> None:
        check_range("beta2", self.beta2, lambda v: 0.0 <= v < 1.0, "0 <= beta2 < 1")
        check_range("eps", self.eps, lambda v: v >= 0.0, "eps >= 0")
        check_range("floor", self.floor, lambda v: 0.0 <= v < 1.0, "0 <= floor < 1")

    def init(self, layout: FlatLayout, like: Tensor) -> Stats:
        return init_second_moment("exp_avg_sq", layout, like, self.eps)

    def stat_kinds(self, layout: FlatLayout) -> dict[str, StatKind]:
        return {"exp_avg_sq": "element", "inv_sqrt": "element"}

    def update(self, stats: Stats, layout: FlatLayout, grad: Tensor, step: int | Tensor) -> None:
        # v̂ = v/(1−β₂ᵗ), the correction in float64 on every path (eager, deferred, compiled)
        update_second_moment(
            stats["exp_avg_sq"], stats["inv_sqrt"], grad, step, self.beta2, self.eps,
            bias_correction=True, floor=self.floor, layout=layout,
        )  # fmt: skip

    def sums_ahead(
        self, stats: Stats, layout: FlatLayout, grad: Tensor, noise: Tensor | None, adapt: bool
    ) -> dict[str, Tensor]:
        """Sharded parameters: the floor's Σ v, summed ahead."""
        return second_moment_sums_ahead(stats["exp_avg_sq"], grad, self.beta2, self.floor, adapt)

    # G⁻¹ = r², G^{-1/2} = r from the shared buffer, as RMSprop's
    inverse = RMSpropMetric.inverse
    inverse_sqrt = RMSpropMetric.inverse_sqrt
