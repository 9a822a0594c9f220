"""When a chain has diverged: the one rule the tuner (and any health check) applies.

A chain has diverged when its potential or its parameters are no longer finite, or when its
per-datum potential has risen by more than ``factor`` (three orders of magnitude by default)
times its starting size above its start. The per-datum potential is in nats per datum, so a rise
of a thousand times max(|u₀|, 1) is a blow-up in any problem; a healthy chain started anywhere
moves *down* towards the typical set, and its fluctuations there are O(D/n) nats per datum.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["BLOW_UP_FACTOR", "diverged"]

#: how many times its starting size a per-datum potential may rise before a chain has diverged
BLOW_UP_FACTOR = 1e3


def diverged(
    start: Tensor, worst: Tensor, finite: Tensor | None = None, *, factor: float = BLOW_UP_FACTOR
) -> Tensor:
    """Per chain, whether it diverged.

    Args:
        start: ``(K,)`` per-datum potential of each chain at its start.
        worst: ``(K,)`` the largest per-datum potential each chain reached since (NaN if any
            value was NaN: ``torch.maximum`` propagates it).
        finite: ``(K,)`` bool, whether each chain's parameters and gradients stayed finite
            (default: all did).
        factor: the rise, in units of max(|start|, 1), beyond which a chain has blown up.

    Returns:
        ``(K,)`` bool tensor: NaN/Inf potential or parameters, or a blown-up potential.
    """
    rise = worst - start
    blown = ~torch.isfinite(worst) | ~torch.isfinite(start)
    blown |= rise > factor * start.abs().clamp_min(1.0)
    if finite is not None:
        blown |= ~finite
    return blown
