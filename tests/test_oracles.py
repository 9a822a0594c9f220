"""Dense-matrix oracles: every metric's G⁻¹ and G^{-1/2} and whole trajectories.

Each oracle re-derives the metric from the paper / reference formulas with explicit D×D matrices
(float64) and no code shared with the library. Shampoo's oracle lives in test_shampoo.py.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import sgrld
from sgrld.core.layout import FlatLayout

SHAPES = {"w": (4, 3), "b": (3,), "s": ()}
D = sum(math.prod(s) for s in SHAPES.values())
SIZES = [math.prod(s) for s in SHAPES.values()]


def _sym_sqrt_inv(g: torch.Tensor) -> torch.Tensor:
    evals, evecs = torch.linalg.eigh(g)
    return evecs @ torch.diag(evals.rsqrt()) @ evecs.T


class DenseOracle:
    """Reference implementation of one metric's statistics with dense matrices."""

    def __init__(self, name: str, **opt: Any) -> None:
        self.name, self.opt = name, opt
        self.v = (
            torch.zeros(D, dtype=torch.float64)
            if name == "rmsprop"
            else torch.ones(D, dtype=torch.float64)
        )
        self.m = torch.zeros(D, dtype=torch.float64)
        self.scale = torch.ones(len(SIZES), dtype=torch.float64)

    def update(self, g: torch.Tensor) -> None:
        lam = self.opt.get("decay", 0.0)
        if self.name in ("rmsprop", "wenzel"):
            self.v = lam * self.v + (1 - lam) * g * g
        if self.name == "monge":
            self.m = lam * self.m + (1 - lam) * g

    def refresh(self) -> None:
        s = torch.stack([seg.mean() for seg in self.v.split(SIZES)]) + self.opt["eps"]
        self.scale = torch.sqrt(s.min() / s)

    def g_inv(self) -> torch.Tensor:
        if self.name == "identity":
            return torch.eye(D, dtype=torch.float64)
        if self.name == "rmsprop":
            return torch.diag(1.0 / (self.v.sqrt() + self.opt["eps"]))
        if self.name == "wenzel":
            return torch.diag(
                torch.cat(
                    [
                        s * torch.ones(n, dtype=torch.float64)
                        for s, n in zip(self.scale, SIZES, strict=True)
                    ]
                )
            )

        def alpha2(m: torch.Tensor) -> float:  # "normalized": α² = c/‖m‖², stretch 1 + c
            c = self.opt["alpha2"]
            return c / float(m @ m) if self.opt.get("alpha2_rule") == "normalized" else c

        if self.opt.get("scope") == "tensor":
            blocks = [
                torch.eye(n, dtype=torch.float64) + alpha2(m) * torch.outer(m, m)
                for m, n in zip(self.m.split(SIZES), SIZES, strict=True)
            ]
            return torch.linalg.inv(torch.block_diag(*blocks))
        return torch.linalg.inv(
            torch.eye(D, dtype=torch.float64) + alpha2(self.m) * torch.outer(self.m, self.m)
        )

    def g_inv_sqrt(self) -> torch.Tensor:
        return _sym_sqrt_inv(torch.linalg.inv(self.g_inv()))


CASES = [
    ("identity", {}),
    ("rmsprop", {"decay": 0.9, "eps": 1e-8}),
    ("rmsprop", {"decay": 0.99, "eps": 0.0}),
    ("wenzel", {"decay": 0.9, "eps": 1e-8}),
    ("monge", {"alpha2": 1.5, "decay": 0.7}),
    ("monge", {"alpha2": 0.3, "decay": 0.9, "scope": "tensor"}),
    ("monge", {"alpha2": 2.0, "decay": 0.7, "alpha2_rule": "normalized"}),
    ("monge", {"alpha2": 0.5, "decay": 0.9, "scope": "tensor", "alpha2_rule": "normalized"}),
]


def _flat_ops(
    name: str, opt: dict[str, Any]
) -> tuple[sgrld.Metric, FlatLayout, dict[str, torch.Tensor]]:
    metric = sgrld.get_metric(name)(**opt)
    layout = FlatLayout(tuple(SHAPES), tuple(SHAPES.values()))
    stats = metric.init(layout, torch.zeros(1, dtype=torch.float64))
    return metric, layout, stats


