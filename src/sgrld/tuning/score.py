"""A round's scores: sample quality of each candidate's thinned points (lower is better).

* ``"ksd"``: the unbiased squared coordinate-subset kernel Stein discrepancy
  (:func:`~sgrld.evaluation.stein.coordinate_stein_discrepancy`) against the posterior, every
  candidate on one common scale (the pooled RMS of the score per coordinate);
* ``"validation"``: minus the validation log predictive density per datum.

A diverged candidate scores +∞.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from sgrld.evaluation.stein import coordinate_stein_discrepancy
from sgrld.tuning.runs import Record

__all__ = ["round_scores"]


def round_scores(
    records: Sequence[Record], subsets: Sequence[Sequence[int]], kind: str
) -> list[tuple[float, float]]:
    """Per record of a round, its score and the score's standard error; (+∞, 0) if diverged.

    KSD: its standard error is half the gap between the estimates from the even and the odd
    points.
    """
    ok = [not r.diverged and bool(np.isfinite(r.scores).all()) for r in records]
    if not any(ok):
        return [(math.inf, 0.0)] * len(records)
    score: Callable[[Record], tuple[float, float]] = _validation
    if kind != "validation":
        pooled = np.concatenate([r.scores for r, fine in zip(records, ok, strict=True) if fine])
        rms = np.sqrt(np.mean(pooled**2, axis=0))
        scale = 1.0 / np.where((rms > 0) & np.isfinite(rms), rms, 1.0)

        def squared(x: np.ndarray, s: np.ndarray) -> float:
            value = coordinate_stein_discrepancy(x, s, subsets, scale)
            return value * abs(value)

        def ksd(r: Record) -> tuple[float, float]:
            whole = squared(r.samples, r.scores)
            even = squared(r.samples[::2], r.scores[::2])
            return whole, abs(even - squared(r.samples[1::2], r.scores[1::2])) / 2

        score = ksd

    return [score(r) if fine else (math.inf, 0.0) for r, fine in zip(records, ok, strict=True)]


def _validation(record: Record) -> tuple[float, float]:
    """Minus the validation log predictive per datum, and its standard error over the data."""
    assert record.log_likelihoods is not None
    ll = record.log_likelihoods  # (points, V)
    top = ll.max(0)
    per_datum = -(top + np.log(np.exp(ll - top).sum(0)) - np.log(len(ll)))
    return float(per_datum.mean()), float(per_datum.std() / math.sqrt(len(per_datum)))
