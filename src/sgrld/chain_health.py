"""Is a chain healthy? One judgement from its telemetry, used by every part of sgrld.

A chain can break down while every value stays finite (at too large a step ℓ each step lands
further out). :func:`health` judges, from the figures the step engine sums on the device, whether
a chain broke down or its ℓ is too large or too small, reading the drift-to-noise ratio
r = ‖ℓG⁻¹ĝ‖ / ‖σG^{-½}ξ‖ as r·√τ. The optimizer's warning, the runner's status, ``sgrld table``
and ``sgrld report`` all call it, so they agree; ``docs/health.md`` gives the rule.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from sgrld.core.engine import telemetry_figures

__all__ = [
    "BLOW_UP_FACTOR",
    "BROKEN_GROWTH",
    "BROKEN_GROWTH_NO_NOISE",
    "BROKEN_RATIO",
    "FALLING",
    "LARGE_RATIO",
    "MOVING",
    "SMALL_FACTOR",
    "SMALL_MIN_STEPS",
    "TREND_WINDOWS",
    "Health",
    "HealthWarning",
    "blown_up",
    "health",
    "judge",
]

#: drift/noise at or above which a chain has broken down (healthy runs: 0.04–0.35)
BROKEN_RATIO = 1e3
#: growth of ‖θ‖ since the first window that, with drift/noise ≥ 1, is a breakdown
BROKEN_GROWTH = 1e3
#: the same growth without injected noise (τ = 0, where drift/noise is undefined)
BROKEN_GROWTH_NO_NOISE = 1e6
#: drift/noise above which ℓ is too large (the stability limit of a Gaussian direction)
LARGE_RATIO = 1.0
#: ℓ is too small when relaxing once, 1/(2r²) steps, takes more than this times the steps taken
SMALL_FACTOR = 1.0
#: steps a chain must have taken before it can be called too slow
SMALL_MIN_STEPS = 2000
#: a drift below this fraction of the drift :data:`TREND_WINDOWS` windows before is falling
FALLING = 0.9
#: how many windows back the trend of the drift is judged against
TREND_WINDOWS = 4
#: ‖θ‖ moving between windows by this fraction of drift × steps is a descent, not a too large ℓ
MOVING = 0.25
#: how many times max(|u₀|, 1) a per-datum potential may rise above its start u₀ (:func:`blown_up`)
BLOW_UP_FACTOR = 1e3

Verdict = Literal["healthy", "lr_too_large", "lr_too_small", "broken_down", "unknown"]

_FIXES: dict[str, str] = {
    "broken_down": "the chain diverged; use a smaller lr (10x smaller is a good first try)",
    "lr_too_large": "use a smaller lr, until drift/noise is below 1 (healthy: 0.04-0.35)",
    "lr_too_small": "use a larger lr, or run more steps",
}


class HealthWarning(RuntimeWarning):
    """A chain that broke down, or whose ℓ is too large or too small (:func:`health`)."""


@dataclass(frozen=True)
class Health:
    """The verdict of :func:`health` on one chain.

    Attributes:
        verdict: ``"healthy"``, ``"broken_down"``, ``"lr_too_large"``, ``"lr_too_small"``, or
            ``"unknown"`` (no step recorded yet).
        figure: the figure that crossed a bound (``"drift_to_noise"``, ``"theta_growth"``,
            ``"relaxation_steps"``, ``"theta_norm"``, ``"gradient"``), ``None`` when healthy.
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
        return _FIXES.get(self.verdict, "")

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


def blown_up(start: Tensor, potential: Tensor) -> Tensor:
    """Per chain, on the device: whether its per-datum potential is no longer finite or has
    risen by more than :data:`BLOW_UP_FACTOR` × max(|u₀|, 1) above its start u₀ (a healthy
    chain moves *down* towards the typical set).

    Args:
        start: ``(K,)`` each chain's per-datum potential at its start.
        potential: ``(K,)`` its per-datum potential now.
    """
    rise = potential - start
    bad = ~torch.isfinite(potential) | ~torch.isfinite(start)
    return bad | (rise > BLOW_UP_FACTOR * start.abs().clamp_min(1.0))