@pytest.mark.parametrize(("name", "opt"), CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_inverse_and_inverse_sqrt_match_dense(name: str, opt: dict[str, Any]) -> None:
    metric, layout, stats = _flat_ops(name, opt)
    oracle = DenseOracle(name, **opt)
    gen = torch.Generator().manual_seed(0)
    for step in range(1, 7):
        g = torch.randn(D, generator=gen, dtype=torch.float64) * torch.linspace(
            0.1, 3, D, dtype=torch.float64
        )
        metric.update(stats, layout, g.clone(), step)
        oracle.update(g)
        if name == "wenzel" and step == 4:
            metric.refresh(stats, layout)
            oracle.refresh()
        v = torch.randn(D, generator=gen, dtype=torch.float64)
        torch.testing.assert_close(
            metric.inverse(stats, layout, v.clone()), oracle.g_inv() @ v, rtol=1e-10, atol=1e-12
        )
        torch.testing.assert_close(
            metric.inverse_sqrt(stats, layout, v.clone()),
            oracle.g_inv_sqrt() @ v,
            rtol=1e-9,
            atol=1e-11,
        )
        # (G^{-1/2})² = G⁻¹ through the library alone
        twice = metric.inverse_sqrt(stats, layout, metric.inverse_sqrt(stats, layout, v.clone()))
        torch.testing.assert_close(
            twice, metric.inverse(stats, layout, v.clone()), rtol=1e-10, atol=1e-12
        )


def test_rmsprop_first_step_preconditioner_is_ten_over_abs_g() -> None:
    metric, layout, stats = _flat_ops("rmsprop", {"decay": 0.99, "eps": 1e-8})
    g = torch.linspace(-2, 3, D, dtype=torch.float64)
    g[g == 0] = 0.5
    metric.update(stats, layout, g.clone(), 1)
    ones = torch.ones(D, dtype=torch.float64)
    torch.testing.assert_close(
        metric.inverse(stats, layout, ones), 1 / (0.1 * g.abs() + 1e-8), rtol=1e-12, atol=0
    )


def test_wenzel_is_identity_until_refresh_then_sqrt_of_ratio() -> None:
    metric, layout, stats = _flat_ops("wenzel", {"decay": 0.99, "eps": 1e-8})
    gen = torch.Generator().manual_seed(1)
    ones = torch.ones(D, dtype=torch.float64)
    v = torch.ones(D, dtype=torch.float64)  # the reference's element-wise EMA of g², from ones
    for step in range(1, 50):
        g = torch.randn(D, generator=gen, dtype=torch.float64) * torch.linspace(0.1, 5, D)
        v = 0.99 * v + 0.01 * g * g
        metric.update(stats, layout, g.clone(), step)
        assert torch.equal(metric.inverse(stats, layout, ones.clone()), ones)
    metric.refresh(stats, layout)
    s = torch.stack([seg.mean() for seg in v.split(SIZES)]) + 1e-8
    expect = torch.cat([torch.sqrt(s.min() / si).expand(n) for si, n in zip(s, SIZES, strict=True)])
    torch.testing.assert_close(
        metric.inverse(stats, layout, ones.clone()), expect, rtol=1e-12, atol=0
    )
    assert float(expect.max()) == pytest.approx(1.0)


@pytest.mark.parametrize("norm", [0.0, 1e-30, 1e-12, 1e-6])
def test_monge_tiny_norm_is_safe(norm: float) -> None:
    """f₋½ → −α²/2 as ‖m‖ → 0 with no guard and no cancellation."""
    alpha2 = 2.0
    metric, layout, stats = _flat_ops("monge", {"alpha2": alpha2, "decay": 0.0})
    m = torch.ones(D, dtype=torch.float64) / math.sqrt(D) * norm
    metric.update(stats, layout, m.clone(), 1)
    v = torch.linspace(-1, 1, D, dtype=torch.float64)
    out = metric.inverse_sqrt(stats, layout, v.clone())
    s = norm**2
    f_half = -alpha2 / (math.sqrt(1 + alpha2 * s) * (1 + math.sqrt(1 + alpha2 * s)))
    assert f_half == pytest.approx(-alpha2 / 2, rel=1e-6)
    torch.testing.assert_close(out, v + f_half * torch.dot(m, v) * m, rtol=1e-14, atol=1e-300)
    assert bool(torch.isfinite(out).all())


def test_monge_fallback_matches_funnel_rule() -> None:
    """Reference §5.3: if ‖G⁻¹g‖ > T use G = (‖g‖/T)·I for drift and noise."""
    thr = 5.0
    metric, layout, stats = _flat_ops(
        "monge", {"alpha2": 0.1, "decay": 0.7, "fallback_threshold": thr}
    )
    metric.update(stats, layout, torch.linspace(-1, 2, D, dtype=torch.float64), 1)
    for scale, fires in ((1.0, False), (100.0, True)):
        g = torch.cos(torch.arange(D, dtype=torch.float64)) * scale
        xi = torch.linspace(0.5, -0.5, D, dtype=torch.float64)
        m = stats["exp_avg"]
        dense = torch.linalg.inv(torch.eye(D, dtype=torch.float64) + 0.1 * torch.outer(m, m))
        drift = metric.inverse(stats, layout, g.clone())
        noise = metric.inverse_sqrt(stats, layout, xi.clone())
        assert bool((dense @ g).norm() > thr) == fires
        if fires:
            c = g.norm() / thr
            torch.testing.assert_close(drift, g / c, rtol=1e-12, atol=0)
            torch.testing.assert_close(noise, xi / c.sqrt(), rtol=1e-12, atol=0)
        else:
            torch.testing.assert_close(drift, dense @ g, rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(
                noise, _sym_sqrt_inv(torch.linalg.inv(dense)) @ xi, rtol=1e-10, atol=1e-12
            )


@pytest.mark.parametrize(("name", "opt"), CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_trajectory_matches_dense_oracle(
    name: str, opt: dict[str, Any], temperature: float
) -> None:
    """θ ← θ − ℓG⁻¹g + √(2ℓτ/n)G^{-1/2}ξ with dense matrices and the same ξ stream."""
    lr, n = 0.03, 20.0
    gen = torch.Generator().manual_seed(7)
    theta0 = torch.randn(D, generator=gen, dtype=torch.float64)
    a = torch.linspace(0.5, 2.0, D, dtype=torch.float64)
    params = {
        k: v.clone()
        for k, v in zip(
            SHAPES,
            (t.reshape(s) for t, s in zip(theta0.split(SIZES), SHAPES.values(), strict=True)),
            strict=True,
        )
    }
    sampler = sgrld.build(name, lr=lr, num_data=n, temperature=temperature, **opt)
    state = sampler.init(params, generator=torch.Generator().manual_seed(11))
    oracle, theta = DenseOracle(name, **opt), theta0.clone()
    oracle_gen = torch.Generator().manual_seed(11)
    sigma = math.sqrt(2 * lr * temperature / n)
    for t in range(25):
        g = a * theta + 0.2 * theta**3
        oracle.update(g)
        xi = (
            torch.randn(D, generator=oracle_gen, dtype=torch.float64)
            if temperature
            else torch.zeros(D, dtype=torch.float64)
        )
        theta = theta - lr * oracle.g_inv() @ g + sigma * oracle.g_inv_sqrt() @ xi
        flat = torch.cat([v.reshape(-1) for v in state.params.values()])
        grads = {
            k: v.reshape(s)
            for k, v, s in zip(
                SHAPES, (a * flat + 0.2 * flat**3).split(SIZES), SHAPES.values(), strict=True
            )
        }
        state = sampler.step(state, grads)
        if name == "wenzel" and t % 5 == 4:
            sampler.refresh(state)
            oracle.refresh()
    flat = torch.cat([v.reshape(-1) for v in state.params.values()])
    torch.testing.assert_close(flat, theta, rtol=1e-9, atol=1e-11)
