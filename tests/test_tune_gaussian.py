"""posteriors' 2-D Gaussian test at the options :func:`sgrld.tune` chooses (issue 40), for every
metric: the target and the protocol of ``tests/test_metric_starts.py`` (a random 2-D Gaussian, a
start drawn with variance 100, 100,000 steps of which 15,000 are burn-in, each of three chains'
mean and covariance within 0.1 of the target's and its KL under 1 % of the start's), with ℓ (and
Monge's α²) from ``sgrld.tune`` given the potential alone (its default score, the KSD), for a
chain of 100,000 steps, from the first chain's start.

Before issue 40's fixes the tuner chose ℓ = 0.316 for RMSprop here (the stiff direction 2.5 times
too wide) and ℓ = 1 for Monge (variance ~30 times the target's).
``python tests/test_tune_gaussian.py [metric ...]`` prints the table of ``docs/tuning.md``.
"""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
import torch
from torch import nn

import sgrld
from test_metric_starts import METRICS, gaussian_kl, run_chains, start_kl, target

STEPS, BURNIN, CHAINS = 100_000, 15_000, 3
#: gradient evaluations per searched option (Monge searches ℓ and α²)
BUDGET = 40_000
#: one scoring datum (the potential reads no data), 100 batches an "epoch" (Wenzel refreshes
#: once per epoch, as in ``tests/test_metric_starts.py``)
LOADER = [torch.zeros(1) for _ in range(100)]


class Point(nn.Module):
    """θ ∈ ℝ², at the first chain's start of ``run_chains`` (variance 100)."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(1)
        self.x = nn.Parameter(10.0 * torch.randn(CHAINS, 2, generator=gen, dtype=torch.float64)[0])


def tuned(name: str) -> sgrld.TuneResult:
    mean, cov = target()
    prec = torch.linalg.inv(cov)

    def potential(model: nn.Module, _: Any) -> torch.Tensor:
        d = model.x - mean
        return 0.5 * d @ prec @ d

    budget = BUDGET * (1 + len(sgrld.get_metric(name).tuned))
    return sgrld.tune(name, Point(), potential, LOADER, num_data=1, steps=STEPS, budget=budget,
                      seed=0, score_points=1, **METRICS[name])  # fmt: skip


def protocol(name: str, options: dict[str, Any]) -> tuple[float, float, float]:
    """Three chains at ``options`` from starts of variance 100: the worst chain's largest mean
    error, covariance error and KL as a fraction of the start's."""
    rest = {k: v for k, v in options.items() if k != "lr"}
    means, covs = run_chains(name, lr=options["lr"], steps=STEPS, burnin=BURNIN, chains=CHAINS,
                             start="var100", **rest)  # fmt: skip
    mean, cov = target()
    worst_mean = max(float((m - mean).abs().max()) for m in means)
    worst_cov = max(float((c - cov).abs().max()) for c in covs)
    kl = max(gaussian_kl(m, c, mean, cov) for m, c in zip(means, covs, strict=True))
    return worst_mean, worst_cov, kl / start_kl()


@pytest.mark.slow  # per metric: tuning (~40,000 gradients per searched option), 100,000 steps
@pytest.mark.parametrize("name", list(METRICS))
def test_the_tuned_options_pass_posteriors_gaussian_test(name: str) -> None:
    result = tuned(name)
    chosen = next(c for c in result.candidates if c.lr == result.lr)
    assert not chosen.too_large and not chosen.diverged
    error, cov_error, kl = protocol(name, result.options)
    assert error < 0.1 and cov_error < 0.1 and kl < 0.01, (result.options, error, cov_error, kl)


def main() -> None:
    import sys

    torch.set_num_threads(1)
    print("| sampler | tuned options | mean error | cov error | KL / start's | tuning (s) |")
    print("|---|---|---|---|---|---|")
    for name in sys.argv[1:] or list(METRICS):
        t0 = time.perf_counter()
        result = tuned(name)
        seconds = time.perf_counter() - t0
        error, cov_error, kl = protocol(name, result.options)
        shown = ", ".join(f"{k} {v:.3g}" for k, v in result.options.items()
                          if k in result.searched)  # fmt: skip
        shown += "" if result.edge is None else f" (the KSD's best ℓ {result.edge:.3g})"
        verdict = "pass" if max(error, cov_error) < 0.1 and kl < 0.01 else "FAIL"
        print(f"| {name} | {shown} | {error:.3f} | {cov_error:.3f} | {100 * kl:.3f} % | "
              f"{seconds:.0f} | {verdict}", flush=True)  # fmt: skip
        assert math.isfinite(kl)


if __name__ == "__main__":
    main()
