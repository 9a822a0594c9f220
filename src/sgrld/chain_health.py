"""Is a chain healthy? One judgement from its telemetry, used by every part of sgrld.

A chain can break down without a single NaN: at too large a step the move −ℓG⁻¹ĝ overshoots,
each step lands further out, and the parameters climb to 1e9 or 1e70 while every value stays
finite. This module decides, from the figures the step engine sums on the device
(:meth:`sgrld.SGRLDOptimizer.telemetry`, :meth:`sgrld.Chains.telemetry`, a run's
``results.json``), whether a chain has broken down or has a step size ℓ that is too large or
too small. The optimizer's default warning, the runner's broken-down status, ``sgrld table`` and
``sgrld report`` all call :func:`health`, so they agree; ``docs/health.md`` explains the rule.

The rule reads the drift-to-noise ratio r = ‖ℓG⁻¹ĝ‖ / ‖σG^{-½}ξ‖ (root-mean-square over the
steps of a window). For a Gaussian posterior with per-datum Hessian λ (in G's coordinates), a
chain at stationarity has r² = ℓλ/2 for that direction, so r < 1 wherever the Euler–Maruyama
step is stable (ℓλ < 2) and r² is half the fraction of a posterior σ relaxed per step:

* **broken down**: r ≥ :data:`BROKEN_RATIO` (the drift a thousand times the injected noise: far
  past the stability limit), or r ≥ 1 while ‖θ‖ has grown :data:`BROKEN_GROWTH` times since
  the first window (the distance from the start keeps growing); without noise (τ = 0), growth
  alone at :data:`BROKEN_GROWTH_NO_NOISE`;
* **ℓ too large**: r > :data:`LARGE_RATIO` = 1 in the last window: the drift (with its minibatch
  noise) dominates the injected noise, so the chain is closer to SGD than to Langevin dynamics
  and its variance is not the posterior's;
* **ℓ too small**: relaxing once across the posterior takes about 1/(2r²) steps; when that is
  more than :data:`SMALL_FACTOR` times the steps taken (after at least :data:`SMALL_MIN_STEPS`),
  the chain has hardly moved against the posterior's scale. A chain still descending from a
  start far from the posterior is not called slow: its drift, so r, stays large until it
  arrives (the distance to the posterior is not the posterior's scale, and neither is ‖θ‖).

Healthy runs read r ≈ 0.04–0.35 (``docs/health.md`` lists the runs checked).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "BROKEN_GROWTH",
    "BROKEN_GROWTH_NO_NOISE",
    "BROKEN_RATIO",
    "LARGE_RATIO",
    "SMALL_FACTOR",
    "SMALL_MIN_STEPS",
    "Health",
    "HealthWarning",
    "health",
    "judge",
]

#: drift/noise at or above which a chain has broken down (healthy runs: 0.04–0.35)
BROKEN_RATIO = 1e3
#: growth of the root-mean-square ‖θ‖ since the first window that, with drift/noise ≥ 1, is a
#: breakdown
BROKEN_GROWTH = 1e3
#: the same growth without injected noise (τ = 0, where drift/noise is undefined)
BROKEN_GROWTH_NO_NOISE = 1e6
#: drift/noise above which ℓ is too large (the stability limit of a Gaussian direction)
LARGE_RATIO = 1.0
#: ℓ is too small when relaxing once, 1/(2r²) steps, takes more than this many times the steps
#: taken
SMALL_FACTOR = 1.0
#: steps a chain must have taken before it can be called too slow
SMALL_MIN_STEPS = 2000

Verdict = Literal["healthy", "lr_too_large", "lr_too_small", "broken_down", "unknown"]

_FIXES: dict[str, str] = {
    "broken_down": "the chain diverged; use a smaller lr (10x smaller is a good first try)",
    "lr_too_large": "use a smaller lr, until drift/noise is below 1 (healthy: 0.04-0.35)",
    "lr_too_small": "use a larger lr, or run more steps",
    "healthy": "",
    "unknown": "",
}


class HealthWarning(RuntimeWarning):
    """A chain that broke down while staying finite, or whose step size ℓ is too large or too
    small (:func:`health`); issued once per optimizer or :class:`~sgrld.Chains`."""


@dataclass(frozen=True)
class Health:
    """The verdict of :func:`health` on one chain.

    Attributes:
        verdict: ``"healthy"``, ``"broken_down"``, ``"lr_too_large"``, ``"lr_too_small"``, or
            ``"unknown"`` (no step recorded yet).
        figure: the figure that crossed a bound (``"drift_to_noise"``, ``"theta_growth"``,
            ``"relaxation_steps"``, ``"theta_norm"``), ``None`` when healthy.
        value: its value.
        bound: the bound it crossed.
        steps: the steps the judgement rests on.
    """

    verdict: Verdict
    figure: str | None = None
    value: float | None = None
    bound: float | None = None
    steps: int = 0

    @property
    def broken_down(self) -> bool:
        """Whether the chain diverged (the run's ``broken_down`` status; a tuner's "diverged")."""
        return self.verdict == "broken_down"

    @property
    def ok(self) -> bool:
        """Whether nothing is wrong (healthy, or too few steps to say)."""
        return self.verdict in ("healthy", "unknown")

    @property
    def reason(self) -> str:
        """Which figure crossed which bound, e.g. ``"drift/noise 1.7e+07 >= 1e+03"``."""
        if self.figure is None or self.value is None or self.bound is None:
            return self.verdict
        name = {"drift_to_noise": "drift/noise", "theta_growth": "growth of |theta|"}.get(
            self.figure, self.figure
        )
        if self.figure == "relaxation_steps":
            return (
                f"drift/noise implies {self.value:.3g} steps to relax once across the "
                f"posterior, more than the {self.steps} steps taken"
            )
        if not math.isfinite(self.value):
            return f"{name} is not finite"
        op = "<" if self.verdict == "lr_too_small" else ">=" if self.broken_down else ">"
        return f"{name} {self.value:.3g} {op} {self.bound:.3g}"

    @property
    def fix(self) -> str:
        """What to change."""
        return _FIXES[self.verdict]

    def __str__(self) -> str:
        if self.ok:
            return self.verdict
        what = {
            "broken_down": "the chain broke down",
            "lr_too_large": "lr is too large",
            "lr_too_small": "lr is too small",
        }[self.verdict]
        over = "" if self.figure == "relaxation_steps" else f", over {self.steps} steps"
        return f"{what} ({self.reason}{over}): {self.fix}"


def _series(value: Any) -> list[float]:
    if isinstance(value, (int, float)):
        return [float(value)]
    return [math.nan if v is None else float(v) for v in value]


def judge(windows: Sequence[Mapping[str, float]], first_theta: float | None = None) -> Health:
    """The verdict on one chain from its telemetry windows, oldest first (each a mapping with
    ``steps``, ``drift_rms``, ``noise_rms``, ``theta_norm`` as :func:`health` reads them);
    ``first_theta``: ‖θ‖ of the chain's first window when ``windows`` no longer hold it."""
    windows = [w for w in windows if w.get("steps", 0) > 0]
    if not windows:
        return Health("unknown")
    steps = int(sum(w["steps"] for w in windows))
    first = windows[0]["theta_norm"] if first_theta is None else first_theta
    for w in windows:
        theta, noise = w["theta_norm"], w["noise_rms"]
        growth = theta / first if first and first > 0 else 1.0
        if not math.isfinite(theta):
            return Health("broken_down", "theta_norm", theta, math.inf, steps)
        if not math.isfinite(w["drift_rms"]):
            return Health("broken_down", "drift_rms", w["drift_rms"], math.inf, steps)
        if not noise > 0:  # τ = 0 (or a cyclical schedule's exploration): no ratio
            if growth >= BROKEN_GROWTH_NO_NOISE:
                return Health("broken_down", "theta_growth", growth, BROKEN_GROWTH_NO_NOISE, steps)
            continue
        ratio = w["drift_rms"] / noise
        if ratio >= BROKEN_RATIO:
            return Health("broken_down", "drift_to_noise", ratio, BROKEN_RATIO, steps)
        if ratio >= 1.0 and growth >= BROKEN_GROWTH:
            return Health("broken_down", "theta_growth", growth, BROKEN_GROWTH, steps)
    last = windows[-1]
    if not last["noise_rms"] > 0:
        return Health("healthy", steps=steps)
    ratio = last["drift_rms"] / last["noise_rms"]
    if ratio > LARGE_RATIO:
        return Health("lr_too_large", "drift_to_noise", ratio, LARGE_RATIO, steps)
    relax = math.inf if ratio == 0 else 1.0 / (2.0 * ratio * ratio)
    if steps >= SMALL_MIN_STEPS and relax > SMALL_FACTOR * steps:
        return Health("lr_too_small", "relaxation_steps", relax, SMALL_FACTOR * steps, steps)
    return Health("healthy", steps=steps)


