"""Layer-wise scalar metric of Wenzel et al. (2020) as adapted in the reference."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from sgrld.core.contract import Metric, StatKind, Stats, check_range, register
from sgrld.core.layout import FlatLayout


@register
@dataclass(frozen=True, kw_only=True)
class WenzelMetric(Metric):
    """G⁻¹ = M_p·I per parameter tensor p, changed only by :meth:`refresh`.

    V (from ones) follows V ← decay·V + (1−decay)·g², kept as its per-tensor mean (the refresh
    reads only mean(V_p), which is linear: no parameter-sized buffer). A refresh (each epoch end)
    sets s_p = mean(V_p) + ε and M_p = (s_p / min_q s_q)^(−1/2); M = 1 until the first refresh,
    so Wenzel is SGLD for the first epoch, as in the reference. The reference folds g into V after
    the move; since M only changes at a refresh, folding before is the same chain.
    ``min_scale`` > 0 floors every M_p (damping); any M_p > 0 keeps the stationary law.

    Args:
        decay: EMA weight in [0, 1).
        eps: ε ≥ 0 added to mean(V) (inside the square root).
        min_scale: floor on M_p in [0, 1] (0, the reference's: none; 1 makes Wenzel SGLD).

    References:
        Wenzel et al. (2020), How good is the Bayes posterior in deep neural networks really?
    """

    name = "wenzel"
    refresh_per_epoch = True
    aliases = ("wenzelsgld",)
    compilable = True
    decay: float = 0.99
    eps: float = 1e-8
    min_scale: float = 0.0

    def __post_init__(self) -> None:
        check_range("decay", self.decay, lambda v: 0.0 <= v < 1.0, "0 <= decay < 1")
        check_range("eps", self.eps, lambda v: v >= 0.0, "eps >= 0")
        check_range("min_scale", self.min_scale, lambda v: 0.0 <= v <= 1.0, "0 <= min_scale <= 1")

    def init(self, layout: FlatLayout, like: Tensor) -> Stats:
        ntensors = len(layout.shapes)
        ones = torch.ones((*layout.batch_shape, ntensors), dtype=like.dtype, device=like.device)
        return {
            "mean_square_avg": ones,  # v_p = mean over tensor p of the EMA of g² (from ones)
            "scale": ones.clone(),  # M_p = G⁻¹ per tensor
            "scale_sqrt": ones.clone(),  # √M_p = G^{-1/2} per tensor
        }

    def stat_kinds(self, layout: FlatLayout) -> dict[str, StatKind]:
        return {"mean_square_avg": "tensor", "scale": "tensor", "scale_sqrt": "tensor"}

    def update(self, stats: Stats, layout: FlatLayout, grad: Tensor, step: int | Tensor) -> None:
        # mean(g_p²) per tensor; dividing by Python ints needs no host-to-device copy
        if layout.shards is None:
            means = [
                torch.linalg.vecdot(g, g) / n
                for g, n in zip(layout.segments(grad), layout.numels, strict=True)
            ]
            stats["mean_square_avg"].lerp_(torch.stack(means, dim=-1), 1.0 - self.decay)
            return
        # sharded: every rank's Σg² per tensor summed over the ranks, over the whole tensor's n
        sums = layout.sum_(self._square_sums(layout, grad), "gg")
        numels = torch.tensor(layout.full_numels, dtype=sums.dtype, device=sums.device)
        stats["mean_square_avg"].lerp_(sums / numels, 1.0 - self.decay)

    @staticmethod
    def _square_sums(layout: FlatLayout, grad: Tensor) -> Tensor:
        return torch.stack([torch.linalg.vecdot(g, g) for g in layout.segments(grad)], dim=-1)

    def sums_ahead(
        self, stats: Stats, layout: FlatLayout, grad: Tensor, noise: Tensor | None, adapt: bool
    ) -> dict[str, Tensor]:
        """Sharded parameters: this rank's Σg² per tensor, summed ahead."""
        return {"gg": self._square_sums(layout, grad)} if adapt else {}

    def refresh(self, stats: Stats, layout: FlatLayout) -> None:
        s = stats["mean_square_avg"] + self.eps
        s_min = s.amin(dim=-1, keepdim=True)
        stats["scale"].copy_(torch.rsqrt(s / s_min))
        if self.min_scale > 0:
            stats["scale"].clamp_(min=self.min_scale)
        stats["scale_sqrt"].copy_(stats["scale"].sqrt())

    @staticmethod
    def _scale(layout: FlatLayout, x: Tensor, scale: Tensor) -> Tensor:
        segs = layout.segments(x)
        if torch.compiler.is_compiling():  # inductor fuses this form into one loop
            return torch.cat([seg * scale[..., i : i + 1] for i, seg in enumerate(segs)], dim=-1)
        torch._foreach_mul_(segs, [scale[..., i : i + 1] for i in range(len(segs))])
        return x

    def inverse(self, stats: Stats, layout: FlatLayout, grad: Tensor) -> Tensor:
        return self._scale(layout, grad, stats["scale"])

    def inverse_sqrt(self, stats: Stats, layout: FlatLayout, noise: Tensor) -> Tensor:
        return self._scale(layout, noise, stats["scale_sqrt"])
