"""Metric plug-ins G; each registers itself (contract and registry: :mod:`sgrld.core.contract`).

Importing this package registers every metric: a new one is its module and one import line here.
"""

from sgrld.core.contract import (
    ALIASES,
    Metric,
    get_metric,
    metric_names,
    register,
    resolve_metric_name,
)
from sgrld.metrics.adam import AdamMetric
from sgrld.metrics.identity import IdentityMetric
from sgrld.metrics.monge import MongeMetric
from sgrld.metrics.rmsprop import RMSpropMetric
from sgrld.metrics.shampoo import ShampooMetric, TensorBlocks
from sgrld.metrics.wenzel import WenzelMetric

__all__ = [
    "ALIASES",
    "AdamMetric",
    "IdentityMetric",
    "Metric",
    "MongeMetric",
    "RMSpropMetric",
    "ShampooMetric",
    "TensorBlocks",
    "WenzelMetric",
    "get_metric",
    "metric_names",
    "register",
    "resolve_metric_name",
]
