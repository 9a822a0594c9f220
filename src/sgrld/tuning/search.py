"""The search: a stability probe, a bracket of ℓ that widens until its ends are worse, then
successive halving (MAMBA: Coullon, South & Nemeth 2023) so that most of the budget goes to the
best candidates; then the same for each of the metric's tuned options (Monge's α²) at the
chosen ℓ. ``docs/tuning.md`` says why each choice was made."""

from __future__ import annotations

import dataclasses
import math
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any, cast

import torch
from torch import Tensor, nn

from sgrld.core.contract import check_choice, check_int
from sgrld.core.runner import sampled
from sgrld.core.warmup import DEFAULT_WARMUP, capped
from sgrld.metrics import get_metric, resolve_metric_name
from sgrld.models import BayesianModel
from sgrld.models import log_likelihood as _declared_log_likelihood
from sgrld.optim import build
from sgrld.tuning.data import Batches
from sgrld.tuning.likelihood import consistent_likelihood
from sgrld.tuning.result import Candidate, Round, TuneResult
from sgrld.tuning.runs import Potential, Problem, Record, run_round
from sgrld.tuning.score import round_scores

Progress = Callable[[str], None]

__all__ = ["tune"]

#: the probe's ladder: ℓ = 10^k for these k, shifted by its width when every ℓ (or none) diverges
PROBE_EXPONENTS = tuple(range(-8, 5))
#: the probe's chain length, at most a quarter of ``steps`` (at least :data:`PROBE_MIN_STEPS`)
PROBE_STEPS = 300
PROBE_MIN_STEPS = 64
#: the bracket's candidates: half a decade apart, from the largest ℓ stable in the probe down
BRACKET = 7
SPACING = math.sqrt(10.0)
MAX_WIDEN = 3
#: a tuned option's bracket: its default times these, a decade apart (and its value at which
#: G = I, where the metric has one and takes it), widened by a decade while the best is at an end
OPTION_FACTORS = (1.0, 0.1, 10.0)
OPTION_SPACING = 10.0
#: coordinates per subset of the score, and subsets when the model has more
SUBSET, SUBSETS = 16, 8
#: the shortest round: scored points × this, or a quarter of ``steps`` if less (then fewer points
#: are scored), so that a bracket halved twice (7, 4, 2 candidates) ends at ``steps``
POINT_SPACING = 4
MIN_LENGTH = 16
#: the score kinds: ``round_scores``' (``"loss"`` is for comparison, ``docs/tuning.md``)
SCORES = ("ksd", "validation", "train", "loss")
#: data of the loader's first pass the ``"train"`` score's log predictive is taken on
TRAIN_POINTS = 256
#: thinned points per chain the likelihood scores read (the KSD's, :data:`KSD_POINTS`): a log
#: predictive ranks candidates from a few dozen draws (the benchmarks' grids ensemble 5), and
#: the points' batches are most of a candidate's cost (``docs/tuning.md``, "Ten runs' worth")
LIKELIHOOD_POINTS = 32
KSD_POINTS = 128
#: the default budget: this many runs of ``steps`` steps (per chain), the issue's aim
RUNS = 10
#: the KSD's choice of ℓ moves one step down (half a decade) when the best candidate of the last
#: round has a KSD² above this (on the common per-coordinate scale): its chain is still in its
#: transient. Measured (docs/tuning.md): 0.013-0.33 on the exact diabetes posterior (× 1, × 10,
#: × 0.1), whose choice stays (one step down fails SGLD × 0.1's test); 0.28-3.2 on the digits
#: MLP, where the KSD's best was the grid's best or half a decade above it (0.46 and more where
#: above). A thin margin on both sides, measured on these cases only
TRANSIENT_KSD2 = 0.4


