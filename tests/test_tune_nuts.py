"""The NUTS case at the options :func:`sgrld.tune` chooses (issue 40): Bayesian logistic
regression on breast cancer (``benchmarks/gold.py``: 455 × 30, minibatch 46, N(0, 1) prior),
``sgrld.tune`` given the potential alone (its default score, the KSD) for a chain of 20,000
steps frozen after 2,000, within 60,000 gradients; then three chains of 20,000 steps at the tuned
ℓ against the NUTS reference (``benchmarks/gold_nuts.json``), with the thresholds of
``tests/test_gold.py``: every posterior mean within Z = 5 batch-means standard errors plus 0.1 σ
(the discretisation and minibatch allowance, ``docs/posterior.md``), the median σ ratio within
10 % of 1. ``python tests/test_tune_nuts.py [label ...]`` prints the table of ``docs/tuning.md``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import sgrld

pytest.importorskip("sklearn")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gold

STEPS, BUDGET, SEEDS = 20_000, 60_000, 3
WARMUP = STEPS // 10
Z, ALLOWANCE, SIGMA_TOLERANCE = 5.0, 0.1, 0.1
#: the settings of gold.py checked (by label)
CHECKED = ("SGLD", "RMSprop", "Monge normalized c = 1")


def tuned(setting: gold.Setting, problem: gold.Problem) -> sgrld.TuneResult:
    n = problem.num_data

    def potential(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        nll = nn.functional.binary_cross_entropy_with_logits(model(x)[..., 0], y)
        return nll + sum((p**2).sum() for p in model.parameters()) / (2 * n)

    model = nn.Linear(30, 1, dtype=torch.float64)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # gold.run's chains start at 0 too
    loader = DataLoader(TensorDataset(problem.x, problem.y), batch_size=problem.batch, shuffle=True)
    return sgrld.tune(setting.metric, model, potential, loader, num_data=n, steps=STEPS,
                      budget=BUDGET, seed=0, adapt_until=WARMUP, **setting.options)  # fmt: skip


def _batch_means_se(draws: np.ndarray, batches: int = 20) -> np.ndarray:
    """Monte-Carlo standard error of each parameter's mean over (S, chains, 31) draws."""
    per_chain = np.stack(np.array_split(draws, batches, axis=0)).mean(1)  # (batches, chains, 31)
    means = per_chain.reshape(-1, draws.shape[-1])
    return means.std(0, ddof=1) / np.sqrt(len(means))


def check(label: str) -> tuple[sgrld.TuneResult, dict[str, float], float, float]:
    """Tune, run, assert; the tuning's result, the errors of ``gold.errors``, the largest mean
    error in units of its allowance (< 1 passes) and the tuning's wall time."""
    problem, ref = gold.Problem(), gold.reference()
    setting = next(s for s in gold.SETTINGS if s.label == label)
    t0 = time.perf_counter()
    result = tuned(setting, problem)
    seconds = time.perf_counter() - t0
    chosen = next(c for c in result.candidates if c.lr == result.lr)
    assert not chosen.too_large and not chosen.diverged
    draws, ok = gold.run(problem, setting, [result.lr], seeds=SEEDS, steps=STEPS,
                         adapt_until=WARMUP)  # fmt: skip
    assert bool(ok.all()), (label, result.lr)
    d = draws.numpy()
    mean, std = np.asarray(ref["mean"]), np.asarray(ref["std"])
    allowed = Z * _batch_means_se(d) + ALLOWANCE * std
    excess = float((np.abs(d.reshape(-1, 31).mean(0) - mean) / allowed).max())
    errors = gold.errors(d.reshape(-1, 31), ref)
    assert excess < 1, (label, result.lr, errors)
    assert abs(errors["std_median"] - 1.0) < SIGMA_TOLERANCE, (label, result.lr, errors)
    return result, errors, excess, seconds


@pytest.mark.slow  # per setting: tuning (60,000 gradients, ~1-3 min), 3 × 20,000 steps
@pytest.mark.parametrize("label", CHECKED)
def test_the_tuned_chain_agrees_with_nuts(label: str) -> None:
    check(label)


def main() -> None:
    torch.set_num_threads(1)
    print("| sampler | tuned ℓ (the KSD's best, if a step below) | mean \\|Δμ\\|/σ "
          "| largest mean error / allowance | σ_SG/σ_NUTS median [min, max] | mean W1/σ "
          "| tuning (s) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for label in sys.argv[1:] or CHECKED:
        result, e, excess, seconds = check(label)
        edge = "" if result.edge is None else f" ({result.edge:.3g})"
        print(f"| {label} | {result.lr:.3g}{edge} | {e['mean_err']:.3f} | {excess:.2f} | "
              f"{e['std_median']:.2f} [{e['std_min']:.2f}, {e['std_max']:.2f}] | {e['w1']:.3f} "
              f"| {seconds:.0f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
