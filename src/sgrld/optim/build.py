"""The functional API's entry point: :func:`build` makes a :class:`~sgrld.core.Sampler` for a
metric of the registry (the level between the core, which steps, and the metrics, which it
steps with)."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from sgrld.core.contract import Metric, check_options
from sgrld.core.noise import NoiseSource
from sgrld.core.sampler import Sampler
from sgrld.core.warmup import DEFAULT_WARMUP
from sgrld.metrics import get_metric

__all__ = ["build"]


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
    adapt_until: int | None = DEFAULT_WARMUP,
    localization: float = 0.0,
    **metric_options: Any,
) -> Sampler:
    """A functional sampler for ``metric`` (a registry name or a :class:`Metric` instance).

    The options are :class:`Sampler`'s (``localization``: the local posterior's pull towards
    the initial parameters, ``docs/llc.md``); the rest go to the metric. The random generator (and
    per-chain seeds) belong to the state: ``sampler.init(params, generator=..., seeds=...)``.

    Examples:
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
        cls = get_metric(metric)
        check_options(cls, metric_options, f"build({metric!r})")
        metric = cls(**metric_options)
    elif metric_options:
        raise TypeError("metric options are only accepted with a metric name")
    return Sampler(
        metric,
        lr,
        num_data,
        temperature,
        check_finite,
        noise,
        compile,
        capturable,
        sync_checks,
        adapt_until,
        localization,
    )
