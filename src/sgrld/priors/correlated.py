"""Correlated Normal prior over conv filters (Fortuin et al. 2022, ``convcorrnormal``).

Each K_h×K_w filter is N(0, Σ), Σ_ab = σ² exp(−d_ab / ℓ) over the row-major grid (exponential,
although the reference class is "SquaredExponentialNormal"). The Cholesky factor and its
inverse are computed once (float64), where the reference rebuilds them at every evaluation.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from sgrld.priors.base import Prior, PriorConfig, register, standard_normal
from sgrld.priors.gaussian import HALF_LOG_2PI, GaussianPrior


def exponential_correlation(kernel_size: tuple[int, int], lengthscale: float = 1.0) -> Tensor:
    """exp(−d_ab/ℓ) over the row-major flattened K_h×K_w grid, float64 of shape (K_h·K_w,)*2."""
    rows, cols = torch.meshgrid(
        torch.arange(kernel_size[0], dtype=torch.float64),
        torch.arange(kernel_size[1], dtype=torch.float64),
        indexing="ij",
    )
    points = torch.stack([rows.flatten(), cols.flatten()], dim=1)
    return torch.exp(-torch.cdist(points, points) / lengthscale)


@register
class ConvCorrelatedNormal(Prior):
    """Independent MVN(0, σ² exp(−d/ℓ)) over every K_h×K_w filter of a conv kernel.

    Args:
        kernel_size: K or (K_h, K_w); ``log_prob`` checks the value's last two dims against it.
        scale: σ (1.41/sqrt(C_in) in the reference).
        lengthscale: ℓ > 0 (1 in the reference).
    """

    name = "convcorrnormal"
    scale_tril: Tensor
    inverse_tril: Tensor

    def __init__(
        self, kernel_size: int | tuple[int, int], scale: float, lengthscale: float = 1.0
    ) -> None:
        super().__init__()
        size = (kernel_size, kernel_size) if isinstance(kernel_size, int) else tuple(kernel_size)
        if len(size) != 2 or min(size) < 1:
            raise ValueError(f"kernel_size must be a positive int or pair, got {kernel_size}")
        if not (scale > 0 and lengthscale > 0):
            raise ValueError(f"scale and lengthscale must be > 0, got {scale}, {lengthscale}")
        self.kernel_size: tuple[int, int] = (int(size[0]), int(size[1]))
        self.scale = float(scale)
        self.lengthscale = float(lengthscale)
        chol = torch.linalg.cholesky(
            scale**2 * exponential_correlation(self.kernel_size, lengthscale)
        )
        inverse = torch.linalg.solve_triangular(
            chol, torch.eye(len(chol), dtype=torch.float64), upper=False
        )
        dtype = torch.get_default_dtype()
        self.register_buffer("scale_tril", chol.to(dtype), persistent=False)
        self.register_buffer("inverse_tril", inverse.to(dtype), persistent=False)
        # log-normaliser per filter: ½ log det Σ + (k/2) log 2π
        self._log_norm = float(torch.log(torch.diagonal(chol)).sum()) + len(chol) * HALF_LOG_2PI

    @property
    def dim(self) -> int:
        """Dimension K_h·K_w of each filter."""
        return self.kernel_size[0] * self.kernel_size[1]

    def log_prob(self, value: Tensor) -> Tensor:
        """Σ over filters of log MVN(filter; 0, Σ), with the cached inverse Cholesky factor."""
        if tuple(value.shape[-2:]) != self.kernel_size:
            raise ValueError(
                f"expected a kernel ending in {self.kernel_size}, got {tuple(value.shape)}"
            )
        filters = value.reshape(-1, self.dim)
        whitened = filters @ self.inverse_tril.T  # rows L⁻¹ x, so |L⁻¹x|² = xᵀ Σ⁻¹ x
        return -0.5 * whitened.square().sum() - filters.shape[0] * self._log_norm

    def sample(self, shape: torch.Size, generator: torch.Generator | None = None) -> Tensor:
        """Independent filter draws L ξ; ``shape`` must end in the kernel size."""
        if tuple(shape[-2:]) != self.kernel_size:
            raise ValueError(f"expected a shape ending in {self.kernel_size}, got {tuple(shape)}")
        count = math.prod(shape) // self.dim
        noise = standard_normal(torch.Size((count, self.dim)), generator, self.scale_tril.device)
        return (noise @ self.scale_tril.T).reshape(shape)

    @classmethod
    def for_parameter(cls, shape: torch.Size, scale: float, config: PriorConfig) -> Prior:
        """Correlated for 4-d conv kernels; dense weights and biases get N(0, scale²)."""
        if len(shape) != 4:
            return GaussianPrior(scale)
        return cls((shape[2], shape[3]), scale, lengthscale=config.lengthscale)

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, scale={self.scale:.4g}, ell={self.lengthscale}"
