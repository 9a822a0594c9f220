"""Diagonal RMSprop metric: pSGLD (Li et al. 2016; paper §3.1, reference §2.3)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from sgrld.core.layout import FlatLayout
from sgrld.metrics.base import Metric, StatKind, Stats, check_range, register


@register
@dataclass(frozen=True, kw_only=True)
class RMSpropMetric(Metric):
    """G = diag(√V + ε), V ← decay·V + (1−decay)·g² (V from zeros, current g included).

    As in the reference there is no bias correction, so at step 1 G⁻¹ = 1/(√(1−decay)|g| + ε),
    i.e. 10/|g| for decay 0.99 (reference §2.3, §10.5). ``bias_correction=True`` divides V by
    1 − decay^t instead, which removes those huge first steps.

    Args:
        decay: EMA weight λ in [0, 1).
        eps: ε ≥ 0 added to √V (outside the square root, as in the paper).
        bias_correction: divide V by 1 − decayᵗ when forming G.
    """

    name = "rmsprop"
    decay: float = 0.99
    eps: float = 1e-8
    bias_correction: bool = False

    def __post_init__(self) -> None:
        check_range("decay", self.decay, lambda v: 0.0 <= v < 1.0, "0 <= decay < 1")
        check_range("eps", self.eps, lambda v: v >= 0.0, "eps >= 0")

    def init(self, layout: FlatLayout, like: Tensor) -> Stats:
        v = layout.zeros(like.dtype, like.device)
        # denom = √V + ε = G (diagonal); G^{-1/2} is formed at each step in ``inv_sqrt``.
        return {
            "square_avg": v,
            "denom": torch.full_like(v, self.eps),
            "inv_sqrt": torch.empty_like(v),
        }

    def stat_kinds(self, stats: Stats) -> dict[str, StatKind]:
        return {"square_avg": "element", "denom": "element", "inv_sqrt": "element"}

    def update(self, stats: Stats, layout: FlatLayout, grad: Tensor, step: int) -> None:
        v, denom = stats["square_avg"], stats["denom"]
        v.mul_(self.decay).addcmul_(grad, grad, value=1.0 - self.decay)
        # G = √V + ε (or √(V/(1−λᵗ)) + ε), kept in a preallocated buffer: 2 passes over D.
        if self.bias_correction:
            torch.div(v, 1.0 - self.decay**step, out=denom)
            denom.sqrt_()
        else:
            torch.sqrt(v, out=denom)
        denom.add_(self.eps)

    def inverse(self, stats: Stats, layout: FlatLayout, grad: Tensor) -> Tensor:
        return grad.div_(stats["denom"])

    def inverse_sqrt(self, stats: Stats, layout: FlatLayout, noise: Tensor) -> Tensor:
        # pow(x, −½) is the vectorised rsqrt kernel on CPU (2× faster than torch.rsqrt here)
        return noise.mul_(torch.pow(stats["denom"], -0.5, out=stats["inv_sqrt"]))
