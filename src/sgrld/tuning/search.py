"""The search: a stability probe, a bracket that widens until its ends are worse, then
successive halving (MAMBA: Coullon, South & Nemeth 2023) so that most of the budget goes to the
best candidates. ``docs/tuning.md`` says why each choice was made."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from sgrld import build
from sgrld.metrics import resolve_metric_name
from sgrld.tuning.data import Batches
from sgrld.tuning.result import Candidate, Round, TuneResult
from sgrld.tuning.runs import Potential, Problem, Record, run_round
from sgrld.tuning.score import round_scores

__all__ = ["tune"]

#: the probe's ladder: ℓ = 10^k for these k, shifted by its width when every ℓ (or none) diverges
PROBE_EXPONENTS = tuple(range(-8, 5))
PROBE_STEPS = 300
#: the bracket's candidates: half a decade apart, from the largest ℓ stable in the probe down
BRACKET = 7
SPACING = math.sqrt(10.0)
MAX_WIDEN = 3
#: coordinates per subset of the score, and subsets when the model has more
SUBSET, SUBSETS = 16, 8


def tune(
    sampler: str,
    model: nn.Module,
    potential: Potential,
    loader: Iterable[Any],
    *,
    num_data: float,
    steps: int,
    budget: int,
    seed: int = 0,
    validation: tuple[Iterable[Any], Callable[[nn.Module, Any], Tensor]] | None = None,
    chains: int = 1,
    points: int = 128,
    score_points: int = 2048,
    **fixed: Any,
) -> TuneResult:
    """Choose the step size ℓ of ``sampler`` for a chain of ``steps`` steps, within ``budget``.

    A stability probe (a ladder of ℓ a decade apart, 300 steps each) finds the largest ℓ that
    does not diverge; the bracket's candidates go down from it half a decade apart and widen
    while the best is at an end; successive halving then reruns the better half of the
    candidates with chains twice as long, until two are left. Each candidate's chain is scored
    on its second half (``points`` thinned points per chain) by the kernel Stein discrepancy of
    its samples from near-full-data gradients on random coordinate subsets, or, with
    ``validation``, by the validation log predictive density (the paper's rule). All candidates
    of a round are chains of one :class:`~sgrld.Chains`, on the same minibatches. The model is
    not changed, and torch's global random state is restored on return.

    Args:
        sampler: a sampler name (``sgrld.metric_names()``, or an alias).
        model: the model, at the point the chains start from (left unchanged).
        potential: ``potential(model, batch)``: the batch's per-datum potential as a 0-d tensor,
            ``nll − log_prior / num_data`` (``docs/conventions.md``).
        loader: re-iterable batches (a ``DataLoader`` or a list), each a tensor, a tuple/list
            or a mapping of tensors.
        num_data: the number of training data n.
        steps: the length of the chain the options are for.
        budget: gradient evaluations the search may spend in all (one minibatch gradient of one
            chain; a scoring or validation batch at a thinned point counts as one).
        seed: the search's seed: the same seed gives the same result.
        validation: ``(batches, log_likelihood)`` with ``log_likelihood(model, batch)`` each
            datum's log-likelihood ``(B,)``: the score is then the validation log predictive.
        chains: chains per candidate.
        points: thinned points per chain scored.
        score_points: data of the loader's first pass used for the score's gradients (all of
            them when there are fewer: the full-data gradient).
        **fixed: the sampler's fixed options (``alpha2_rule="normalized"``, ``decay``,
            ``temperature``, ``adapt_until``, ...), kept in the result's options.

    Returns:
        A :class:`TuneResult`: ``options`` (``lr`` and ``fixed``), ``candidates``, ``spent``.

    Raises:
        ValueError: a budget too small to compare two candidates (naming the minimum), every
            candidate diverging (naming the range tried), a loader that is empty on its second
            pass, or invalid options.

    Example:
        >>> result = sgrld.tune("monge", model, potential, loader, num_data=n,
        ...                     steps=40_000, budget=150_000, seed=0)  # doctest: +SKIP
        >>> opt = sgrld.SGRLDOptimizer(model.parameters(), metric="monge", num_data=n,
        ...                            **result.options)  # doctest: +SKIP
    """
    name = resolve_metric_name(sampler)
    for label, value, low in (("steps", steps, 1), ("budget", budget, 1), ("seed", seed, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"invalid {label}: {value!r} (expected an int >= {low})")
    if "lr" in fixed:
        raise TypeError("tune() chooses lr: pass the other options only")
    build(name, lr=1.0, num_data=num_data, noise="philox", **fixed)  # refuse bad options
    first = next(iter(model.parameters()), None)
    if first is None:
        raise ValueError("the model has no parameters")
    devices = [first.device] if first.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        batches = Batches(loader, score_points, first.device)
        coords, subsets = _subsets(sum(p.numel() for p in model.parameters()), seed)
        problem = Problem(
            name, model, potential, batches, num_data, dict(fixed), coords, seed, chains, points,
            None if validation is None else (list(validation[0]), validation[1]),
        )  # fmt: skip
        return _Search(problem, steps, budget, subsets).run()


def _subsets(size: int, seed: int) -> tuple[Tensor, list[list[int]]]:
    """The scored coordinates (flat indices) and the subsets, as columns of the kept ones."""
    if size <= SUBSET:
        return torch.arange(size), [list(range(size))]
    gen = torch.Generator().manual_seed(seed)
    count = min(SUBSET * SUBSETS, size)
    coords = torch.randperm(size, generator=gen)[:count].sort().values
    order = torch.randperm(count, generator=gen).tolist()
    return coords, [order[i : i + SUBSET] for i in range(0, count - SUBSET + 1, SUBSET)]


class _Search:
    """The state of one search: what was run, what it scored, what it cost."""

    def __init__(self, problem: Problem, steps: int, budget: int, subsets: list[list[int]]):
        self.problem, self.steps, self.budget, self.subsets = problem, steps, budget, subsets
        self.kind = "ksd" if problem.validation is None else "validation"
        self.spent = 0
        self.rounds: list[Round] = []
        self.history: dict[float, list[tuple[int, float]]] = {}
        self.broken: set[float] = set()
        self.min_length = 4 * problem.points

    def run(self) -> TuneResult:
        probe_cost = self.problem.cost(len(PROBE_EXPONENTS), PROBE_STEPS, scored=False)
        minimum = probe_cost + self._least()
        if self.budget < minimum:
            raise ValueError(
                f"budget={self.budget} cannot compare two candidates: give at least {minimum} "
                f"gradient evaluations (a {PROBE_STEPS}-step stability probe and two "
                f"{self.min_length}-step chains with {self.problem.points} scored points)"
            )
        top = self._probe()
        plan = self._plan(self.budget - self.spent)
        lrs = [top / SPACING**j for j in range(plan[0][0])]
        scores = self._bracket(lrs, plan[0][1])
        for count, length in plan[1:]:
            ranked = sorted((s, lr) for lr, s in scores.items() if math.isfinite(s))
            lrs = [lr for _, lr in ranked[:count] if lr < min(self.broken, default=math.inf)]
            if len(lrs) < 2:
                break
            length = min(length, self._affordable(len(lrs)))
            if length < self.min_length:
                break
            scores = self._round("halving", lrs, length)
        best = self._best()
        return TuneResult(
            sampler=self.problem.sampler,
            options={"lr": best, **self.problem.fixed},
            candidates=tuple(
                Candidate(
                    lr,
                    tuple(s for _, s in h),
                    tuple(n for n, _ in h),
                    sum(n for n, _ in h) * self.problem.chains_per_candidate,
                    lr in self.broken,
                )
                for lr, h in sorted(self.history.items())
            ),
            rounds=tuple(self.rounds),
            spent=self.spent,
            budget=self.budget,
            score=self.kind,
            steps=self.steps,
        )

    def _probe(self) -> float:
        """The largest ℓ of the ladder that does not diverge in a short run; the ladder moves
        down (every ℓ diverged) or up (none did) by its width once."""
        width = len(PROBE_EXPONENTS)
        stable = self._ladder(0)
        if stable and len(stable) < width:
            return max(stable)
        if self.spent + self._probe_cost() + self._least() <= self.budget:
            shift = width if stable else -width
            moved = self._ladder(shift)
            if moved:
                return max(moved)
        if stable:
            return max(stable)
        raise self._all_diverged([lr for r in self.rounds for lr in r.lrs])

    def _ladder(self, shift: int) -> list[float]:
        lrs = [10.0 ** (k + shift) for k in PROBE_EXPONENTS]
        records = run_round(self.problem, lrs, PROBE_STEPS, scored=False)
        self.spent += self._probe_cost()
        marks = tuple(math.inf if r.diverged else 0.0 for r in records)
        self.rounds.append(Round("probe", PROBE_STEPS, tuple(lrs), marks, self._probe_cost()))
        self.broken.update(lr for lr, r in zip(lrs, records, strict=True) if r.diverged)
        return [lr for lr, r in zip(lrs, records, strict=True) if not r.diverged]

    def _affordable(self, candidates: int) -> int:
        """The longest chains ``candidates`` can still run within the budget."""
        per_step = self.problem.cost(candidates, 1) - self.problem.cost(candidates, 0)
        return (self.budget - self.spent - self.problem.cost(candidates, 0)) // per_step

    def _least(self) -> int:
        """The cost of the smallest comparison: two candidates, the shortest chains."""
        return self.problem.cost(2, self.min_length)

    def _probe_cost(self) -> int:
        return self.problem.cost(len(PROBE_EXPONENTS), PROBE_STEPS, scored=False)

    def _plan(self, left: int) -> list[tuple[int, int]]:
        """(candidates, length) per round: the bracket, then halving down to two; the first
        length as long as the budget allows with room to widen, the last at most ``steps``."""
        cost = self.problem.cost
        for first in range(BRACKET, 1, -1):
            counts = [first]
            while counts[-1] > 2:
                counts.append(math.ceil(counts[-1] / 2))
            widen = MAX_WIDEN if first == BRACKET else 0
            fixed = sum(cost(c, 0) for c in counts) + cost(widen, 0)
            per_step = sum(cost(c, 2**r) - cost(c, 0) for r, c in enumerate(counts))
            per_step += cost(widen, 1) - cost(widen, 0)
            length = min((left - fixed) // max(per_step, 1), self.steps // 2 ** (len(counts) - 1))
            if length >= self.min_length:
                return [(c, length * 2**r) for r, c in enumerate(counts)]
        return [(2, self.min_length)]  # fits: the probe left room for it (run, _probe)

    def _bracket(self, lrs: list[float], length: int) -> dict[float, float]:
        """Score the bracket, widening it by one candidate at a time while the best is at an
        end that did not diverge (a larger ℓ known to diverge closes the top), at most
        ``MAX_WIDEN`` times; while every candidate diverged, downwards as long as the budget
        allows."""
        records = dict(zip(lrs, run_round(self.problem, lrs, length), strict=True))
        self.spent += self.problem.cost(len(lrs), length)
        widened = 0
        while True:
            scored = dict(zip(records, round_scores(list(records.values()), self.subsets,
                                                    self.kind), strict=True))  # fmt: skip
            scores = {lr: v[0] for lr, v in scored.items()}
            finite = [lr for lr, s in scores.items() if math.isfinite(s)]
            best = min(finite, key=lambda lr: scores[lr]) if finite else None
            if best is None or best == min(records):  # every one diverged, or the best is
                extra = min(records) / SPACING  # the smallest: look lower
            elif best == max(records) and best * SPACING < min(self.broken, default=math.inf):
                extra = best * SPACING
            else:
                break
            room = self.spent + self.problem.cost(1, length) <= self.budget
            if not room or (best is not None and widened == MAX_WIDEN):
                break
            records[extra] = run_round(self.problem, [extra], length)[0]
            self.spent += self.problem.cost(1, length)
            widened += 1
        if best is None:
            raise self._all_diverged(list(records))
        self._note("bracket", length, records, scored)
        return scores

    def _round(self, name: str, lrs: list[float], length: int) -> dict[float, float]:
        records = dict(zip(lrs, run_round(self.problem, lrs, length), strict=True))
        self.spent += self.problem.cost(len(lrs), length)
        scored = dict(zip(lrs, round_scores(list(records.values()), self.subsets, self.kind),
                          strict=True))  # fmt: skip
        self._note(name, length, records, scored)
        return {lr: v[0] for lr, v in scored.items()}

    def _note(
        self,
        name: str,
        length: int,
        records: dict[float, Record],
        scored: dict[float, tuple[float, float]],
    ) -> None:
        lrs = sorted(records)
        for lr in lrs:
            self.history.setdefault(lr, []).append((length, scored[lr][0]))
            if records[lr].diverged:
                self.broken.add(lr)
        cost = self.problem.cost(len(lrs), length)
        scores = tuple(scored[lr][0] for lr in lrs)
        errors = tuple(scored[lr][1] for lr in lrs)
        self.rounds.append(Round(name, length, tuple(lrs), scores, cost, errors))

    def _best(self) -> float:
        """The best candidate of the last round with one below every ℓ that diverged, or the
        smallest ℓ whose score is within one standard error of the best's (the one-standard-
        error rule): a too-large ℓ's bias stays in a chain of any length, while a too-small
        one's slower mixing shrinks in the user's chain, longer than the round's."""
        ceiling = min(self.broken, default=math.inf)
        for r in reversed(self.rounds):
            if r.name == "probe":
                continue
            fine = [(s, lr, e) for lr, s, e in zip(r.lrs, r.scores, r.errors, strict=True)
                    if math.isfinite(s) and lr < ceiling]  # fmt: skip
            if fine:
                score, _, error = min(fine)
                close = [c for s, c, e in fine if s <= score + math.hypot(error, e)]
                return min(close)
        raise self._all_diverged(list(self.history))

    def _all_diverged(self, lrs: list[float]) -> ValueError:
        return ValueError(
            f"every candidate diverged (ℓ from {min(lrs):.3g} to {max(lrs):.3g} tried): check "
            "that potential(model, batch) is finite at the model's start and is the per-datum "
            "potential (nll − log_prior / num_data), and that num_data is the number of data"
        )
