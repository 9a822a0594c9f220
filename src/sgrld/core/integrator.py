"""The one Euler–Maruyama integrator shared by every metric (paper eq. 4, Γ dropped).

    θ ← θ − ℓ · G⁻¹ĝ + √(2ℓτ/n) · G^{-1/2}ξ,   ξ ~ N(0, I)

with ℓ the learning rate, n the number of data, τ the temperature and ĝ the gradient of the
per-datum potential; h = ℓ/n is the SDE step (see ``docs/conventions.md``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor


def noise_scale(lr: float, num_data: float, temperature: float) -> float:
    """σ = √(2ℓτ/n), the standard deviation of the injected noise before G^{-1/2}."""
    return math.sqrt(2.0 * lr * temperature / num_data)


@torch.no_grad()
def euler_maruyama(
    params: Sequence[Tensor],
    drift: Sequence[Tensor],
    noise: Sequence[Tensor] | None,
    lr: float | Tensor,
    sigma: float | Tensor,
) -> None:
    """In place: θ_p ← θ_p − ℓ · drift_p + σ · noise_p for every parameter tensor p.

    ``drift`` holds G⁻¹ĝ and ``noise`` G^{-1/2}ξ, shaped like ``params``; ``noise=None`` (τ = 0)
    gives deterministic preconditioned descent. ``lr`` and ``sigma`` may be 0-d tensors: the
    form traced by ``torch.compile`` (:mod:`sgrld.core.compiled`), where Python floats would be
    guarded on and recompile whenever a scheduler changes ℓ; it is one fused expression per
    tensor there (eagerly it would allocate, so the eager core passes floats).
    """
    if isinstance(lr, Tensor) or isinstance(sigma, Tensor):
        if noise is None:
            torch._foreach_add_(list(params), [d * -lr for d in drift])
        else:
            moves = [n * sigma - d * lr for d, n in zip(drift, noise, strict=True)]
            torch._foreach_add_(list(params), moves)
        return
    torch._foreach_add_(list(params), list(drift), alpha=-lr)
    if noise is not None:
        torch._foreach_add_(list(params), list(noise), alpha=sigma)
