"""One round of the search: every candidate (ℓ and the searched options' values) a chain, or a
few, of one :class:`~sgrld.Chains`.

A round runs its candidates together on the same minibatches and keeps, at ``points`` thinned
steps of each chain's second half, the scored coordinates, ∇log p = −(n/τ)∇u there (from the
scoring batches) and each validation datum's log-likelihood. Divergence is
:meth:`~sgrld.Chains.health`'s verdict on the second half; a chain whose potential blows up
(:func:`~sgrld.chain_health.blown_up`) gets a non-finite gradient, so the engine freezes it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import Tensor, nn

from sgrld.chain_health import blown_up
from sgrld.chains import Chains
from sgrld.core.runner import Account, Stepper, VectorizedChains, run, sampled
from sgrld.core.warmup import DEFAULT_WARMUP, capped
from sgrld.metrics import get_metric
from sgrld.optim import build
from sgrld.tuning.data import Batches
from sgrld.tuning.score import Record
from sgrld.tuning.score import records as _records
from sgrld.tuning.score import thinned as _score
from sgrld.tuning.score import validation as _validation

__all__ = ["Problem", "Record", "run_round"]  # Record: re-exported from score

Potential = Callable[[nn.Module, Any], Tensor]


@dataclasses.dataclass
class Problem:
    """What every round shares: the sampler, the model, the data and the scoring subset."""

    sampler: str
    model: nn.Module
    potential: Potential
    batches: Batches
    num_data: float
    fixed: dict[str, Any]
    coords: Tensor  # flat indices of the scored coordinates
    seed: int
    chains_per_candidate: int
    points: int
    validation: tuple[list[Any], Callable[[nn.Module, Any], Tensor]] | None = None
    account: Account = dataclasses.field(default_factory=Account)

    def build(self, candidates: Sequence[Mapping[str, float]], length: int) -> Chains:
        """The round's chains (``lr`` and the searched options per candidate): candidate c's
        chains are ``c·C, …, c·C + C − 1``, with telemetry for their health."""
        options: dict[str, Any] = {**self.fixed, **candidates[0]}
        # inside the burn-in (the first half) of a round
        warmup = capped(options.pop("adapt_until", DEFAULT_WARMUP), length // 4)
        sampler = build(
            self.sampler, num_data=self.num_data, noise="philox", adapt_until=warmup,
            **options,
        )  # fmt: skip
        c = self.chains_per_candidate
        seeds = [(self.seed * 1_000_003 + j) % 2**63 for _ in candidates for j in range(c)]
        per_chain: dict[str, Any] = {
            name: [float(x[name]) for x in candidates for _ in range(c)] for name in candidates[0]
        }
        sample = sampled(self.model).__contains__  # the frozen parameters stay
        return Chains(self.model, sampler, seeds, telemetry=True, sample=sample, **per_chain)

    def cost(self, candidates: int, length: int, *, scored: bool = True) -> int:
        """The forecast of a round's gradient evaluations that the search plans with
        (:func:`run_round` counts what it spends into :attr:`account`; the tests hold the two
        equal): one per chain and step, and per scoring or validation batch at a thinned
        point."""
        chains = candidates * self.chains_per_candidate
        per_point = len(self.batches.scoring) + len(self.validation[0] if self.validation else [])
        return chains * (length + self.points * per_point * scored)


def run_round(
    problem: Problem,
    candidates: Sequence[Mapping[str, float]],
    length: int,
    *,
    scored: bool = True,
) -> list[Record]:
    """Run every candidate (``{"lr": ℓ, **searched options}``) for ``length`` steps; one
    :class:`Record` each (``scored=False``: whether it diverged only, e.g. for a stability
    probe). The gradient evaluations go into ``problem.account``, each where it is spent."""
    chains = problem.build(candidates, length)
    k = chains.num_chains
    burn = length // 2
    stride = max(1, (length - burn) // problem.points)
    thinned = {burn + stride * (i + 1) for i in range(problem.points)} if scored else set()
    kept: dict[str, list[Tensor]] = {"x": [], "s": [], "ll": []}
    temperature = float(problem.fixed.get("temperature", 1.0)) or 1.0

    def each(_: Stepper, step: int) -> None:
        if step == burn:
            chains.telemetry()  # health is judged on the second half, the scored one
        if step in thinned:
            problem.account.spend(k * len(problem.batches.scoring))
            x, s = _score(problem, chains)
            kept["x"].append(x)
            kept["s"].append(s * (problem.num_data / temperature))
            if problem.validation is not None:
                problem.account.spend(k * len(problem.validation[0]))  # priced as gradients
                kept["ll"].append(_validation(problem, chains))

    refresh = get_metric(problem.sampler).refresh_per_epoch
    # a chain whose potential blows up gets a non-finite gradient: the engine freezes it
    stepper = VectorizedChains(chains, problem.potential, rule=blown_up, refresh=refresh)
    run([stepper], problem.batches.loader, length, account=problem.account, each=each)
    broken = [h.broken_down for h in chains.health()]
    c = problem.chains_per_candidate
    return _records(problem, [any(broken[i : i + c]) for i in range(0, k, c)], kept)
