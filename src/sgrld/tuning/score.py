"""A round's scores: sample quality of each candidate's thinned points (lower is better).

* ``"ksd"``: the unbiased squared coordinate-subset kernel Stein discrepancy
  (:func:`~sgrld.evaluation.stein.coordinate_stein_discrepancy`) against the posterior, every
  candidate on one common scale (the pooled RMS of the score per coordinate); its standard error
  is at least the round's median one, so that a chain that hardly moves cannot win on a
  standard error of ~0;
* ``"validation"``: minus the validation log predictive density per datum;
* ``"train"``: the same on the training loader's first data (which the chains also train on);
* ``"loss"``: the mean per-datum potential on the scoring data at the thinned points (kept for
  comparison: ``docs/tuning.md`` says why it is not a default).

A diverged candidate, and one whose ℓ :func:`sgrld.health` calls too large on the scored second
half, scores +∞: no score can choose it. What a round keeps at a chain's thinned points
(:func:`thinned`, :func:`validation`) and its :class:`Record` per candidate (:func:`records`)
live here too, so that whatever runs the chains hands over exactly what the scores read.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from sgrld.chain_health import judge
from sgrld.evaluation.stein import coordinate_stein_discrepancy
from sgrld.tuning.data import bind, expanded, flatten, size

if TYPE_CHECKING:
    from sgrld.chains import Chains
    from sgrld.tuning.problem import Problem

__all__ = ["Record", "records", "round_scores", "thinned", "validation"]


@dataclasses.dataclass
class Record:
    """One candidate's round: whether it diverged and what was kept at its thinned points."""

    diverged: bool
    samples: np.ndarray  # (points·C, d) scored coordinates
    scores: np.ndarray  # (points·C, d) ∇log p on them
    log_likelihoods: np.ndarray | None  # (points·C, V) validation log-likelihoods
    potentials: np.ndarray | None = None  # (points·C,) per-datum potential on the scoring data
    too_large: bool = False  # sgrld.health: "lr_too_large" on the scored half, at its end

    @property
    def excluded(self) -> bool:
        """Whether no score may choose it: it diverged or its ℓ is too large."""
        return self.diverged or self.too_large


#: columns :func:`thinned` appends to the scored coordinates: the potential, then the health
#: telemetry's sums since the burn-in (‖drift‖², ‖noise‖², ‖θ‖², steps)
EXTRA = 5
#: the scored half's health windows: one, as ``Chains.health()`` judges it. Four (the rule's
#: trend, whose descent exemption an optimizer's 512-step windows get) let SGLD's ℓ = 1 to 10 on
#: the digits MLP through: the noise spreading the weights moves ‖θ‖ as a descent would, and
#: the KSD then chose ℓ = 10, a chain at chance accuracy (``docs/tuning.md``)
HEALTH_WINDOWS = 1
#: a chain whose potential falls over the scored half by more than this many standard errors
#: (last quarter against first) still descends: its drift/noise above 1 is the descent, not a
#: too large ℓ (Shampoo on the digits MLP at the grid's best ℓ: drift/noise > 1, still falling)
FALLING_SE = 2.0


def _flat(tensors: Iterable[Tensor], k: int) -> Tensor:
    return torch.cat([t.reshape(k, -1) for t in tensors], 1)


def thinned(problem: Problem, chains: Chains) -> tuple[Tensor, Tensor]:
    """Every chain's scored coordinates and −∇u on them from the scoring batches, ``(K, d)``
    each; the coordinates are followed by :data:`EXTRA` columns that :func:`records` takes off:
    the potential on the scoring batches and the telemetry's sums since the burn-in (read, not
    reset: the round's own breakdown verdict reads them at its end)."""
    k = chains.num_chains
    total = sum(size(b) for b in problem.batches.scoring)
    grad, potential = None, None
    for batch in problem.batches.scoring:
        tensors, rebuild = expanded(batch, k)
        losses, grads = chains.grads(bind(problem.potential, rebuild), *tensors)
        weight = size(batch) / total
        part = _flat(grads.values(), k)[:, problem.coords] * weight
        grad = part if grad is None else grad + part
        potential = losses * weight if potential is None else potential + losses * weight
    assert grad is not None and potential is not None
    keys = ("drift_rms", "noise_rms", "theta_norm")
    sums = torch.tensor(
        [[f[key] ** 2 * f["steps"] for key in keys] + [f["steps"]]
         for f in chains.telemetry(reset=False)],
        dtype=torch.float64,
    )  # fmt: skip
    x = _flat(chains.params.values(), k)[:, problem.coords].detach().double().cpu()
    return torch.cat([x, potential.double().cpu()[:, None], sums], 1), -grad.double().cpu()


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
    """One :class:`Record` per candidate from a round's kept points (``bad``: whether each
    candidate broke down; a probe keeps no points)."""
    c = problem.chains_per_candidate
    if not kept["x"]:  # a probe: nothing kept
        zeros = torch.zeros(len(bad) * c, 1 + EXTRA, dtype=torch.float64)
        kept = {**kept, "x": [zeros], "s": [zeros[:, :1]]}
    both = torch.stack(kept["x"], 1)  # (K, points, d + EXTRA)
    x, potential, sums = both[..., :-EXTRA], both[..., -EXTRA], both[..., -EXTRA + 1 :]
    temperature = float(problem.fixed.get("temperature", 1.0))
    verdicts = [_verdict(sums[j], temperature) for j in range(len(sums))]
    verdicts = [
        "healthy" if v == "lr_too_large" and _falling(potential[j].numpy()) else v
        for j, v in enumerate(verdicts)
    ]
    s = torch.stack(kept["s"], 1)  # (K, points, d)
    ll = torch.stack(kept["ll"], 1) if kept["ll"] else None  # (K, points, V)
    out = []
    for i, broken in enumerate(bad):
        part = slice(i * c, (i + 1) * c)
        out.append(
            Record(
                broken or "broken_down" in verdicts[part],
                x[part].reshape(-1, x.shape[-1]).numpy(),
                s[part].reshape(-1, s.shape[-1]).numpy(),
                None if ll is None else ll[part].reshape(-1, ll.shape[-1]).numpy(),
                potential[part].reshape(-1).numpy(),
                "lr_too_large" in verdicts[part],
            )
        )
    return out


