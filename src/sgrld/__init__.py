"""sgrld: scalable Stochastic Gradient Riemannian Langevin Dynamics for PyTorch.

Samplers θ ← θ − ℓ G⁻¹ĝ + √(2ℓτ/n) G^{-1/2}ξ that differ only in the metric G
(Yu, Hartmann, Williams, Klami; TMLR 2023). Two API levels:

* ``torch.optim`` facades: :class:`SGLD`, :class:`RMSpropSGLD`, :class:`WenzelSGLD`,
  :class:`MongeSGLD`, :class:`ShampooSGLD`;
* the functional core: ``sampler = sgrld.build("monge", lr=..., num_data=...)``, then
  ``state = sampler.init(params)`` and ``state = sampler.step(state, grads)``.

Conventions (ℓ, n, τ, h, signs): ``docs/conventions.md``.
"""

from typing import Any

from torch import Tensor

from sgrld.chains import Chains
from sgrld.core import NonFiniteGradientError, Sampler, SamplerState
from sgrld.core.noise import NoiseSource
from sgrld.metrics import (
    IdentityMetric,
    Metric,
    MongeMetric,
    RMSpropMetric,
    ShampooMetric,
    WenzelMetric,
    get_metric,
    metric_names,
)
from sgrld.optim import (
    SGLD,
    MongeSGLD,
    RMSpropSGLD,
    SGRLDOptimizer,
    ShampooSGLD,
    WenzelSGLD,
)

__version__ = "0.1.0"


def build(
    metric: str | Metric,
    *,
    lr: float | Tensor,
    num_data: float,
    temperature: float = 1.0,
    check_finite: bool = True,
    noise: NoiseSource = "torch",
    compile: bool = False,
    capturable: bool = False,
    sync_checks: bool | None = None,
    **metric_options: Any,
) -> Sampler:
    """A functional sampler for ``metric`` (a registry name or a :class:`Metric` instance).

    The options are :class:`Sampler`'s; the rest go to the metric. The random generator (and
    per-chain seeds) belong to the state: ``sampler.init(params, generator=..., seeds=...)``.

    Example:
        >>> sampler = build("rmsprop", lr=1e-3, num_data=50_000, decay=0.99)
        >>> type(sampler.metric).__name__
        'RMSpropMetric'
    """
    for misplaced in ("generator", "seeds", "num_chains"):
        if misplaced in metric_options:
            raise TypeError(
                f"build() takes no {misplaced}: pass it to sampler.init(params, {misplaced}=...),"
                " which creates the state that owns the randomness"
            )
    if isinstance(metric, str):
        metric = get_metric(metric)(**metric_options)
    elif metric_options:
        raise TypeError("metric options are only accepted with a metric name")
    return Sampler(
        metric, lr, num_data, temperature, check_finite, noise, compile, capturable, sync_checks
    )


__all__ = [
    "SGLD",
    "Chains",
    "IdentityMetric",
    "Metric",
    "MongeMetric",
    "MongeSGLD",
    "NonFiniteGradientError",
    "RMSpropMetric",
    "RMSpropSGLD",
    "SGRLDOptimizer",
    "Sampler",
    "SamplerState",
    "ShampooMetric",
    "ShampooSGLD",
    "WenzelMetric",
    "WenzelSGLD",
    "__version__",
    "build",
    "get_metric",
    "metric_names",
]
