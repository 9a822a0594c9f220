"""A round's scores: sample quality of each candidate's thinned points (lower is better).

* ``"ksd"``: the unbiased squared coordinate-subset kernel Stein discrepancy
  (:func:`~sgrld.evaluation.stein.coordinate_stein_discrepancy`) against the posterior, every
  candidate on one common scale (the pooled RMS of the score per coordinate);
* ``"validation"``: minus the validation log predictive density per datum.

A diverged candidate scores +∞. What a round keeps at a chain's thinned points (:func:`thinned`,
:func:`validation`) and its :class:`Record` per candidate (:func:`records`) live here too, so
that whatever runs the chains hands over exactly what the scores read.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from sgrld.evaluation.stein import coordinate_stein_discrepancy
from sgrld.tuning.data import bind, expanded, flatten, size

if TYPE_CHECKING:
    from sgrld.chains import Chains
    from sgrld.tuning.runs import Problem

__all__ = ["Record", "records", "round_scores", "thinned", "validation"]


@dataclasses.dataclass
class Record:
    """One candidate's round: whether it diverged and what was kept at its thinned points."""

    diverged: bool
    samples: np.ndarray  # (points·C, d) scored coordinates
    scores: np.ndarray  # (points·C, d) ∇log p on them
    log_likelihoods: np.ndarray | None  # (points·C, V) validation log-likelihoods


def _flat(tensors: Iterable[Tensor], k: int) -> Tensor:
    return torch.cat([t.reshape(k, -1) for t in tensors], 1)


def thinned(problem: Problem, chains: Chains) -> tuple[Tensor, Tensor]:
    """Every chain's scored coordinates and −∇u on them from the scoring batches."""
    k = chains.num_chains
    total = sum(size(b) for b in problem.batches.scoring)
    grad = None
    for batch in problem.batches.scoring:
        tensors, rebuild = expanded(batch, k)
        _, grads = chains.grads(bind(problem.potential, rebuild), *tensors)
        part = _flat(grads.values(), k)[:, problem.coords] * (size(batch) / total)
        grad = part if grad is None else grad + part
    assert grad is not None
    x = _flat(chains.params.values(), k)[:, problem.coords]
    return x.detach().double().cpu(), -grad.double().cpu()


def validation(problem: Problem, chains: Chains) -> Tensor:
    """Every chain's log-likelihood of each validation datum, ``(K, V)``."""
    assert problem.validation is not None
    data, log_likelihood = problem.validation
    out = []
    with torch.no_grad():
        for batch in data:
            tensors, rebuild = flatten(batch)
            out.append(chains.map(bind(log_likelihood, rebuild), *tensors, shared=True))
    return torch.cat(out, 1).double().cpu()


def records(problem: Problem, bad: list[bool], kept: dict[str, list[Tensor]]) -> list[Record]:
    c = problem.chains_per_candidate
    if not kept["x"]:  # a probe: nothing kept
        kept["x"] = kept["s"] = [torch.zeros(len(bad) * c, 1, dtype=torch.float64)]
    x, s = torch.stack(kept["x"], 1), torch.stack(kept["s"], 1)  # (K, points, d)
    ll = torch.stack(kept["ll"], 1) if kept["ll"] else None  # (K, points, V)
    out = []
    for i, broken in enumerate(bad):
        part = slice(i * c, (i + 1) * c)
        out.append(
            Record(
                broken,
                x[part].reshape(-1, x.shape[-1]).numpy(),
                s[part].reshape(-1, s.shape[-1]).numpy(),
                None if ll is None else ll[part].reshape(-1, ll.shape[-1]).numpy(),
            )
        )
    return out


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
