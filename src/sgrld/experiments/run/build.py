"""From a config to the objects of a run, through the registries only: nothing here knows a
metric, model, prior or data set by name (every metric option is settable and sweepable)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from sgrld.core import contract
from sgrld.data import Splits, dataset_info
from sgrld.experiments.run.choices import PRIORS
from sgrld.likelihoods import Likelihood, get_likelihood
from sgrld.metrics import Metric, get_metric
from sgrld.models import BayesianModel, build_model
from sgrld.optim import SGRLDOptimizer


def option_names(sampler: str) -> list[str]:
    """The options ``sampler``'s metric takes (:func:`sgrld.core.contract.option_names`)."""
    return contract.option_names(get_metric(sampler))


def _typed(cls: type[Metric], name: str, value: Any) -> Any:
    """A JSON value as the metric's field wants it: a dtype option from its name."""
    default = {f.name: f.default for f in dataclasses.fields(cls)}.get(name)  # type: ignore[arg-type]
    if isinstance(default, torch.dtype) and isinstance(value, str):
        dtype = getattr(torch, value.removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"invalid {name}: {value!r} (expected a torch dtype name)")
        return dtype
    return value


def build_metric(sampler: str, options: Mapping[str, Any], paper: bool = False) -> Metric:
    """The metric ``sampler`` with ``options``, validated by the metric (a ValueError names the
    option). ``paper`` (``adapt="always"``) keeps the paper's absolute ε: a relative ``floor``
    is 0 unless an option sets it."""
    cls = get_metric(sampler)
    try:  # misspellings: did-you-mean and the list, as the library says them
        contract.check_options(cls, options, sampler)
    except TypeError as exc:
        raise ValueError(str(exc)) from None
    values = {name: _typed(cls, name, value) for name, value in options.items()}
    if paper and "floor" in option_names(sampler) and "floor" not in values:
        values["floor"] = 0.0
    try:
        return cls(**values)
    except TypeError as exc:  # a wrongly typed value the metric's checks do not word
        raise ValueError(f"invalid {sampler} options {dict(options)}: {exc}") from None


def make_sampler(
    config: Any,
    params: list[Tensor],
    num_data: int,
    generator: torch.Generator,
    *,
    capturable: bool = False,
) -> SGRLDOptimizer:
    """The config's sampler over ``params`` in one parameter group; ``capturable`` (the deferred
    loops): ℓ a device tensor and NaN/Inf checks device flags, else refused at once."""
    lr: float | Tensor = config.lr
    if capturable:
        lr = torch.tensor(config.lr, dtype=params[0].dtype, device=params[0].device)
    metric = build_metric(config.sampler, config.metric_options, paper=config.adapt == "always")
    return SGRLDOptimizer(
        params,
        lr,
        num_data,
        config.temperature,
        metric=metric,
        generator=generator,
        noise=config.noise,
        compile=config.compile,
        capturable=capturable,
        sync_checks=None if capturable else True,
        telemetry=not config.compile,  # the fused compiled step has no place for them
        adapt_until=config.adapt_until,
    )


def build_likelihood(config: Any, splits: Splits | None = None) -> Likelihood:
    """The config's data set's likelihood: categorical, or Gaussian with the config's σ."""
    info = dataset_info(config.dataset)
    cls = get_likelihood(info.likelihood)
    if info.likelihood == "categorical":
        return cls(info.num_outputs)
    target_scale = 1.0 if splits is None or splits.target_scale is None else splits.target_scale
    return cls(config.likelihood_scale, target_scale=float(target_scale))


def build_run_model(
    config: Any, splits: Splits | None = None, generator: torch.Generator | None = None
) -> BayesianModel:
    """The config's network with its prior and likelihood (initialised from ``generator``)."""
    likelihood = build_likelihood(config, splits)
    return build_model(
        config.model,
        prior=PRIORS[config.prior],
        width=config.width,
        generator=generator,
        in_features=math.prod(dataset_info(config.dataset).input_shape),
        likelihood=likelihood,
    )
