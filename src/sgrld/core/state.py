"""Sampler state: everything a step depends on, so that save → load → continue is exact."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from sgrld.core.layout import FlatLayout
from sgrld.core.noise import NoiseBuffer


@dataclass
class Workspace:
    """Preallocated flat scratch buffers (not part of the state: recreated on demand)."""

    grad: Tensor
    noise: NoiseBuffer

    @staticmethod
    def for_layout(layout: FlatLayout, like: Tensor) -> Workspace:
        shape = (*layout.batch_shape, layout.size)
        return Workspace(
            layout.empty(like.dtype, like.device), NoiseBuffer(shape, like.dtype, like.device)
        )


@dataclass
class SamplerState:
    """State of one group of parameters under one sampler.

    Attributes:
        params: the parameters (updated in place by :func:`sgrld.core.sampler.Sampler.step`).
        stats: the metric's statistics (see :mod:`sgrld.metrics.base`).
        step: number of steps taken so far.
        generator: the random generator that drives the noise.
        layout: the flat layout of ``params``.
    """

    params: dict[str, Tensor]
    stats: dict[str, Tensor]
    step: int
    generator: torch.Generator
    layout: FlatLayout
    workspace: Workspace | None = field(default=None, repr=False, compare=False)

    def state_dict(self) -> dict[str, Any]:
        """Statistics, step and generator state (parameters are saved by the caller)."""
        return {
            "stats": {k: v.clone() for k, v in self.stats.items()},
            "step": self.step,
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore in place, keeping existing buffers (and views of them) valid."""
        if set(sd["stats"]) != set(self.stats):
            missing = set(self.stats) ^ set(sd["stats"])
            raise ValueError(f"state dict does not match this sampler (keys {sorted(missing)})")
        for k, v in sd["stats"].items():
            if v.shape != self.stats[k].shape:
                raise ValueError(
                    f"state dict entry {k!r} has shape {tuple(v.shape)}, "
                    f"expected {tuple(self.stats[k].shape)}"
                )
            self.stats[k].copy_(v)
        self.step = int(sd["step"])
        self.generator.set_state(sd["generator"])


def new_generator(
    device: torch.device | str, seed_from: torch.Generator | None = None
) -> torch.Generator:
    """A private generator seeded from ``seed_from`` (default: torch's global generator)."""
    seed = int(torch.randint(0, 2**62, (), generator=seed_from).item())
    return torch.Generator(device=device).manual_seed(seed)
