"""The user's batches as the tuner's chains see them: every candidate the same batch.

A batch (a tensor, a tuple/list or a mapping of tensors) is flattened to tensors, each expanded
to ``(K, ...)`` without a copy (common random numbers: candidates differ by their ℓ only), and
rebuilt for ``potential``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = ["Batches", "bind", "expanded", "flatten", "size"]


def flatten(batch: Any) -> tuple[list[Tensor], Callable[[tuple[Tensor, ...]], Any]]:
    """The tensors of ``batch`` and a function rebuilding a batch of its structure from them."""
    if isinstance(batch, Tensor):
        return [batch], lambda ts: ts[0]
    if isinstance(batch, Mapping):
        keys = list(batch)
        return [batch[k] for k in keys], lambda ts: dict(zip(keys, ts, strict=True))
    if isinstance(batch, (tuple, list)):
        kind = type(batch) if isinstance(batch, list) else tuple
        return list(batch), lambda ts: kind(ts)
    name = type(batch).__name__
    raise TypeError(f"a batch must be a tensor, a tuple/list or a mapping of tensors, got {name}")


@dataclasses.dataclass
class Batches:
    """A re-iterable loader checked once, its batch count and a cached scoring set.

    Args:
        loader: anything that yields batches each time it is iterated.
        score_points: how many data of the first pass are kept (on the model's device) for the
            score's gradients.
        device: where the model lives.
    """

    loader: Iterable[Any]
    score_points: int
    device: torch.device
    per_epoch: int = 0
    scoring: list[Any] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        kept = 0
        for batch in self.loader:
            self.per_epoch += 1
            if kept < self.score_points:
                tensors, rebuild = flatten(batch)
                self.scoring.append(rebuild(tuple(t.to(self.device) for t in tensors)))
                kept += len(tensors[0])
        if not self.per_epoch:
            raise ValueError("the loader yielded no batch")
        if next(iter(self.loader), None) is None:
            raise ValueError(
                "the loader was empty on its second pass (a generator can be iterated once): "
                "pass a DataLoader or a list of batches, which yield their batches every time"
            )

    def epochs(self) -> Iterator[tuple[Any, bool]]:
        """Batches on the device, endlessly, each with whether it ends an epoch."""
        while True:
            count = 0
            for batch in self.loader:
                count += 1
                tensors, rebuild = flatten(batch)
                yield rebuild(tuple(t.to(self.device) for t in tensors)), count == self.per_epoch
            if not count:
                raise ValueError("the loader was empty on a later pass: it must be re-iterable")


def expanded(batch: Any, k: int) -> tuple[tuple[Tensor, ...], Callable[[tuple[Tensor, ...]], Any]]:
    """``batch``'s tensors expanded to ``(k, ...)`` (views) and the rebuild function."""
    tensors, rebuild = flatten(batch)
    return tuple(t.expand(k, *t.shape) for t in tensors), rebuild


def size(batch: Any) -> int:
    """The number of data in ``batch`` (the first dimension of its first tensor)."""
    return len(flatten(batch)[0][0])


def bind(
    fn: Callable[[Any, Any], Tensor], rebuild: Callable[[tuple[Tensor, ...]], Any]
) -> Callable[..., Tensor]:
    """``fn(model, batch)`` as a function ``(model, *tensors)`` of the batch's tensors."""

    def call(model: Any, *tensors: Tensor) -> Tensor:
        return fn(model, rebuild(tensors))

    return call
