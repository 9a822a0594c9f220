"""The likelihood a potential alone is consistent with, so that a network given by its potential
is scored by the log predictive, as one given with its likelihood is (the KSD, the only score a
potential alone allows otherwise, chose too large an ℓ on networks: ``docs/tuning.md``).

The per-datum potential is ``u(θ; B) = mean_{i∈B} nll_i(θ) − log π(θ) / n``: at one θ, two
batches' potentials differ by their mean negative log-likelihoods alone. A candidate ``nll`` for
which ``u(θ; B) − mean_B nll`` is the same for every batch B, at the model's start and at a
perturbed θ, is the potential's likelihood up to a term in θ alone, the prior's, which the log
predictive does not need. The candidates are the common ones of ``(x, y)`` batches: categorical
on logits (integer labels), Bernoulli on one logit (labels 0 and 1) and Gaussian on a prediction
(real targets; its precision is the slope of the batches' potentials in their mean squared
error, the same at every θ).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sgrld.core.runner import restoring, sampled

__all__ = ["consistent_likelihood"]

LogLikelihood = Callable[[nn.Module, Any], Tensor]

#: batches compared: the first scoring batches, each also cut in halves
BATCHES = 4
#: how far the batches' residuals may differ, relative to the potential's size: float32's
#: rounding is ~1e-7 of it; a likelihood tempered by 0.99 differs by ~1e-2 of the spread of the
#: batches' nll (``tests/test_tune_likelihood.py``)
TOLERANCE = 1e-4
#: how far the parts' potentials may scale against their mean nll from 1: the residuals' rule
#: above scales with the potential, so a potential that its prior term dominates would let a
#: likelihood tempered by a few per cent through; the slope does not see the prior term
SLOPE_TOLERANCE = 1e-3
#: the perturbed θ: each sampled tensor plus this × its RMS (at least this) × N(0, 1)
PERTURBATION = 0.5


def consistent_likelihood(
    model: nn.Module, potential: Callable[[nn.Module, Any], Tensor], batches: Sequence[Any],
    seed: int = 0,
) -> tuple[str, LogLikelihood] | None:  # fmt: skip
    """``(name, log_likelihood)`` of the common likelihood ``potential`` is consistent with on
    ``batches`` (``(x, y)`` pairs), or ``None`` (no candidate fits, or the batches cannot tell:
    fewer than three parts, a stochastic forward)."""
    parts = _parts(batches)
    if len(parts) < 3:
        return None
    gen = torch.Generator().manual_seed(seed)
    params = list(sampled(model).values())
    moved = [_perturbed(p, gen) for p in params]
    devices = sorted({p.device for p in params if p.device.type == "cuda"}, key=str)
    # the parameters and batch norm's running figures put back on the way out; a stochastic
    # forward (dropout) draws from torch's random state: the search's stays as it was
    with (
        torch.no_grad(),
        torch.random.fork_rng(devices=devices),
        restoring([*params, *model.buffers()]),
    ):
        try:
            start = _evaluate(model, potential, parts)
            for p, v in zip(params, moved, strict=True):
                p.copy_(v)
            away = _evaluate(model, potential, parts)
        except (RuntimeError, TypeError, ValueError, IndexError, KeyError, AttributeError):
            return None  # a model or potential that does not take these parts: cannot tell
    if start is None or away is None:
        return None
    fits = (("categorical", _categorical), ("bernoulli", _bernoulli), ("gaussian", _gaussian))
    for name, fit in fits:
        found = fit([start, away])
        if found is not None:
            return name, found
    return None


def _parts(batches: Sequence[Any]) -> list[tuple[Tensor, Tensor]]:
    out = []
    for batch in batches[:BATCHES]:
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            return []
        x, y = batch
        if not (isinstance(x, Tensor) and isinstance(y, Tensor)) or len(x) != len(y):
            return []
        half = len(x) // 2
        out += [(x, y)] + ([(x[:half], y[:half]), (x[half:], y[half:])] if half else [])
    return out


def _perturbed(value: Tensor, gen: torch.Generator) -> Tensor:
    noise = torch.randn(value.shape, generator=gen, dtype=torch.float64).to(value)
    scale = max(float(value.detach().double().pow(2).mean().sqrt()), 1.0) if value.numel() else 1.0
    return value.detach() + PERTURBATION * scale * noise


Point = list[tuple[float, Tensor, Tensor]]  # per part: its potential, the output, the target


def _evaluate(
    model: nn.Module, potential: Callable[[nn.Module, Any], Tensor],
    parts: list[tuple[Tensor, Tensor]],
) -> Point | None:  # fmt: skip
    """Each part's potential and the model's output on it; ``None`` where the forward is not
    repeatable or not finite."""
    point = []
    for x, y in parts:
        u, out, again = potential(model, (x, y)), model(x), model(x)
        if not (isinstance(out, Tensor) and isinstance(u, Tensor) and u.numel() == 1):
            return None
        if not torch.equal(out, again) or not (torch.isfinite(u) and torch.isfinite(out).all()):
            return None  # dropout, or a start where nothing can be compared
        point.append((float(u), out.detach(), y))
    return point


def _consistent(residuals: list[float], potentials: list[float]) -> bool:
    spread = max(residuals) - min(residuals)
    return spread <= TOLERANCE * (1.0 + max(abs(u) for u in potentials))


def _slope(xs: list[float], ys: list[float]) -> float | None:
    """The least-squares slope of ``ys`` on ``xs`` (``None`` where ``xs`` do not vary)."""
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mean_x) ** 2 for x in xs)
    if var <= 0:
        return None
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var


def _matches(points: list[Point], nll: Callable[[Tensor, Tensor], Tensor]) -> bool:
    """Whether every part's potential minus its mean ``nll(output, target)`` is the same, at
    each point, and the potentials move one for one with the nll across the parts."""
    for point in points:
        values = [float(nll(out.double(), y)) for _, out, y in point]
        potentials = [u for u, _, _ in point]
        residuals = [u - v for u, v in zip(potentials, values, strict=True)]
        if not _consistent(residuals, potentials):
            return False
        slope = _slope(values, potentials)
        if slope is not None and abs(slope - 1.0) > SLOPE_TOLERANCE:
            return False
    return True


def _categorical(points: list[Point]) -> LogLikelihood | None:
    for _, out, y in (part for point in points for part in point):
        if out.ndim != 2 or y.ndim != 1 or y.dtype.is_floating_point or y.is_complex():
            return None
        if y.min() < 0 or y.max() >= out.shape[1]:
            return None
    if not _matches(points, F.cross_entropy):
        return None

    def log_likelihood(model: nn.Module, batch: Any) -> Tensor:
        x, y = batch
        return -F.cross_entropy(model(x), y, reduction="none")

    return log_likelihood


def _bernoulli(points: list[Point]) -> LogLikelihood | None:
    for _, out, y in (part for point in points for part in point):
        if out.numel() != y.numel() or not ((y == 0) | (y == 1)).all():
            return None
    if not _matches(points, lambda out, y: F.binary_cross_entropy_with_logits(
            out.reshape(y.shape), y.to(out.dtype))):  # fmt: skip
        return None

    def log_likelihood(model: nn.Module, batch: Any) -> Tensor:
        x, y = batch
        out = model(x).reshape(y.shape)
        return -F.binary_cross_entropy_with_logits(out, y.to(out.dtype), reduction="none")

    return log_likelihood


def _gaussian(points: list[Point]) -> LogLikelihood | None:
    slopes = []
    for point in points:
        if not all(y.is_floating_point() and out.numel() == y.numel() for _, out, y in point):
            return None
        q = [float(0.5 * (out.reshape(y.shape).double() - y.double()).pow(2).mean())
             for _, out, y in point]  # fmt: skip
        u = [p[0] for p in point]
        # u = s·q + c for every part: least squares, then every residual the same
        s = _slope(q, u)
        if (
            s is None
            or not s > 0
            or not _consistent([b - s * a for a, b in zip(q, u, strict=True)], u)
        ):
            return None
        slopes.append(s)
    if abs(slopes[0] - slopes[-1]) > TOLERANCE * 10 * slopes[0]:
        return None  # the precision is a constant of the likelihood, not of θ
    precision = slopes[0]
    constant = 0.5 * math.log(precision / (2 * math.pi))

    def log_likelihood(model: nn.Module, batch: Any) -> Tensor:
        x, y = batch
        out = model(x).reshape(y.shape)
        return constant - 0.5 * precision * (out - y) ** 2

    return log_likelihood
