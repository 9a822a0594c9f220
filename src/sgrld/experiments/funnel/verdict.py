"""What a funnel run shows against the truth, in words, with the spread over its chains.

The paper's claim (Figure 2, §5.1): Identity cannot reach the funnel's neck (v ≪ 0), the better
metrics can. K chains test it directly (mass below v = −5, deepest v, mean ± 2 standard errors);
whether a sampler samples N(0, 80) takes longer runs, which :func:`verdicts` names.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

__all__ = ["mean_and_error", "verdicts"]

NECK = "frac_v_below_minus5"
#: the neck: v below it (P(v < −5) = 0.288 under N(0, 80)); the figure, the run and the verdict
V_THRESHOLD = -5.0


def mean_and_error(values: Sequence[float] | np.ndarray) -> tuple[float, float]:
    """Mean over chains and 2 standard errors of it (``nan`` for one chain: no spread)."""
    arr = np.asarray(values, dtype=np.float64)
    if arr.size < 2:
        return float(arr.mean()), math.nan
    return float(arr.mean()), 2.0 * float(arr.std(ddof=1)) / math.sqrt(arr.size)


def _neck_word(mean: float, error: float, truth: float) -> str:
    if mean + error < truth:
        return "under-visits the neck"
    if mean - error > truth:
        return "over-visits the neck"
    return "its mass in the neck agrees with the truth"


def verdicts(
    distances: Mapping[str, Mapping[str, Sequence[float]]],
    truth: float,
    *,
    baseline: str | None,
    longer: str,
) -> list[str]:
    """Each sampler's neck mass and depth against the truth and ``baseline``'s (Identity's, or
    ``None``), then a line on what W1 separates; ``longer`` names the run for what it cannot.

    Args:
        distances: per sampler, the per-chain distances of :func:`~.run.v_distances`.
        truth: the exact mass below v = −5 (0.288).
    """
    lines = []
    depth = {name: mean_and_error(d["min_v"]) for name, d in distances.items()}
    base = depth.get(baseline) if baseline is not None else None
    for name, d in distances.items():
        mass, error = mean_and_error(d[NECK])
        chains = len(d[NECK])
        if chains < 2:
            lines.append(
                f"{name}: {mass:.0%} of its iterates below v = -5 (truth {truth:.0%}); one chain "
                "has no spread to judge by: run --chains 8 or more"
            )
            continue
        deep, deep_error = depth[name]
        text = (
            f"{name}: {_neck_word(mass, error, truth)}: {mass:.0%} ± {error:.0%} of its "
            f"iterates below v = -5 (truth {truth:.0%}); deepest v per chain "
            f"{deep:.1f} ± {deep_error:.1f}"
        )
        if base is not None and name != baseline:
            gap = math.hypot(deep_error, base[1])
            if deep + gap < base[0]:
                text += f" (deeper than {baseline}: the paper's Figure 2)"
            elif deep - gap > base[0]:
                text += f" (shallower than {baseline})"
            else:
                text += f" (not separated from {baseline}'s depth)"
        lines.append(text)
    lines.append(
        _w1_line({n: mean_and_error(d["wasserstein1"]) for n, d in distances.items()}, longer)
    )
    return lines


def _w1_line(w1: Mapping[str, tuple[float, float]], longer: str) -> str:
    """The closest sampler in W1, those farther beyond 2 standard errors, and the rest."""
    best = min(w1, key=lambda name: w1[name][0])
    mean, error = w1[best]
    if len(w1) == 1:
        return (
            f"Not shown by this run: whether {best} samples N(0, 80) (W1 {mean:.2f}, 0 is "
            f"exact). For that: {longer}"
        )
    farther = [n for n, (m, e) in w1.items() if n != best and mean + error < m - e]
    tied = [n for n in w1 if n != best and n not in farther]
    text = f"W1 to N(0, 80) (0 is exact): closest {best}, {mean:.2f} ± {error:.2f}"
    if farther:
        text += "; farther beyond 2 standard errors: " + ", ".join(
            f"{n} {w1[n][0]:.2f} ± {w1[n][1]:.2f}" for n in farther
        )
    if tied:
        text += (
            f". Not shown by this run: which of {', '.join([best, *tied])} samples N(0, 80) "
            f"best (their spreads overlap). Longer: {longer}"
        )
    return text