def _windows(figures: Mapping[str, Any]) -> list[dict[str, float]]:
    """Telemetry as windows: one mapping of floats, or per-window lists (``results.json``'s
    ``telemetry.per_epoch``); ``theta_rms``, its name in results written before, is read where
    ``theta_norm`` is absent."""
    theta_key = "theta_norm" if "theta_norm" in figures else "theta_rms"
    keys = {"steps": "steps", "drift_rms": "drift_rms", "noise_rms": "noise_rms"}
    keys["theta_norm"] = theta_key
    if not all(k in figures for k in keys.values()):
        return []
    columns = {mine: _series(figures[theirs]) for mine, theirs in keys.items()}
    count = min(len(c) for c in columns.values())
    return [{k: c[i] for k, c in columns.items()} for i in range(count)]


def health(source: Any) -> Health | list[Health]:
    """Whether a chain broke down or has too large or too small a step size, from its telemetry.

    Args:
        source: an :class:`~sgrld.SGRLDOptimizer` (all its steps: the sparse figures every
            optimizer keeps, or with ``telemetry=True`` those not yet read), a
            :class:`~sgrld.Chains` (one verdict per chain), a ``results.json`` mapping (its
            ``telemetry.per_epoch``), or telemetry figures as
            :meth:`~sgrld.SGRLDOptimizer.telemetry` returns them (one window) or as per-window
            lists.

    Returns:
        A :class:`Health` (a list of them, one per chain, for :class:`~sgrld.Chains`).

    Example:
        >>> figures = {"steps": 500, "drift_rms": 3e6, "noise_rms": 2.0, "theta_norm": 1e9}
        >>> h = health(figures)
        >>> h.broken_down, h.reason
        (True, 'drift/noise 1.5e+06 >= 1e+03')
    """
    own = getattr(source, "health", None)
    if callable(own):  # an optimizer or Chains judges its own record
        result: Health | list[Health] = own()
        return result
    if not isinstance(source, Mapping):
        raise TypeError(
            "health() takes an SGRLDOptimizer, a Chains, a results.json mapping or telemetry "
            f"figures, not a {type(source).__name__}"
        )
    telemetry = source.get("telemetry")
    if isinstance(telemetry, Mapping) and "per_epoch" in telemetry:
        source = telemetry["per_epoch"] or {}
    return judge(_windows(source))


