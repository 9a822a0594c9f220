"""A round's scores: sample quality of each candidate's thinned points (lower is better).

* ``"ksd"``: the coordinate-subset kernel Stein discrepancy
  (:func:`~sgrld.evaluation.stein.coordinate_stein_discrepancy`) of the points against the
  posterior, from the near-full-data score at each; every candidate of a round on one common
  scale (the pooled root mean square of the score per coordinate, the posterior's conditional
  precision for exact draws), so that a chain that is too wide, too narrow or not yet mixed
  scores worse than one that is right.
* ``"validation"``: minus the validation log predictive density of the points' ensemble
  (the paper's selection rule), per datum.

A diverged candidate scores +∞.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from sgrld.evaluation.stein import coordinate_stein_discrepancy
from sgrld.tuning.runs import Record

__all__ = ["round_scores"]


def round_scores(
    records: Sequence[Record], subsets: Sequence[Sequence[int]], kind: str
) -> list[float]:
    """One score per record of a round, +∞ for a diverged one."""
    ok = [not r.diverged and bool(np.isfinite(r.scores).all()) for r in records]
    if not any(ok):
        return [math.inf] * len(records)
    if kind == "validation":
        return [_validation(r) if fine else math.inf for r, fine in zip(records, ok, strict=False)]
    pooled = np.concatenate([r.scores for r, fine in zip(records, ok, strict=False) if fine])
    rms = np.sqrt(np.mean(pooled**2, axis=0))
    scale = 1.0 / np.where((rms > 0) & np.isfinite(rms), rms, 1.0)
    return [
        coordinate_stein_discrepancy(r.samples, r.scores, subsets, scale) if fine else math.inf
        for r, fine in zip(records, ok, strict=False)
    ]


def _validation(record: Record) -> float:
    assert record.log_likelihoods is not None
    ll = record.log_likelihoods  # (points, V)
    top = ll.max(0)
    lse = top + np.log(np.exp(ll - top).sum(0))
    return float(-(lse - np.log(len(ll))).mean())
