"""The functional core: flat layout, state, the Euler–Maruyama integrator and the sampler."""

from sgrld.core.integrator import euler_maruyama, noise_scale
from sgrld.core.layout import FlatLayout
from sgrld.core.sampler import NonFiniteGradientError, Sampler, clone_state, sgrld_step
from sgrld.core.state import SamplerState

__all__ = [
    "FlatLayout",
    "NonFiniteGradientError",
    "Sampler",
    "SamplerState",
    "clone_state",
    "euler_maruyama",
    "noise_scale",
    "sgrld_step",
]
