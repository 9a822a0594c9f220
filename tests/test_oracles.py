"""Dense-matrix oracles: every metric's G⁻¹ and G^{-1/2} and whole trajectories.

The oracles (``tests/metric_cases.py``, one per registered metric) re-derive each metric from the
paper / reference formulas with explicit D×D matrices (float64) and no code shared with the
library. Shampoo's own maths (blocking, roots) is tested further in test_shampoo.py.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import sgrld
from metric_cases import CASES, DenseOracle, sym_inverse_sqrt
from sgrld.core.layout import FlatLayout

SHAPES = {"w": (4, 3), "b": (3,), "s": ()}
D = sum(math.prod(s) for s in SHAPES.values())
SIZES = [math.prod(s) for s in SHAPES.values()]


#: (registry name, options) of every oracle case of every registered metric
ORACLE_CASES = [(name, opt) for name, case in CASES.items() for opt in case.oracle_options]
ORACLE_IDS = [f"{n}-{i}" for i, (n, _) in enumerate(ORACLE_CASES)]


def _oracle(name: str, opt: dict[str, Any]) -> DenseOracle:
    return CASES[name].oracle(list(SHAPES.values()), **opt)


def _flat_ops(
    name: str, opt: dict[str, Any]
) -> tuple[sgrld.Metric, FlatLayout, dict[str, torch.Tensor]]:
    metric = sgrld.get_metric(name)(**opt)
    layout = FlatLayout(tuple(SHAPES), tuple(SHAPES.values()))
    stats = metric.init(layout, torch.zeros(1, dtype=torch.float64))
    return metric, layout, stats


@pytest.mark.parametrize(("name", "opt"), ORACLE_CASES, ids=ORACLE_IDS)
def test_inverse_and_inverse_sqrt_match_dense(name: str, opt: dict[str, Any]) -> None:
    metric, layout, stats = _flat_ops(name, opt)
    oracle = _oracle(name, opt)
    gen = torch.Generator().manual_seed(0)
    for step in range(1, 7):
        g = torch.randn(D, generator=gen, dtype=torch.float64) * torch.linspace(
            0.1, 3, D, dtype=torch.float64
        )
        metric.update(stats, layout, g.clone(), step)
        oracle.update(g, step)
        # a refresh when the engine would run one, and an explicit one (Wenzel's) at step 4
        if step == 4 or (metric.refresh_interval and step % metric.refresh_interval == 0):
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
    metric, layout, stats = _flat_ops("rmsprop", {"decay": 0.99, "eps": 1e-8, "floor": 0.0})
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
        "monge", {"alpha2": 0.1, "decay": 0.7, "fallback_threshold": thr, "alpha2_rule": "fixed"}
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
                noise, sym_inverse_sqrt(torch.linalg.inv(dense)) @ xi, rtol=1e-10, atol=1e-12
            )


@pytest.mark.parametrize(("name", "opt"), ORACLE_CASES, ids=ORACLE_IDS)
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
    oracle, theta = _oracle(name, opt), theta0.clone()
    interval = sampler.metric.refresh_interval
    oracle_gen = torch.Generator().manual_seed(11)
    sigma = math.sqrt(2 * lr * temperature / n)
    for t in range(25):
        g = a * theta + 0.2 * theta**3
        oracle.update(g, t + 1)
        if interval and (t + 1) % interval == 0:  # the engine refreshes right after the update
            oracle.refresh()
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
        if t % 5 == 4:  # an explicit refresh (Wenzel's preconditioner at an epoch end)
            sampler.refresh(state)
            oracle.refresh()
    flat = torch.cat([v.reshape(-1) for v in state.params.values()])
    torch.testing.assert_close(flat, theta, rtol=1e-9, atol=1e-11)


def test_wenzel_min_scale_floors_the_scales_a_refresh_sets() -> None:
    layout = FlatLayout(tuple(SHAPES), tuple(SHAPES.values()))
    g = torch.cat([torch.full((12,), 0.1), torch.full((3,), 1.0), torch.full((1,), 10.0)])
    scales = []
    for min_scale in (0.0, 0.05):
        metric = sgrld.WenzelMetric(decay=0.0, eps=0.0, min_scale=min_scale)
        stats = metric.init(layout, torch.zeros(1, dtype=torch.float64))
        metric.update(stats, layout, g.double(), 1)
        metric.refresh(stats, layout)
        scales.append(stats["scale"])
    torch.testing.assert_close(scales[0], torch.tensor([1.0, 0.1, 0.01], dtype=torch.float64))
    torch.testing.assert_close(scales[1], torch.tensor([1.0, 0.1, 0.05], dtype=torch.float64))
