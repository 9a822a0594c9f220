"""The step size of :func:`sgrld.slt.llc` when none is given: one rule, in one function.

With S = G^{-½}(nβ∇²L_n(w₀) + γI)G^{-½}, its extreme eigenvalues a₊, a₋ (power iteration) and
s² the minibatch gradient's variance along S's top eigenvector (``docs/llc.md`` derives it):

    ε_bias = 4·1 % / (a₊ + nβ²s²)      the stiffest direction inflated by 1 %
    ε_mix  = 2·20 / (a₋·T)              the slowest one relaxed 20 times over the trace
    ε_max  = 4·10 % / (a₊ + nβ²s²)      the stiffest direction inflated by 10 % at most
    ε      = min(max(ε_bias, ε_mix), ε_max)

The cap bounds the step's bias on λ̂ (a share-weighted mean of every direction's inflation, at
most the stiffest one's): a cap of 50 % biased λ̂ by 14-28 % on reduced-rank regression, by a
different amount under each metric's G (``docs/llc.md``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from sgrld.core.runner import LossFn, sampled
from sgrld.core.sampler import Sampler

#: the stiffest direction's relative inflation the rule aims at, and the most it allows (the
#: bound on the step's relative bias on λ̂)
BIAS, MAX_BIAS = 0.01, 0.1
#: relaxations of the slowest direction over the trace the rule aims at
RELAXATIONS = 20.0
#: Hutchinson probes of the Hessian's trace (the verdict's step bias)
TRACE_PROBES = 4


@dataclass(frozen=True)
class Spectrum:
    """The quadratic model of the local posterior at w₀ in the metric's coordinates.

    Attributes:
        top: a₊, the largest eigenvalue of S = G^{-½}(nβ∇²L_n(w₀) + γI)G^{-½}.
        bottom: a₋, its smallest (≤ 0 where w₀ is no minimum).
        noise: nβ²s², s² the minibatch gradient's variance along S's top eigenvector.
        hessian_trace: tr(G^{-½}·nβ∇²L_n(w₀)·G^{-½}) (Hutchinson's estimate).
        noise_trace: nβ²·tr(G^{-½}ΣG^{-½}), Σ the minibatch gradient's covariance.
        stats: the metric's statistics of that G (built from the batches' gradients at w₀), laid
            out over the parameters that need grad in the model's order: the G that
            :func:`sgrld.llc` freezes by default, so its chains use the G their ε was sized for.
    """

    top: float
    bottom: float
    noise: float
    hessian_trace: float = math.nan
    noise_trace: float = math.nan
    stats: dict[str, Tensor] | None = field(default=None, repr=False, compare=False)

    def inflation(self, lr: float) -> float:
        """The stiffest direction's variance inflation at ε = ``lr``: ε(a₊ + nβ²s²)/4."""
        return lr * (self.top + self.noise) / 4.0

    def step_bias(self, lr: float) -> float:
        """The step's bias on λ̂ in the quadratic model: Σᵢ ½(nβhᵢ/aᵢ)·ε(aᵢ + nβ²sᵢ²)/4 ≤
        ε/8·(tr(nβH) + nβ²tr Σ) (``docs/llc.md``)."""
        return lr / 8.0 * (self.hessian_trace + self.noise_trace)

    def relaxations(self, lr: float, num_steps: int) -> float:
        """How many times the slowest direction relaxes over ``num_steps``: εa₋T/2."""
        return lr * self.bottom * num_steps / 2.0


class DoubleBackwardError(RuntimeError):
    """The model has an operation without a second derivative (e.g. CPU's fused attention)."""


def calibrate_lr(
    model: nn.Module,
    loss: LossFn,
    batches: Sequence[object],
    sampler: Sampler,
    *,
    nbeta: float,
    localization: float,
    num_steps: int,
    iterations: int = 20,
    hessian_batches: int = 4,
    seed: int = 0,
) -> float:
    """devinterp's ε for ``sampler``'s metric at the model's current parameters w₀.

    Args:
        model: the model at w₀ (left unchanged).
        loss: ``loss(model, batch)``, the batch-mean negative log-likelihood.
        batches: the batches whose gradients build G and give s².
        sampler: the sampler whose metric (and options) the chains will use.
        nbeta: the inverse temperature nβ.
        localization: devinterp's γ.
        num_steps: the steps of each chain's trace, T.
        iterations: power iterations (for each end of the spectrum).
        hessian_batches: the first batches whose mean loss's Hessian is H (each Hessian-vector
            product costs about three gradients per batch).
        seed: the start vector's seed.

    Returns:
        ε > 0 (the sampler's ℓ is ε·nβ/2, :func:`sgrld.slt.devinterp_options`).

    Raises:
        ValueError: the curvature at w₀ is not positive.
        DoubleBackwardError: the model has no second derivative (pass ``lr``).
    """
    spec = spectrum(
        model, loss, batches, sampler, nbeta=nbeta, localization=localization,
        iterations=iterations, hessian_batches=hessian_batches, seed=seed,
    )  # fmt: skip
    return lr_from_spectrum(spec, num_steps)


