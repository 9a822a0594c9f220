"""The user's batches as the tuner's chains see them: every candidate the same batch
(:func:`~sgrld.core.runner.expanded`: common random numbers, candidates differ by their ℓ
only), and the scoring set kept from the first pass."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch

from sgrld.core.runner import bind, expanded, flatten, passes, size

__all__ = ["Batches", "bind", "expanded", "flatten", "size"]


@dataclasses.dataclass
class Batches:
    """A re-iterable loader (:func:`~sgrld.core.runner.passes`) and a cached scoring set.

    Args:
        loader: anything that yields batches each time it is iterated, every pass ending.
        score_points: how many data of the first pass are kept (on the model's device) for the
            score's gradients; only the batches they need are read.
        device: where the model lives.
    """

    loader: Iterable[Any]
    score_points: int
    device: torch.device
    scoring: list[Any] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        kept = 0
        # the whole first pass, then the start of a second, as the tuner always read them: a
        # shuffling loader draws its order from torch's random state, which the search's
        # chains share, so the same reads keep the same tuning for the same seed
        for batch, last in passes(self.loader):
            if kept < self.score_points:
                tensors, rebuild = flatten(batch)
                self.scoring.append(rebuild(tuple(t.to(self.device) for t in tensors)))
                kept += len(tensors[0])
            if last:
                break
        next(iter(self.loader), None)

    def joined(self) -> Any:
        """The scoring batches as one batch (their tensors concatenated)."""
        parts = [flatten(batch) for batch in self.scoring]
        tensors = [torch.cat(ts) for ts in zip(*(p[0] for p in parts), strict=True)]
        return parts[0][1](tuple(tensors))

    def first(self, points: int) -> list[Any]:
        """The scoring batches that hold the first ``points`` data, as a :class:`Batches`
        keeping ``points`` would have kept them (the loader read the same way)."""
        out, kept = [], 0
        for batch in self.scoring:
            if kept >= points:
                break
            out.append(batch)
            kept += size(batch)
        return out
