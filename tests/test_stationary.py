"""Stationary moments of the discretised chain on Gaussian targets.

With a frozen metric the SGRLD step on u(θ) = ½(θ−μ)ᵀA(θ−μ) with gradient noise ζ ~ N(0, Σ_ζ) is
the linear chain θ' = Bθ + c + w, B = I − ℓPA, w ~ N(0, ℓ²PΣ_ζPᵀ + σ²SSᵀ), with P = G⁻¹,
S = G^{-1/2} and σ² = 2ℓτ/n. Its stationary law is N(μ, C) with C = BCBᵀ + Q (discrete Lyapunov
equation) — exactly, for any step size, not only as ℓ → 0. K independent chains run long enough
to forget their start give K iid draws, so the sample mean and covariance have known Monte-Carlo
standard errors: √(C_ii/K) and √((C_ii C_jj + C_ij²)/K). We accept deviations below Z of them.
"""

from __future__ import annotations

import pytest
import torch

import sgrld
from conftest import SAMPLERS, SamplerSpec, flatten_chains, unflatten_chains

K = 4000  # chains
Z = 5.0  # threshold in Monte-Carlo standard errors (≈ 6e-7 two-sided per statistic)
SHAPES = {"a": (2,), "b": (3, 5)}
D = 17
LR, NUM_DATA = 0.04, 4.0


def lyapunov(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Solve C = B C Bᵀ + Q through vec(C) = (I − B⊗B)⁻¹ vec(Q)."""
    d = b.shape[0]
    vec = torch.linalg.solve(torch.eye(d * d, dtype=b.dtype) - torch.kron(b, b), q.reshape(-1))
    c = vec.reshape(d, d)
    return (c + c.T) / 2


def _problem() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(D, D, generator=gen, dtype=torch.float64))
    a = q @ torch.diag(torch.linspace(0.5, 3.0, D, dtype=torch.float64)) @ q.T
    mu = torch.randn(D, generator=gen, dtype=torch.float64)
    return a, mu


def _dense(metric: sgrld.Metric, state: sgrld.SamplerState) -> tuple[torch.Tensor, torch.Tensor]:
    """P = G⁻¹ and S = G^{-1/2} of chain 0 (all chains share its statistics), column by column."""
    basis = torch.zeros(K, D, dtype=torch.float64)
    basis[:D] = torch.eye(D, dtype=torch.float64)
    p = metric.inverse(state.stats, state.layout, basis.clone())[:D].T
    s = metric.inverse_sqrt(state.stats, state.layout, basis.clone())[:D].T
    return p, s


@pytest.mark.parametrize("grad_noise", [0.0, 0.7])
def test_stationary_moments_match_lyapunov(spec: SamplerSpec, grad_noise: float) -> None:
    _check_stationary(spec, grad_noise, "torch")


@pytest.mark.parametrize("name", ["identity", "monge", "shampoo"])
def test_stationary_moments_with_philox_noise(name: str) -> None:
    """The counter-based noise source gives the same stationary law (sgrld.core.noise)."""
    _check_stationary(next(s for s in SAMPLERS if s.name == name), 0.7, "philox")


def _check_stationary(spec: SamplerSpec, grad_noise: float, noise: str) -> None:
    a, mu = _problem()
    sampler = sgrld.build(
        spec.name,
        lr=LR,
        num_data=NUM_DATA,
        noise=noise,  # type: ignore[arg-type]
        **spec.case.stationary,
    )
    gen = torch.Generator().manual_seed(1)
    noise_gen = torch.Generator().manual_seed(2)
    theta0 = mu + 0.3 * torch.randn(K, D, generator=gen, dtype=torch.float64)
    state = sampler.init(unflatten_chains(theta0, SHAPES), num_chains=K, generator=gen)

    def grads(adapt: bool) -> dict[str, torch.Tensor]:
        theta = flatten_chains(state.params)
        g = (theta - mu) @ a
        if grad_noise:
            g = g + grad_noise * torch.randn(K, D, generator=noise_gen, dtype=torch.float64)
        return unflatten_chains(g, SHAPES)

    for _ in range(150):  # adapt the metric (Shampoo refreshes its roots at 50, 100, 150)
        state = sampler.step(state, grads(True))
    sampler.refresh(state)  # Wenzel's preconditioner; a no-op for the others
    for v in state.stats.values():  # every chain gets chain 0's metric, then freeze it
        v.copy_(v[:1].expand_as(v))

    p, s = _dense(sampler.metric, state)
    b = torch.eye(D, dtype=torch.float64) - LR * p @ a
    sigma2 = 2 * LR * 1.0 / NUM_DATA
    q = LR**2 * grad_noise**2 * p @ p.T + sigma2 * s @ s.T
    torch.testing.assert_close(s @ s.T, p, rtol=1e-8, atol=1e-10)
    rho = float(torch.linalg.eigvals(b).abs().max())
    steps = 1500
    assert rho**steps < 1e-6, f"chain too slow to forget its start (ρ = {rho})"
    cov = lyapunov(b, q)

    for _ in range(steps):
        state = sampler.step(state, grads(False), adapt=False)
    theta = flatten_chains(state.params)

    mean_err = (theta.mean(0) - mu) / torch.sqrt(torch.diag(cov) / K)
    assert float(mean_err.abs().max()) < Z, f"mean off by {float(mean_err.abs().max()):.2f} s.e."
    centred = theta - mu
    emp = centred.T @ centred / K
    var = torch.diag(cov)
    se = torch.sqrt((torch.outer(var, var) + cov**2) / K)
    cov_err = (emp - cov) / se
    assert float(cov_err.abs().max()) < Z, (
        f"covariance off by {float(cov_err.abs().max()):.2f} s.e."
    )
    # A wrong noise scale (e.g. √2 off) would be caught: it changes C by a factor of 2.
    assert float(((emp - 2 * cov) / se).abs().max()) > Z
