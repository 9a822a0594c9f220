"""The LLC against closed forms and against devinterp 2.x's own SGLD (long runs: ``slow``).

Targets from :mod:`sgrld.slt.targets`; the measured table is ``benchmarks/llc_theory.py``'s
(``docs/llc.md``). Thresholds: the Monte-Carlo error (standard errors over the chains) plus,
where the estimator has a known bias, that bias's bound.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import sgrld
from sgrld.slt import targets

# the verdicts of these runs are asserted where they matter, not raised as warnings
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::sgrld.slt.LLCWarning")]
torch.set_num_threads(1)

METRICS = {
    "identity": {},
    "rmsprop": {"decay": 0.99, "eps": 0.1},
    "monge": {"alpha2": 1.0},
    "shampoo": {"precondition_vectors": True},
}


@pytest.mark.parametrize("name", list(METRICS))
def test_logistic_regression_at_its_mle(name: str) -> None:
    """Regular: the localised posterior's λ̂ is ½Σ nβhᵢ/(nβhᵢ + γ) (5.45 at γ = 1, d/2 = 5.5 as
    γ → 0). With the calibrated ε (the rule's mixing branch here) the estimates measured
    +4.3 % to +6.6 % (``docs/llc.md``); the bound is 4 standard errors and 8 %, a guard against
    a regression of the rule or the samplers, not a proof of its accuracy. The first 1,000
    steps, over which G adapts, are left out (Monge adapting through the kept steps read +33 %:
    an adapting G samples no fixed posterior, which the verdict flags)."""
    t = targets.logistic()
    nbeta = t.num_data / math.log(t.num_data)
    est = sgrld.llc(t.model, t.loss, t.batches, num_data=t.num_data, sampler=name, nbeta=nbeta,
                    localization=1.0, num_chains=8, num_steps=3_000, burnin=1_000,
                    adapt_until=1_000, **METRICS[name])  # fmt: skip
    exact = t.exact(nbeta, 1.0)
    assert abs(est.mean - exact) < 4 * est.std_error + 0.08 * exact, (est.mean, est.lr)


@pytest.mark.parametrize("rrr", [(4, 4, 3, 1), (8, 2, 3, 1)])
def test_reduced_rank_regression_with_devinterp_settings(rrr: tuple[int, int, int, int]) -> None:
    """Two regimes of Aoyagi & Watanabe's formula at devinterp's settings (ε = 1e-4, γ = 100,
    nβ = n/log n): SGLD lands within 10 % of λ (measured +8 %: the finite-n, finite-γ, finite-ε
    estimate, the same with devinterp's own SGLD, below)."""
    t = targets.reduced_rank_regression(*rrr)
    nbeta = t.num_data / math.log(t.num_data)
    est = sgrld.llc(t.model, t.loss, t.batches, num_data=t.num_data, nbeta=nbeta,
                    localization=100.0, num_chains=8, num_steps=3_000, lr=1e-4)  # fmt: skip
    assert abs(est.mean - t.theory) < 4 * est.std_error + 0.1 * t.theory


def test_devinterp_sgld_agrees_within_standard_errors() -> None:
    """devinterp 2.0.1's SGMCMC.sgld and sgrld's SGLD with the same model, data, ε, nβ, γ and
    number of chains: the estimates agree within 3 combined standard errors."""
    optim = pytest.importorskip("devinterp.optim")
    t = targets.reduced_rank_regression(4, 4, 3, 1)
    nbeta, eps, gamma, k, steps = t.num_data / math.log(t.num_data), 1e-4, 100.0, 8, 3_000
    ours = sgrld.llc(t.model, t.loss, t.batches, num_data=t.num_data, nbeta=nbeta,
                     localization=gamma, num_chains=k, num_steps=steps, lr=eps)  # fmt: skip
    with torch.no_grad():
        init = float(np.mean([float(t.loss(t.model, b)) for b in t.batches]))
    theirs = []
    for chain in range(k):
        model = targets.reduced_rank_regression(4, 4, 3, 1).model
        opt = optim.SGMCMC.sgld(model.parameters(), lr=eps, nbeta=nbeta, localization=gamma)
        gen = torch.Generator().manual_seed(chain)
        trace = []
        for step in range(steps):
            opt.zero_grad()
            value = t.loss(model, t.batches[step % len(t.batches)])
            value.backward()
            trace.append(float(value.detach()))
            opt.step(noise_generator=gen)
        theirs.append(nbeta * (np.mean(trace) - init))
    mean, se = np.mean(theirs), np.std(theirs, ddof=1) / math.sqrt(k)
    assert abs(ours.mean - mean) < 3 * math.hypot(ours.std_error, se), (ours.mean, mean)


@pytest.mark.parametrize("rrr", [(4, 4, 3, 1), (10, 2, 2, 1)])
def test_every_metric_agrees_with_sgld_or_says_it_has_not(rrr: tuple[int, int, int, int]) -> None:
    """Every correct sampler of one local posterior gives one λ̂: with the calibrated step,
    each metric lands within 3 combined standard errors or 5 % of SGLD's, or one of the two
    verdicts is not ok (the estimate says it cannot be trusted instead of passing silently)."""
    t = targets.reduced_rank_regression(*rrr)
    kw = dict(num_data=t.num_data, localization=100.0, num_chains=4, num_steps=1_000)
    sgld = sgrld.llc(t.model, t.loss, t.batches, sampler="identity", **kw)
    for name, options in METRICS.items():
        if name == "identity":
            continue
        est = sgrld.llc(t.model, t.loss, t.batches, sampler=name, **kw, **options)
        close = abs(est.mean - sgld.mean) < max(
            3 * math.hypot(est.std_error, sgld.std_error), 0.05 * abs(sgld.mean)
        )
        assert close or not (est.ok and sgld.ok), (name, est.summary(), sgld.summary())
