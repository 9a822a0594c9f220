"""Diagonal RMSprop metric: pSGLD (Li et al. 2016; paper §3.1)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from sgrld.core.contract import Metric, StatKind, Stats, check_range, register
from sgrld.core.layout import FlatLayout


class SecondMomentMetric(Metric):
    """A diagonal G = diag(√v + max(ε, floor·s)) from a second moment v of ĝ kept under
    :attr:`key`, with r = G^{-1/2} (G⁻¹ = r²: one buffer serves both); the subclass's dataclass
    fields hold ε, the floor, v's EMA weight (the option :attr:`decay_option`) and whether G uses
    v/(1 − decayᵗ) (an option, or fixed by the class).
    """

    compilable = True
    #: the statistic holding v, as checkpoints name it
    key: ClassVar[str]
    #: the option holding v's EMA weight
    decay_option: ClassVar[str]
    eps: float
    floor: float
    bias_correction: bool

    def __post_init__(self) -> None:
        name = self.decay_option
        check_range(name, self._decay, lambda v: 0.0 <= v < 1.0, f"0 <= {name} < 1")
        check_range("eps", self.eps, lambda v: v >= 0.0, "eps >= 0")
        check_range("floor", self.floor, lambda v: 0.0 <= v < 1.0, "0 <= floor < 1")

    @property
    def _decay(self) -> float:
        decay: float = getattr(self, self.decay_option)
        return decay

    def init(self, layout: FlatLayout, like: Tensor) -> Stats:
        """v from zeros, and r = G^{-1/2} = ε^{-1/2}."""
        v = layout.zeros(like.dtype, like.device)
        return {
            self.key: v,
            "inv_sqrt": torch.full_like(v, self.eps**-0.5 if self.eps else math.inf),
        }

    def stat_kinds(self, layout: FlatLayout) -> dict[str, StatKind]:
        return {self.key: "element", "inv_sqrt": "element"}

    def update(self, stats: Stats, layout: FlatLayout, grad: Tensor, step: int | Tensor) -> None:
        update_second_moment(
            stats[self.key], stats["inv_sqrt"], grad, step, self._decay, self.eps,
            bias_correction=self.bias_correction, floor=self.floor, layout=layout,
        )  # fmt: skip

    @property
    def restarts(self) -> bool:
        """A bias-corrected v restarts cleanly at a warm-up window's start (v̂ is the window's own
        mean from its first step); an uncorrected one would start at G ≈ ε, a 1/ε step."""
        return self.bias_correction

    def restart(self, stats: Stats, layout: FlatLayout, where: Tensor | None = None) -> None:
        v = stats[self.key]
        if where is None:
            v.zero_()
        else:  # 0-d or per chain, against v's (*batch, D)
            v.masked_fill_(where.reshape(*where.shape, *[1] * (v.dim() - where.dim())), 0.0)

    def sums_ahead(
        self, stats: Stats, layout: FlatLayout, grad: Tensor, noise: Tensor | None, adapt: bool
    ) -> dict[str, Tensor]:
        """Sharded parameters: this rank's Σ of the v that :meth:`update` is about to make, for the
        floor (nothing without a floor or when frozen)."""
        if not (self.floor and adapt):
            return {}
        decay = self._decay
        ahead = stats[self.key].mul(decay).addcmul_(grad, grad, value=1.0 - decay)
        return {"scale": ahead.sum(dim=-1, keepdim=True)}

    def inverse(self, stats: Stats, layout: FlatLayout, grad: Tensor) -> Tensor:
        r = stats["inv_sqrt"]
        return grad.mul_(r).mul_(r)

    def inverse_sqrt(self, stats: Stats, layout: FlatLayout, noise: Tensor) -> Tensor:
        return noise.mul_(stats["inv_sqrt"])


@register
@dataclass(frozen=True, kw_only=True)
class RMSpropMetric(SecondMomentMetric):
    """G = diag(√V + max(ε, floor·s)), V ← decay·V + (1−decay)·g² (V from zeros, current g
    included), s = √mean(V) over the group (per chain).

    As in the reference there is no bias correction (at step 1 G⁻¹ = 1/(√(1−decay)|g| + ε));
    ``bias_correction=True`` divides V by 1 − decayᵗ. The relative ``floor`` keeps a coordinate
    whose gradient is zero (a dead ReLU, an absent embedding row) from getting G = ε and 10⁴ × the
    noise: no G is below ``floor`` times the group's scale s; G = I while s = 0. It changes how fast
    such coordinates mix, not what a frozen G samples (``docs/health.md``); ``floor=0`` is the
    paper's metric.

    Args:
        decay: EMA weight λ in [0, 1).
        eps: ε ≥ 0 added to √V (outside the square root, as in the paper).
        bias_correction: divide V by 1 − decayᵗ when forming G.
        floor: in [0, 1), the least added to √V relative to the statistics' scale s.

    References:
        Li et al. (2016), pSGLD; Yu et al. (2023) §3.1.
    """

    name = "rmsprop"
    aliases = ("psgld", "rmspropsgld")
    key = "square_avg"
    decay_option = "decay"
    decay: float = 0.99
    eps: float = 1e-8
    bias_correction: bool = False
    floor: float = 0.1


def update_second_moment(
    v: Tensor,
    r: Tensor,
    grad: Tensor,
    step: int | Tensor,
    decay: float,
    eps: float,
    *,
    bias_correction: bool,
    floor: float = 0.0,
    layout: FlatLayout | None = None,
) -> None:
    """v ← decay·v + (1−decay)·g², then r = (√v + max(ε, floor·s))^{-1/2}, s = √mean(v) over the
    group (per chain, over every rank's shard), or with v/(1−decayᵗ); r = 1 while s = 0.

    Multiplying by r twice is cheaper than dividing by √v + ε. Eagerly pow(x, −½) is CPU's
    vectorised rsqrt (2× torch.rsqrt); under torch.compile rsqrt is the fast one.
    """
    v.mul_(decay).addcmul_(grad, grad, value=1.0 - decay)
    correction = None
    if bias_correction:  # 1 − λᵗ in float64 for an int and a 0-d int64 tensor step alike
        correction = 1.0 - decay ** (step if isinstance(step, int) else step.double())
        torch.div(v, correction, out=r)
        r.sqrt_()
    else:
        torch.sqrt(v, out=r)
    if floor and layout is not None:  # one more pass over D: the group's mean of v
        total = layout.sum_(v.sum(dim=-1, keepdim=True), "scale")  # summed ahead if sharded
        if correction is not None:
            total = total / correction
        scale = (total / sum(layout.full_numels)).sqrt_()
        # r ← r + max(ε, floor·s), or 1 (G = I) while s = 0, as seen·r + add in one pass
        # over D (r·1 and r·0 are exact)
        seen = scale != 0.0
        add = torch.where(seen, torch.clamp(scale * floor, min=eps), 1.0)
        torch.addcmul(add, r, seen.to(r.dtype), out=r)
    else:
        r.add_(eps)
    if torch.compiler.is_compiling():
        r.rsqrt_()
    else:
        r.pow_(-0.5)
