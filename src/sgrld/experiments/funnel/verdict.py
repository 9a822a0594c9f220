"""What a funnel run shows against the truth, in words, with the spread over its chains.

The paper's claim for Figure 2 (§5.1) is that the identity metric cannot reach the funnel's neck
(the region of high curvature, v ≪ 0) while the better metrics can, Monge best. A run of K
independent chains tests the first half directly: the mass each chain puts below v = −5 (truth
0.288 under N(0, 80)) and the deepest v it reaches, mean ± 2 standard errors over the chains.
Whether a sampler then samples N(0, 80) (W1 → 0), and which is best, takes far more steps than a
demo has; :func:`verdicts` says which samplers W1 separates and which it does not, and names a
longer run for those.
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
    """One line per sampler, then one on what the run cannot show.

    Args:
        distances: per sampler, the per-chain distances of :func:`~.run.v_distances`.
        truth: the exact mass below v = −5 (0.288).
        baseline: the sampler on the identity metric, whose depth the others are compared
            with (``None``: no comparison).
        longer: what to run to see what this run cannot (a command, or advice).

    Returns:
        Lines of text: each sampler's neck mass and depth against the truth and identity's, then
        what W1 does or does not separate.
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
    """The sampler closest to N(0, 80) in W1, those farther beyond 2 standard errors (of both),
    and those this run cannot tell from it."""
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
