"""Monge's scale-free rule α²_t = c/‖m_t‖² (issue 14 §1); the dense oracle is in test_oracles."""

from __future__ import annotations

import math

import pytest
import torch

import sgrld
from conftest import check_resume_is_bit_identical, quadratic_problem
from sgrld.core.layout import FlatLayout

D = 7


def _metric(**opt: object) -> tuple[sgrld.MongeMetric, FlatLayout, dict[str, torch.Tensor]]:
    metric = sgrld.MongeMetric(**opt)  # type: ignore[arg-type]
    layout = FlatLayout(("w",), ((D,),))
    return metric, layout, metric.init(layout, torch.zeros(1, dtype=torch.float64))


@pytest.mark.parametrize("scale", [1e-150, 1e-6, 1.0, 1e6, 1e150])
@pytest.mark.parametrize("c", [0.1, 1.0, 7.0])
def test_eigenvalue_along_m_is_one_plus_c_at_every_scale(scale: float, c: float) -> None:
    metric, layout, stats = _metric(alpha2=c, decay=0.0, alpha2_rule="normalized")
    m = torch.linspace(-1, 2, D, dtype=torch.float64) * scale
    metric.update(stats, layout, m.clone(), 1)
    # G⁻¹m = m/(1+c), G^{-1/2}m = m/√(1+c); orthogonal vectors are left alone.
    torch.testing.assert_close(
        metric.inverse(stats, layout, m.clone()), m / (1 + c), rtol=1e-13, atol=0
    )
    torch.testing.assert_close(
        metric.inverse_sqrt(stats, layout, m.clone()), m / math.sqrt(1 + c), rtol=1e-13, atol=0
    )
    ortho = torch.zeros(D, dtype=torch.float64)
    ortho[0], ortho[1] = float(m[1]), -float(m[0])
    torch.testing.assert_close(
        metric.inverse(stats, layout, ortho.clone()), ortho, rtol=1e-13, atol=0
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("norm", [0.0, 1e-30, 1e-170])
def test_guard_for_vanishing_m_is_finite(dtype: torch.dtype, norm: float) -> None:
    """Below the smallest normal ‖m‖² the rule falls back to G = I (documented guard)."""
    metric = sgrld.MongeMetric(alpha2=3.0, decay=0.0, alpha2_rule="normalized")
    layout = FlatLayout(("w",), ((D,),))
    stats = metric.init(layout, torch.zeros(1, dtype=dtype))
    m = torch.full((D,), norm / math.sqrt(D), dtype=dtype)
    metric.update(stats, layout, m.clone(), 1)
    v = torch.linspace(-1, 1, D, dtype=dtype)
    drift = metric.inverse(stats, layout, v.clone())
    noise = metric.inverse_sqrt(stats, layout, v.clone())
    assert bool(torch.isfinite(drift).all()) and bool(torch.isfinite(noise).all())
    if float(stats["sq_norm"]) < torch.finfo(dtype).tiny:
        assert torch.equal(drift, v) and torch.equal(noise, v)


def test_normalized_rule_is_the_default() -> None:
    """A new user's Monge is scale-free; the paper's fixed α² is asked for by name."""
    assert sgrld.MongeMetric().alpha2_rule == "normalized"
    assert sgrld.build("monge", lr=0.1, num_data=10).metric == sgrld.MongeMetric(
        alpha2_rule="normalized", alpha2=1.0
    )
    assert sgrld.MongeSGLD([torch.zeros(2, requires_grad=True)], lr=0.1, num_data=10).metric == (
        sgrld.MongeMetric(alpha2_rule="normalized")
    )


@pytest.mark.parametrize(
    ("opt", "message"),
    [
        ({"alpha2": 0.0, "alpha2_rule": "normalized"}, "c = alpha2 > 0"),
        ({"alpha2": -1.0, "alpha2_rule": "normalized"}, "c = alpha2 > 0"),
        ({"alpha2": math.inf, "alpha2_rule": "normalized"}, "c = alpha2 > 0"),
        ({"alpha2": 1.0, "alpha2_rule": "scaled"}, "invalid alpha2_rule: 'scaled'"),
    ],
)
def test_bad_values_are_refused(opt: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        sgrld.MongeMetric(**opt)  # type: ignore[arg-type]
    params = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match=message):
        sgrld.MongeSGLD(params, lr=0.1, num_data=10, **opt)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=message):
        sgrld.build("monge", lr=0.1, num_data=10, **opt)


def test_facade_equals_functional_core() -> None:
    gen = torch.Generator().manual_seed(3)
    theta = torch.randn(4, 3, generator=gen, dtype=torch.float64)
    p = torch.nn.Parameter(theta.clone())
    opt = sgrld.MongeSGLD(
        [p],
        lr=0.05,
        num_data=10,
        alpha2=0.8,
        alpha2_rule="normalized",
        generator=torch.Generator().manual_seed(5),
    )
    sampler = sgrld.build("monge", lr=0.05, num_data=10, alpha2=0.8, alpha2_rule="normalized")
    state = sampler.init({"w": theta.clone()}, generator=torch.Generator().manual_seed(5))
    for _ in range(10):
        p.grad = p.detach() ** 3 + p.detach()
        opt.step()
        state = sampler.step(state, {"w": state.params["w"] ** 3 + state.params["w"]})
    assert torch.equal(p.detach(), state.params["w"])


def test_resume_is_bit_identical() -> None:
    params, grad = quadratic_problem()
    plist = [torch.nn.Parameter(v.clone()) for v in params.values()]

    def make(ps: list[torch.nn.Parameter], gen: torch.Generator) -> torch.optim.Optimizer:
        return sgrld.MongeSGLD(
            ps, lr=0.01, num_data=10, alpha2=0.5, alpha2_rule="normalized", generator=gen
        )

    def run(opt: torch.optim.Optimizer, ps: list[torch.nn.Parameter], steps: range) -> None:
        for _ in steps:
            grads = grad(dict(zip(params, (p.detach() for p in ps), strict=True)))
            for p, g in zip(ps, grads.values(), strict=True):
                p.grad = g
            opt.step()

    check_resume_is_bit_identical(make, plist, run, 7, 15)
