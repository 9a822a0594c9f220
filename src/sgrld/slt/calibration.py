"""The step size of :func:`sgrld.slt.llc` when none is given: one rule, in one function.

Euler–Maruyama on a Gaussian of precision a with devinterp's step ε
(w ← w − (ε/2)·(a·w + nβ·ζ) + √ε·ξ, ζ the minibatch gradient's error, of variance s²) has the
stationary variance (1 + ε·nβ²s²/4)/(a(1 − εa/4)): the LLC's share of that direction is biased
by ≈ ε(a + nβ²s²)/4. A constant metric G turns a into the eigenvalues of S = G^{-½}AG^{-½} and
s² into the variance of uᵀG^{-½}g_B along S's eigenvector u. The rule takes
A = nβ·∇²L_n(w₀) + γI and the G that the metric folds from the gradients at w₀, finds S's
largest eigenvalue a and its u by power iteration (Hessian-vector products), s² from the
probe batches' gradients, and sets

    ε = 4·bias / (a + nβ²·s²)

so that the stiffest direction's bias is ``bias`` (1 % by default). It ignores that G goes on
adapting during the warm-up; ``docs/llc.md`` reports the values it gives and the errors
measured with them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from sgrld.core.sampler import Sampler

#: the stiffest direction's relative bias the rule aims at
DEFAULT_BIAS = 0.01


def calibrate_lr(
    model: nn.Module,
    loss: Callable[[nn.Module, object], Tensor],
    batches: Sequence[object],
    sampler: Sampler,
    *,
    nbeta: float,
    localization: float,
    bias: float = DEFAULT_BIAS,
    iterations: int = 30,
    seed: int = 0,
) -> float:
    """devinterp's ε for ``sampler``'s metric at the model's current parameters w₀.

    Args:
        model: the model at w₀ (left unchanged).
        loss: ``loss(model, batch)``, the batch-mean negative log-likelihood.
        batches: the batches whose gradients build G and whose mean loss's Hessian is H.
        sampler: the sampler whose metric (and options) the chains will use.
        nbeta: the inverse temperature nβ.
        localization: devinterp's γ.
        bias: the stiffest direction's relative bias of the LLC (see the module docstring).
        iterations: power iterations.
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
        for batch in batches:
            first = torch.autograd.grad(loss(model, batch), params, create_graph=True)
            dot = sum((g * w).sum() for g, w in zip(first, u, strict=True))
            parts = torch.autograd.grad(dot, params)  # type: ignore[arg-type]
            torch._foreach_add_(hv, [p.detach() / len(batches) for p in parts])
        return scaled(_flat(hv) * nbeta + _flat(u) * localization)

    gen = torch.Generator(device=params[0].device).manual_seed(seed)
    v = torch.randn(layout.size, generator=gen, dtype=params[0].dtype, device=params[0].device)
    top = 0.0
    for _ in range(iterations):
        v = v / v.norm()
        w = curvature(v)
        top = float(torch.dot(v, w))  # Rayleigh quotient of the symmetric S
        v = w
    if not top > 0.0:
        raise ValueError(f"calibrate_lr: the curvature at w₀ is not positive (λ_max = {top:g})")
    direction = scaled(v / v.norm())
    spread = torch.stack([torch.dot(g, direction) for g in grads])
    noise = float(spread.var()) if len(grads) > 1 else 0.0
    return 4.0 * bias / (top + nbeta**2 * noise)


def _flat(tensors: Sequence[Tensor]) -> Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])