def _series(value: Any) -> list[float]:
    if isinstance(value, (int, float)):
        return [float(value)]
    return [math.nan if v is None else float(v) for v in value]


def _falling(windows: Sequence[Mapping[str, float]], i: int) -> bool:
    """Whether the drift of window ``i`` is below :data:`FALLING` times that of the window
    :data:`TREND_WINDOWS` before it (or the first): a descent, not a divergence."""
    earlier = windows[max(0, i - TREND_WINDOWS)]["drift_rms"]
    return i > 0 and windows[i]["drift_rms"] < FALLING * earlier


def _descending(windows: Sequence[Mapping[str, float]], i: int) -> bool:
    """Whether window ``i`` still descends: its drift falls, or ‖θ‖ moved since the window
    before by at least :data:`MOVING` times what the drift could move it."""
    if i == 0:
        return False
    moved = abs(windows[i]["theta_norm"] - windows[i - 1]["theta_norm"])
    return _falling(windows, i) or moved >= MOVING * windows[i]["drift_rms"] * windows[i]["steps"]


def judge(windows: Sequence[Mapping[str, float]], temperature: float = 1.0) -> Health:
    """The verdict on one chain from its telemetry windows, oldest first (mappings with
    ``steps``, ``drift_rms``, ``noise_rms``, ``theta_norm`` and optionally ``temperature``);
    ``temperature``: τ of windows without their own."""
    windows = [w for w in windows if w.get("steps", 0) > 0]
    if not windows:
        return Health("unknown")
    steps = int(sum(w["steps"] for w in windows))
    first = windows[0]["theta_norm"]
    ratios = [_ratio(w, temperature) for w in windows]
    for i, w in enumerate(windows):
        theta, drift = w["theta_norm"], w["drift_rms"]
        if not math.isfinite(theta):
            return Health("broken_down", "theta_norm", theta, math.inf, steps)
        if not math.isfinite(drift):
            return Health("broken_down", "drift_rms", drift, math.inf, steps)
        growth = theta / first if first and first > 0 else 1.0
        # diverging: ‖θ‖ and with it the drift grow (a descent from far away: the drift falls)
        drift_grew = drift > windows[0]["drift_rms"]
        ratio = ratios[i]
        if ratio is None:  # τ = 0 (or a cyclical schedule's exploration): no ratio
            if growth >= BROKEN_GROWTH_NO_NOISE and drift_grew:
                return Health("broken_down", "theta_growth", growth, BROKEN_GROWTH_NO_NOISE, steps)
            continue
        if ratio >= BROKEN_RATIO and not _falling(windows, i):
            return Health("broken_down", "drift_to_noise", ratio, BROKEN_RATIO, steps)
        if ratio >= 1.0 and growth >= BROKEN_GROWTH and drift_grew:
            return Health("broken_down", "theta_growth", growth, BROKEN_GROWTH, steps)
    ratio = ratios[-1]
    if ratio is None:
        return Health("healthy", steps=steps)
    if ratio > LARGE_RATIO and not _descending(windows, len(windows) - 1):
        return Health("lr_too_large", "drift_to_noise", ratio, LARGE_RATIO, steps)
    relax = math.inf if ratio == 0 else 1.0 / (2.0 * ratio * ratio)
    if steps >= SMALL_MIN_STEPS and relax > SMALL_FACTOR * steps:
        return Health("lr_too_small", "relaxation_steps", relax, SMALL_FACTOR * steps, steps)
    return Health("healthy", steps=steps)


def _ratio(window: Mapping[str, float], temperature: float) -> float | None:
    """r·√τ: drift/noise against the noise at τ = 1 (a cold chain's r grows like 1/√τ);
    ``None`` without noise."""
    noise = window["noise_rms"]
    if not noise > 0:
        return None
    return window["drift_rms"] / noise * math.sqrt(window.get("temperature", temperature))


