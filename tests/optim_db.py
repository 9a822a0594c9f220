"""The conformance registry: every sgrld optimizer with its option sets (cf. torch's ``optim_db``).

One :class:`OptimizerInfo` per metric of :func:`sgrld.metric_names`, built from its case in
``tests/metric_cases.py`` (its facade, its base options and its own option sets), so a new
metric is picked up by ``tests/test_conformance.py`` with no edit here: it runs through
``SGRLDOptimizer(metric=<name>)`` when it has no named facade, with the option sets every
sampler has (:data:`COMMON_OPTIONS`) on top of its own. The model, the gradients and the training
loop the generic cases share live here too, so that every case drives the optimizers the same
way.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import sgrld
from metric_cases import CASES as METRIC_CASES

LR = 0.05
NUM_DATA = 50

#: option sets of every sampler (name → options on top of the metric's base options)
COMMON_OPTIONS: dict[str, dict[str, Any]] = {
    "default": {},
    "philox": {"noise": "philox"},
    "capturable": {"capturable": True},
}

#: group keys an optimizer gained after its first release: a state dict written before may lack
#: them and must load with the defaults (torch's ``setdefault`` in ``__setstate__``)
NEWER_GROUP_KEYS = ("adapt_metric", "alpha2_rule", "ridge", "tiling", "root_dtype")


@dataclass(frozen=True)
class OptimizerInfo:
    """One sampler of the registry: how to build it and with which option sets."""

    metric: str
    option_sets: dict[str, dict[str, Any]]

    def facade(self, params: Any, **kw: Any) -> sgrld.SGRLDOptimizer:
        """The metric's named facade class, or :meth:`generic` where it has none."""
        named = METRIC_CASES[self.metric].facade
        return (named or self.generic)(params, **kw)

    def generic(self, params: Any, **kw: Any) -> sgrld.SGRLDOptimizer:
        """SGRLDOptimizer with the metric named, built from the options that are its fields."""
        return sgrld.SGRLDOptimizer(params, metric=self.metric, **kw)

    def make(self, params: Any, option_set: str = "default", **kw: Any) -> sgrld.SGRLDOptimizer:
        """The optimizer with ``option_set``; ``kw`` (lr, temperature, generator, ...) on top."""
        options = {"lr": LR, "num_data": NUM_DATA, **self.option_sets[option_set], **kw}
        return self.facade(params, **options)


def _info(metric: str) -> OptimizerInfo:
    base = METRIC_CASES[metric].conformance_base
    sets = {**COMMON_OPTIONS, **METRIC_CASES[metric].conformance_sets}
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
