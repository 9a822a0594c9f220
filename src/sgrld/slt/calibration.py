"""The step size of :func:`sgrld.slt.llc` when none is given: one rule, in one function.

With S = G^{-½}(nβ∇²L_n(w₀) + γI)G^{-½}, its extreme eigenvalues a₊, a₋ (power iteration) and
s² the minibatch gradient's variance along S's top eigenvector (``docs/llc.md`` derives it):

    ε_bias = 4·1 % / (a₊ + nβ²s²)      the stiffest direction inflated by 1 %
    ε_mix  = 2·20 / (a₋·T)              the slowest one relaxed 20 times over the trace
    ε_max  = 4·50 % / (a₊ + nβ²s²)      halfway to the stability edge εa₊ = 4
    ε      = min(max(ε_bias, ε_mix), ε_max)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from sgrld.core.sampler import Sampler

#: the stiffest direction's relative inflation the rule aims at, and the most it allows
BIAS, MAX_BIAS = 0.01, 0.5
#: relaxations of the slowest direction over the trace the rule aims at
RELAXATIONS = 20.0


def calibrate_lr(
    model: nn.Module,
    loss: Callable[[nn.Module, object], Tensor],
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
    """
    params = [p for p in model.parameters() if p.requires_grad]
    names = [str(i) for i in range(len(params))]
    state = sampler.init(dict(zip(names, [p.detach().clone() for p in params], strict=True)))
    metric, layout = sampler.metric, state.layout
    grads = []
    for step, batch in enumerate(batches, start=1):  # G from the loss's gradients at w₀
        grads.append(_flat(torch.autograd.grad(loss(model, batch), params)))
        metric.update(state.stats, layout, grads[-1].clone(), step)
    metric.refresh(state.stats, layout)

    def scaled(v: Tensor) -> Tensor:  # G^{-½}v
        return metric.inverse_sqrt(state.stats, layout, v.clone())

    def curvature(v: Tensor) -> Tensor:  # S·v = G^{-½}(nβ·H + γ)G^{-½}v, H the batches' mean
        u = layout.views(scaled(v))
        hv = [torch.zeros_like(p) for p in params]
        for batch in batches[:hessian_batches]:
            first = torch.autograd.grad(loss(model, batch), params, create_graph=True)
            dot = sum((g * w).sum() for g, w in zip(first, u, strict=True))
            parts = torch.autograd.grad(dot, params)  # type: ignore[arg-type]
            torch._foreach_add_(hv, [p.detach() / len(batches[:hessian_batches]) for p in parts])
        return scaled(_flat(hv) * nbeta + _flat(u) * localization)

    gen = torch.Generator(device=params[0].device).manual_seed(seed)
    start = torch.randn(layout.size, generator=gen, dtype=params[0].dtype, device=params[0].device)
    top, v = _power(curvature, start, iterations)
    gap, _ = _power(lambda x: top * x - curvature(x), start, iterations)  # a₊ − a₋
    if not top > 0.0:
        raise ValueError(f"calibrate_lr: the curvature at w₀ is not positive (a = {top:g})")
    direction = scaled(v)
    spread = torch.stack([torch.dot(g, direction) for g in grads])
    stiff = top + nbeta**2 * (float(spread.var()) if len(grads) > 1 else 0.0)
    slow = max(top - gap, 1e-12 * top)  # a₋ (≤ 0 where w₀ is no minimum: ε_max decides)
    mix = 2.0 * RELAXATIONS / (slow * num_steps)
    return min(max(4.0 * BIAS / stiff, mix), 4.0 * MAX_BIAS / stiff)


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
