"""Identity metric G = I: plain SGLD (Welling & Teh 2011)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from sgrld.core.layout import FlatLayout
from sgrld.metrics.base import Metric, Stats, register


@register
@dataclass(frozen=True, kw_only=True)
class IdentityMetric(Metric):
    """G = I. No statistics; G⁻¹g = g and G^{-1/2}ξ = ξ without copies."""

    name = "identity"
    compilable = True

    def init(self, layout: FlatLayout, like: Tensor) -> Stats:
        return {}

    def update(self, stats: Stats, layout: FlatLayout, grad: Tensor, step: int | Tensor) -> None:
        return None

    def inverse(self, stats: Stats, layout: FlatLayout, grad: Tensor) -> Tensor:
        return grad

    def inverse_sqrt(self, stats: Stats, layout: FlatLayout, noise: Tensor) -> Tensor:
        return noise
