"""Step-size schedules for every sampler, as ``torch.optim`` learning-rate schedulers.

:class:`CyclicalLR` (Zhang et al. 2020, eq. 3): K steps in M cycles of L = ⌈K/M⌉ steps; step k
(1-based) uses

    ℓ_k = ℓ₀/2 · (cos(π · ((k−1) mod L) / L) + 1)

and explores (τ = 0, no samples: :attr:`CyclicalLR.exploring`) while ((k−1) mod L)/L < r.
"""

from __future__ import annotations

import math
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

__all__ = ["CyclicalLR", "cyclical_lr"]


def cyclical_lr(step: int, base_lr: float, cycle_length: int) -> float:
    """ℓ_k of step ``step`` (1-based) for a cycle of ``cycle_length`` steps (the formula above)."""
    phase = ((step - 1) % cycle_length) / cycle_length
    return base_lr / 2.0 * (math.cos(math.pi * phase) + 1.0)


class CyclicalLR(LRScheduler):
    """Cosine-cyclical ℓ with exploration (τ = 0) and sampling phases (cSG-MCMC).

    Call :meth:`step` after each ``optimizer.step()``; after ``j`` calls the optimizer's groups
    hold ℓ (and τ) of step ``j + 1``.

    Args:
        optimizer: any optimizer; groups with a ``temperature`` (the sgrld samplers) get τ = 0
            in exploring steps and their own τ back in sampling steps.
        total_steps: K ≥ 1, the number of steps the M cycles share.
        cycles: M ≥ 1.
        explore_fraction: r in [0, 1), the leading fraction of each cycle that explores.
        last_epoch: as in ``torch.optim.lr_scheduler`` (steps already taken, −1 for a new run).

    References:
        Zhang, Li, Zhang, Chen, Wilson: Cyclical Stochastic Gradient MCMC for Bayesian Deep
        Learning, ICLR 2020.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_steps: int,
        cycles: int,
        explore_fraction: float = 0.0,
        last_epoch: int = -1,
    ) -> None:
        check_cyclical(total_steps, cycles, explore_fraction)
        self.total_steps = total_steps
        self.cycles = cycles
        self.explore_fraction = float(explore_fraction)
        self.cycle_length = math.ceil(total_steps / cycles)
        self.base_temperatures: list[float | None] = [
            g.get("temperature") for g in optimizer.param_groups
        ]
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:  # type: ignore[override]
        step, length = self.last_epoch + 1, self.cycle_length
        return [cyclical_lr(step, float(base), length) for base in self.base_lrs]

    @property
    def exploring(self) -> bool:
        """Whether the next optimizer step (step ``last_epoch + 1``) is in an exploration phase."""
        phase = (self.last_epoch % self.cycle_length) / self.cycle_length
        return phase < self.explore_fraction

    def step(self, epoch: Any = None) -> None:
        super().step(epoch)
        exploring = self.exploring
        for group, temperature in zip(
            self.optimizer.param_groups, self.base_temperatures, strict=True
        ):
            if temperature is not None:
                group["temperature"] = 0.0 if exploring else temperature

    def describe(self) -> dict[str, Any]:
        """The schedule as JSON values: with these, ℓ of every step follows from the formula."""
        return {
            "name": "cyclical",
            "formula": "lr_k = base_lr/2 * (cos(pi * ((k-1) % cycle_length) / cycle_length) + 1)",
            "base_lrs": [float(b) for b in self.base_lrs],
            "total_steps": self.total_steps,
            "cycles": self.cycles,
            "cycle_length": self.cycle_length,
            "explore_fraction": self.explore_fraction,
            "exploring_if": "((k-1) % cycle_length) / cycle_length < explore_fraction",
        }


def check_cyclical(total_steps: int, cycles: int, explore_fraction: float) -> None:
    """Refuse bad cyclical-schedule values with a message naming the argument."""
    for name, value in (("total_steps", total_steps), ("cycles", cycles)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"invalid {name}: {value!r} (expected an integer >= 1)")
    if (
        isinstance(explore_fraction, bool)
        or not isinstance(explore_fraction, (int, float))
        or not 0.0 <= explore_fraction < 1.0
    ):
        raise ValueError(f"invalid explore_fraction: {explore_fraction!r} (expected 0 <= r < 1)")
