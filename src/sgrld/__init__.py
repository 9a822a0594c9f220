"""sgrld: scalable Stochastic Gradient Riemannian Langevin Dynamics for PyTorch.

Samplers θ ← θ − ℓ G⁻¹ĝ + √(2ℓτ/n) G^{-1/2}ξ that differ only in the metric G
(Yu, Hartmann, Williams, Klami; TMLR 2023): ``torch.optim`` facades (:class:`SGLD`,
:class:`RMSpropSGLD`, :class:`WenzelSGLD`, :class:`MongeSGLD`, :class:`ShampooSGLD`) and the
functional core (:func:`build`). Conventions (ℓ, n, τ, h, signs): ``docs/conventions.md``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sgrld.chain_health import Health, HealthWarning, health
    from sgrld.chains import Chains
    from sgrld.core import NonFiniteGradientError, Sampler, SamplerState
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
        build,
    )
    from sgrld.samples import (
        SampleStore,
        log_density,
        log_predictive_density,
        posterior_predictive,
    )
    from sgrld.schedules import CyclicalLR
    from sgrld.slt import LLCEstimate, llc
    from sgrld.tuning import TuneResult, tune

# Imported on first use (PEP 562), so that `import sgrld.cli` does not import torch: the command
# line then handles Ctrl-C during start-up itself (exit 130, no traceback), and `--help` is fast.
_LAZY = {
    name: module
    for module, names in (
        ("sgrld.core", "NonFiniteGradientError Sampler SamplerState"),
        ("sgrld.metrics", "IdentityMetric Metric MongeMetric RMSpropMetric ShampooMetric"),
        ("sgrld.metrics", "WenzelMetric get_metric metric_names"),
        ("sgrld.optim", "SGLD MongeSGLD RMSpropSGLD SGRLDOptimizer ShampooSGLD WenzelSGLD build"),
        ("sgrld.samples", "SampleStore log_density log_predictive_density posterior_predictive"),
        ("sgrld.chain_health", "Health HealthWarning health"),
        ("sgrld.schedules", "CyclicalLR"),
        ("sgrld.chains", "Chains"),
        ("sgrld.slt", "LLCEstimate llc"),
        ("sgrld.tuning", "TuneResult tune"),
    )
    for name in names.split()
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'sgrld' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__version__ = "0.1.0"
"""The package's version (``sgrld --version`` prints it with torch's and Python's)."""


__all__ = [
    "SGLD",
    "Chains",
    "CyclicalLR",
    "Health",
    "HealthWarning",
    "IdentityMetric",
    "LLCEstimate",
    "Metric",
    "MongeMetric",
    "MongeSGLD",
    "NonFiniteGradientError",
    "RMSpropMetric",
    "RMSpropSGLD",
    "SGRLDOptimizer",
    "SampleStore",
    "Sampler",
    "SamplerState",
    "ShampooMetric",
    "ShampooSGLD",
    "TuneResult",
    "WenzelMetric",
    "WenzelSGLD",
    "__version__",
    "build",
    "get_metric",
    "health",
    "llc",
    "log_density",
    "log_predictive_density",
    "metric_names",
    "posterior_predictive",
    "tune",
]
