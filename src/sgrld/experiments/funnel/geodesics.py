"""``sgrld geodesics``: Monge-metric geodesics on the funnel (the paper's Figure 1).

The geodesics of G(x) = I + α² ∇ℓ ∇ℓᵀ, ℓ = log p, solve (Hartmann et al. 2022)

    ẍ = −( α² ⟨ẋ, ∇²ℓ(x) ẋ⟩ / (1 + α² ‖∇ℓ(x)‖²) ) · ∇ℓ(x),

integrated as the reference does (RK45, t ∈ [0, 1]) from x̂ with velocities 10·(cos 2πu,
sin 2πu): the red curve joins the end points of 500 directions, 9 geodesics are drawn whole.
Needs scipy, and matplotlib for the figures; outputs in ``docs/funnel.md``.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from sgrld.experiments.base.files import sha256_hex, write_atomic

MANIFEST = "geodesics.json"  # the settings and each figure's SHA-256, written last

__all__ = ["BASE_POINTS", "compute_panel", "geodesic", "geodesic_rhs", "plot_panel", "write_set"]

#: name → base point x̂ (the paper's Figure 1: the two panels of the funnel's contours).
BASE_POINTS: dict[str, tuple[float, float]] = {"neck": (2.0, -4.0), "flat": (5.0, 10.0)}
SPEED = 10.0  # |ẋ(0)| (the reference's ``multiplier``)


def _funnel_derivatives(
    x: np.ndarray, w: np.ndarray, mean: float, v_variance: float, clip: float
) -> tuple[np.ndarray, np.ndarray]:
    """∇ℓ(x) and ∇²ℓ(x)·w as :class:`FunnelTarget` computes them, in floats: the ODE solver's
    single-point calls would be dominated by tensor overhead (``tests/test_geodesics.py``)."""
    t1, v = float(x[0]), float(x[1])
    s = math.log1p(math.exp(-abs(v))) + max(v, 0.0)  # softplus: the variance of θ₁
    s1 = 1.0 / (1.0 + math.exp(-v)) if v >= 0 else math.exp(v) / (1.0 + math.exp(v))
    s2 = s1 - s1 * s1
    d = t1 - mean
    grad = np.array([-d / s, -0.5 * s1 / s + 0.5 * d * d * s1 / (s * s) - v / v_variance])
    h11 = -1.0 / s
    h12 = d * s1 / (s * s)
    h22 = (
        -0.5 * (s2 / s - s1 * s1 / (s * s))
        + 0.5 * d * d * (s2 / (s * s) - 2.0 * s1 * s1 / (s * s * s))
        - 1.0 / v_variance
    )
    hvp = np.array([h11 * w[0] + h12 * w[1], h12 * w[0] + h22 * w[1]])
    return _clip(grad, clip), _clip(hvp, clip)


def _clip(u: np.ndarray, threshold: float) -> np.ndarray:
    norm = float(np.linalg.norm(u))
    if math.isfinite(norm) and norm > threshold:
        return threshold * u / norm
    return np.where(np.isnan(u), 1.0, u)


def geodesic_rhs(alpha2: float = 1.0) -> Callable[[float, np.ndarray], np.ndarray]:
    """f(t, y) for y = (x, ẋ): (ẋ, −α²⟨ẋ, ∇²ℓ ẋ⟩/(1 + α²‖∇ℓ‖²) · ∇ℓ) on the paper's funnel."""
    from sgrld.data.funnel import FunnelTarget

    target = FunnelTarget()

    def rhs(t: float, y: np.ndarray) -> np.ndarray:
        x, xdot = y[:2], y[2:]
        grad, hvp = _funnel_derivatives(x, xdot, target.mean, target.v_variance, target.clip_norm)
        coef = alpha2 * float(xdot @ hvp) / (1.0 + alpha2 * float(grad @ grad))
        return np.concatenate([xdot, -coef * grad])

    return rhs


def geodesic(
    base: tuple[float, float] | np.ndarray,
    velocity: np.ndarray,
    alpha2: float = 1.0,
    **solve_ivp_options: Any,
) -> np.ndarray:
    """The geodesic from ``base`` with initial ``velocity``: ``(20, 2)`` points, t = 0 … 1 (RK45,
    scipy's default tolerances unless ``solve_ivp_options`` override them)."""
    from scipy.integrate import solve_ivp

    y0 = np.concatenate([np.asarray(base, dtype=np.float64), np.asarray(velocity, np.float64)])
    sol = solve_ivp(
        geodesic_rhs(alpha2), (0.0, 1.0), y0, t_eval=np.linspace(0.0, 1.0, 20), **solve_ivp_options
    )
    if not sol.success:
        raise RuntimeError(f"geodesic from {tuple(y0[:2])} failed: {sol.message}")
    return np.asarray(sol.y[:2].T)


def _directions(n: int) -> np.ndarray:
    u = np.linspace(0.0, 1.0, n)
    return np.stack([np.cos(2 * np.pi * u), np.sin(2 * np.pi * u)], axis=-1)


def compute_panel(
    base: tuple[float, float], alpha2: float = 1.0, num_surface: int = 500, num_paths: int = 9
) -> tuple[np.ndarray, list[np.ndarray]]:
    """End points of ``num_surface`` geodesics (the red curve) and ``num_paths`` full paths."""
    ends = np.stack([geodesic(base, SPEED * d, alpha2)[-1] for d in _directions(num_surface)])
    paths = [geodesic(base, SPEED * d, alpha2) for d in _directions(num_paths)]
    return ends, paths


def plot_panel(
    base: tuple[float, float],
    ends: np.ndarray,
    paths: list[np.ndarray],
    path: Path | str | io.BytesIO,
) -> None:
    """One panel of Figure 1: contours, the red end-point curve and the arrowed geodesics."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    from sgrld.data.funnel import FunnelTarget

    x0 = np.arange(-5.0, 9.0, 0.05)
    x1 = np.arange(-25.0, 25.0, 0.05)
    grid = torch.from_numpy(np.stack(np.meshgrid(x0, x1), axis=-1))
    logp = FunnelTarget().log_prob(grid).numpy()
    fig, ax = plt.subplots(figsize=(6, 6))
    ax.contour(x0, x1, logp, [-10.0, -7.5, -5.0, -2.5])
    ax.plot(ends[:, 0], ends[:, 1], color="red", lw=1.5)
    for p in paths:
        ax.plot(p[:, 0], p[:, 1], color="black", lw=1.0)
        ax.annotate(
            "",
            xy=(p[-1, 0], p[-1, 1]),
            xytext=(p[-2, 0], p[-2, 1]),
            arrowprops={"arrowstyle": "->", "color": "black", "lw": 1.0},
        )
    ax.plot([base[0]], [base[1]], "o", color="black", ms=4)
    ax.set_xlim(-5.0, 9.0)
    ax.set_ylim(-25.0, 25.0)
    ax.set_xlabel("θ₁")
    ax.set_ylabel("v")
    fig.savefig(path, dpi=200, bbox_inches="tight", format="png")
    plt.close(fig)


def write_set(out: Path, files: dict[str, bytes], settings: dict[str, Any]) -> list[Path]:
    """Write the figures as one set: ``geodesics.json`` (the settings and each figure's SHA-256)
    removed first and written last, each file replaced atomically."""
    listing = out / MANIFEST
    listing.unlink(missing_ok=True)
    written = []
    for name, data in files.items():
        write_atomic(out / name, data)
        written.append(out / name)
    record = {**settings, "files": {name: sha256_hex(data) for name, data in files.items()}}
    write_atomic(listing, json.dumps(record, indent=2) + "\n")
    return [*written, listing]
