"""The exact Riemannian drift Γ for Monge's metric with m = ∇u(θ) (Hartmann et al. 2022).

SGRLD drops Γ_i = Σ_j ∂(G⁻¹)_ij/∂θ_j (paper eq. 4). With s = ‖m‖², G⁻¹ = I − β(s) m mᵀ and
H = ∇²u:

    Γ = −2β'(s)(mᵀHm) m − β Hm − β tr(H) m,

(β' = −β² for the fixed rule; −β/s for the normalised one, so Γ grows as 1/‖∇u‖ near critical
points: use the fixed rule with the correction, ``docs/results/beyond.md``). Hm is one
Hessian–vector product; tr(H) is exact (D products) or a Hutchinson estimate. Γ enters with
the noise's variance factor ℓτ/n (``docs/conventions.md``):

    θ ← θ − ℓ·G⁻¹∇u + (ℓτ/n)·Γ + √(2ℓτ/n)·G^{-1/2}ξ.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

from sgrld.core.contract import check_choice, check_int
from sgrld.core.integrator import noise_scale
from sgrld.core.layout import FlatLayout
from sgrld.core.sampler import NonFiniteGradientError, validate_hyperparameters
from sgrld.metrics.monge import MongeMetric

__all__ = [
    "exact_monge_move",
    "exact_monge_step",
    "hutchinson_trace",
    "monge_divergence",
    "monge_move",
]

PotentialFn = Callable[[Tensor], Tensor]
TraceMethod = Literal["exact", "hutchinson"]
EXACT_TRACE_MAX_DIM = 64  # "auto": D Hessian-vector products up to this D, Hutchinson above


def monge_divergence(metric: MongeMetric, m: Tensor, hess_m: Tensor, trace_h: Tensor) -> Tensor:
    """Γ = −2β'(s)(mᵀHm) m − β Hm − β tr(H) m for G⁻¹(θ) = I − β(s) m mᵀ, m = ∇u(θ).

    Args:
        metric: gives β(s) and β'(s) (its ``alpha2`` and ``alpha2_rule``).
        m: ∇u(θ), shape ``(*batch, D)``.
        hess_m: H m, shape ``(*batch, D)``.
        trace_h: tr(H) (exact or an unbiased estimate), shape ``(*batch,)``.
    """
    s = torch.linalg.vecdot(m, m).unsqueeze(-1)
    beta = -metric.coefficients(s)[0]
    slope = metric.coefficient_slope(s)
    m_h_m = torch.linalg.vecdot(m, hess_m).unsqueeze(-1)
    return -(2.0 * slope * m_h_m + beta * trace_h.unsqueeze(-1)) * m - beta * hess_m


def hutchinson_trace(
    hvp: Callable[[Tensor], Tensor],
    like: Tensor,
    probes: int,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Unbiased tr(H) per chain: the mean of zᵀHz over ``probes`` Rademacher vectors z
    (``hvp(v)`` = H v for ``v`` shaped like ``like``).
    """
    return probe_trace(hvp, rademacher((probes, *like.shape), like, generator))


def rademacher(shape: tuple[int, ...], like: Tensor, generator: torch.Generator | None) -> Tensor:
    """±1 with probability ½ each, in ``like``'s dtype and device (one draw from ``generator``)."""
    z = torch.randint(0, 2, shape, generator=generator, device=like.device)
    return z.to(like.dtype).mul_(2.0).sub_(1.0)


def probe_trace(hvp: Callable[[Tensor], Tensor], z: Tensor) -> Tensor:
    """mean over the leading dim of ``z`` (probes) of zᵀHz, per chain."""
    total = torch.linalg.vecdot(z[0], hvp(z[0]))
    for probe in z[1:]:
        total = total + torch.linalg.vecdot(probe, hvp(probe))
    return total / z.shape[0]


def exact_monge_step(
    potential_fn: PotentialFn,
    theta: Tensor,
    *,
    metric: MongeMetric,
    lr: float,
    num_data: float,
    temperature: float = 1.0,
    correction: bool = True,
    trace: TraceMethod | None = None,
    probes: int = 1,
    generator: torch.Generator | None = None,
) -> Tensor:
    """One step θ ← θ − ℓ G⁻¹∇u + (ℓτ/n) Γ + √(2ℓτ/n) G^{-1/2}ξ with m = ∇u(θ), by autograd.

    Args:
        potential_fn: θ ``(*batch, D)`` → per-datum potential u ``(*batch,)``, differentiable twice
            (chains must not interact: the gradient of the sum is taken).
        theta: the current point(s), shape ``(*batch, D)``; not modified.
        metric, lr, num_data, temperature, correction, trace, probes, generator: as in
            :func:`exact_monge_move`.

    Returns:
        The new point, a fresh tensor.

    Examples:
        >>> import torch
        >>> from sgrld.metrics import MongeMetric
        >>> u = lambda x: 0.5 * (x * x).sum(-1) + 0.1 * (x**4).sum(-1)
        >>> theta = torch.ones(4, 3, dtype=torch.float64)  # 4 chains in 3-D
        >>> exact_monge_step(u, theta, metric=MongeMetric(alpha2=1.0), lr=0.1, num_data=1).shape
        torch.Size([4, 3])
    """
    x = theta.detach().requires_grad_(True)
    with torch.enable_grad():
        (grad,) = torch.autograd.grad(potential_fn(x).sum(), x, create_graph=correction)

    def hvp(v: Tensor) -> Tensor:
        return torch.autograd.grad(grad, x, grad_outputs=v, retain_graph=True)[0].detach()

    return exact_monge_move(
        theta,
        grad.detach(),
        hvp,
        metric=metric,
        lr=lr,
        num_data=num_data,
        temperature=temperature,
        correction=correction,
        trace=trace,
        probes=probes,
        generator=generator,
    )


