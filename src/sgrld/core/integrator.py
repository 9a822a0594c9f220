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


def noise_scale(lr: float | Tensor, num_data: float, temperature: float) -> float | Tensor:
    """σ = √(2ℓτ/n), the standard deviation of the injected noise before G^{-1/2}; on the
    device (no host read) when ℓ is a tensor (0-d, or one per chain)."""
    if isinstance(lr, Tensor):
        return torch.sqrt(lr * (2.0 * temperature / num_data))
    return math.sqrt(2.0 * lr * temperature / num_data)


def _over(scale: float | Tensor, like: Tensor) -> float | Tensor:
    """A per-chain ``(*batch, 1)`` ℓ or σ shaped to broadcast over a parameter ``like``."""
    if isinstance(scale, Tensor) and scale.dim() > 0:
        return scale.reshape(*scale.shape[:-1], *([1] * (like.dim() - scale.dim() + 1)))
    return scale


@torch.no_grad()
def euler_maruyama(
    params: Sequence[Tensor],
    drift: Sequence[Tensor],
    noise: Sequence[Tensor] | None,
    lr: float | Tensor,
    sigma: float | Tensor,
) -> None:
    """In place: θ_p ← θ_p − ℓ · drift_p + σ · noise_p for every parameter tensor p.

    ``drift`` holds G⁻¹ĝ and ``noise`` G^{-1/2}ξ (``None``: τ = 0, preconditioned descent). ``lr``
    and ``sigma`` are floats (two foreach passes) or tensors, 0-d (traced: no recompile when ℓ
    changes) or ``(*batch, 1)`` per chain: one expression per tensor.
    """
    if isinstance(lr, Tensor) or isinstance(sigma, Tensor):
        rates = [_over(lr, d) for d in drift]
        if noise is None:
            moves = [d * -r for d, r in zip(drift, rates, strict=True)]
        else:
            scales = [_over(sigma, d) for d in drift]
            moves = [n * s - d * r for d, n, r, s in zip(drift, noise, rates, scales, strict=True)]
        torch._foreach_add_(list(params), moves)
        return
    torch._foreach_add_(list(params), list(drift), alpha=-lr)
    if noise is not None:
        torch._foreach_add_(list(params), list(noise), alpha=sigma)
