"""Diagonal Adam-style metric: pSGLD's G with Adam's bias-corrected second moment."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from sgrld.core.contract import Metric, StatKind, Stats, check_range, register
from sgrld.core.layout import FlatLayout


@register
@dataclass(frozen=True, kw_only=True)
class AdamMetric(Metric):
    """G = diag(√v̂ + ε), v ← β₂·v + (1−β₂)·g², v̂ = v/(1−β₂ᵗ) (v from zeros, current g included).

    The second moment is Adam's (Kingma & Ba 2015, Algorithm 1), with no first moment: the drift
    stays −ℓ G⁻¹ĝ. Without the bias correction (pSGLD, :class:`~sgrld.metrics.RMSpropMetric`)
    v starts near zero, so G⁻¹ = 1/(√(1−β₂)|g| + ε) is huge in the first steps (31.6/|g| at
    β₂ = 0.999) and shrinks as v fills; v̂ is an unbiased average from step 1 (G = |g| + ε then),
    so a slow β₂ such as Adam's 0.999 is usable from the start. As for pSGLD, G follows ĝ and
    the step drops Γ(θ) (paper eq. 4; Li et al. 2016, Algorithm 1): exact only once G is frozen
    after the warm-up (``docs/posterior.md``). The same chain as
    ``RMSpropMetric(decay=beta2, eps=eps, bias_correction=True)``, under its own name and Adam's
    defaults.

    Args:
        beta2: EMA weight β₂ in [0, 1) of the squared gradients.
        eps: ε ≥ 0 added to √v̂ (outside the square root, as in Adam).
    """

    name = "adam"
    compilable = True
    beta2: float = 0.999
    eps: float = 1e-8

    def __post_init__(self) -> None:
        check_range("beta2", self.beta2, lambda v: 0.0 <= v < 1.0, "0 <= beta2 < 1")
        check_range("eps", self.eps, lambda v: v >= 0.0, "eps >= 0")

    def init(self, layout: FlatLayout, like: Tensor) -> Stats:
        v = layout.zeros(like.dtype, like.device)
        # r = (√v̂ + ε)^{-1/2} = G^{-1/2} (diagonal); G⁻¹ = r², so one buffer serves both.
        return {
            "exp_avg_sq": v,
            "inv_sqrt": torch.full_like(v, self.eps**-0.5 if self.eps else math.inf),
        }

    def stat_kinds(self, stats: Stats) -> dict[str, StatKind]:
        return {"exp_avg_sq": "element", "inv_sqrt": "element"}

    def update(self, stats: Stats, layout: FlatLayout, grad: Tensor, step: int | Tensor) -> None:
        v, r = stats["exp_avg_sq"], stats["inv_sqrt"]
        v.mul_(self.beta2).addcmul_(grad, grad, value=1.0 - self.beta2)
        # v̂ = v/(1−β₂ᵗ), the correction in float64 whether ``step`` is an int (eager) or a 0-d
        # int64 tensor (deferred checks, compiled, captured): the same chain on every path
        t = step if isinstance(step, int) else step.double()
        torch.div(v, 1.0 - self.beta2**t, out=r)
        r.sqrt_().add_(self.eps)
        # rsqrt under torch.compile, pow(x, −½) eagerly: see RMSpropMetric.update
        if torch.compiler.is_compiling():
            r.rsqrt_()
        else:
            r.pow_(-0.5)

    def inverse(self, stats: Stats, layout: FlatLayout, grad: Tensor) -> Tensor:
        r = stats["inv_sqrt"]
        return grad.mul_(r).mul_(r)

    def inverse_sqrt(self, stats: Stats, layout: FlatLayout, noise: Tensor) -> Tensor:
        return noise.mul_(stats["inv_sqrt"])
