"""Monge metric G = I + α² m mᵀ with m an EMA of gradients (paper §4.1)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import Tensor

from sgrld.core.contract import Metric, StatKind, Stats, check_choice, check_range, register
from sgrld.core.layout import FlatLayout


def _dots(xs: list[Tensor], ys: list[Tensor]) -> Tensor:
    """⟨x_i, y_i⟩ per segment pair, shape ``(*batch, S)`` (BLAS dots: 10× a matmul on CPU)."""
    return torch.stack([torch.linalg.vecdot(x, y) for x, y in zip(xs, ys, strict=True)], -1)


@register
@dataclass(frozen=True, kw_only=True)
class MongeMetric(Metric):
    """Rank-one metric G = I + α² m mᵀ, applied in O(D) without forming G.

    m ← decay·m + (1−decay)·g (from zeros, current g included). With s = ‖m‖² (paper eq. 11–12):

        G⁻¹v = v + f₋₁ ⟨m, v⟩ m,        f₋₁ = −α² / (1 + α²s)
        G^{-1/2}v = v + f₋½ ⟨m, v⟩ m,   f₋½ = −α² / (√(1+α²s) · (1 + √(1+α²s)))

    (f₋½ the cancellation-free form, −α²/2 as ‖m‖ → 0). α² = 0 is exactly SGLD.

    By default (``alpha2_rule="normalized"``) α²_t = c/s_t with c = ``alpha2``: G's eigenvalue
    along m is always 1 + c (2 at the default c = 1), whatever the gradients' scale, so the same
    options behave alike on a summed or an averaged loss and in any units of the data; where s
    underflows (m = 0) α²_t = 0 and G = I. The paper's rule ``alpha2_rule="fixed"`` uses α² as
    given: G's stretch α²‖m‖² then grows with the square of the gradients (α² = 1 with
    ‖ĝ‖ ≈ 600 shrinks every move along m 360,000-fold). The paper's configurations give it
    explicitly, and a state dict without the rule loads as ``"fixed"`` (``docs/posterior.md``).

    Args:
        alpha2: c > 0 (``"normalized"``), or α² ≥ 0 (``"fixed"``).
        alpha2_rule: ``"normalized"`` (α²_t = c/‖m_t‖², the default) or ``"fixed"`` (the
            paper's).
        decay: EMA weight λ in [0, 1).
        scope: ``"global"`` (the paper's metric: inner products over all parameters of the
            group) or ``"tensor"`` (one rank-one metric per parameter tensor).
        fallback_threshold: if set, a step whose drift ‖G⁻¹g‖ exceeds it uses G = c·I with
            c = ‖g‖/threshold instead (the funnel code's explosion fallback).

    References:
        Yu et al. (2023) §4.1; Hartmann et al. (2022).
    """

    name = "monge"
    aliases = ("mongesgld",)
    tuned = ("alpha2",)
    identity_at: ClassVar[Mapping[str, float]] = {
        "alpha2": 0.0
    }  # G = I + 0·m mᵀ: the paper's "α² = 0 is SGLD"
    symbols: ClassVar[Mapping[str, str]] = {"alpha2": "α²"}
    # Not compilable (the default): compiled, its three fused reductions ran at 1.1 ms per step
    # inside a training loop (MLP 784-400-400-10, 2 threads) against 0.33 ms eager (BLAS dots).
    alpha2: float = 1.0
    alpha2_rule: Literal["fixed", "normalized"] = "normalized"
    decay: float = 0.9
    scope: Literal["global", "tensor"] = "global"
    fallback_threshold: float | None = None

    def __post_init__(self) -> None:
        check_choice("alpha2_rule", self.alpha2_rule, ("fixed", "normalized"))
        if self.alpha2_rule == "normalized":
            check_range("alpha2", self.alpha2, lambda v: 0.0 < v < math.inf, "c = alpha2 > 0")
        else:
            check_range("alpha2", self.alpha2, lambda v: v >= 0.0, "alpha2 >= 0")
        check_range("decay", self.decay, lambda v: 0.0 <= v < 1.0, "0 <= decay < 1")
        check_choice("scope", self.scope, ("global", "tensor"))
        if self.fallback_threshold is not None:
            check_range("fallback_threshold", self.fallback_threshold, lambda v: v > 0, "> 0")

    def init(self, layout: FlatLayout, like: Tensor) -> Stats:
        nseg = 1 if self.scope == "global" else len(layout.shapes)
        scalars = torch.zeros((*layout.batch_shape, nseg), dtype=like.dtype, device=like.device)
        return {
            "exp_avg": layout.zeros(like.dtype, like.device),
            "sq_norm": scalars,  # s = ‖m‖² per scope segment, refreshed by update()
            "fallback": scalars.clone(),  # 1/c where the fallback fired this step, else 0
        }

    def stat_kinds(self, layout: FlatLayout) -> dict[str, StatKind]:
        seg: StatKind = "global" if self.scope == "global" else "tensor"
        return {"exp_avg": "element", "sq_norm": seg, "fallback": seg}

    def diagnostics(self, stats: Stats, layout: FlatLayout) -> dict[str, Tensor]:
        """``stretch``: α²‖m‖², G's eigenvalue along m minus 1 (per chain)."""
        s = stats["sq_norm"]
        if self.alpha2_rule == "normalized":
            tiny = torch.finfo(s.dtype).tiny
            stretch = torch.where(s > tiny, torch.full_like(s, self.alpha2), torch.zeros_like(s))
        else:
            stretch = self.alpha2 * s
        return {"stretch": stretch.amax(-1)}  # per chain

    def _segments(self, layout: FlatLayout, x: Tensor) -> list[Tensor]:
        return [x] if self.scope == "global" else layout.segments(x)

    @staticmethod
    def _axpy(ys: list[Tensor], xs: list[Tensor], coef: Tensor) -> None:
        """y_i += coef[..., i] · x_i, with coef on device (no host sync)."""
        for i, (y, x) in enumerate(zip(ys, xs, strict=True)):
            y.addcmul_(x, coef[..., i : i + 1])

    def coefficients(self, sq_norm: Tensor) -> tuple[Tensor, Tensor]:
        """(f₋₁, f₋½) for s = ``sq_norm``: G⁻¹ = I + f₋₁ m mᵀ, G^{-1/2} = I + f₋½ m mᵀ."""
        return self._inverse_coefficient(sq_norm), self._inverse_sqrt_coefficient(sq_norm)

    # each step needs one of the two in inverse and the other in inverse_sqrt: computed apart,
    # a step runs half the small kernels (the same expressions, so the same numbers)
    def _inverse_coefficient(self, sq_norm: Tensor) -> Tensor:
        a2 = self.alpha2
        if self.alpha2_rule == "fixed":
            return -a2 / (1.0 + a2 * sq_norm)
        return self._inverse_norm(sq_norm) * (-a2 / (1.0 + a2))

    def _inverse_sqrt_coefficient(self, sq_norm: Tensor) -> Tensor:
        a2 = self.alpha2
        if self.alpha2_rule == "fixed":
            root = torch.sqrt(1.0 + a2 * sq_norm)
            return -a2 / (root * (1.0 + root))
        c_root = math.sqrt(1.0 + a2)
        return self._inverse_norm(sq_norm) * (-a2 / (c_root * (1.0 + c_root)))

    @staticmethod
    def _inverse_norm(sq_norm: Tensor) -> Tensor:
        """1/s, and 0 where s is below the smallest normal number (the normalized rule's guard)."""
        tiny = torch.finfo(sq_norm.dtype).tiny
        return torch.where(sq_norm >= tiny, sq_norm.clamp(min=tiny).reciprocal(), 0.0)

    def coefficient_slope(self, sq_norm: Tensor) -> Tensor:
        """dβ/ds with β = −f₋₁: −β² (fixed), −β/s (normalized, 0 where guarded), for
        :mod:`sgrld.metrics.monge_exact`.
        """
        beta = -self._inverse_coefficient(sq_norm)
        if self.alpha2_rule == "fixed":
            return -beta * beta
        tiny = torch.finfo(sq_norm.dtype).tiny
        return torch.where(sq_norm >= tiny, -beta / sq_norm.clamp(min=tiny), 0.0)

    @staticmethod
    def _with_norm(ms: list[Tensor], gs: list[Tensor]) -> Tensor:
        return torch.cat([_dots(ms, gs), _dots(gs, gs)], -1)

    def sums_ahead(
        self, stats: Stats, layout: FlatLayout, grad: Tensor, noise: Tensor | None, adapt: bool
    ) -> dict[str, Tensor]:
        """Sharded parameters: this rank's ‖m‖², ⟨m, g⟩ (‖g‖²) and ⟨m, ξ⟩ of the m :meth:`update` is
        about to make, summed ahead by the engine.
        """
        m = stats["exp_avg"]
        if adapt:
            m = torch.lerp(m, grad, 1.0 - self.decay)  # update's m, not stored yet
        ms, gs = self._segments(layout, m), self._segments(layout, grad)
        out = {"mm": _dots(ms, ms)} if adapt else {}
        out["mg"] = _dots(ms, gs) if self.fallback_threshold is None else self._with_norm(ms, gs)
        if noise is not None:
            out["mx"] = _dots(ms, self._segments(layout, noise))
        return out

    def update(self, stats: Stats, layout: FlatLayout, grad: Tensor, step: int | Tensor) -> None:
        m = stats["exp_avg"]
        m.lerp_(grad, 1.0 - self.decay)  # λm + (1−λ)g in one pass
        ms = self._segments(layout, m)
        stats["sq_norm"].copy_(layout.sum_(_dots(ms, ms), "mm"))  # over the shards, if any

    def inverse(self, stats: Stats, layout: FlatLayout, grad: Tensor) -> Tensor:
        s = stats["sq_norm"]
        ms, gs = self._segments(layout, stats["exp_avg"]), self._segments(layout, grad)
        if self.fallback_threshold is None:
            a = layout.sum_(_dots(ms, gs), "mg")
        else:  # ⟨m, g⟩ and ‖g‖² summed over the shards together
            a, gg = layout.sum_(self._with_norm(ms, gs), "mg").chunk(2, -1)
        coef = a * self._inverse_coefficient(s)  # f₋₁ ⟨m, g⟩
        if self.fallback_threshold is not None:
            # ‖G⁻¹g‖² = ‖g + c m‖² = ‖g‖² + c(2a + c s), c = f₋₁a: no extra pass over D.
            drift_sq = gg + coef * (2.0 * a + coef * s)
            thr = self.fallback_threshold
            fire = drift_sq > thr * thr
            inv_c = torch.where(fire, thr * torch.rsqrt(gg), torch.zeros_like(gg))
            stats["fallback"].copy_(inv_c)
            for i, g in enumerate(gs):
                g.mul_(torch.where(fire[..., i : i + 1], inv_c[..., i : i + 1], 1.0))
            coef = torch.where(fire, torch.zeros_like(coef), coef)
        self._axpy(gs, ms, coef)
        return grad

    def inverse_sqrt(self, stats: Stats, layout: FlatLayout, noise: Tensor) -> Tensor:
        s = stats["sq_norm"]
        ms, xs = self._segments(layout, stats["exp_avg"]), self._segments(layout, noise)
        coef = layout.sum_(_dots(ms, xs), "mx") * self._inverse_sqrt_coefficient(s)  # f₋½⟨m, ξ⟩
        if self.fallback_threshold is not None:
            inv_c = stats["fallback"]
            fire = inv_c > 0
            for i, x in enumerate(xs):
                x.mul_(torch.where(fire[..., i : i + 1], inv_c[..., i : i + 1].sqrt(), 1.0))
            coef = torch.where(fire, torch.zeros_like(coef), coef)
        self._axpy(xs, ms, coef)
        return noise
