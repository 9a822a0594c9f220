"""The functional core: the metric contract, flat layout, state, the step engine and the
functional sampler; it imports nothing above it. Names are imported on first use (PEP 562).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sgrld.core.engine import Move, NonFiniteGradientError, advance, body, check
    from sgrld.core.integrator import euler_maruyama, noise_scale
    from sgrld.core.layout import FlatLayout
    from sgrld.core.sampler import Sampler, clone_state
    from sgrld.core.state import SamplerState

_LAZY = {
    **dict.fromkeys(
        ("Move", "NonFiniteGradientError", "advance", "body", "check"), "sgrld.core.engine"
    ),
    **dict.fromkeys(("euler_maruyama", "noise_scale"), "sgrld.core.integrator"),
    "FlatLayout": "sgrld.core.layout",
    **dict.fromkeys(("Sampler", "clone_state"), "sgrld.core.sampler"),
    "SamplerState": "sgrld.core.state",
}

__all__ = [
    "FlatLayout",
    "Move",
    "NonFiniteGradientError",
    "Sampler",
    "SamplerState",
    "advance",
    "body",
    "check",
    "clone_state",
    "euler_maruyama",
    "noise_scale",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'sgrld.core' has no attribute {name!r}")
