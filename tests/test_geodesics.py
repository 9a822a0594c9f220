"""Monge-metric geodesics on the funnel (the paper's Figure 1)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from sgrld.cli import main
from sgrld.data.funnel import FunnelTarget
from sgrld.experiments.funnel import geodesics

pytest.importorskip("scipy")
TARGET = FunnelTarget()


def _derivatives(x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return geodesics._funnel_derivatives(x, w, TARGET.mean, TARGET.v_variance, TARGET.clip_norm)


def _metric(x: np.ndarray, alpha2: float) -> np.ndarray:
    grad, _ = _derivatives(x, np.zeros(2))
    return np.eye(2) + alpha2 * np.outer(grad, grad)


@pytest.mark.parametrize("point", [(2.0, -4.0), (5.0, 10.0), (-1.0, 0.3), (2.5, -12.0)])
def test_float_derivatives_match_the_target(point: tuple[float, float]) -> None:
    x = np.array(point)
    w = np.array([0.3, -1.7])
    grad, hvp = _derivatives(x, w)
    xt, wt = torch.tensor(x), torch.tensor(w)
    np.testing.assert_allclose(grad, TARGET.grad_log_prob(xt).numpy(), rtol=1e-12)
    np.testing.assert_allclose(hvp, TARGET.hvp_log_prob(xt, wt).numpy(), rtol=1e-12)
    # The Hessian-vector product is the directional derivative of the gradient.
    h = 1e-6
    fd = (_derivatives(x + h * w, w)[0] - _derivatives(x - h * w, w)[0]) / (2 * h)
    np.testing.assert_allclose(hvp, fd, rtol=1e-6, atol=1e-8)


def test_rhs_is_the_monge_geodesic_equation() -> None:
    alpha2 = 1.0
    y = np.array([2.0, -4.0, 3.0, -1.0])
    f = geodesics.geodesic_rhs(alpha2)(0.0, y)
    grad, hvp = _derivatives(y[:2], y[2:])
    expected = -alpha2 * (y[2:] @ hvp) / (1 + alpha2 * grad @ grad) * grad
    np.testing.assert_allclose(f[:2], y[2:], rtol=0)
    np.testing.assert_allclose(f[2:], expected, rtol=1e-14)


def test_rhs_equals_christoffel_symbols_of_the_monge_metric() -> None:
    """ẍᵏ = −Γᵏᵢⱼ ẋⁱẋʲ with Γ from finite differences of G(x) = I + α²∇ℓ∇ℓᵀ."""
    alpha2, h = 0.7, 1e-5
    x, xdot = np.array([1.2, -2.5]), np.array([0.8, 2.0])
    dg = np.stack(  # dg[k] = ∂G/∂x_k
        [(_metric(x + h * e, alpha2) - _metric(x - h * e, alpha2)) / (2 * h) for e in np.eye(2)]
    )
    # Γ_kij (first kind) = ½(∂_i G_kj + ∂_j G_ki − ∂_k G_ij)
    gamma1 = 0.5 * (
        np.einsum("ikj->kij", dg) + np.einsum("jki->kij", dg) - np.einsum("kij->kij", dg)
    )
    accel = -np.linalg.solve(_metric(x, alpha2), np.einsum("kij,i,j->k", gamma1, xdot, xdot))
    f = geodesics.geodesic_rhs(alpha2)(0.0, np.concatenate([x, xdot]))
    np.testing.assert_allclose(f[2:], accel, rtol=1e-5, atol=1e-7)


def test_geodesics_keep_their_metric_speed() -> None:
    from scipy.integrate import solve_ivp

    alpha2 = 1.0
    y0 = np.array([2.0, -4.0, 10 * np.cos(1.0), 10 * np.sin(1.0)])
    sol = solve_ivp(geodesics.geodesic_rhs(alpha2), (0, 1), y0, rtol=1e-10, atol=1e-10)
    speeds = [
        sol.y[2:, i] @ _metric(sol.y[:2, i], alpha2) @ sol.y[2:, i] for i in range(sol.y.shape[1])
    ]
    np.testing.assert_allclose(speeds, speeds[0], rtol=1e-6)


def test_zero_alpha2_gives_straight_lines() -> None:
    path = geodesics.geodesic((5.0, 10.0), np.array([3.0, -4.0]), alpha2=0.0)
    assert path.shape == (20, 2)
    np.testing.assert_allclose(path[-1], [8.0, 6.0], rtol=1e-9)


def test_cli_writes_both_panels(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    assert main(["geodesics", "--out", str(tmp_path), "--directions", "12"]) == 0
    for name in ("neck", "flat"):
        assert (tmp_path / f"geodesics_{name}.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "geodesics.json",  # written last: the set's listing
        "geodesics_flat.png",
        "geodesics_neck.png",
    ]


def test_cli_rejects_bad_input(tmp_path: Path) -> None:
    assert main(["geodesics", "--out", str(tmp_path), "--alpha2", "-1"]) == 2
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["geodesics", "--out", str(blocker / "sub")]) == 74  # EX_IOERR, as every command
