"""Identity metric G = I: plain SGLD (Welling & Teh 2011)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from sgrld.core.contract import Metric, Stats, register
from sgrld.core.layout import FlatLayout


@register
@dataclass(frozen=True, kw_only=True)
class IdentityMetric(Metric):
    """G = I. No statistics; G⁻¹g = g and G^{-1/2}ξ = ξ without copies."""

    name = "identity"
    aliases = ("sgld",)
    compilable = True
    preconditions = False

    def init(self, layout: FlatLayout, like: Tensor) -> Stats:
        return {}

    def update(self, stats: Stats, layout: FlatLayout, grad: Tensor, step: int | Tensor) -> None:
        return None

    def inverse(self, stats: Stats, layout: FlatLayout, grad: Tensor) -> Tensor:
        return grad

    def inverse_sqrt(self, stats: Stats, layout: FlatLayout, noise: Tensor) -> Tensor:
        return noise