def lr_from_spectrum(spec: Spectrum, num_steps: int) -> float:
    """The rule (module docstring) applied to a :class:`Spectrum`."""
    if not spec.top > 0.0:
        raise ValueError(f"calibrate_lr: the curvature at w₀ is not positive (a = {spec.top:g})")
    stiff = spec.top + spec.noise
    slow = max(spec.bottom, 1e-12 * spec.top)  # a₋ ≤ 0 where w₀ is no minimum: ε_max decides
    mix = 2.0 * RELAXATIONS / (slow * num_steps)
    return min(max(4.0 * BIAS / stiff, mix), 4.0 * MAX_BIAS / stiff)


def spectrum(
    model: nn.Module,
    loss: LossFn,
    batches: Sequence[object],
    sampler: Sampler,
    *,
    nbeta: float,
    localization: float,
    iterations: int = 20,
    hessian_batches: int = 4,
    seed: int = 0,
) -> Spectrum:
    """S's extreme eigenvalues and the gradient noise along the top one (:func:`calibrate_lr`'s
    arguments).

    Raises:
        DoubleBackwardError: the model has no second derivative.
    """
    named = sampled(model)  # the parameters the chains sample, in the model's order
    params = list(named.values())
    state = sampler.init({n: p.detach().clone() for n, p in named.items()})
    metric, layout = sampler.metric, state.layout
    grads = []
    for step, batch in enumerate(batches, start=1):  # G from the loss's gradients at w₀
        grads.append(_flat(torch.autograd.grad(loss(model, batch), params)))
        metric.update(state.stats, layout, grads[-1].clone(), step)
    metric.refresh(state.stats, layout)

    def scaled(v: Tensor) -> Tensor:  # G^{-½}v
        return metric.inverse_sqrt(state.stats, layout, v.clone())

    def curvature(v: Tensor) -> Tensor:  # S·v = G^{-½}(nβ·H + γ)G^{-½}v, H the batches' mean
        return hessian(v) + scaled(scaled(v)) * localization

    def hessian(v: Tensor) -> Tensor:  # G^{-½}·nβH·G^{-½}v
        u = layout.views(scaled(v))
        hv = [torch.zeros_like(p) for p in params]
        for batch in batches[:hessian_batches]:
            first = torch.autograd.grad(loss(model, batch), params, create_graph=True)
            dot = sum((g * w).sum() for g, w in zip(first, u, strict=True))
            try:
                parts = torch.autograd.grad(dot, params)  # type: ignore[arg-type]
            except RuntimeError as exc:
                if "derivative for" not in str(exc) and "differentiate twice" not in str(exc):
                    raise
                raise DoubleBackwardError(
                    f"the step-size calibration needs second derivatives, which this model "
                    f"lacks ({str(exc).splitlines()[0]}); pass lr= (devinterp's ε, e.g. 1e-4), "
                    f'or build a Hugging Face model with attn_implementation="eager"'
                ) from None
            torch._foreach_add_(hv, [p.detach() / len(batches[:hessian_batches]) for p in parts])
        return scaled(_flat(hv) * nbeta)

    gen = torch.Generator(device=params[0].device).manual_seed(seed)
    start = torch.randn(layout.size, generator=gen, dtype=params[0].dtype, device=params[0].device)
    top, v = _power(curvature, start, iterations)
    gap, _ = _power(lambda x: top * x - curvature(x), start, iterations)  # a₊ − a₋
    direction = scaled(v)
    spread = torch.stack([torch.dot(g, direction) for g in grads])
    noise = nbeta**2 * (float(spread.var()) if len(grads) > 1 else 0.0)
    probes = [  # Hutchinson: E[vᵀAv] = tr A for Rademacher v
        torch.randint(0, 2, (layout.size,), generator=gen, device=start.device).to(start) * 2 - 1
        for _ in range(TRACE_PROBES)
    ]
    hessian_trace = sum(float(torch.dot(v, hessian(v))) for v in probes) / len(probes)
    noise_trace = math.nan
    if len(grads) > 1:
        mean = torch.stack(grads).mean(0)
        spread2 = sum(float(scaled(g - mean).square().sum()) for g in grads)
        noise_trace = nbeta**2 * spread2 / (len(grads) - 1)
    return Spectrum(top=top, bottom=top - gap, noise=noise, hessian_trace=hessian_trace,
                    noise_trace=noise_trace, stats=state.stats)  # fmt: skip


def _power(op: Callable[[Tensor], Tensor], v: Tensor, iterations: int) -> tuple[float, Tensor]:
    """The largest eigenvalue of the symmetric ``op`` (Rayleigh quotient) and its vector."""
    value = 0.0
    for _ in range(iterations):
        v = v / v.norm()
        w = op(v)
        value = float(torch.dot(v, w))
        v = w
    return value, v / v.norm()


def _flat(tensors: Sequence[Tensor]) -> Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])
