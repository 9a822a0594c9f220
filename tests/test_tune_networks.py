"""``sgrld.tune`` on a neural network (issue 40): the 64-64-10 ReLU MLP on scikit-learn's digits
of ``benchmarks/tune_networks.py``, and its small CNN (``--model cnn``), whose tables are in
``docs/tuning.md`` and ``docs/results/tuning_mnist.md``.

Each case: a hand grid of ℓ half a decade apart, 20 epochs each (chains of one ``sgrld.Chains``),
their test log predictive averaged over four seeds; then ``sgrld.tune`` with its default score
for the data given (the validation log predictive; with a log-likelihood alone, that of the
loader's first data; with the potential alone, that of the likelihood the potential is
consistent with; the KSD where asked for by name) and a run with ``result.options``. Before
issue 40 the tuner chose ℓ = 10 for SGLD here (a chain at chance accuracy) and an RMSprop ℓ
the health rule calls too large. Claims: the tuned ℓ is within half a decade of the grid's
best, is not one the health rule calls too large (no candidate it called so was chosen), and
its run classifies (test accuracy at least 0.9, where the grid's best is about 0.95 and chance
0.1).
"""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import sgrld
from sgrld.core.warmup import DEFAULT_WARMUP, capped

pytest.importorskip("sklearn")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import tune_networks as tn


@pytest.mark.slow  # per case 10-35 s on one core (the CNN 70 s): 5-run grid × 4 seeds, tuning, run
@pytest.mark.parametrize(
    ("name", "grid", "fixed", "score", "arch"),
    [("sgld", (-2, 0), {}, "validation", "mlp"), ("rmsprop", (-3, -1), {}, "validation", "mlp"),
     ("shampoo", (-2, 0), {"precondition_vectors": True}, "validation", "mlp"),
     # a log-likelihood alone: the log predictive of the loader's first data (the KSD, with
     # the potential alone, chose ℓ = 0.1 here: docs/results/tuning_scores.md)
     ("rmsprop", (-3, -1), {}, "train", "mlp"),
     # the potential alone: the categorical likelihood it is consistent with, found, and its
     # log predictive of the loader's first data, as with log_likelihood= given
     ("sgld", (-2, 0), {}, "potential", "mlp"),
     # a small CNN (two convolutions and a linear layer), the KSD asked for by name
     # (docs/results/tuning_mnist.md)
     ("sgld", (-2, 0), {}, "ksd", "cnn")],
)  # fmt: skip
def test_the_tuned_lr_is_the_grids_on_the_digits_mlp(
    name: str, grid: tuple[int, int], fixed: dict[str, bool], score: str, arch: str
) -> None:
    torch.set_num_threads(1)
    data = tn.digits(1.0)
    n = len(data["y"])
    steps = tn.EPOCHS * math.ceil(n / tn.BATCH)
    lrs = [10 ** (grid[0] + i / 2) for i in range(2 * (grid[1] - grid[0]) + 1)]
    # the grid runs with the warm-up result.options carries (Stan's windows, a quarter of it)
    warmup = capped(DEFAULT_WARMUP, steps // 4)
    # over four seeds: one seed's best has a winner's curse (Shampoo's ℓ = 0.316 scored LPD
    # −0.25 at one seed, −0.44 to −1.66 at three others; docs/tuning.md)
    rows = tn.seeded(name, [{"lr": lr} for lr in lrs], data, {**fixed, "adapt_until": warmup}, 4,
                     arch=arch)  # fmt: skip
    best = max(range(len(lrs)), key=lambda i: rows[i][1] if math.isfinite(rows[i][1]) else -1e9)
    assert 0 < best < len(lrs) - 1, rows  # the grid brackets its best
    loader = DataLoader(TensorDataset(data["x"], data["y"]), batch_size=tn.BATCH, shuffle=True)
    # the likelihood scores at their defaults (ten runs' worth, 32 points); the KSD's case as
    # measured (docs/results/tuning_mnist.md)
    scored: dict[str, Any] = {
        "validation": {"validation": ([(data["xv"], data["yv"])], tn.log_likelihood)},
        "train": {"log_likelihood": tn.log_likelihood},
        "ksd": {"score": "ksd", "budget": 30_000, "points": 32},
    }.get(score, {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn of: a likelihood, found or given
        result = sgrld.tune(name, tn.model(0, arch), tn.potential(n), loader, num_data=n,
                            steps=steps, seed=0, **scored, **fixed)  # fmt: skip
    assert result.score == {"potential": "train"}.get(score, score)
    assert result.likelihood == ("categorical" if score == "potential" else None)
    assert abs(math.log10(result.lr / lrs[best])) <= 0.5 + 1e-9, (result.lr, lrs[best])
    chosen = next(c for c in result.candidates if c.lr == result.lr)
    assert not chosen.too_large and not chosen.diverged
    assert all(c.lr > result.lr for c in result.candidates if c.too_large)
    # the likelihood scores within their default budget, ten runs' worth; the KSD's scoring
    # gradients about 30
    assert result.budget == (30_000 if score == "ksd" else 10 * steps)
    assert result.spent <= (32 if score == "ksd" else 10) * steps
    searched = {k: v for k, v in result.options.items() if k in result.searched}
    options = {k: v for k, v in result.options.items() if k not in result.searched}
    ((accuracy, _, _),) = tn.sample(name, [searched], data, {**fixed, **options}, arch=arch)
    assert accuracy >= 0.9, (result.lr, accuracy)
