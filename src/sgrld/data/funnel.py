"""The paper's 2-D funnel target: log density, gradient, Hessian, exact draws.

    log p(θ) = log N(θ₁ | μ, sp(v)) + log N(v | 0, σ²),    μ = 2, σ² = 80, sp(x) = log(1 + eˣ)

**softplus(v) is the variance of θ₁**, not its standard deviation; the v-marginal is exactly
N(0, σ²). Functions take ``(..., 2)`` tensors and are branch-free (``torch.compile``-able); the
gradient is the reference's ``funnel.dlogp``: clipped by norm at 1e11, NaNs set to 1 otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["FunnelTarget"]

_LOG_2PI = math.log(2.0 * math.pi)


def _softplus(x: Tensor) -> Tensor:
    """log(1 + eˣ) in the reference's stable form log1p(e^{−|x|}) + max(x, 0) (no threshold)."""
    return torch.log1p(torch.exp(-x.abs())) + x.clamp(min=0.0)


@dataclass(frozen=True, kw_only=True)
class FunnelTarget:
    """The paper's funnel (defaults: the paper's constants).

    Args:
        mean: μ, the mean of θ₁ (2).
        v_variance: σ², the variance of the funnel coordinate v (80).
        clip_norm: gradients (and Hessian–vector products) longer than this are rescaled to it
            (1e11, the reference's ``clip_derivative`` threshold ``10e10``).

    """

    mean: float = 2.0
    v_variance: float = 80.0
    clip_norm: float = 1e11

    def __post_init__(self) -> None:
        if not (math.isfinite(self.mean) and self.v_variance > 0 and self.clip_norm > 0):
            raise ValueError(
                f"invalid funnel: mean={self.mean!r}, v_variance={self.v_variance!r}, "
                f"clip_norm={self.clip_norm!r} (need a finite mean and positive v_variance, "
                "clip_norm)"
            )

    @property
    def v_std(self) -> float:
        """σ, the standard deviation of the exact v-marginal N(0, σ²)."""
        return math.sqrt(self.v_variance)

    # ------------------------------------------------------------------ density and derivatives

    def log_prob(self, x: Tensor) -> Tensor:
        """log p(θ) for ``x`` of shape ``(..., 2)``; returns shape ``(...)``."""
        t1, v = x[..., 0], x[..., 1]
        var = _softplus(v)
        d = t1 - self.mean
        return (
            -0.5 * (_LOG_2PI + torch.log(var))
            - 0.5 * d * d / var
            - 0.5 * (_LOG_2PI + math.log(self.v_variance) + v * v / self.v_variance)
        )

    def grad_log_prob(self, x: Tensor) -> Tensor:
        """∇log p(θ), clipped by norm at ``clip_norm`` (``funnel.dlogp``).

        ∂/∂θ₁ = −(θ₁−μ)/sp(v),
        ∂/∂v = −½ sig(v)/sp(v) + ½ (θ₁−μ)² sig(v)/sp(v)² − v/σ²,
        with sig the logistic function. If the norm is finite and exceeds ``clip_norm`` the
        vector is rescaled to that norm; otherwise NaN entries are replaced by 1 (as the
        reference does).
        """
        t1, v = x[..., 0:1], x[..., 1:2]
        var = _softplus(v)
        sig = torch.sigmoid(v)
        d = t1 - self.mean
        g_t1 = -d / var
        g_v = -0.5 * sig / var + 0.5 * d * d * sig / (var * var) - v / self.v_variance
        # elementwise only (no cat, no reduction): a compiled sampler block fuses it
        norm = torch.sqrt(g_t1 * g_t1 + g_v * g_v)
        clip = torch.isfinite(norm) & (norm > self.clip_norm)
        first = torch.arange(2, device=x.device) == 0
        g = torch.where(first, g_t1, g_v)
        return torch.where(clip, g * (self.clip_norm / norm), torch.where(torch.isnan(g), 1.0, g))

    def hvp_log_prob(self, x: Tensor, w: Tensor) -> Tensor:
        """∇²log p(θ) · w, clipped by norm like the gradient (reference ``funnel.hvp_logp``).

        With s = sp(v), s' = sig(v), s'' = s'(1 − s'), d = θ₁ − μ:
        H₁₁ = −1/s, H₁₂ = d s'/s², H₂₂ = −½(s''/s − s'²/s²) + ½ d² (s''/s² − 2s'²/s³) − 1/σ².
        """
        t1, v = x[..., 0:1], x[..., 1:2]
        s = _softplus(v)
        s1 = torch.sigmoid(v)
        s2 = s1 - s1 * s1
        d = t1 - self.mean
        h11 = -1.0 / s
        h12 = d * s1 / (s * s)
        h22 = (
            -0.5 * (s2 / s - s1 * s1 / (s * s))
            + 0.5 * d * d * (s2 / (s * s) - 2.0 * s1 * s1 / (s * s * s))
            - 1.0 / self.v_variance
        )
        w1, w2 = w[..., 0:1], w[..., 1:2]
        return self._clip(torch.cat([h11 * w1 + h12 * w2, h12 * w1 + h22 * w2], dim=-1))

    def _clip(self, g: Tensor) -> Tensor:
        norm = torch.linalg.vector_norm(g, dim=-1, keepdim=True)
        clip = torch.isfinite(norm) & (norm > self.clip_norm)
        unclipped = torch.where(torch.isnan(g), torch.ones_like(g), g)
        return torch.where(clip, g * (self.clip_norm / norm), unclipped)

    def potential_grad(self, x: Tensor, noise: Tensor, noise_std: float = 1.0) -> Tensor:
        """The sampler's input ĝ = −(∇log p(θ) + noise_std·noise).

        The reference's clipped gradient plus N(0, 1) noise (``noise``, shaped like ``x``), its
        sign flipped: sgrld descends a potential (``docs/conventions.md``).
        """
        return -(self.grad_log_prob(x) + noise_std * noise)

    # ------------------------------------------------------------------ ground truth

    def sample(
        self,
        num: int,
        *,
        generator: torch.Generator | None = None,
        dtype: torch.dtype = torch.float64,
    ) -> Tensor:
        """Exact draws, shape ``(num, 2)``: v ~ N(0, σ²), then θ₁ | v ~ N(μ, sp(v))."""
        z = torch.randn(num, 2, generator=generator, dtype=dtype)
        v = z[:, 1] * self.v_std
        t1 = self.mean + torch.sqrt(_softplus(v)) * z[:, 0]
        return torch.stack([t1, v], dim=-1)

    def v_cdf(self, v: Tensor) -> Tensor:
        """CDF of the exact v-marginal N(0, σ²)."""
        return torch.special.ndtr(v / self.v_std)

    def v_pdf(self, v: Tensor) -> Tensor:
        """Density of the exact v-marginal N(0, σ²)."""
        norm = math.sqrt(2.0 * math.pi * self.v_variance)
        return torch.exp(-0.5 * v * v / self.v_variance) / norm

    def prob_v_below(self, threshold: float) -> float:
        """P(v < threshold) under the exact marginal (0.288 for −5: the neck's mass)."""
        return 0.5 * math.erfc(-threshold / (self.v_std * math.sqrt(2.0)))
