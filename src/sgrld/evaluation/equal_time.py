"""Equal-computation-time re-analysis of per-epoch curves (Tables 6-7).

Every sampler is compared at the budget ``num_epochs × T_fastest``, epoch ``e`` ending at
``(e + 1)·T``: curves are linearly interpolated there (as the reference's ``interp1d``), the
setting re-selected on the interpolated mean validation LP and the test metrics read off.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = [
    "EqualTimeEntry",
    "SamplerCurves",
    "epoch_end_times",
    "equal_time_table",
    "interpolate_at_time",
    "mean_std_over_runs",
    "select_at_time",
]


def mean_std_over_runs(values: npt.ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """Per-epoch mean and population std (ddof = 0) of a ``(runs, epochs)`` metric."""
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 2:
        raise ValueError(f"expected (runs, epochs), got shape {array.shape}")
    return array.mean(axis=0), array.std(axis=0, ddof=0)


def epoch_end_times(num_epochs: int, seconds_per_epoch: float) -> np.ndarray:
    """Wall-clock time at which each epoch ends, ``(e + 1)·T`` for ``e = 0..num_epochs−1``."""
    if not seconds_per_epoch > 0:
        raise ValueError(f"seconds_per_epoch must be > 0, got {seconds_per_epoch}")
    return (np.arange(num_epochs) + 1.0) * seconds_per_epoch


def interpolate_at_time(curve: npt.ArrayLike, seconds_per_epoch: float, budget_s: float) -> float:
    """Linearly interpolate a per-epoch curve (epoch ``e`` ends at ``(e + 1)·T``) at
    ``budget_s`` in ``[T, len(curve)·T]``; a NaN entry matters only as an end point.

    Raises:
        ValueError: If the budget is outside the curve's time range.
    """
    values = np.asarray(curve, dtype=np.float64)
    if values.ndim != 1 or values.size == 0:
        raise ValueError(f"expected a non-empty 1-D curve, got shape {values.shape}")
    times = epoch_end_times(values.size, seconds_per_epoch)
    # rounding error at the end points (400 × 8.3 computed elsewhere)
    tolerance = 1e-9 * times[-1]
    if not times[0] - tolerance <= budget_s <= times[-1] + tolerance:
        raise ValueError(f"budget {budget_s} s is outside [{times[0]}, {times[-1]}] s")
    position = float(np.clip(budget_s, times[0], times[-1]))
    index = min(int(np.searchsorted(times, position, side="right")) - 1, values.size - 1)
    if times[index] == position:
        return float(values[index])
    weight = (position - times[index]) / (times[index + 1] - times[index])
    return float((1.0 - weight) * values[index] + weight * values[index + 1])


def select_at_time(
    selection: Mapping[Hashable, npt.ArrayLike], seconds_per_epoch: float, budget_s: float
) -> tuple[Hashable, float]:
    """``(setting, value)`` whose interpolated selection curve (mean val LP) is highest; NaN
    skipped, ties to the first.

    Raises:
        ValueError: If every candidate is NaN at the budget.
    """
    best: tuple[Hashable, float] | None = None
    for setting, curve in selection.items():
        value = interpolate_at_time(curve, seconds_per_epoch, budget_s)
        if not math.isnan(value) and (best is None or value > best[1]):
            best = (setting, value)
    if best is None:
        raise ValueError("no setting has a finite selection value at the budget")
    return best


@dataclass(frozen=True, kw_only=True)
class SamplerCurves:
    """Per-epoch curves of one sampler over its candidate settings (e.g. ℓ, or (ℓ, α²)).

    Attributes:
        seconds_per_epoch: The sampler's time per epoch at its best setting (Tables 2-3), used for
            every setting.
        selection: Setting → per-epoch mean validation LP (the selection criterion).
        test_mean: Setting → metric name → per-epoch mean over runs of the test metric.
        test_std: Same keys → per-epoch population std over runs.
    """

    seconds_per_epoch: float
    selection: Mapping[Hashable, npt.ArrayLike]
    test_mean: Mapping[Hashable, Mapping[str, npt.ArrayLike]]
    test_std: Mapping[Hashable, Mapping[str, npt.ArrayLike]]


@dataclass(frozen=True, kw_only=True)
class EqualTimeEntry:
    """One sampler's row of the equal-time table.

    Attributes:
        setting: The re-selected setting.
        selection_value: Its interpolated mean validation LP.
        metrics: Metric name → (interpolated mean, interpolated std) of the test metric.
    """

    setting: Hashable
    selection_value: float
    metrics: dict[str, tuple[float, float]]


def equal_time_table(
    curves: Mapping[str, SamplerCurves], *, budget_s: float | None = None
) -> dict[str, EqualTimeEntry]:
    """Re-select and read off every sampler at a common wall-clock budget.

    Args:
        curves: Sampler name → its curves. All curves must have the same number of epochs.
        budget_s: Budget in seconds; by default ``num_epochs × min_sampler T``.

    Returns:
        Sampler name → :class:`EqualTimeEntry`.
    """
    lengths = {
        np.asarray(c).size for sampler in curves.values() for c in sampler.selection.values()
    }
    if len(lengths) != 1:
        raise ValueError(f"all selection curves must have one common length, got {lengths}")
    if budget_s is None:
        budget_s = lengths.pop() * min(sampler.seconds_per_epoch for sampler in curves.values())
    table = {}
    for name, sampler in curves.items():
        time = sampler.seconds_per_epoch
        setting, value = select_at_time(sampler.selection, time, budget_s)
        metrics = {
            metric: (
                interpolate_at_time(mean, time, budget_s),
                interpolate_at_time(sampler.test_std[setting][metric], time, budget_s),
            )
            for metric, mean in sampler.test_mean[setting].items()
        }
        table[name] = EqualTimeEntry(setting=setting, selection_value=value, metrics=metrics)
    return table