def tune(
    sampler: str,
    model: nn.Module,
    potential: Potential,
    loader: Iterable[Any],
    *,
    num_data: float,
    steps: int,
    budget: int | None = None,
    seed: int = 0,
    validation: tuple[Iterable[Any], Callable[[nn.Module, Any], Tensor]] | None = None,
    log_likelihood: Callable[[nn.Module, Any], Tensor] | None = None,
    chains: int = 1,
    points: int | None = None,
    score_points: int = 2048,
    score: str | None = None,
    progress: bool | Progress | None = None,
    **fixed: Any,
) -> TuneResult:
    """Choose the step size ℓ of ``sampler`` (and its tuned options that are not fixed, e.g.
    Monge's α²) for a chain of ``steps`` steps, within ``budget``.

    Each chain is scored on its second half by the log predictive of validation data, or of
    the training loader's first :data:`TRAIN_POINTS` data (``log_likelihood`` alone, or a
    :class:`~sgrld.models.BayesianModel`, which declares its likelihood), or, with neither, by
    the kernel Stein discrepancy on coordinate subsets (``docs/tuning.md`` says which won where;
    a warning says when the KSD sees only some of a large model's parameters: on networks it
    chose too large an ℓ). The model is not changed, and torch's global random state is restored on
    return.

    Args:
        sampler: a sampler name (``sgrld.metric_names()``, or an alias).
        model: the model, at the point the chains start from (left unchanged).
        potential: ``potential(model, batch)``: the batch's per-datum potential as a 0-d tensor,
            ``nll − log_prior / num_data`` (``docs/conventions.md``).
        loader: re-iterable batches, each a tensor, a tuple/list or a mapping of tensors.
        num_data: the number of training data n.
        steps: the length of the chain the options are for.
        budget: gradient evaluations the search may spend in all (one minibatch gradient of one
            chain; a scoring or validation batch at a thinned point counts as one); by default
            :data:`RUNS` runs' worth, ``RUNS × steps × chains`` (or, if more, the least that
            compares two candidates: the KSD's scoring gradients cost more).
        seed: the search's seed: the same seed gives the same result.
        validation: ``(batches, log_likelihood)`` with ``log_likelihood(model, batch)`` each
            datum's log-likelihood ``(B,)``: the score is then the validation log predictive.
        log_likelihood: ``log_likelihood(model, batch)`` on the loader's batches, each datum's
            log-likelihood ``(B,)``, without validation data: the score is then the log
            predictive of the loader's first :data:`TRAIN_POINTS` data (``"train"``). A
            :class:`~sgrld.models.BayesianModel` without it gets its own
            (:func:`sgrld.models.log_likelihood`, on ``(x, y)`` batches).
        chains: chains per candidate.
        points: thinned points per chain scored (fewer, a quarter of the round's steps, in a
            round shorter than ``4 × points`` steps); by default :data:`LIKELIHOOD_POINTS` for
            the likelihood scores, :data:`KSD_POINTS` for the KSD and the loss.
        score_points: data of the loader's first pass used for the score's gradients.
        score: ``"validation"`` (the default with ``validation``), ``"train"`` (the default
            with ``log_likelihood`` alone), ``"ksd"`` (the default with neither), or ``"loss"``
            (the mean potential; for comparison, ``docs/tuning.md``).
        progress: a line per round (its candidates, their scores, the budget spent, the time
            left): ``True`` prints them to standard error, a callable receives each line.
        **fixed: the sampler's fixed options (``decay``, ``temperature``, ``adapt_until``, ...),
            kept in the result's options; a tuned option given here is not searched.

    Returns:
        A :class:`TuneResult`: ``options`` (``lr``, the searched options and ``fixed``),
        ``candidates``, ``spent``.

    Raises:
        ValueError: a budget too small to compare two candidates, every candidate diverging, a
            loader that is empty on its second pass, or invalid options.
    """
    name = resolve_metric_name(sampler)
    for label, value, low in (("steps", steps, 1), ("seed", seed, 0), ("chains", chains, 1),
                              ("score_points", score_points, 1)):  # fmt: skip
        check_int(label, value, low)
    if budget is not None:
        check_int("budget", budget, 1)
    if seed >= 2**63:
        raise ValueError(f"invalid seed: {seed!r} (expected an integer in [0, 2**63))")
    if not (isinstance(num_data, (int, float)) and not isinstance(num_data, bool)
            and math.isfinite(num_data) and num_data > 0):  # fmt: skip
        raise ValueError(f"invalid num_data: {num_data!r} (expected a finite number > 0)")
    if validation is not None and log_likelihood is not None:
        raise TypeError("give validation=(batches, log_likelihood) or log_likelihood, not both")
    declared = (  # a BayesianModel declares its likelihood
        validation is None and log_likelihood is None and score in (None, "train")
        and isinstance(model, BayesianModel)
    )  # fmt: skip
    if declared:
        log_likelihood = cast(Callable[[nn.Module, Any], Tensor], _declared_log_likelihood)
    kind = score or (
        "validation" if validation is not None else "train" if log_likelihood else "ksd"
    )
    check_choice("score", kind, SCORES)
    if points is not None:
        check_int("points", points, 2)
    if kind == "validation" and validation is None:
        raise ValueError(
            "invalid score: 'validation' (expected validation=(batches, log_likelihood) with it)"
        )
    if kind == "train" and log_likelihood is None:
        raise ValueError("invalid score: 'train' (expected log_likelihood=... with it)")
    held = None if validation is None else list(validation[0])
    if held is not None and not held:
        raise ValueError("invalid validation: its batches are empty (expected at least one)")
    if "lr" in fixed:
        raise TypeError("tune() chooses lr: pass the other options only")
    build(name, lr=1.0, num_data=num_data, noise="philox", **fixed)  # refuse bad options
    first = next(iter(model.parameters()), None)
    if first is None:
        raise ValueError("the model has no parameters")
    devices = [first.device] if first.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        # the KSD's gradients and the loss need the scoring data; validation one batch of it,
        # "train" its log predictive's data
        kept = {"validation": 1, "train": min(score_points, TRAIN_POINTS)}.get(kind, score_points)
        batches = Batches(loader, kept, first.device)
        if declared and not all(
            isinstance(b, (tuple, list)) and len(b) == 2 for b in batches.scoring
        ):
            raise ValueError(
                "the model's log-likelihood (sgrld.models.log_likelihood, the default score of a "
                "BayesianModel) reads (x, y) batches, and the loader's are not: give "
                "log_likelihood=... or score='ksd'"
            )
        size = sum(p.numel() for p in sampled(model).values())
        coords, subsets = _subsets(size, seed)
        report = _printer(progress)
        found = None
        if kind == "ksd" and score is None and size > len(coords):
            # a network given by its potential alone: the KSD chose too large an ℓ there; the
            # likelihood the potential is consistent with gives the log predictive instead
            found = consistent_likelihood(model, potential, batches.scoring, seed)
            if found is None:
                warnings.warn(
                    f"sgrld.tune scores by the kernel Stein discrepancy (no validation= or "
                    f"log_likelihood= given, and the potential matches no categorical, "
                    f"Bernoulli or Gaussian likelihood), which sees {len(coords)} of the "
                    f"model's {size} "
                    "parameters: on networks it chose ℓ up to 1.5 decades too large "
                    "(docs/tuning.md). Give validation=(batches, log_likelihood) or "
                    "log_likelihood=... (each datum's log-likelihood), or score='ksd' to keep it",
                    UserWarning,
                    stacklevel=2,
                )
            else:
                kind, log_likelihood = "train", found[1]
                batches.scoring = batches.first(min(score_points, TRAIN_POINTS))
                if report is not None:
                    report(f"tune {name}: a potential alone, consistent with a {found[0]} "
                           "likelihood: scored by its log predictive of the loader's first "
                           f"{TRAIN_POINTS} data")  # fmt: skip
        likelihood = kind in ("validation", "train")
        points = (LIKELIHOOD_POINTS if likelihood else KSD_POINTS) if points is None else points
        scored = None if validation is None or held is None else (held, validation[1])
        if kind == "train" and log_likelihood is not None:
            # one batch of the first TRAIN_POINTS data, a validation batch's price at a point;
            # the health figures' potential on the first of them, as with validation data
            scored = ([batches.joined()], log_likelihood)
            batches.scoring = batches.scoring[:1]
        problem = Problem(
            name, model, potential, batches, num_data, dict(fixed), coords, seed, chains, points,
            scored,
        )  # fmt: skip
        metric: Any = get_metric(name)  # a dataclass
        defaults: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(metric)}
        searched = {n: float(defaults[n]) for n in metric.tuned if n not in fixed}
        result = _Search(problem, steps, budget, subsets, searched, kind, report).run()
        return result if found is None else dataclasses.replace(result, likelihood=found[0])


