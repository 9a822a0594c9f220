"""One test case per registered metric: its dense-matrix oracle and the options tests use.

The generic tests (contract, dense oracles, stationary moments, conformance, state dicts,
warm-up, chains) read :data:`CASES`, keyed by registry name (:func:`sgrld.metric_names`), and
nothing else about a metric: a new metric is its module, its registry line and its entry here.
Importing this module fails when a registered metric has no entry (or an entry names no metric).

Each oracle re-derives its metric from the paper's / the reference's formulas with explicit D×D
matrices in float64 from the gradients it has seen, sharing no code with the library's maths.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

import sgrld
from sgrld.metrics._blocking import merge_small_dims

Options = dict[str, Any]


def sym_inverse_sqrt(g: Tensor) -> Tensor:
    """G^{-1/2} of a symmetric positive definite G, through its eigen-decomposition."""
    evals, evecs = torch.linalg.eigh(g)
    return evecs @ torch.diag(evals.rsqrt()) @ evecs.T


class DenseOracle:
    """A metric's G⁻¹ and G^{-1/2} as dense matrices, from the flat gradients it was given.

    ``update`` is called with every gradient (step counting from 1) and ``refresh`` whenever the
    library's ``refresh`` ran (explicitly, or when :attr:`Metric.refresh_interval` was due).
    """

    def __init__(self, shapes: list[tuple[int, ...]], **options: Any) -> None:
        self.shapes, self.opt = shapes, options
        self.sizes = [math.prod(s) for s in shapes]
        self.d = sum(self.sizes)

    def update(self, g: Tensor, step: int) -> None:
        return None

    def refresh(self) -> None:
        return None

    def g_inv(self) -> Tensor:
        return torch.eye(self.d, dtype=torch.float64)

    def g_inv_sqrt(self) -> Tensor:
        return sym_inverse_sqrt(torch.linalg.inv(self.g_inv()))


class SecondMomentOracle(DenseOracle):
    """G = diag(√v̂ + ε), v ← λv + (1−λ)g² from zeros; v̂ = v/(1−λᵗ) with bias correction
    (pSGLD, Li et al. 2016; Adam's second moment, Kingma & Ba 2015, Algorithm 1)."""

    decay_option = "decay"

    def __init__(self, shapes: list[tuple[int, ...]], **options: Any) -> None:
        super().__init__(shapes, **options)
        self.v = torch.zeros(self.d, dtype=torch.float64)
        self.v_hat = self.v

    def corrected(self) -> bool:
        return bool(self.opt.get("bias_correction", False))

    def update(self, g: Tensor, step: int) -> None:
        lam = self.opt[self.decay_option]
        self.v = lam * self.v + (1 - lam) * g * g
        self.v_hat = self.v / (1 - lam**step) if self.corrected() else self.v

    def g_inv(self) -> Tensor:
        # the floor relative to the statistics' scale s = √mean(v̂); G = I while s = 0
        from sgrld.metrics import RMSpropMetric

        floor = self.opt.get("floor", RMSpropMetric.floor)
        scale = float(self.v_hat.mean().sqrt())
        if floor and scale == 0.0:
            return torch.eye(self.d, dtype=torch.float64)
        added = max(self.opt["eps"], floor * scale)
        return torch.diag(1.0 / (self.v_hat.sqrt() + added))


class AdamOracle(SecondMomentOracle):
    decay_option = "beta2"

    def corrected(self) -> bool:
        return True


class WenzelOracle(DenseOracle):
    """G⁻¹ = M_p I per tensor, M_p = max((s_p/min s)^{-1/2}, min_scale), s_p = mean of v over
    tensor p + ε, v ← λv + (1−λ)g² from ones; M = 1 until the first refresh."""

    def __init__(self, shapes: list[tuple[int, ...]], **options: Any) -> None:
        super().__init__(shapes, **options)
        self.v = torch.ones(self.d, dtype=torch.float64)
        self.scale = torch.ones(len(self.sizes), dtype=torch.float64)

    def update(self, g: Tensor, step: int) -> None:
        lam = self.opt["decay"]
        self.v = lam * self.v + (1 - lam) * g * g

    def refresh(self) -> None:
        s = torch.stack([seg.mean() for seg in self.v.split(self.sizes)]) + self.opt["eps"]
        self.scale = torch.sqrt(s.min() / s).clamp(min=self.opt.get("min_scale", 0.0))

    def g_inv(self) -> Tensor:
        return torch.diag(torch.repeat_interleave(self.scale, torch.tensor(self.sizes)))


class MongeOracle(DenseOracle):
    """G = I + α² m mᵀ (per tensor with ``scope="tensor"``), m ← λm + (1−λ)g from zeros;
    the "normalized" rule takes α² = c/‖m‖² (stretch 1 + c along m)."""

    def __init__(self, shapes: list[tuple[int, ...]], **options: Any) -> None:
        super().__init__(shapes, **options)
        self.m = torch.zeros(self.d, dtype=torch.float64)

    def update(self, g: Tensor, step: int) -> None:
        lam = self.opt.get("decay", 0.0)
        self.m = lam * self.m + (1 - lam) * g

    def g_inv(self) -> Tensor:
        def g(m: Tensor) -> Tensor:
            c = self.opt["alpha2"]
            normalized = self.opt.get("alpha2_rule", "normalized") == "normalized"  # the default
            alpha2 = c / float(m @ m) if normalized else c
            return torch.eye(len(m), dtype=torch.float64) + alpha2 * torch.outer(m, m)

        if self.opt.get("scope") == "tensor":
            return torch.linalg.inv(torch.block_diag(*map(g, self.m.split(self.sizes))))
        return torch.linalg.inv(g(self.m))


def row_major_blocks(
    merged: tuple[int, ...], b: int, tiling: str = "reference"
) -> list[list[np.ndarray]]:
    """Per block, the index ranges of each merged dim: chunks of b then the remainder
    (reference), or the fewest chunks of ≤ b with sizes differing by ≤ 1 (even)."""
    if tiling == "reference":
        per_dim = [[np.arange(a, min(a + b, n)) for a in range(0, n, b)] for n in merged]
    else:
        per_dim = [np.array_split(np.arange(n), -(-n // b)) for n in merged]
    return [list(r) for r in itertools.product(*per_dim)]


def _root(h: np.ndarray, e: float, ridge: str, eps: float, floor: float = 0.0) -> np.ndarray:
    """(H + rI)^{−e}, the eigenvalues of H + rI raised to at least ``floor``² (G ≥ floor·I)."""
    w, q = np.linalg.eigh(h)
    w = np.clip(w, 0.0, None)
    w = w + {"relative": eps * w.max(), "absolute": eps, "none": 0.0}[ridge]
    w = np.maximum(w, floor**2)
    return (q * w ** (-e)) @ q.T


def shampoo_dense(
    metric: sgrld.ShampooMetric, shapes: list[tuple[int, ...]], grads: list[np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """Shampoo's dense (G⁻¹, G^{-1/2}) after the statistics have seen ``grads`` (flat, float64):
    every factor an EMA from ε·I, every block's operator ⊗_i (H_i + rI)^{−e}, scattered at the
    block's flat indices, in this oracle's own row-major blocking."""
    d = sum(math.prod(s) for s in shapes)
    ginv, ginv_sqrt = np.eye(d), np.eye(d)
    offset = 0
    for shape in shapes:
        merged = merge_small_dims(shape, metric.block_size)
        k = len(merged)
        numel = math.prod(shape)
        if k >= (1 if metric.precondition_vectors else 2):
            for ranges in row_major_blocks(merged, metric.block_size, metric.tiling):
                hs = [metric.eps * np.eye(len(r)) for r in ranges]
                for g in grads:
                    x = g[offset : offset + numel].reshape(merged)[np.ix_(*ranges)]
                    for a in range(k):
                        xa = np.moveaxis(x, a, 0).reshape(len(ranges[a]), -1)
                        hs[a] = metric.decay * hs[a] + (1 - metric.decay) * xa @ xa.T
                idx = (
                    offset
                    + np.ravel_multi_index(np.meshgrid(*ranges, indexing="ij"), merged).ravel()
                )
                for out, e in ((ginv, 1 / (2 * k)), (ginv_sqrt, 1 / (4 * k))):
                    block = np.ones((1, 1))
                    for h in hs:
                        root = _root(h, e, metric.ridge, metric.eps, metric.floor)
                        block = np.kron(block, root)
                    out[np.ix_(idx, idx)] = block
        offset += numel
    return ginv, ginv_sqrt


class ShampooOracle(DenseOracle):
    """Shampoo (paper §3.2): G = I until the first refresh, then the roots of the factors as
    they were at the last refresh (:func:`shampoo_dense`)."""

    def __init__(self, shapes: list[tuple[int, ...]], **options: Any) -> None:
        super().__init__(shapes, **options)
        self.history: list[np.ndarray] = []
        self.dense = (np.eye(self.d), np.eye(self.d))

    def update(self, g: Tensor, step: int) -> None:
        self.history.append(g.numpy().copy())

    def refresh(self) -> None:
        self.dense = shampoo_dense(sgrld.ShampooMetric(**self.opt), self.shapes, self.history)

    def g_inv(self) -> Tensor:
        return torch.from_numpy(self.dense[0])

    def g_inv_sqrt(self) -> Tensor:
        return torch.from_numpy(self.dense[1])


@dataclass(frozen=True, kw_only=True)
class MetricCase:
    """What the generic tests need to know about one metric (options are its dataclass fields)."""

    #: G rebuilt with dense matrices, run over every set of ``oracle_options``
    oracle: type[DenseOracle]
    oracle_options: tuple[Options, ...] = ({},)
    #: options of the contract tests (fast EMAs, so that few steps move G)
    options: Options = field(default_factory=dict)
    #: options of the stationary test (G adapts for 150 steps, then is frozen)
    stationary: Options = field(default_factory=dict)
    #: warm-up test cases (id → options), for metrics that adapt
    warmup: dict[str, Options] = field(default_factory=dict)
    #: (option, invalid value) pairs the metric must refuse when built
    bad_options: tuple[tuple[str, Any], ...] = ()
    #: the named facade class; ``None``: ``SGRLDOptimizer(metric=<registry name>)``
    facade: type[sgrld.SGRLDOptimizer] | None = None
    #: options every conformance set starts from, and the metric's own sets on top of it
    conformance_base: Options = field(default_factory=dict)
    conformance_sets: dict[str, Options] = field(default_factory=dict)


_SHAMPOO_SMALL = {"eps": 1e-4, "block_size": 4}

CASES: dict[str, MetricCase] = {
    "identity": MetricCase(oracle=DenseOracle, facade=sgrld.SGLD),
    "rmsprop": MetricCase(
        oracle=SecondMomentOracle,
        oracle_options=(
            {"decay": 0.9, "eps": 1e-8},
            {"decay": 0.99, "eps": 0.0},
            {"decay": 0.9, "eps": 1e-8, "bias_correction": True},
            {"decay": 0.9, "eps": 1e-8, "floor": 0.0},  # the paper's absolute ε alone
        ),
        options={"decay": 0.9, "eps": 1e-8},
        stationary={"decay": 0.9, "eps": 1e-8},
        warmup={"rmsprop": {"decay": 0.9, "eps": 1e-8}},
        bad_options=(("decay", 1.0), ("decay", -0.1), ("eps", -1e-8), ("floor", -0.1)),
        facade=sgrld.RMSpropSGLD,
        conformance_sets={"bias_correction": {"bias_correction": True}},
    ),
    "adam": MetricCase(
        oracle=AdamOracle,
        oracle_options=({"beta2": 0.9, "eps": 1e-8}, {"beta2": 0.999, "eps": 0.0}),
        options={"beta2": 0.9},
        stationary={"beta2": 0.9},
        warmup={"adam": {"beta2": 0.99}},
        bad_options=(("beta2", 1.0), ("beta2", -0.1), ("eps", -1e-8), ("floor", 1.0)),
    ),
    "wenzel": MetricCase(
        oracle=WenzelOracle,
        oracle_options=({"decay": 0.9, "eps": 1e-8}, {"decay": 0.9, "eps": 0.0, "min_scale": 0.9}),
        options={"decay": 0.9},
        stationary={"decay": 0.9},
        warmup={"wenzel": {"decay": 0.9}},
        bad_options=(("decay", 1.5), ("eps", -1.0)),
        facade=sgrld.WenzelSGLD,
        conformance_base={"refresh_every": 3},
    ),
    "monge": MetricCase(
        oracle=MongeOracle,
        oracle_options=(
            {"alpha2": 1.5, "decay": 0.7},
            {"alpha2": 1.5, "decay": 0.7, "alpha2_rule": "fixed"},
            {"alpha2": 0.3, "decay": 0.9, "scope": "tensor", "alpha2_rule": "fixed"},
            {"alpha2": 2.0, "decay": 0.7, "alpha2_rule": "normalized"},
            {"alpha2": 0.5, "decay": 0.9, "scope": "tensor", "alpha2_rule": "normalized"},
        ),
        options={"alpha2": 2.0, "decay": 0.8, "alpha2_rule": "fixed"},
        stationary={"alpha2": 0.05, "decay": 0.9, "alpha2_rule": "fixed"},
        warmup={
            "monge": {"alpha2": 0.1, "decay": 0.9, "alpha2_rule": "fixed"},
            "monge-normalized": {"alpha2": 1.0, "decay": 0.9, "alpha2_rule": "normalized"},
        },
        bad_options=(("alpha2", -0.5), ("decay", 1.0)),
        facade=sgrld.MongeSGLD,
        conformance_base={"alpha2": 2.0, "decay": 0.8, "alpha2_rule": "fixed"},
        conformance_sets={
            "normalized": {"alpha2_rule": "normalized", "alpha2": 0.5},
            "tensor_scope": {"scope": "tensor"},
        },
    ),
    "shampoo": MetricCase(
        oracle=ShampooOracle,
        oracle_options=(
            {"decay": 0.8, "eps": 1e-3, "block_size": 2, "update_interval": 3},
            {"decay": 0.8, "eps": 1e-3, "block_size": 2, "precondition_vectors": True},
            {"decay": 0.8, "eps": 1e-3, "block_size": 2, "floor": 0.0},  # the paper's metric
            {"decay": 0.8, "eps": 1e-3, "block_size": 2, "floor": 2.0},  # the floor binds
        ),
        options={"decay": 0.9, **_SHAMPOO_SMALL, "update_interval": 3},
        stationary={"decay": 0.9, **_SHAMPOO_SMALL, "update_interval": 50},
        warmup={
            "shampoo": {"decay": 0.9, **_SHAMPOO_SMALL, "update_interval": 50},
            "shampoo-vectors": {
                "decay": 0.9,
                **_SHAMPOO_SMALL,
                "update_interval": 50,
                "precondition_vectors": True,
            },
        },
        bad_options=(
            ("decay", 1.0),
            ("eps", -1.0),
            ("block_size", 0),
            ("update_interval", 0),
            ("floor", -0.1),
        ),
        facade=sgrld.ShampooSGLD,
        conformance_base={"eps": 1e-4, "block_size": 2, "update_interval": 2},
        conformance_sets={
            "vectors": {"precondition_vectors": True, "block_size": 3},
            "even_tiling": {"tiling": "even", "block_size": 3},
        },
    ),
}

_missing = sorted(set(sgrld.metric_names()) - set(CASES))
_unknown = sorted(set(CASES) - set(sgrld.metric_names()))
if _missing or _unknown:
    raise LookupError(
        f"tests/metric_cases.py must hold one case per registered metric: "
        f"missing {_missing}, not registered {_unknown}"
    )