def _verdict(sums: Tensor, temperature: float) -> str:
    """:func:`sgrld.chain_health.judge` on the scored half cut into :data:`HEALTH_WINDOWS`
    windows at thinned points, from one chain's cumulative sums ``(points, 4)``."""
    points = len(sums)
    cuts = sorted({max(0, round(points * j / HEALTH_WINDOWS) - 1)
                   for j in range(1, HEALTH_WINDOWS + 1)})  # fmt: skip
    windows, before = [], torch.zeros(4, dtype=torch.float64)
    for i in cuts:
        part = (sums[i] - before).tolist()
        before = sums[i]
        if part[3] > 0:
            steps = part[3]
            figures = [math.sqrt(max(v, 0.0) / steps) for v in part[:3]]
            windows.append(dict(zip(("drift_rms", "noise_rms", "theta_norm"), figures,
                                    strict=True), steps=steps))  # fmt: skip
    return judge(windows, temperature).verdict


def _falling(potentials: np.ndarray) -> bool:
    """Whether the potential's last quarter is below its first by :data:`FALLING_SE` standard
    errors (a descent, not a stationary chain)."""
    quarter = len(potentials) // 4
    if quarter < 2:
        return False
    first, last = potentials[:quarter], potentials[-quarter:]
    se = math.sqrt((first.var() + last.var()) / quarter)
    return bool(last.mean() < first.mean() - FALLING_SE * se)


def round_scores(
    records: Sequence[Record], subsets: Sequence[Sequence[int]], kind: str
) -> list[tuple[float, float]]:
    """Per record of a round, its score and the score's standard error; (+∞, 0) if it diverged
    or its ℓ is too large (:attr:`Record.excluded`).

    KSD: its standard error is half the gap between the estimates from the even and the odd
    points, and at least the median of the round's (:data:`SE_FLOOR_QUANTILE`). Validation and
    train: the paired standard error of its difference from the round's best (:func:`_paired`).
    """
    ok = [not r.excluded and bool(np.isfinite(r.scores).all()) for r in records]
    if not any(ok):
        return [(math.inf, 0.0)] * len(records)
    if kind in ("validation", "train"):
        return _paired(records, ok)
    score: Callable[[Record], tuple[float, float]] = _loss
    if kind != "loss":
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

    out = [score(r) if fine else (math.inf, 0.0) for r, fine in zip(records, ok, strict=True)]
    if kind == "ksd":
        floor = float(np.quantile([e for (_, e), f in zip(out, ok, strict=True) if f],
                                  SE_FLOOR_QUANTILE))  # fmt: skip
        out = [(v, max(e, floor)) if f else (v, e) for (v, e), f in zip(out, ok, strict=True)]
    return out


#: the KSD's standard error is at least this quantile of the round's (the median): a chain that
#: hardly moves has even and odd points alike, and so a standard error of ~0 that is not its own
SE_FLOOR_QUANTILE = 0.5


def _loss(record: Record) -> tuple[float, float]:
    """The mean potential at the thinned points, its standard error from 8 batch means."""
    assert record.potentials is not None
    blocks = np.array([b.mean() for b in np.array_split(record.potentials, 8) if len(b)])
    return float(record.potentials.mean()), float(blocks.std() / math.sqrt(len(blocks)))


def _per_datum(record: Record) -> np.ndarray:
    """Minus the log predictive of each scored datum, averaged over the record's points."""
    assert record.log_likelihoods is not None
    ll = record.log_likelihoods  # (points, V)
    top = ll.max(0)
    return -(top + np.log(np.exp(ll - top).sum(0)) - np.log(len(ll)))


def _paired(records: Sequence[Record], ok: Sequence[bool]) -> list[tuple[float, float]]:
    """Minus the log predictive per datum, and its paired standard error: the candidates of a
    round are scored on the same data, so what separates two of them is the standard error of
    their per-datum difference, not either score's own (which holds the spread between easy and
    hard data, common to both). Each candidate's error is that of its difference from the
    round's best, the best's 0, so that the one-standard-error rule's ``hypot`` is the paired
    error; (+∞, 0) where not ``ok``."""
    per_datum = {j: _per_datum(r) for j, r in enumerate(records) if ok[j]}
    means = {j: float(values.mean()) for j, values in per_datum.items()}
    best = per_datum[min(means, key=means.__getitem__)]
    out = [(math.inf, 0.0)] * len(records)
    for j, values in per_datum.items():
        diff = values - best
        out[j] = (means[j], float(diff.std() / math.sqrt(len(diff))))
    return out
