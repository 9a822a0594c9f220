"""One round of the search: every candidate (ℓ and the searched options' values) a chain, or a
few, of one :class:`~sgrld.Chains`.

A round runs its candidates together on the same minibatches and keeps, at ``points`` thinned
steps of each chain's second half, the scored coordinates, ∇log p = −(n/τ)∇u there (from the
scoring batches) and each validation datum's log-likelihood. Divergence is
:meth:`~sgrld.Chains.health`'s verdict on the second half; a chain whose potential blows up
(:func:`~sgrld.chain_health.blown_up`) gets a non-finite gradient, so the engine freezes it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import Tensor

from sgrld.chain_health import blown_up
from sgrld.core.runner import Stepper, VectorizedChains, run
from sgrld.metrics import get_metric
from sgrld.tuning.problem import Potential, Problem
from sgrld.tuning.score import Record
from sgrld.tuning.score import records as _records
from sgrld.tuning.score import thinned as _score
from sgrld.tuning.score import validation as _validation

__all__ = ["Potential", "Problem", "Record", "run_round"]  # re-exported from problem, score


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
