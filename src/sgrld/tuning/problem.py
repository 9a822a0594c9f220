"""What every round of the search shares (:class:`Problem`): the sampler, the model, the data,
the scored coordinates and the account of gradient evaluations the runner spends into."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import Tensor, nn

from sgrld.chains import Chains
from sgrld.core.runner import Account, sampled
from sgrld.core.warmup import DEFAULT_WARMUP, capped
from sgrld.optim import build
from sgrld.tuning.data import Batches

__all__ = ["Potential", "Problem"]

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
