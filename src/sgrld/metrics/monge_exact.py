"""The exact Riemannian drift Γ for Monge's metric with m = ∇u(θ) (Hartmann et al. 2022).

SGRLD drops Γ_i(θ) = Σ_j ∂(G⁻¹)_ij/∂θ_j (paper eq. 4). For the Monge metric of Hartmann et al.,
whose m is the gradient of the per-datum potential at the current point, m = ∇u(θ), it is cheap.
With s = ‖m‖², G⁻¹ = I − β(s) m mᵀ (β = −f₋₁ of :class:`~sgrld.metrics.MongeMetric`) and H = ∇²u:
∂_j m_i = H_ij and ∂_j β = β'(s)·2(Hm)_j, so

    Γ = −Σ_j ∂_j(β m_i m_j) = −2β'(s)(mᵀHm) m − β Hm − β tr(H) m.

For the fixed rule β = α²/(1+α²s) and β' = −β², which gives Γ = 2β²(mᵀHm) m − β Hm − β tr(H) m
(checked against finite differences of the dense G⁻¹ in
``tests/test_riemann.py``); for the normalised rule β = c/((1+c)s) and β' = −β/s, so there Γ
grows as 1/‖∇u‖ near critical points of u (on the funnel the corrected chain diverged:
``docs/results/beyond.md``; use the fixed rule with the correction). One Hessian–
vector product gives Hm; tr(H) is exact (D products, which also give Hm) or a Hutchinson estimate
with Rademacher probes (unbiased: E[zᵀHz] = tr H).

Scaling (``docs/conventions.md``): the Riemannian Langevin SDE for exp(−n·u/τ) is
dθ = (−G⁻¹∇(n u) + τΓ) dt + √(2τ) G^{-1/2} dW; its Euler–Maruyama step with h = ℓ/n is

    θ ← θ − ℓ·G⁻¹∇u + (ℓτ/n)·Γ + √(2ℓτ/n)·G^{-1/2}ξ,

i.e. Γ enters with the noise's variance factor hτ = ℓτ/n (on the funnel n = 1: ℓτΓ).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

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
    """Unbiased tr(H) per chain: the mean of zᵀHz over ``probes`` Rademacher vectors z.

    ``hvp(v)`` returns H v for ``v`` shaped like ``like`` ``(*batch, D)``.
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
    """One step θ ← θ − ℓ G⁻¹∇u + (ℓτ/n) Γ + √(2ℓτ/n) G^{-1/2}ξ with m = ∇u(θ) (module doc).

    ∇u and the Hessian–vector products come from autograd; :func:`exact_monge_move` is the same
    step for a caller with analytic derivatives.

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
    """The step of :func:`exact_monge_step` given m = ∇u(θ) and v ↦ ∇²u(θ)·v.

    G⁻¹ and G^{-1/2} are the :class:`~sgrld.metrics.MongeMetric`'s own (its α² rule included);
    its ``decay`` plays no part (m is the current gradient, not an average).

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

    References: Hartmann, Girolami, Klami: Lagrangian manifold Monte Carlo on Monge patches,
    AISTATS 2022; Girolami & Calderhead 2011 (the Γ term); Yu et al. 2023 eq. 4.
    """
    validate_hyperparameters(lr, num_data, temperature)
    if metric.scope != "global" or metric.fallback_threshold is not None:
        raise ValueError("the exact drift needs a Monge metric with scope='global', no fallback")
    if trace not in (None, "exact", "hutchinson"):
        raise ValueError(f"invalid trace: {trace!r} (expected 'exact', 'hutchinson' or None)")
    if isinstance(probes, bool) or not isinstance(probes, int) or probes < 1:
        raise ValueError(f"invalid probes: {probes!r} (expected an integer >= 1)")
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
    sync, so a caller can ``torch.compile`` blocks of it): ``probes`` ``(P, *batch, D)`` for
    Hutchinson's tr(H), ``None`` for the exact trace; ``noise`` ξ (overwritten), ``None`` when
    τ = 0."""
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