def exact_monge_move(
    theta: Tensor,
    grad: Tensor,
    hvp: Callable[[Tensor], Tensor],
    *,
    metric: MongeMetric,
    lr: float,
    num_data: float,
    temperature: float = 1.0,
    correction: bool = True,
    trace: TraceMethod | None = None,
    probes: int = 1,
    generator: torch.Generator | None = None,
) -> Tensor:
    """The step of :func:`exact_monge_step` given m = ∇u(θ) and v ↦ ∇²u(θ)·v, with the
    :class:`~sgrld.metrics.MongeMetric`'s G (its ``decay`` plays no part).

    Args:
        theta: the current point(s), shape ``(*batch, D)``; not modified.
        grad: ∇u(θ), same shape (the per-datum potential's gradient, ``docs/conventions.md``).
        hvp: v ↦ ∇²u(θ) v per chain, for ``v`` of ``theta``'s shape (used only with ``correction``).
        metric: a ``scope="global"`` Monge metric without ``fallback_threshold``.
        lr, num_data, temperature: ℓ ≥ 0, n > 0, τ ≥ 0 (``docs/conventions.md``).
        correction: add Γ (``False``: the SGRLD step with m = ∇u(θ), Γ dropped).
        trace: ``"exact"`` (D Hessian–vector products, which also give Hm), ``"hutchinson"``
            (``probes`` products plus one for Hm) or ``None``: exact for D ≤ 64.
        probes: Rademacher probes of the Hutchinson estimate, ≥ 1.
        generator: drives the probes (drawn first) and then ξ.

    Raises:
        NonFiniteGradientError: ``grad`` holds NaN or Inf (nothing is returned).

    References:
        Hartmann, Girolami, Klami (2022), AISTATS; Girolami & Calderhead (2011); Yu et al. (2023)
        eq. 4.
    """
    validate_hyperparameters(lr, num_data, temperature)
    if metric.scope != "global" or metric.fallback_threshold is not None:
        raise ValueError("the exact drift needs a Monge metric with scope='global', no fallback")
    check_choice("trace", trace, ("exact", "hutchinson", None))
    check_int("probes", probes, 1)
    if not bool(torch.isfinite(grad).all()):
        raise NonFiniteGradientError("gradient of the potential contains NaN or Inf")
    dim = theta.shape[-1]
    exact = (trace or ("exact" if dim <= EXACT_TRACE_MAX_DIM else "hutchinson")) == "exact"
    gamma = correction and temperature > 0.0
    z = None if exact or not gamma else rademacher((probes, *theta.shape), theta, generator)
    xi = None
    if temperature > 0.0:
        xi = torch.randn(theta.shape, generator=generator, dtype=theta.dtype, device=theta.device)
    return monge_move(
        theta, grad, hvp, metric, lr, num_data, temperature, gamma=gamma, probes=z, noise=xi
    )


def monge_move(
    theta: Tensor,
    grad: Tensor,
    hvp: Callable[[Tensor], Tensor],
    metric: MongeMetric,
    lr: float,
    num_data: float,
    temperature: float,
    *,
    gamma: bool,
    probes: Tensor | None,
    noise: Tensor | None,
) -> Tensor:
    """The arithmetic of :func:`exact_monge_move` with its randomness given (no checks, no host
    sync: compilable): ``probes`` ``(P, *batch, D)`` or ``None`` (exact trace); ``noise`` ξ
    (overwritten) or ``None`` when τ = 0."""
    m, dim = grad, theta.shape[-1]
    layout = FlatLayout(("theta",), ((dim,),), tuple(theta.shape[:-1]))
    stats = metric.init(layout, theta)
    stats["exp_avg"].copy_(m)
    stats["sq_norm"].copy_(torch.linalg.vecdot(m, m).unsqueeze(-1))
    new = theta.detach() - lr * metric.inverse(stats, layout, m.clone())
    if gamma:
        if probes is None:
            hess_m = torch.zeros_like(m)
            trace_h = torch.zeros(m.shape[:-1], dtype=m.dtype, device=m.device)
            for i in range(dim):  # column i of H (symmetric): Hm = Σ_i H e_i m_i
                basis = torch.zeros_like(m)
                basis[..., i] = 1.0
                column = hvp(basis)
                hess_m = hess_m + column * m[..., i : i + 1]
                trace_h = trace_h + column[..., i]
        else:
            trace_h, hess_m = probe_trace(hvp, probes), hvp(m)
        new = new + (lr * temperature / num_data) * monge_divergence(metric, m, hess_m, trace_h)
    if noise is not None:
        sigma = noise_scale(lr, num_data, temperature)
        new = new + sigma * metric.inverse_sqrt(stats, layout, noise)
    return new
