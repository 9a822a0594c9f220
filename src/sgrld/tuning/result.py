"""What :func:`sgrld.tune` returns: the chosen options and every candidate it tried."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

__all__ = ["Candidate", "Round", "TuneResult"]


@dataclasses.dataclass(frozen=True)
class Round:
    """One round of the search: the option it varies, its chain length, and each candidate's
    value of that option and score; ``at``: the other searched options' values, held."""

    name: str  # "probe", "bracket" or "halving"
    option: str  # "lr", or the tuned option searched at the chosen ℓ (Monge: "alpha2")
    length: int
    values: tuple[float, ...]
    scores: tuple[float, ...]  # +inf: diverged (a probe scores 0 for a stable ℓ)
    spent: int
    #: the scores' standard errors; validation and train scores: the standard error of each
    #: candidate's per-datum difference from the round's best (the same data: paired), the best's 0
    errors: tuple[float, ...] = ()
    at: dict[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A candidate: its ℓ and its values of the searched tuned options (``options``), its score
    in each round it was scored in (lower is better), the sampler steps spent on it (all its
    chains, all rounds), whether it diverged in any and whether :func:`sgrld.health` called its ℓ
    too large in any (either: it is out)."""

    lr: float
    scores: tuple[float, ...]
    lengths: tuple[int, ...]
    steps: int
    diverged: bool
    options: dict[str, float] = dataclasses.field(default_factory=dict)
    too_large: bool = False  # sgrld.health called its ℓ too large in a round: never chosen

    @property
    def score(self) -> float:
        """Its score in the longest round it ran (+∞ if it diverged there)."""
        return self.scores[-1] if self.scores else math.inf


@dataclasses.dataclass(frozen=True)
class TuneResult:
    """The outcome of :func:`sgrld.tune`.

    Attributes:
        sampler: the registry name of the sampler.
        options: the chosen ``lr`` and searched options with the fixed options and the
            ``adapt_until`` the candidates ran with for ``steps`` steps, ready for
            ``SGRLDOptimizer(..., metric=sampler, num_data=n, **options)`` or ``sgrld.build``.
        searched: the options chosen by the search: ``"lr"`` and the metric's tuned options
            that were not fixed (Monge: ``"alpha2"``).
        candidates: every candidate scored, by its searched options' values, then ℓ.
        rounds: the probe, then per searched option its bracket (with its widening) and
            halving rounds, in order.
        spent: gradient evaluations spent in all (≤ ``budget``).
        budget: the budget it was given.
        score: ``"ksd"``, ``"validation"``, ``"train"`` or ``"loss"``: what the scores are.
        steps: the length of chain the options are for.
        seconds: the search's wall time.
        edge: with the KSD score, the ℓ it scored best when the choice is one step below it
            (the chains were still in their transient, ``docs/tuning.md``); else ``None``.
        likelihood: with a potential alone, the likelihood found consistent with it
            (``"categorical"``, ``"bernoulli"``, ``"gaussian"``) whose log predictive was the
            score; else ``None``.
    """

    sampler: str
    options: dict[str, Any]
    searched: tuple[str, ...]
    candidates: tuple[Candidate, ...]
    rounds: tuple[Round, ...]
    spent: int
    budget: int
    score: str
    steps: int
    seconds: float = math.nan
    edge: float | None = None
    likelihood: str | None = None

    @property
    def lr(self) -> float:
        """The chosen ℓ."""
        return float(self.options["lr"])

    @property
    def runs(self) -> float:
        """The budget spent as a multiple of one chain of ``steps`` steps."""
        return self.spent / self.steps

    def __repr__(self) -> str:
        chosen = ", ".join(f"{k}={self.options[k]:.3g}" for k in self.searched)
        return (
            f"TuneResult(sampler={self.sampler!r}, {chosen}, score={self.score!r}, "
            f"candidates={len(self.candidates)}, rounds={len(self.rounds)}, "
            f"spent={self.spent}/{self.budget} ({self.runs:.1f} runs of {self.steps} steps))"
        )

    def summary(self) -> str:
        """A short table: per round its candidates and scores (``!``: diverged, ``>``: ℓ too
        large), then the choice and the cost."""
        lines = [repr(self), f"{'round':<8} {'option':<7} {'steps':>6}  values: score"]
        for r in self.rounds:
            if r.name == "probe":
                cells = " ".join(f"{v:.0e}{'!' if math.isinf(s) else ''}"
                                 for v, s in zip(r.values, r.scores, strict=True))  # fmt: skip
            else:
                cells = "  ".join(
                    f"{v:.3g}: {s:.4g}" if math.isfinite(s) else f"{v:.3g}: out"
                    for v, s in zip(r.values, r.scores, strict=True)
                )
            lines.append(f"{r.name:<8} {r.option:<7} {r.length:>6}  {cells}")
        out = [c for c in self.candidates if c.diverged or c.too_large]
        if out:
            why = [f"ℓ {c.lr:.3g} ({'diverged' if c.diverged else 'lr too large'})" for c in out]
            lines.append("out: " + ", ".join(why))
        if self.edge is not None:
            lines.append(f"ℓ one step below the KSD's best, {self.edge:.3g}: its chains were "
                         "still in their transient")  # fmt: skip
        if self.likelihood is not None:
            lines.append(f"scored by the log predictive of the {self.likelihood} likelihood the "
                         "potential is consistent with")  # fmt: skip
        lines.append(f"options: {self.options}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (infinite scores as ``None``)."""

        def clean(value: Any) -> Any:
            if isinstance(value, float) and not math.isfinite(value):
                return None
            if isinstance(value, (list, tuple)):
                return [clean(v) for v in value]
            if isinstance(value, dict):
                return {k: clean(v) for k, v in value.items()}
            return value

        cleaned: dict[str, Any] = clean(dataclasses.asdict(self))
        return cleaned
