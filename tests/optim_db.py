"""The conformance registry: every sgrld optimizer with its option sets (cf. torch's ``optim_db``).

One :class:`OptimizerInfo` per metric of :func:`sgrld.metric_names`, so a new metric is
picked up by ``tests/test_conformance.py`` with no edit here: it runs through the generic
:class:`sgrld.SGRLDOptimizer` facade until it gets a named one in :data:`FACADES`, and with the
option sets every sampler has (:data:`COMMON_OPTIONS`) until it gets its own in
:data:`METRIC_OPTIONS`. The model, the gradients and the training loop the generic cases share
live here too, so that every case drives the optimizers the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import sgrld

LR = 0.05
NUM_DATA = 50

#: the facade class of each metric; a metric missing here runs through SGRLDOptimizer(metric=)
FACADES: dict[str, type[sgrld.SGRLDOptimizer]] = {
    "identity": sgrld.SGLD,
    "rmsprop": sgrld.RMSpropSGLD,
    "wenzel": sgrld.WenzelSGLD,
    "monge": sgrld.MongeSGLD,
    "shampoo": sgrld.ShampooSGLD,
}

#: options every set of a metric starts from: small enough that the tests reach the metric's
#: scheduled parts (Shampoo's blocks and root refreshes, Wenzel's refresh) within a few steps
BASE_OPTIONS: dict[str, dict[str, Any]] = {
    "wenzel": {"refresh_every": 3},
    "monge": {"alpha2": 2.0, "decay": 0.8},
    "shampoo": {"eps": 1e-4, "block_size": 2, "update_interval": 2},
}

#: option sets of every sampler (name → options on top of the metric's base options)
COMMON_OPTIONS: dict[str, dict[str, Any]] = {
    "default": {},
    "philox": {"noise": "philox"},
    "capturable": {"capturable": True},
}

#: each metric's own option sets
METRIC_OPTIONS: dict[str, dict[str, dict[str, Any]]] = {
    "rmsprop": {"bias_correction": {"bias_correction": True}},
    "monge": {
        "normalized": {"alpha2_rule": "normalized", "alpha2": 0.5},
        "tensor_scope": {"scope": "tensor"},
    },
    "shampoo": {
        "vectors": {"precondition_vectors": True, "block_size": 3},
        "even_tiling": {"tiling": "even", "block_size": 3},
    },
}

#: group keys an optimizer gained after its first release: a state dict written before may lack
#: them and must load with the defaults (torch's ``setdefault`` in ``__setstate__``)
NEWER_GROUP_KEYS = ("adapt_metric", "alpha2_rule", "ridge", "tiling", "root_dtype")


@dataclass(frozen=True)
class OptimizerInfo:
    """One sampler of the registry: how to build it and with which option sets."""

    metric: str
    option_sets: dict[str, dict[str, Any]]

    @property
    def facade(self) -> Callable[..., sgrld.SGRLDOptimizer]:
        return FACADES.get(self.metric) or self.generic

    def generic(self, params: Any, **kw: Any) -> sgrld.SGRLDOptimizer:
        """SGRLDOptimizer with the metric built from the options that are its fields."""
        fields = {f.name for f in dataclasses.fields(sgrld.get_metric(self.metric))}  # type: ignore[arg-type]
        metric_kw = {k: kw.pop(k) for k in list(kw) if k in fields}
        return sgrld.SGRLDOptimizer(params, metric=sgrld.get_metric(self.metric)(**metric_kw), **kw)

    def make(self, params: Any, option_set: str = "default", **kw: Any) -> sgrld.SGRLDOptimizer:
        """The optimizer with ``option_set``; ``kw`` (lr, temperature, generator, ...) on top."""
        options = {"lr": LR, "num_data": NUM_DATA, **self.option_sets[option_set], **kw}
        return self.facade(params, **options)


def _info(metric: str) -> OptimizerInfo:
    base = BASE_OPTIONS.get(metric, {})
    sets = {**COMMON_OPTIONS, **METRIC_OPTIONS.get(metric, {})}
    return OptimizerInfo(metric, {name: {**base, **opts} for name, opts in sets.items()})


OPTIMIZERS: list[OptimizerInfo] = [_info(name) for name in sgrld.metric_names()]

#: (optimizer, option set) pairs, with pytest ids such as ``"monge-normalized"``
CASES: list[tuple[OptimizerInfo, str]] = [
    (info, name) for info in OPTIMIZERS for name in info.option_sets
]


def case_id(case: tuple[OptimizerInfo, str]) -> str:
    return f"{case[0].metric}-{case[1]}"


# --- the model, gradients and loop every generic case shares ------------------------------------


class Net(nn.Module):
    """Two small linear layers: tensors of rank 1 and 2, of sizes that Shampoo blocks unevenly."""

    def __init__(self, dtype: torch.dtype = torch.float64, seed: int = 0) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):  # leaves torch's global generator alone
            torch.manual_seed(seed)
            self.fc1 = nn.Linear(5, 4, dtype=dtype)
            self.fc2 = nn.Linear(4, 3, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def batch(t: int, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """The minibatch of step ``t``: a function of ``t`` only, so two runs see the same data."""
    g = torch.Generator().manual_seed(1000 + t)
    return torch.randn(8, 5, generator=g, dtype=dtype), torch.randn(8, 3, generator=g, dtype=dtype)


def loss_at(model: nn.Module, t: int) -> torch.Tensor:
    """Per-datum potential: mean squared error plus a Gaussian prior's share (1/num_data)."""
    dtype = next(model.parameters()).dtype
    x, y = batch(t, dtype)
    prior = sum((p**2).sum() for p in model.parameters()) / (2 * NUM_DATA)
    return ((model(x) - y) ** 2).mean() + prior


def train(opt: torch.optim.Optimizer, model: nn.Module, steps: Iterable[int]) -> None:
    """The user's loop: zero_grad, forward, backward, step."""
    for t in steps:
        opt.zero_grad()
        loss_at(model, t).backward()
        opt.step()


def snapshot(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]
