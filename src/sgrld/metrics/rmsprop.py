"""Diagonal RMSprop metric: pSGLD (Li et al. 2016; paper §3.1)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from sgrld.core.contract import Metric, StatKind, Stats, check_range, register
from sgrld.core.layout import FlatLayout


@register
@dataclass(frozen=True, kw_only=True)
class RMSpropMetric(Metric):
    """G = diag(√V + ε), V ← decay·V + (1−decay)·g² (V from zeros, current g included).

    As in the reference there is no bias correction, so at step 1 G⁻¹ = 1/(√(1−decay)|g| + ε),
    i.e. 10/|g| for decay 0.99. ``bias_correction=True`` divides V by
    1 − decay^t instead, which removes those huge first steps.

    Args:
        decay: EMA weight λ in [0, 1).
        eps: ε ≥ 0 added to √V (outside the square root, as in the paper).
        bias_correction: divide V by 1 − decayᵗ when forming G.
    """

    name = "rmsprop"
    aliases = ("psgld", "rmspropsgld")
    compilable = True
    decay: float = 0.99
    eps: float = 1e-8
    bias_correction: bool = False

    def __post_init__(self) -> None:
        check_range("decay", self.decay, lambda v: 0.0 <= v < 1.0, "0 <= decay < 1")
        check_range("eps", self.eps, lambda v: v >= 0.0, "eps >= 0")

    def init(self, layout: FlatLayout, like: Tensor) -> Stats:
        return init_second_moment("square_avg", layout, like, self.eps)

    def stat_kinds(self, stats: Stats) -> dict[str, StatKind]:
        return {"square_avg": "element", "inv_sqrt": "element"}

    def update(self, stats: Stats, layout: FlatLayout, grad: Tensor, step: int | Tensor) -> None:
        update_second_moment(
            stats["square_avg"], stats["inv_sqrt"], grad, step, self.decay, self.eps,
            bias_correction=self.bias_correction,
        )  # fmt: skip

    def inverse(self, stats: Stats, layout: FlatLayout, grad: Tensor) -> Tensor:
        r = stats["inv_sqrt"]
        return grad.mul_(r).mul_(r)

    def inverse_sqrt(self, stats: Stats, layout: FlatLayout, noise: Tensor) -> Tensor:
        return noise.mul_(stats["inv_sqrt"])


def init_second_moment(key: str, layout: FlatLayout, like: Tensor, eps: float) -> Stats:
    """The second moment ``key`` from zeros and r = G^{-1/2}, diagonal (G⁻¹ = r², so one
    buffer serves both), shared by the RMSprop and Adam metrics."""
    v = layout.zeros(like.dtype, like.device)
    return {key: v, "inv_sqrt": torch.full_like(v, eps**-0.5 if eps else math.inf)}


def update_second_moment(
    v: Tensor,
    r: Tensor,
    grad: Tensor,
    step: int | Tensor,
    decay: float,
    eps: float,
    *,
    bias_correction: bool,
) -> None:
    """v ← decay·v + (1−decay)·g², then r = (√v + ε)^{-1/2}, or with v/(1−decayᵗ).

    r lives in a preallocated buffer, 3 passes over D (4 with bias correction); multiplying by r
    twice is cheaper than dividing by √v + ε. Eagerly pow(x, −½) is the vectorised rsqrt kernel
    on CPU (2× faster than torch.rsqrt); under torch.compile (the funnel's fast path) inductor
    turns pow into a slow generic pow, rsqrt into rsqrt.
    """
    v.mul_(decay).addcmul_(grad, grad, value=1.0 - decay)
    if bias_correction:  # 1 − λᵗ in float64 for an int and a 0-d int64 tensor step alike
        t = step if isinstance(step, int) else step.double()
        torch.div(v, 1.0 - decay**t, out=r)
        r.sqrt_()
    else:
        torch.sqrt(v, out=r)
    r.add_(eps)
    if torch.compiler.is_compiling():
        r.rsqrt_()
    else:
        r.pow_(-0.5)