#: the watch every optimizer and :class:`~sgrld.Chains` keeps: the figures of one step in
#: :data:`WATCH_EVERY` are summed on the device (three reductions on that step only) and read
#: on the host once every :data:`WATCH_WINDOW` such steps (one read per 512 steps)
WATCH_EVERY = 16
WATCH_WINDOW = 32


class Watch:
    """The host side of one chain's sparse watch: its windows, the verdict, one warning each.

    The device sums (drift², noise², θ², steps, as :func:`sgrld.core.engine.record_telemetry`
    adds them) of the watched steps are handed to :meth:`close` once a window is full.
    """

    def __init__(self, label: str = "") -> None:
        self.label = label
        self.windows: list[dict[str, float]] = []
        self.warned: set[str] = set()

    def close(self, sums: Sequence[float], settled: bool) -> Health:
        """Add a window (the watched steps' sums) and judge; warn once per verdict.

        ``settled``: whether the chain is past its warm-up, so that ℓ may be judged (before,
        only a breakdown is).
        """
        drift_sq, noise_sq, theta_sq, watched = sums
        n = max(watched, 1.0)
        self.windows.append(
            {
                "steps": watched * WATCH_EVERY,
                "drift_rms": math.sqrt(drift_sq / n),
                "noise_rms": math.sqrt(noise_sq / n),
                "theta_norm": math.sqrt(theta_sq / n),
            }
        )
        verdict = self.verdict(settled)
        if not verdict.ok and verdict.verdict not in self.warned:
            self.warned.add(verdict.verdict)
            # the user's opt.step(): close ← _watch_step ← step ← torch's two step wrappers
            warnings.warn(HealthWarning(f"{self.label}{verdict}"), stacklevel=6)
        return verdict

    def verdict(self, settled: bool = True) -> Health:
        """The verdict on every window so far."""
        result = judge(self.windows)
        if not settled and result.verdict in ("lr_too_large", "lr_too_small"):
            return Health("healthy", steps=result.steps)
        return result