def _printer(progress: bool | Progress | None) -> Progress | None:
    """The callable that receives the search's lines, or ``None`` (silent)."""
    if progress is None or progress is False:
        return None
    if progress is True:
        return lambda line: print(line, file=sys.stderr, flush=True)
    if not callable(progress):
        raise TypeError(f"progress must be True, False, None or a callable, got {progress!r}")
    return progress


def _subsets(size: int, seed: int) -> tuple[Tensor, list[list[int]]]:
    """The scored coordinates (flat indices) and the subsets, as columns of the kept ones."""
    if size <= SUBSET:
        return torch.arange(size), [list(range(size))]
    gen = torch.Generator().manual_seed(seed)
    count = min(SUBSET * SUBSETS, size)
    coords = torch.randperm(size, generator=gen)[:count].sort().values
    order = torch.randperm(count, generator=gen).tolist()
    return coords, [order[i : i + SUBSET] for i in range(0, count - SUBSET + 1, SUBSET)]


Key = tuple[tuple[str, float], ...]


def _key(candidate: Mapping[str, float]) -> Key:
    return tuple(sorted(candidate.items()))


class _Search:
    """The state of one search: what was run, what it scored, what it cost. A candidate is a
    mapping ``{"lr": ℓ, **searched options}``; ``at`` holds the searched options' values while
    another one varies (their defaults, then each chosen value)."""

    def __init__(
        self,
        problem: Problem,
        steps: int,
        budget: int | None,
        subsets: list[list[int]],
        searched: dict[str, float],
        kind: str = "ksd",
        progress: Progress | None = None,
    ):
        self.problem, self.steps, self.subsets = problem, steps, subsets
        self.kind, self.progress = kind, progress
        self.started = time.monotonic()
        self.at = dict(searched)
        self.rounds: list[Round] = []
        self.history: dict[Key, list[tuple[int, float]]] = {}
        self.broken: set[Key] = set()
        self.hot: set[Key] = set()  # sgrld.health: ℓ too large
        self.ceiling = math.inf  # the smallest ℓ that diverged (or was too large) at the defaults
        self.edge: float | None = None  # the KSD's best ℓ when the choice is one step below
        # a user's chain shorter than 4 × points: rounds as short as it, scoring fewer points
        self.min_length = max(MIN_LENGTH, min(POINT_SPACING * problem.points, steps // 4))
        self.probe_steps = max(PROBE_MIN_STEPS, min(PROBE_STEPS, steps // 4))
        self.passes = 1 + len(searched)  # ℓ, then each searched option
        self.probe_cost = problem.cost(len(PROBE_EXPONENTS), self.probe_steps, scored=False)
        self.least = problem.cost(2, self.min_length)  # two candidates, the shortest chains
        self.minimum = self.probe_cost + self.passes * self.least
        # by default RUNS runs' worth, or the least that compares two candidates if more
        runs = RUNS * steps * problem.chains_per_candidate
        self.budget = max(runs, self.minimum) if budget is None else budget
        problem.account.budget = self.budget  # run_round spends into it, where it spends
        self.limit = self.budget  # what the current pass may spend up to

    @property
    def spent(self) -> int:
        """The gradient evaluations spent so far, as counted by the runner."""
        return self.problem.account.spent

    def run(self) -> TuneResult:
        minimum = self.minimum
        if self.budget < minimum:
            each = f" for ℓ and for each of {', '.join(self.at)}" if self.at else ""
            raise ValueError(
                f"budget={self.budget} cannot compare two candidates: give at least {minimum} "
                f"gradient evaluations (a {self.probe_steps}-step stability probe and two "
                f"{self.min_length}-step chains with {self.problem.points} scored points{each})"
            )
        top = self._probe()
        if self.kind in ("validation", "train") and top * SPACING < self.ceiling:
            # the largest stable ℓ lies between the probe's top decade and the one that
            # diverged: a likelihood score, which judges the predictive itself, starts the
            # bracket half a decade above (the KSD favours the edge of stability: not it)
            top *= SPACING
        plan = self._plan(self._share(0), BRACKET, MAX_WIDEN)
        lrs = [top / SPACING**j for j in range(plan[0][0])]
        lr = self._search("lr", lrs, plan)
        for i, name in enumerate(list(self.at), 1):
            values = self._option_values(name, lr)
            plan = self._plan(self._share(i), len(values), MAX_WIDEN)
            self.at[name] = self._search(name, values[: plan[0][0]], plan, lr)
        chosen = _key({"lr": lr, **self.at})
        options = {**self.problem.fixed, "lr": lr, **self.at}
        # the candidates' warm-up (Problem.build) for `steps` steps
        options["adapt_until"] = capped(
            self.problem.fixed.get("adapt_until", DEFAULT_WARMUP), self.steps // 4
        )
        self._say(f"chose {', '.join(f'{k} = {v:.3g}' for k, v in chosen)}; "
                  f"{self.spent} of {self.budget} gradient evaluations spent"
                  f"{self._unspent()}")  # fmt: skip
        return TuneResult(
            sampler=self.problem.sampler,
            options=options,
            searched=("lr", *self.at),
            candidates=tuple(
                Candidate(
                    dict(key)["lr"],
                    tuple(s for _, s in h),
                    tuple(n for n, _ in h),
                    sum(n for n, _ in h) * self.problem.chains_per_candidate,
                    key in self.broken,
                    {n: v for n, v in key if n != "lr"},
                    key in self.hot,
                )
                for key, h in sorted(self.history.items())
            ),
            rounds=tuple(self.rounds),
            spent=self.spent,
            budget=self.budget,
            score=self.kind,
            steps=self.steps,
            seconds=time.monotonic() - self.started,
            edge=self.edge,
        )

    def _unspent(self) -> str:
        """Why budget is left, if much is (more than the shortest comparison costs)."""
        if self.budget - self.spent < self.least:
            return ""
        if max(r.length for r in self.rounds) >= self.steps:
            return (" (the rest was not needed: no round runs longer than the user's "
                    f"{self.steps} steps, and the halving ends at two candidates)")  # fmt: skip
        return " (the rest was too little for a further round)"

    def _say(self, line: str) -> None:
        if self.progress is not None:
            self.progress(f"tune {self.problem.sampler}: {line}")

    def _eta(self) -> str:
        elapsed = time.monotonic() - self.started
        if not self.spent:
            return f"{elapsed:.0f} s"
        left = elapsed / self.spent * max(self.budget - self.spent, 0)
        return f"{elapsed:.0f} s, at most about {left:.0f} s left"

    def _share(self, done: int) -> int:
        """An equal share of what is left for each pass still to run, from pass ``done`` on;
        sets :attr:`limit`, which that pass's rounds and widening stay within."""
        share = (self.budget - self.spent) // (self.passes - done)
        self.limit = self.spent + share
        return share

    def _candidate(self, option: str, value: float, lr: float | None = None) -> dict[str, float]:
        """ℓ = ``value`` (``lr`` None), or ``option`` = ``value`` at ℓ = ``lr``."""
        if lr is None:
            return {"lr": value, **self.at}
        return {"lr": lr, **self.at, option: value}

    def _option_values(self, name: str, lr: float) -> list[float]:
        """The bracket of a tuned option: its default × :data:`OPTION_FACTORS`, then its value
        at which G = I; those the metric refuses (a normalized α² must be > 0) left out."""
        start = self.at[name]
        values = [start * f for f in OPTION_FACTORS]
        identity = get_metric(self.problem.sampler).identity_at.get(name)
        values += [] if identity is None else [float(identity)]
        return [v for v in dict.fromkeys(values) if self._valid(name, v, lr)]

    def _valid(self, name: str, value: float, lr: float | None) -> bool:
        """Whether the metric takes ``name`` = ``value`` (every ℓ > 0 does)."""
        if lr is None:
            return True
        try:
            options = {**self.problem.fixed, **self._candidate(name, value, lr)}
            build(self.problem.sampler, num_data=self.problem.num_data, noise="philox", **options)
        except ValueError:
            return False
        return True

    def _search(
        self, option: str, values: list[float], plan: list[tuple[int, int]], lr: float | None = None
    ) -> float:
        """The bracket and the halving rounds over ``option`` (ℓ, or a tuned option at ``lr``);
        the chosen value."""
        scores = self._round(option, values, plan[0][1], lr, widen=True)
        for count, length in plan[1:]:
            ranked = sorted((s, v) for v, s in scores.items() if math.isfinite(s))
            kept = [v for _, v in ranked if lr is not None or v < self.ceiling][:count]
            length = min(length, self._affordable(len(kept)))
            if len(kept) < 2 or length < self.min_length:
                break
            scores = self._round(option, kept, length, lr)
        return self._best(option, lr)

    def _probe(self) -> float:
        """The largest ℓ of the ladder that does not diverge in a short run; the ladder moves
        down (every ℓ diverged) or up (none did) by its width once."""
        width = len(PROBE_EXPONENTS)
        stable = self._ladder(0)
        if stable and len(stable) < width:
            return max(stable)
        if self.spent + self.probe_cost + self.passes * self.least <= self.budget:
            shift = width if stable else -width
            moved = self._ladder(shift)
            if moved:
                return max(moved)
        if stable:
            return max(stable)
        raise self._all_diverged([v for r in self.rounds for v in r.values])

    def _ladder(self, shift: int) -> list[float]:
        lrs = [10.0 ** (k + shift) for k in PROBE_EXPONENTS]
        before, length = self.spent, self.probe_steps
        records = run_round(self.problem, [self._candidate("lr", lr) for lr in lrs], length,
                            scored=False)  # fmt: skip
        marks = tuple(math.inf if r.diverged else 0.0 for r in records)
        self.rounds.append(Round("probe", "lr", length, tuple(lrs), marks, self.spent - before,
                                 at=dict(self.at)))  # fmt: skip
        bad = [lr for lr, r in zip(lrs, records, strict=True) if r.diverged]
        stable = [f"{lr:.0e}" for lr, r in zip(lrs, records, strict=True) if not r.diverged]
        self._say(f"probe, {len(lrs)} × {length} steps: stable ℓ "
                  f"{', '.join(stable) or 'none'} ({self._eta()})")  # fmt: skip
        self.ceiling = min([self.ceiling, *bad])
        # a stable ℓ above one that diverged is out too (a verdict need not be monotone in ℓ)
        return [lr for lr, r in zip(lrs, records, strict=True) if lr < self.ceiling]

    def _affordable(self, candidates: int) -> int:
        """The longest chains ``candidates`` can still run within the pass's share."""
        per_step = self.problem.cost(candidates, 1) - self.problem.cost(candidates, 0)
        return (self.limit - self.spent - self.problem.cost(candidates, 0)) // per_step

    def _plan(self, left: int, bracket: int, widen: int) -> list[tuple[int, int]]:
        """(candidates, length) per round: the bracket, then halving down to two; the first
        length as long as ``left`` allows with room to widen, the last at most ``steps``."""
        cost = self.problem.cost
        for first in range(bracket, 1, -1):
            counts = [first]
            while counts[-1] > 2:
                counts.append(math.ceil(counts[-1] / 2))
            room = widen if first == bracket else 0
            fixed = sum(cost(c, 0) for c in counts) + cost(room, 0)
            per_step = sum(cost(c, 2**r) - cost(c, 0) for r, c in enumerate(counts))
            per_step += cost(room, 1) - cost(room, 0)
            length = min((left - fixed) // max(per_step, 1), self.steps // 2 ** (len(counts) - 1))
            if length >= self.min_length:
                return [(c, length * 2**r) for r, c in enumerate(counts)]
        return [(2, self.min_length)]  # fits: the budget was checked for it (run, _probe)

    def _extra(self, option: str, scores: dict[float, float]) -> float | None:
        """The value to widen the bracket by, or ``None``: past the end the best is at (ℓ:
        downwards also while every one is out, upwards only below :attr:`ceiling`)."""
        eligible = self._eligible(option, scores)
        best = min(eligible, key=scores.__getitem__) if eligible else None
        if option == "lr":
            if best is None or best == min(scores):
                return min(scores) / SPACING
            up = best * SPACING
            return up if best == max(scores) and up < self.ceiling else None
        ends = sorted(v for v in scores if v != get_metric(self.problem.sampler).identity_at.get(
            option))  # fmt: skip
        if best is None or best not in (ends[0], ends[-1]):
            return None
        return best * OPTION_SPACING if best == ends[-1] else best / OPTION_SPACING

    def _eligible(self, option: str, scores: dict[float, float]) -> list[float]:
        """The values a score may choose: finite, and for ℓ below every ℓ that is out (this
        round's and earlier ones': a verdict need not be monotone in ℓ)."""
        finite = [v for v, s in scores.items() if math.isfinite(s)]
        if option != "lr":
            return finite
        ceiling = min([self.ceiling, *(v for v in scores if v not in finite)])
        return [v for v in finite if v < ceiling]

    def _round(
        self, option: str, values: list[float], length: int, lr: float | None, widen: bool = False
    ) -> dict[float, float]:
        """Run and score a round; a bracket (``widen``) widens by one candidate at a time
        (:meth:`_extra`), at most ``MAX_WIDEN`` times, and while every ℓ diverged, downwards as
        long as the pass's share allows."""
        make = [self._candidate(option, v, lr) for v in values]
        before = self.spent
        records = dict(zip(values, run_round(self.problem, make, length), strict=True))
        widened = 0
        while True:
            scored = dict(zip(records, round_scores(list(records.values()), self.subsets,
                                                    self.kind), strict=True))  # fmt: skip
            scores = {v: s for v, (s, _) in scored.items()}
            extra = self._extra(option, scores) if widen else None
            diverged = not self._eligible(option, scores)
            if extra is None or self.spent + self.problem.cost(1, length) > self.limit:
                break
            if (not diverged and widened == MAX_WIDEN) or not self._valid(option, extra, lr):
                break
            make = [self._candidate(option, extra, lr)]
            records[extra] = run_round(self.problem, make, length)[0]
            widened += 1
        if widen and lr is None and diverged:
            raise self._all_diverged(list(records))
        self._note(option, "bracket" if widen else "halving", length, records, scored, lr,
                   self.spent - before)  # fmt: skip
        return scores

    def _note(
        self,
        option: str,
        name: str,
        length: int,
        records: dict[float, Record],
        scored: dict[float, tuple[float, float]],
        lr: float | None,
        cost: int,
    ) -> None:
        values = sorted(records)
        for v in values:
            key = _key(self._candidate(option, v, lr))
            self.history.setdefault(key, []).append((length, scored[v][0]))
            if records[v].diverged or records[v].too_large:
                (self.broken if records[v].diverged else self.hot).add(key)
                if option == "lr":
                    self.ceiling = min(self.ceiling, v)
        scores = tuple(scored[v][0] for v in values)
        errors = tuple(scored[v][1] for v in values)
        at = {k: x for k, x in self._candidate(option, 0.0, lr).items() if k != option}
        self.rounds.append(Round(name, option, length, tuple(values), scores, cost, errors, at))
        symbol = "ℓ" if option == "lr" else option
        paired = self.kind in ("validation", "train")  # ± the difference from the best's
        finite = [s for s in scores if math.isfinite(s)]
        top = min(finite) if paired and finite else None

        def cell(v: float) -> str:
            if records[v].excluded:
                return "diverged" if records[v].diverged else "lr too large"
            if scored[v][0] == top:
                return f"{scored[v][0]:.4g} (best)"
            return f"{scored[v][0]:.4g} ± {scored[v][1]:.2g}"

        cells = ", ".join(f"{v:.3g}: {cell(v)}" for v in values)
        what = f"{self.kind}, ± paired with the best" if paired else self.kind
        self._say(f"{name}, {len(values)} × {length} steps, {symbol} → {what}: {cells} "
                  f"({self.spent} of {self.budget} gradients, {self._eta()})")  # fmt: skip

    def _best(self, option: str, lr: float | None) -> float:
        """The choice in the last round over ``option``, among the candidates within one
        standard error of the best's score. ℓ: the smallest of them below every ℓ that diverged
        (a too-large ℓ's bias stays, a too-small one's slow mixing shrinks in a longer chain).
        A tuned option: the value ℓ was chosen at if it is among them, else the best."""
        for r in reversed([r for r in self.rounds if r.option == option and r.name != "probe"]):
            fine = [(s, v, e) for v, s, e in zip(r.values, r.scores, r.errors, strict=True)
                    if math.isfinite(s) and (lr is not None or v < self.ceiling)]  # fmt: skip
            if fine:
                score, best, error = min(fine)
                close = [v for s, v, e in fine if s <= score + math.hypot(error, e)]
                if lr is not None:
                    return self.at[option] if self.at[option] in close else best
                return self._margin(min(close), score)
        if lr is not None:  # every value diverged at ℓ: keep the one ℓ was chosen at
            return self.at[option]
        raise self._all_diverged([dict(k)["lr"] for k in self.history])

    def _margin(self, chosen: float, score: float) -> float:
        """The KSD's choice, or the next smaller ℓ tried where the best KSD² is above
        :data:`TRANSIENT_KSD2`: no candidate's chain has reached the posterior, so the KSD
        ranks how far each got, and the fastest is the largest ℓ that stays stable, whose
        stationary law is the most biased (``docs/tuning.md``, "The KSD on a transient")."""
        if self.kind != "ksd" or not score > TRANSIENT_KSD2:
            return chosen
        tried = [
            dict(k)["lr"] for k in self.history if {n: v for n, v in k if n != "lr"} == self.at
        ]
        below = [v for v in tried if v < chosen]
        if not below:
            return chosen
        self.edge = chosen
        step = max(below)
        self._say(f"the best KSD² {score:.3g} > {TRANSIENT_KSD2:g}: the chains are still in "
                  f"their transient, where the KSD favours the edge of stability: ℓ = "
                  f"{step:.3g}, one step below {chosen:.3g}")  # fmt: skip
        return step

    def _all_diverged(self, lrs: list[float]) -> ValueError:
        if self.hot and not self.broken - self.hot:
            return ValueError(
                f"sgrld.health called every ℓ tried too large (ℓ from {min(lrs):.3g} to "
                f"{max(lrs):.3g}): give a larger budget, so that the bracket can widen "
                "downwards, or check that num_data is the number of data"
            )
        return ValueError(
            f"every candidate diverged (ℓ from {min(lrs):.3g} to {max(lrs):.3g} tried): check "
            "that potential(model, batch) is finite at the model's start and is the per-datum "
            "potential (nll − log_prior / num_data), and that num_data is the number of data"
        )
