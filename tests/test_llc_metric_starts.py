"""devinterp's sampler-accuracy targets through :func:`sgrld.llc` with every metric.

The targets (devinterp, ``tests/slt/sampler_accuracy_test.py``): y = x·∏ᵢ wᵢ^{pᵢ} with x ~ N(0, 2²)
and pure-noise labels y ~ N(0, 0.25²), n = 1,000, the model at w = 0, where every gradient
vanishes; its learning coefficient is λ = 1/(2 maxᵢ pᵢ). devinterp's tolerance: λ within two
standard deviations (over chains) of the estimate. Each metric runs at its defaults except as
devinterp runs it (RMSprop and Adam with devinterp's ε = 0.1) and Shampoo with a full-matrix
factor for the weight vector (``precondition_vectors=True``) and a floor G ≥ I where the factors
vanish with the gradients (``docs/posterior.md``). Without a floor every Shampoo chain goes
non-finite a few steps after its first root refresh (step 100).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import sgrld
from sgrld.core.engine import NonFiniteGradientError

SLOW = pytest.mark.slow
#: (powers, λ = 1/(2 max p))
TARGETS = [((1, 1), 0.5), ((1, 2), 0.25), ((2, 3), 1 / 6)]
METRICS: dict[str, dict[str, Any]] = {
    "identity": {},
    "rmsprop": {"eps": 0.1},
    "adam": {"eps": 0.1},
    "wenzel": {},
    "monge": {},
    # G ≥ I: never a longer step than the SGLD whose ε this is; at the default floor 0.1 (G⁻¹ up
    # to 10) 2 of 10 chains of (1, 1) and (2, 3) went non-finite once stale roots met the
    # polynomial's steep walls (docs/posterior.md)
    "shampoo": {"precondition_vectors": True, "floor": 1.0},
}
#: devinterp's settings in this library's terms (ε, γ), 10 chains of 2,000 draws
LR, LOCALIZATION, CHAINS, STEPS = 5e-4, 1.0, 10, 2000


class Polynomial(nn.Module):
    """y = x·∏ᵢ wᵢ^{pᵢ}, w from zeros."""

    def __init__(self, powers: tuple[int, ...]) -> None:
        super().__init__()
        self.register_buffer("powers", torch.tensor(powers, dtype=torch.float32))
        self.weights = nn.Parameter(torch.zeros(len(powers)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.prod(self.weights**self.powers)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(42)
    return 2.0 * torch.randn(1000, generator=gen), 0.25 * torch.randn(1000, generator=gen)


def _mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def estimate(
    name: str, powers: tuple[int, ...], *, chains: int = CHAINS, steps: int = STEPS
) -> sgrld.slt.LLCEstimate:
    """λ̂ of the target ``powers`` by ``name`` with :data:`METRICS`' options and devinterp's ε
    (the metric adapts in the waiting warm-up: ``sgrld.llc``'s default with ``lr`` given)."""
    with warnings.catch_warnings():  # a 2-vector's Shampoo says once that it is small
        warnings.simplefilter("ignore", UserWarning)
        return sgrld.llc(Polynomial(powers), _mse, [_data()], num_data=1000, sampler=name,
                         num_chains=chains, num_steps=steps, lr=LR, localization=LOCALIZATION,
                         seed=0, **METRICS[name])  # fmt: skip


@SLOW  # the first llc of a process compiles the Philox kernel (a minute or more)
@pytest.mark.parametrize("name", ["rmsprop", "adam"])
def test_devinterp_eps_chains_stay_finite_past_the_freeze(name: str) -> None:
    """RMSprop and Adam with devinterp's ε = 0.1 on a target whose gradients vanish at the start:
    every chain finite and λ̂ at the right scale past the nominal freeze (step 950). The chains
    spread from w = 0 through the valley for thousands of steps, so the default warm-up waits
    and G keeps following the walls' gradients (a G⁻¹ frozen at ~1/ε sent one chain in ten off
    the walls at steps 970-975)."""
    est = estimate(name, (1, 2), chains=4, steps=1400)
    assert math.isfinite(est.mean) and math.isfinite(est.std_error)
    assert 0.0 < est.mean < 1.0, est.mean


@SLOW
@pytest.mark.parametrize(
    ("name", "powers", "true_lc"),
    [pytest.param(name, powers, lc, id=f"{name}-{powers}")
     for name in METRICS for powers, lc in TARGETS],
)  # fmt: skip
def test_llc_of_devinterp_targets(name: str, powers: tuple[int, ...], true_lc: float) -> None:
    est = estimate(name, powers)
    sd = est.std_error * math.sqrt(CHAINS)  # devinterp's tolerance: the chains' spread
    assert abs(est.mean - true_lc) < 2 * sd, (est.mean, sd, true_lc)


@SLOW
@pytest.mark.parametrize("name", [n for n in METRICS if n != "identity"])
def test_at_the_defaults_the_metric_is_frozen_at_w0_and_the_verdict_is_clean(name: str) -> None:
    """``sgrld.llc`` at its defaults (ε calibrated, ``adapt_until="calibration"``): G frozen from
    the first step at the calibration's G at w₀, so no kept step adapts. Every gradient vanishes
    at w = 0, so that G is I (the floors) and every metric's chains are SGLD's, step for step,
    with SGLD's verdict (docs/results/warmup.md: clean at the defaults)."""

    def at_defaults(sampler: str) -> sgrld.slt.LLCEstimate:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return sgrld.llc(Polynomial((1, 2)), _mse, [_data()], num_data=1000,
                             sampler=sampler, **METRICS[sampler])  # fmt: skip

    sgld, est = at_defaults("identity"), at_defaults(name)
    assert est.verdict is not None and sgld.verdict is not None
    assert not any("adapted" in p for p in est.verdict.problems), est.verdict
    assert est.verdict.problems == sgld.verdict.problems
    assert np.array_equal(est.trace, sgld.trace)


@SLOW
def test_shampoo_without_a_floor_fails_with_the_library_error() -> None:
    """The paper's Shampoo (floor 0) on vanishing gradients: G⁻¹ ~ 1e4 from the first root refresh
    (step 100) sends every chain off within a few steps. The library says so, naming the step
    (its non-finite check, or a refresh's ShampooRootError), not torch's LinAlgError nor a silent
    NaN estimate."""
    from sgrld.metrics.shampoo import ShampooRootError

    error = pytest.raises((NonFiniteGradientError, ShampooRootError), match=r"step 10\d")
    with error, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        sgrld.llc(Polynomial((1, 2)), _mse, [_data()], num_data=1000, sampler="shampoo",
                  num_chains=4, num_steps=400, lr=LR, localization=LOCALIZATION, seed=0,
                  precondition_vectors=True, floor=0.0)  # fmt: skip


@SLOW
@pytest.mark.parametrize("name", list(METRICS))
def test_ordinality_of_devinterp_polynomial_points(name: str) -> None:
    """devinterp's ordinality targets (``tests/slt/sampler_ordinality_test.py``): y = x·∏ᵢ wᵢ²
    in 2 and 10 dimensions, the LLC at the origin (every weight zero, the more singular point)
    no larger than at (1, ..., 1, 0), with devinterp's ε = 1e-4/d, 5 chains of 1,000 draws.
    Where d = 10 the loss at the origin is flat to float32's precision (∏ wᵢ² ~ 1e-40 within the
    chains' reach): no chain moves it, λ̂ = 0, and the verdict says so instead of passing it."""
    for dim in (2, 10):
        at: list[sgrld.slt.LLCEstimate] = []
        for point in ([0.0] * dim, [1.0] * (dim - 1) + [0.0]):
            model = Polynomial((2,) * dim)
            with torch.no_grad():
                model.weights.copy_(torch.tensor(point))
            options = dict(num_chains=5, num_steps=1000, lr=1e-4 / dim, seed=0, **METRICS[name])
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                est = sgrld.llc(model, _mse, [_data()], num_data=1000, sampler=name,
                                localization=LOCALIZATION, **options)  # fmt: skip
            at.append(est)
        origin, other = at
        assert math.isfinite(other.mean) and origin.mean <= other.mean, (dim, origin, other)
        if dim == 10:
            assert origin.verdict is not None
            assert any("did not move it" in p for p in origin.verdict.problems), origin.verdict
