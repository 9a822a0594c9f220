"""The functional core: flat layout, state, the step engine and the functional sampler."""

from sgrld.core.engine import NonFiniteGradientError, advance, body, check
from sgrld.core.integrator import euler_maruyama, noise_scale
from sgrld.core.layout import FlatLayout
from sgrld.core.sampler import Sampler, clone_state
from sgrld.core.state import SamplerState

__all__ = [
    "FlatLayout",
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
