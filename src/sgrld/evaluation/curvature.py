"""Input-space curvature ``C(θ)`` of a classifier (after Srinivas et al. 2022).

Per test point, power iteration with Hessian–vector products estimates the top eigenvalue ρ_i
of the input Hessian of the NLL, and ``c_i = |ρ_i| / (‖g_i‖ + 1e-6)``. As in the reference, g
and H are of the batch-mean NLL (scaled by 1/B), so ``c_i = |λ_max(∇²ₓ NLL_i)| / (‖∇ₓ NLL_i‖ +
B·1e-6)``, and the power iteration's ``+1e-6`` is kept. The start vectors come from their own
generator, so measuring never perturbs a chain's noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from sgrld.likelihoods.categorical import Categorical

__all__ = ["CurvatureStats", "curvature_per_example", "measure_curvature"]

_EPS = 1e-6  # the reference's stabiliser, in both the power iteration and c_i


@dataclass(frozen=True, kw_only=True)
class CurvatureStats:
    """Curvature of one posterior sample over the evaluation points.

    Attributes:
        mean: Mean of ``c_i`` (the per-sample value averaged into the paper's "Curv.").
        std: Unbiased standard deviation of ``c_i``.
        rho_abs_mean: Mean of ``|ρ_i|`` (``1/B``-scaled).
        rho_abs_std: Its unbiased standard deviation.
        grad_norm_mean: Mean of ``‖g_i‖`` (``1/B``-scaled).
        grad_norm_std: Its unbiased standard deviation.
        curvature: Per-example ``c_i``, float64 on CPU, shape ``(num_points,)``.
        rho_abs: Per-example ``|ρ_i|``.
        grad_norm: Per-example ``‖g_i‖``.
    """

    mean: float
    std: float
    rho_abs_mean: float
    rho_abs_std: float
    grad_norm_mean: float
    grad_norm_std: float
    curvature: torch.Tensor
    rho_abs: torch.Tensor
    grad_norm: torch.Tensor


def _std(t: torch.Tensor) -> float:
    """Unbiased std as the reference's ``torch.Tensor.std``; NaN (no warning) below 2 values."""
    return float(t.std()) if t.numel() > 1 else math.nan


def _norm(t: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    """Per-example norm over all non-batch dims (``keepdim``: shaped to broadcast against t)."""
    norm = t.flatten(1).norm(dim=1)
    return norm.reshape(-1, *([1] * (t.ndim - 1))) if keepdim else norm


def curvature_per_example(
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    generator: torch.Generator,
    num_iterations: int = 20,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Power-iteration curvature of one batch, with the model used as is (no mode change).

    ``num_iterations`` steps ``u ← H u / (‖H u‖ + 1e-6)`` per example, then ``ρ = ⟨u, H u⟩``.
    The model must treat examples independently (e.g. batch norm in eval mode).

    Args:
        model: Maps ``inputs`` to logits ``(B, C)`` (a Bayesian model: its likelihood's η).
        inputs: Batch ``(B, ...)``; norms are over all non-batch dimensions.
        targets: Integer labels ``(B,)`` (regression: float targets).
        generator: Source of the Gaussian start vectors (its device is where they are drawn).
        num_iterations: Power iterations before the final HVP (20 in the reference).

    Returns:
        ``(c, |ρ|, ‖g‖)``, each of shape ``(B,)``, detached, in the inputs' dtype.
    """
    if num_iterations < 0:
        raise ValueError(f"num_iterations must be >= 0, got {num_iterations}")
    x = inputs.detach().clone().requires_grad_(True)
    u = torch.randn(x.shape, generator=generator, dtype=x.dtype, device=generator.device)
    u = u.to(x.device)
    u = u / _norm(u, keepdim=True)
    with torch.enable_grad():
        # batch-mean NLL, the reference's 1/B (a Bayesian model's own likelihood if it has one)
        likelihood = getattr(model, "likelihood", None)
        loss = (Categorical() if likelihood is None else likelihood).nll(model(x), targets)
        (grad,) = torch.autograd.grad(loss, x, create_graph=True)
        for _ in range(num_iterations):
            (hvp,) = torch.autograd.grad(grad, x, grad_outputs=u, retain_graph=True)
            u = hvp / (_norm(hvp, keepdim=True) + _EPS)
        (hvp,) = torch.autograd.grad(grad, x, grad_outputs=u)
    rho_abs = (u * hvp).flatten(1).sum(dim=1).abs().detach()
    grad_norm = _norm(grad).detach()
    return rho_abs / (grad_norm + _EPS), rho_abs, grad_norm


def measure_curvature(
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    generator: torch.Generator,
    num_points: int = 1000,
    batch_size: int = 100,
    num_iterations: int = 20,
) -> CurvatureStats:
    """Curvature ``C(θ)`` of a model on the first ``num_points`` evaluation points.

    The model is in eval mode meanwhile (modes restored after); no ``.grad`` is written and the
    global RNG is not touched.

    Args:
        model: Maps inputs to logits.
        inputs: Evaluation inputs ``(N, ...)`` in their fixed order (the official test order).
        targets: Integer labels ``(N,)``.
        generator: Dedicated generator for the power-iteration start vectors.
        num_points: How many leading points to use (1,000 in the paper).
        batch_size: Batch size ``B``; it enters ``c_i`` through the ``1/B`` scaling (100).
        num_iterations: Power iterations per batch before the final HVP (20).

    Returns:
        The per-example values and their summaries, see :class:`CurvatureStats`.

    References:
        Spec §4.5; Srinivas et al. (2022), "Efficient training of low-curvature neural networks".
    """
    if batch_size < 1 or num_points < 1:
        raise ValueError(f"batch_size and num_points must be >= 1, got {batch_size}, {num_points}")
    if num_points > len(inputs) or len(inputs) != len(targets):
        raise ValueError(
            f"need num_points ({num_points}) <= len(inputs) ({len(inputs)}) == len(targets) "
            f"({len(targets)})"
        )
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        parts = [
            curvature_per_example(
                model,
                inputs[start : start + batch_size][: num_points - start],
                targets[start : start + batch_size][: num_points - start],
                generator=generator,
                num_iterations=num_iterations,
            )
            for start in range(0, num_points, batch_size)
        ]
    finally:
        for module, training in modes:
            module.training = training
    curvature, rho_abs, grad_norm = (
        torch.cat([part[k] for part in parts]).to(device="cpu", dtype=torch.float64)
        for k in range(3)
    )
    return CurvatureStats(
        mean=float(curvature.mean()),
        std=_std(curvature),
        rho_abs_mean=float(rho_abs.mean()),
        rho_abs_std=_std(rho_abs),
        grad_norm_mean=float(grad_norm.mean()),
        grad_norm_std=_std(grad_norm),
        curvature=curvature,
        rho_abs=rho_abs,
        grad_norm=grad_norm,
    )
