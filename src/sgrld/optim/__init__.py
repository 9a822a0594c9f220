"""``torch.optim`` facade: the samplers as optimizers, thin wrappers over :mod:`sgrld.core`.

``p.grad`` must hold the gradient of the per-datum potential (batch-mean negative log-likelihood
minus log-prior / num_data); every sampler then applies

    θ ← θ − lr · G⁻¹ · grad + √(2 · lr · temperature / num_data) · G^{-1/2} · ξ

(see ``docs/conventions.md``): :class:`SGRLDOptimizer` with any metric
(:mod:`~sgrld.optim.optimizer`), and one preset per metric of the paper
(:mod:`~sgrld.optim.presets`).
"""

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
    "drawn_adapting",
]