def _windows(figures: Mapping[str, Any]) -> list[dict[str, float]]:
    """Telemetry as windows: one mapping of floats, or per-window lists (``results.json``'s
    ``telemetry.per_epoch``); ``theta_rms`` (older results) where ``theta_norm`` is absent."""
    theta_key = "theta_norm" if "theta_norm" in figures else "theta_rms"
    keys = {"steps": "steps", "drift_rms": "drift_rms", "noise_rms": "noise_rms"}
    keys["theta_norm"] = theta_key
    if not all(k in figures for k in keys.values()):
        return []
    columns = {mine: _series(figures[theirs]) for mine, theirs in keys.items()}
    if isinstance(figures.get("temperature"), Sequence):  # a column (else health()'s τ)
        columns["temperature"] = _series(figures["temperature"])
    count = min(len(c) for c in columns.values())
    return [{k: c[i] for k, c in columns.items()} for i in range(count)]


def health(source: Any) -> Health | list[Health]:
    """Whether a chain broke down or has too large or too small a step size, from its telemetry.

    Args:
        source: an :class:`~sgrld.SGRLDOptimizer`, a :class:`~sgrld.Chains` (one verdict per
            chain), a ``results.json`` mapping, or telemetry figures (one window, or per-window
            lists), with the chain's τ as ``temperature`` where it is not 1.

    Returns:
        A :class:`Health` (a list of them, one per chain, for :class:`~sgrld.Chains`).

    Examples:
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
    temperature = 1.0
    telemetry = source.get("telemetry")
    if isinstance(telemetry, Mapping) and "per_epoch" in telemetry:
        config = source.get("config")
        if isinstance(config, Mapping) and config.get("temperature") is not None:
            temperature = float(config["temperature"])
        source = telemetry["per_epoch"] or {}
    elif isinstance(source.get("temperature"), (int, float)):
        temperature = float(source["temperature"])
    windows = _windows(source)
    for tau in [temperature, *(w["temperature"] for w in windows if "temperature" in w)]:
        if not (0.0 <= tau < math.inf):  # NaN too: a verdict on it would be a guess
            raise ValueError(f"health(): invalid temperature {tau!r} (expected finite >= 0)")
    for w in windows:  # a non-finite noise is a broken chain, not a noiseless one
        if w["steps"] > 0 and not math.isfinite(w["noise_rms"]):
            steps = int(sum(v["steps"] for v in windows))
            return Health("broken_down", "noise_rms", w["noise_rms"], math.inf, steps)
    return judge(windows, temperature=temperature)


#: the optimizer's watch: one step in :data:`WATCH_EVERY` is summed on the device, read on the
#: host once every :data:`WATCH_WINDOW` such steps (at step multiples of 512)
WATCH_EVERY = 16
WATCH_WINDOW = 32
#: a window's parts: a snapshot of its sums every this many watched steps (128 steps), so that
#: a chain whose first window has not closed (a run under 512 steps) is judged on parts whose
#: trend shows a descent, as the closed windows' does for a long run
PART_WATCHED = 8
#: the fewest parts (256 steps) an ℓ verdict rests on before the first window closes
SHORT_PARTS = 2


class Watch:
    """The host side of one chain's sparse watch: its windows, the verdict, one warning each.

    The verdict is stable: ℓ is judged on the closed windows only (the open one, polled at any
    step, can only add a breakdown), and once a closed window of the settled chain calls ℓ too
    large, the chain's verdict stays so (its warning said so; a later window's drift/noise
    below 1 does not undo a stretch of sampling at too large an ℓ).

    Until the second window closes, ℓ is judged on the first window's complete parts
    (:data:`PART_WATCHED`; those of the open window before the first closes), so that a short
    run gets a verdict: too large if any run of at least :data:`SHORT_PARTS` parts from the
    start was judged so once the chain settled, which is the same whenever it is polled (a
    later poll adds parts, never removes one).

    ``first``: the chain's first window, kept across a resume (the growth reference).
    """

    def __init__(self, label: str = "", first: Mapping[str, float] | None = None) -> None:
        self.label = label
        self.windows: list[dict[str, float]] = []
        self.first = dict(first) if first else None
        self.resumed_from = self.first  # the reference of a resumed chain's parts
        self.first_parts: list[dict[str, float]] = []  # the first closed window's parts
        self.warned: set[str] = set()
        self.large: Health | None = None  # the first "lr_too_large" of a closed window

    @staticmethod
    def window(sums: Sequence[float], temperature: float) -> dict[str, float]:
        """A window of the watched steps' sums (each standing for :data:`WATCH_EVERY` steps)."""
        figures = telemetry_figures(sums, {})
        keep = ("drift_rms", "noise_rms", "theta_norm")
        window = {key: figures[key] for key in keep}
        return {"steps": sums[3] * WATCH_EVERY, **window, "temperature": temperature}

    def close(
        self, window: dict[str, float], settled: bool, parts: Sequence[dict[str, float]] = ()
    ) -> Health:
        """Add a closed window (and, for the first, its complete ``parts``) and judge
        (:meth:`verdict`)."""
        if not self.windows:
            self.first_parts = list(parts)
        self.windows.append(window)
        if self.first is None:
            self.first = window
        result = self.verdict(settled)
        if result.verdict == "lr_too_large" and self.large is None:
            self.large = result
        return result

    def warn(self, verdict: Health) -> None:
        """Warn once per verdict that is not ok (after the step's bookkeeping)."""
        if not verdict.ok and verdict.verdict not in self.warned:
            self.warned.add(verdict.verdict)
            # the user's opt.step(): warn ← _watch_step ← step ← torch's two step wrappers
            warnings.warn(HealthWarning(f"{self.label}{verdict}"), stacklevel=6)

    def verdict(
        self,
        settled: bool = True,
        open_window: dict[str, float] | None = None,
        parts: Sequence[dict[str, float]] = (),
    ) -> Health:
        """The verdict on every window so far and ``open_window`` (its complete ``parts``: how
        a chain is judged before its first window closes); before the chain has ``settled``
        (its warm-up), only a breakdown."""
        everything = self._from_first(self.windows + ([open_window] if open_window else []))
        result = judge(everything)
        if result.broken_down:
            return result
        short = list(parts) if not self.windows else self.first_parts
        short = short if len(self.windows) <= 1 else []
        if settled and self.large is None and len(short) >= SHORT_PARTS:
            self.large = self._too_large(short)
        if self.large is not None:
            return dataclasses.replace(self.large, steps=result.steps)
        if len(short) >= SHORT_PARTS:  # the parts: a short run's trend
            result = dataclasses.replace(judge(self._parts(short)), steps=result.steps)
        elif self.windows:  # ℓ on the closed windows: a partly filled one does not flip it
            result = dataclasses.replace(judge(self._from_first(self.windows)), steps=result.steps)
        if not settled and result.verdict in ("lr_too_large", "lr_too_small"):
            return Health("healthy", steps=result.steps)
        return result

    def _too_large(self, parts: list[dict[str, float]]) -> Health | None:
        """The first "lr_too_large" of the runs of parts from the start, if any."""
        for end in range(SHORT_PARTS, len(parts) + 1):
            result = judge(self._parts(parts[:end]))
            if result.verdict == "lr_too_large":
                return result
        return None

    def _parts(self, parts: list[dict[str, float]]) -> list[dict[str, float]]:
        return [self.resumed_from, *parts] if self.resumed_from is not None else parts

    def _from_first(self, windows: list[dict[str, float]]) -> list[dict[str, float]]:
        if self.first is not None and (not windows or windows[0] is not self.first):
            return [self.first, *windows]  # a resumed chain: the reference of its start
        return windows
