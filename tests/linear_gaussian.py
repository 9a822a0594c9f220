"""Exact oracles of Bayesian linear regression with known noise, shared by the posterior tests.

Likelihood N(y | Xθ, s²), prior N(0, I): the posterior is N(μ, Σ) with Σ = (XᵀX/s² + I)⁻¹ and
μ = ΣXᵀy/s². With full-batch gradients the per-datum potential's gradient is Aθ − b
(A = Σ⁻¹/n, b = Xᵀy/(n s²)), so a chain θ ← Bθ + c + noise of covariance Q is linear Gaussian:
its stationary covariance solves the discrete Lyapunov equation C = B C Bᵀ + Q.
"""

from __future__ import annotations

import torch


def linear_posterior(
    x: torch.Tensor, y: torch.Tensor, noise_var: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A, b of the per-datum potential, the exact posterior mean μ and covariance Σ."""
    n, d = x.shape
    a = x.T @ x / (n * noise_var) + torch.eye(d, dtype=x.dtype) / n
    b = x.T @ y / (n * noise_var)
    return a, b, torch.linalg.solve(a, b), torch.linalg.inv(a) / n


def lyapunov(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """C with C = B C Bᵀ + Q for each leading index of ``b``, ``q`` ``(K, d, d)``."""
    d = b.shape[-1]
    kron = torch.einsum("kij,klm->kiljm", b, b).reshape(-1, d * d, d * d)
    eye = torch.eye(d * d, dtype=b.dtype)
    c = torch.linalg.solve(eye - kron, q.reshape(-1, d * d, 1)).reshape(-1, d, d)
    return (c + c.transpose(1, 2)) / 2
