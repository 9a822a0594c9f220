"""The Gaussian likelihood of regression: y ~ N(f(x; θ), σ²), σ fixed or sampled with θ."""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import Tensor, nn

from sgrld.likelihoods.base import Likelihood, register
from sgrld.likelihoods.mixture import mixture_quantile
from sgrld.priors.gaussian import HALF_LOG_2PI, normal_log_prob_sum

#: the central intervals whose coverage :meth:`Gaussian.scores` reports
COVERAGE_LEVELS = (0.5, 0.9)


@register
class Gaussian(Likelihood):
    """y ~ N(f(x), σ²) with one network output; η = (f(x), log σ).

    With ``scale=None`` the parameter ``log_scale`` = log σ is sampled with the weights, under the
    prior log σ ~ N(``prior_loc``, ``prior_scale``²) (smooth in the coordinate the chain moves,
    where a Gamma on 1/σ² is too stiff), started at ``prior_loc``. The ensemble keeps every
    mixture component; the scores ``lp``, ``rmse``, ``coverage_50``, ``coverage_90`` are in the
    original target units (``docs/likelihoods.md`` defines them).

    Args:
        scale: the fixed σ > 0 (in standardised units), or ``None`` to learn it.
        prior_loc: mean of the prior on log σ (learned σ only).
        prior_scale: standard deviation > 0 of the prior on log σ (learned σ only).
        target_scale: the standard deviation the targets were divided by (1: not scaled).
    """

    name = "gaussian"
    score_names = ("lp", "rmse", *(f"coverage_{round(100 * p)}" for p in COVERAGE_LEVELS))
    headline: ClassVar[dict[str, str]] = {
        "RMSE": "rmse",
        **{f"cov{round(100 * p)}": f"coverage_{round(100 * p)}" for p in COVERAGE_LEVELS},
    }
    table_scores: ClassVar[dict[str, tuple[str, ...]]] = {
        "test": score_names[1:],
        "val": ("rmse",),
    }
    fractions = score_names[2:]
    nonnegative = ("rmse",)

    def __init__(
        self,
        scale: float | None = None,
        *,
        prior_loc: float = 0.0,
        prior_scale: float = 1.0,
        target_scale: float = 1.0,
    ) -> None:
        super().__init__()
        for field, value in (("prior_scale", prior_scale), ("target_scale", target_scale)):
            if not value > 0:
                raise ValueError(f"{field} must be > 0, got {value!r}")
        if scale is not None and not scale > 0:
            raise ValueError(f"scale must be > 0 or None (learned), got {scale!r}")
        self.fixed_scale = None if scale is None else float(scale)
        self._fixed_log_scale = 0.0 if scale is None else math.log(scale)
        self.prior_loc, self.prior_scale = float(prior_loc), float(prior_scale)
        self.target_scale = float(target_scale)
        self.log_scale = None if scale is not None else nn.Parameter(torch.tensor(prior_loc))

    @property
    def num_outputs(self) -> int:
        return 1

    @property
    def width(self) -> int:
        return 2

    def forward(self, outputs: Tensor) -> Tensor:
        if self.log_scale is None:
            log_scale = torch.full_like(outputs, self._fixed_log_scale)
        else:
            log_scale = self.log_scale.expand_as(outputs)
        return torch.cat([outputs, log_scale], dim=-1)

    def nll(self, eta: Tensor, targets: Tensor) -> Tensor:
        return -self.log_prob(eta, targets).mean()

    def log_prob(self, eta: Tensor, targets: Tensor) -> Tensor:
        if targets.shape != eta.shape[:-1]:  # a (B, 1) target would broadcast to (B, B)
            raise ValueError(f"targets must have shape {tuple(eta.shape[:-1])}, got "
                             f"{tuple(targets.shape)}")  # fmt: skip
        mean, log_scale = eta[..., 0], eta[..., 1]
        z = (targets - mean) * torch.exp(-log_scale)
        return -0.5 * z.square() - log_scale - HALF_LOG_2PI

    def log_prior_terms(self) -> list[Tensor]:
        if self.log_scale is None:
            return []
        return [normal_log_prob_sum(self.log_scale - self.prior_loc, self.prior_scale)]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        if self.log_scale is not None:
            self.log_scale.fill_(self.prior_loc)

    def total_shape(
        self, lead: tuple[int, ...], num_points: int, num_samples: int
    ) -> tuple[int, ...]:
        return (*lead, num_points, num_samples, self.width)  # one component per sample

    def ensemble_init(self, lead: tuple[int, ...], num_points: int, device: torch.device) -> Tensor:
        shape = self.total_shape(lead, num_points, 0)
        return torch.empty(shape, dtype=torch.float64, device=device)

    def ensemble_terms(self, eta: Tensor) -> Tensor:
        return eta.detach().to(torch.float64)

    def ensemble_fold(self, total: Tensor, terms: Tensor) -> Tensor:
        return torch.cat([total, terms.unsqueeze(-2)], dim=-2)  # (…, N, S, 2)

    def scores(
        self, total: Tensor, num_samples: int, targets: Tensor, *, num_bins: int = 30
    ) -> dict[str, Tensor]:
        y = targets.to(device=total.device, dtype=torch.float64)
        means, log_scales = total[..., 0], total[..., 1]
        components = self.log_prob(total, y[:, None].expand(total.shape[:-1]))
        log_mixture = torch.logsumexp(components, dim=-1) - math.log(num_samples)
        error = means.mean(dim=-1) - y
        out = {
            "lp": log_mixture.mean(dim=-1) - math.log(self.target_scale),
            "rmse": self.target_scale * error.square().mean(dim=-1).sqrt(),
        }
        scales = log_scales.exp()
        for level in COVERAGE_LEVELS:
            low = mixture_quantile(means, scales, (1 - level) / 2)
            high = mixture_quantile(means, scales, (1 + level) / 2)
            out[f"coverage_{round(100 * level)}"] = ((low <= y) & (y <= high)).double().mean(-1)
        return out

    def extra_repr(self) -> str:
        return f"scale={'learned' if self.fixed_scale is None else self.fixed_scale}"
