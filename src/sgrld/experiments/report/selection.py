"""The paper's tuning rule: for each α² the ℓ with the best mean final validation LP over seeds,
then Monge's α² (Identity counting as α² = 0); never a configuration with a broken-down run;
ties to the smaller value; a choice at the edge of its grid warned about, as the reference
notebook does. ``docs/experiments.md`` ("sgrld report") states it in full.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sgrld.experiments.report.tables import Group


def val_lp(group: Group) -> float:
    """Mean final validation LP over the group's completed runs (NaN if none)."""
    return group.stat("val_lp")[0]


def _eligible(group: Group) -> bool:
    return group.num_broken == 0 and bool(group.completed) and not math.isnan(val_lp(group))


def _edge(name: str, chosen: float, grid: Sequence[float]) -> str | None:
    values = sorted(set(grid))
    if len(values) == 1:
        return f"{name} = {chosen:g} is the only value tried (not tuned)"
    text = "{" + ", ".join(f"{v:g}" for v in values) + "}"
    if chosen == values[0]:
        return f"{name} = {chosen:g} is the smallest of its grid {text}"
    if chosen == values[-1]:
        return f"{name} = {chosen:g} is the largest of its grid {text}"
    return None


@dataclass
class Stage:
    """One choice: the ℓ for one α² (``kind="lr"``) or the α² of Monge (``kind="alpha2"``).

    Attributes:
        alpha2: the α² this ℓ is chosen for (``None`` for samplers without α²).
        chosen: ``None`` when every candidate broke down, or α² = 0 (Identity) is optimal.
        scores: candidate value (ℓ or α²) → mean final validation LP (NaN: broken down).
        broken: candidate values with a broken-down run, never chosen.
        warning: edge-of-grid or no-choice message, if any.
    """

    kind: str
    alpha2: float | None
    chosen: Group | None
    scores: dict[float, float]
    broken: list[float] = field(default_factory=list)
    warning: str | None = None

    @property
    def value(self) -> float | None:
        """The chosen ℓ or α² (0.0 when Identity is optimal for Monge)."""
        if self.chosen is None:
            return 0.0 if self.kind == "alpha2" and self.warning is None else None
        return float(self.chosen.config["lr" if self.kind == "lr" else "alpha2"])


@dataclass
class Choice:
    """A cell's (setting, prior, sampler) selection.

    Attributes:
        setting: the config fields shared by the cell (no prior, sampler, ℓ, α²).
        chosen: ``None`` if every configuration broke down or :attr:`identity_optimal`.
        stages: every choice made, ℓ per α² first, then α².
        candidates: the cell's configurations.
        identity_optimal: Monge's best α² is 0.
    """

    setting: dict[str, Any]
    prior: str
    sampler: str
    chosen: Group | None
    stages: list[Stage]
    candidates: list[Group]
    identity_optimal: bool = False

    @property
    def warnings(self) -> list[str]:
        return [s.warning for s in self.stages if s.warning]

    @property
    def best_own(self) -> Group | None:
        """The chosen configuration, or, when Identity is optimal, Monge's own best α²."""
        if not self.identity_optimal:
            return self.chosen
        own = [s.chosen for s in self.stages if s.kind == "lr" and s.chosen is not None]
        return max(own, key=val_lp) if own else None


def _choose_lr(candidates: Sequence[Group], alpha2: float | None) -> Stage:
    scores = {float(g.config["lr"]): val_lp(g) for g in candidates}
    broken = sorted(float(g.config["lr"]) for g in candidates if g.num_broken)
    eligible = sorted((g for g in candidates if _eligible(g)), key=lambda g: g.config["lr"])
    if not eligible:
        return Stage("lr", alpha2, None, scores, broken, "every ℓ broke down (nothing chosen)")
    best = max(eligible, key=val_lp)  # max keeps the first of equals: the smaller ℓ
    name = "ℓ" if alpha2 is None else f"ℓ (for α² = {alpha2:g})"
    return Stage("lr", alpha2, best, scores, broken, _edge(name, best.config["lr"], list(scores)))


def select_cell(
    candidates: Sequence[Group], *, identity_score: float | None = None
) -> tuple[Group | None, list[Stage], bool]:
    """Apply the rule to one cell's configurations.

    Args:
        candidates: the configurations of one setting, prior and sampler.
        identity_score: for Monge, the chosen Identity configuration's mean validation LP in the
            same setting and prior (α² = 0), if there is one.

    Returns:
        ``(chosen, stages, identity_optimal)``.
    """
    by_alpha2: dict[float | None, list[Group]] = {}
    for group in candidates:
        by_alpha2.setdefault(group.config.get("alpha2"), []).append(group)
    stages = [_choose_lr(by_alpha2[a], a) for a in sorted(by_alpha2, key=lambda a: a or 0.0)]
    if list(by_alpha2) == [None]:
        return stages[0].chosen, stages, False
    winners = sorted((s for s in stages if s.chosen is not None), key=lambda s: s.alpha2 or 0.0)
    scores = {float(s.alpha2 or 0.0): val_lp(s.chosen) if s.chosen else math.nan for s in stages}
    broken = [float(s.alpha2 or 0.0) for s in stages if s.chosen is None]
    if not winners:
        stages.append(Stage("alpha2", None, None, scores, broken, "every α² broke down"))
        return None, stages, False
    best = max(winners, key=lambda s: val_lp(s.chosen) if s.chosen else -math.inf)
    assert best.chosen is not None
    if identity_score is not None:  # Identity is α² = 0
        scores = {0.0: identity_score, **scores}
        if identity_score >= val_lp(best.chosen):
            stages.append(Stage("alpha2", None, None, scores, broken))
            return None, stages, True
    warning = _edge("α²", float(best.chosen.config["alpha2"]), list(scores))
    stages.append(Stage("alpha2", None, best.chosen, scores, broken, warning))
    return best.chosen, stages, False
