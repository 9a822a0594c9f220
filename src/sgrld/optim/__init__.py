"""``torch.optim`` facade over :mod:`sgrld.core`: :class:`SGRLDOptimizer` with any metric
(:mod:`~sgrld.optim.optimizer`), one preset per metric of the paper
(:mod:`~sgrld.optim.presets`) and the functional samplers' :func:`~sgrld.optim.build.build`;
``docs/conventions.md`` fixes ℓ, n, τ and the signs."""

from sgrld.optim.build import build
from sgrld.optim.groups import drawn_adapting
from sgrld.optim.optimizer import ParamsT, SGRLDOptimizer
from sgrld.optim.presets import SGLD, MongeSGLD, RMSpropSGLD, ShampooSGLD, WenzelSGLD

__all__ = [
    "SGLD",
    "MongeSGLD",
    "ParamsT",
    "RMSpropSGLD",
    "SGRLDOptimizer",
    "ShampooSGLD",
    "WenzelSGLD",
    "build",
    "drawn_adapting",
]
