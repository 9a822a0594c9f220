"""The paper's tuning rule: for each value of the metric's tuned option (Monge's α²,
:attr:`sgrld.metrics.Metric.tuned`) the ℓ with the best mean final validation LP over seeds, then
the option's value (Identity counting as the value where the metric is G = I,
:attr:`~sgrld.metrics.Metric.identity_at`: α² = 0); never a configuration with a broken-down
run; ties to the smaller value; a choice at the edge of its grid warned about, as the reference
notebook does. ``docs/experiments.md`` ("sgrld report") states it in full.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sgrld.experiments.report.tables import Group
from sgrld.experiments.run.config import symbol
from sgrld.metrics import get_metric, metric_names


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


def _tuned(candidates: Sequence[Group]) -> str | None:
    """The tuned option of the candidates' metric (Monge's ``"alpha2"``), if it has one."""
    sampler = candidates[0].config["sampler"] if candidates else None
    tuned = get_metric(sampler).tuned if sampler in metric_names() else ()
    return tuned[0] if tuned else None


@dataclass
class Stage:
    """One choice: the ℓ for one value of the tuned option (``kind="lr"``), or that option's
    value (``kind`` its name: Monge's ``"alpha2"``).

    Attributes:
        alpha2: the tuned option's value (Monge's α²) this ℓ is chosen for (``None`` for
            samplers without one).
        chosen: ``None`` when every candidate broke down, or Identity (α² = 0) is optimal.
        scores: candidate value (ℓ or α²) → mean final validation LP (NaN: broken down).
        broken: candidate values with a broken-down run, never chosen.
        warning: edge-of-grid or no-choice message, if any.
        identity: where the metric is G = I, when Identity is optimal (α² = 0).
    """

    kind: str
    alpha2: float | None
    chosen: Group | None
    scores: dict[float, float]
    broken: list[float] = field(default_factory=list)
    warning: str | None = None
    identity: float | None = None

    @property
    def value(self) -> float | None:
        """The chosen ℓ or α² (where the metric is G = I when Identity is optimal: 0.0)."""
        if self.chosen is None:
            return self.identity
        return float(self.chosen.config[self.kind])


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


def _choose_lr(candidates: Sequence[Group], tuned: str | None, value: float | None) -> Stage:
    scores = {float(g.config["lr"]): val_lp(g) for g in candidates}
    broken = sorted(float(g.config["lr"]) for g in candidates if g.num_broken)
    eligible = sorted((g for g in candidates if _eligible(g)), key=lambda g: g.config["lr"])
    if not eligible:
        return Stage("lr", value, None, scores, broken, "every ℓ broke down (nothing chosen)")
    best = max(eligible, key=val_lp)  # max keeps the first of equals: the smaller ℓ
    name = "ℓ" if value is None else f"ℓ (for {symbol(str(tuned))} = {value:g})"
    return Stage("lr", value, best, scores, broken, _edge(name, best.config["lr"], list(scores)))


def select_cell(
    candidates: Sequence[Group], *, identity_score: float | None = None
) -> tuple[Group | None, list[Stage], bool]:
    """Apply the rule to one cell's configurations.

    Args:
        candidates: the configurations of one setting, prior and sampler.
        identity_score: for a metric that is G = I at a value of its tuned option (Monge's
            α² = 0), the chosen Identity configuration's mean validation LP in the same setting
            and prior, if there is one.

    Returns:
        ``(chosen, stages, identity_optimal)``.
    """
    tuned = _tuned(candidates)
    by_value: dict[float | None, list[Group]] = {}
    for group in candidates:
        by_value.setdefault(None if tuned is None else group.config.get(tuned), []).append(group)
    stages = [_choose_lr(by_value[a], tuned, a) for a in sorted(by_value, key=lambda a: a or 0.0)]
    if tuned is None or list(by_value) == [None]:
        return stages[0].chosen, stages, False
    name, at = symbol(tuned), get_metric(candidates[0].config["sampler"]).identity_at.get(tuned)
    winners = sorted((s for s in stages if s.chosen is not None), key=lambda s: s.alpha2 or 0.0)
    scores = {float(s.alpha2 or 0.0): val_lp(s.chosen) if s.chosen else math.nan for s in stages}
    broken = [float(s.alpha2 or 0.0) for s in stages if s.chosen is None]
    if not winners:
        stages.append(Stage(tuned, None, None, scores, broken, f"every {name} broke down"))
        return None, stages, False
    best = max(winners, key=lambda s: val_lp(s.chosen) if s.chosen else -math.inf)
    assert best.chosen is not None
    if identity_score is not None and at is not None:  # Identity is the metric at ``at``
        scores = {float(at): identity_score, **scores}
        if identity_score >= val_lp(best.chosen):
            stages.append(Stage(tuned, None, None, scores, broken, identity=float(at)))
            return None, stages, True
    warning = _edge(name, float(best.chosen.config[tuned]), list(scores))
    stages.append(Stage(tuned, None, best.chosen, scores, broken, warning))
    return best.chosen, stages, False
