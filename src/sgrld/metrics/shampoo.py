"""Shampoo metric: a blocked Kronecker-factored RMSprop metric (paper §3.2, reference §2.5).

Per parameter tensor, reshaped to its merged shape of rank k and cut into blocks
(:mod:`sgrld.metrics._blocking`), every block X carries one factor H_i per axis i:

    H_i ← decay·H_i + (1 − decay)·X_(i) X_(i)ᵀ,      H_i(0) = eps·I,

with X_(i) the unfolding of X along axis i. The metric of a block is G = ⊗_i (H_i + rI)^{1/(2k)},
so

    G⁻¹g = (⊗_i (H_i + rI)^{−1/(2k)}) g,       G^{-1/2}ξ = (⊗_i (H_i + rI)^{−1/(4k)}) ξ.

The two roots of every factor are recomputed only when ``step % update_interval == 0`` and are
the identity before the first refresh (so the first ``update_interval − 1`` steps are SGLD, as in
the reference). Roots never modify the statistics (reference §10.2). How G⁻¹ and G^{-1/2} enter
the step (ℓ, n, τ) is fixed once in ``docs/conventions.md``.

Speed (performance.md): blocks of equal shape are stacked and handled with batched matmuls; each
Kronecker product is applied by k matmuls contracting one axis at a time (the cyclic "tensordot"
trick: no copy per axis, one gather and one scatter per group of blocks); work buffers are reused
across steps; nothing in ``update``, ``inverse`` or ``inverse_sqrt`` syncs with the host, only
the root refresh does.

Measured (2 CPU threads, fp32, MLP 784-400-400-10, D = 478,410, defaults): ``update`` 1.7 ms,
``inverse`` 1.9 ms, ``inverse_sqrt`` 1.9 ms per step, ≈ 150 GFLOP/s, near the GEMM rate (block
128 costs 0.73 GFLOP per step). A root refresh of all 96 factors takes 68-71 ms (float64
``eigh``, both roots), i.e. 0.7 ms per step at ``update_interval=100``, and 180-240 ms with
``root_method="newton"`` (see :mod:`sgrld.metrics._linalg`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from sgrld.core.layout import FlatLayout
from sgrld.metrics._blocking import TILINGS, BlockGroup, BlockPlan, Tiling, plan_blocks
from sgrld.metrics._linalg import Ridge, inverse_root_newton, inverse_roots_eigh
from sgrld.metrics.base import Metric, Stats, check_range, register


def _check_int(name: str, value: int, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"invalid {name}: {value!r} (expected an integer >= {low})")


def _key(stat: str, group: int, axis: int, index: int) -> str:
    """Per-tensor stat key ``"<stat>_<group>_<axis>@<index>"`` (see :mod:`sgrld.metrics.base`)."""
    return f"{stat}_{group}_{axis}@{index}"


@register
@dataclass(frozen=True, kw_only=True)
class ShampooMetric(Metric):
    """Blocked Kronecker-factored metric G = ⊗_i H_i^{1/(2k)} per block (paper §3.2).

    With the defaults this is the reference ``ShampooSGLD`` with its bugs fixed (reference §2.5,
    §2.6, §10.1-2): an explicit step counter, roots computed on a copy, in float64 ``eigh``.
    Tensors of merged rank ≤ 1 (biases, scalars) get G = I unless ``precondition_vectors``.

    The funnel's full-matrix RMSprop (reference §5.3) is
    ``ShampooMetric(decay=0.9995, eps=1e-6, update_interval=1, precondition_vectors=True,
    ridge="none")``: for a 2-vector G⁻¹ = H^{−1/2} and G^{-1/2} = H^{−1/4}.

    Args:
        decay: EMA weight λ of the factors, in [0, 1).
        eps: ε ≥ 0: the factors start at ε·I, and ε sets the ridge r.
        block_size: largest merged dim and largest block side (integer ≥ 1).
        update_interval: the roots are recomputed at steps that are multiples of it
            (integer ≥ 1); they are the identity before.
        root_method: ``"eigh"`` (float64 eigendecomposition, tiny negative eigenvalues clamped
            to 0) or ``"newton"`` (the reference's coupled Newton iteration, in the dtype of the
            statistics).
        precondition_vectors: give tensors of merged rank 1 a full-matrix factor (full-matrix
            RMSprop, blocked like any other dim) instead of the identity.
        tiling: how a merged dim larger than ``block_size`` is cut: ``"reference"`` (chunks of
            ``block_size`` plus a remainder, the paper's code and spec §2.5) or ``"even"`` (the
            fewest chunks of ≤ ``block_size``, sizes differing by ≤ 1: 784 → 7 × 112; faster,
            a different but equally valid metric).
        ridge: r added to each factor before its root: ``"relative"`` r = ε·λ_max(H_i) (the
            reference), ``"absolute"`` r = ε, or ``"none"`` r = 0 (the funnel).
        root_dtype: the precision of ``eigh`` (float64, the default; float32 is much faster on
            a GPU and is retried in float64 for a bucket whose decomposition fails).

    References:
        Yu et al. (2023) §3.2; Gupta, Koren & Singer (2018), Shampoo; reference.md §2.5.

    Example:
        >>> import torch
        >>> from sgrld.core.layout import FlatLayout
        >>> layout = FlatLayout(("w",), ((3, 4),))
        >>> metric = ShampooMetric(update_interval=1)
        >>> stats = metric.init(layout, torch.zeros(12))
        >>> g = torch.randn(12)
        >>> metric.update(stats, layout, g, step=1)
        >>> metric.refresh(stats, layout)  # the step engine does this every update_interval
        >>> metric.inverse(stats, layout, g.clone()).shape
        torch.Size([12])
    """

    name = "shampoo"
    decay: float = 0.99
    eps: float = 1e-8
    block_size: int = 128
    update_interval: int = 100
    root_method: Literal["eigh", "newton"] = "eigh"
    precondition_vectors: bool = False
    ridge: Ridge = "relative"
    tiling: Tiling = "reference"
    root_dtype: torch.dtype = torch.float64
    # Work buffers reused across steps (not state: results never depend on them).
    _scratch: dict[tuple[torch.dtype, torch.device], Tensor] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        check_range("decay", self.decay, lambda v: 0.0 <= v < 1.0, "0 <= decay < 1")
        check_range("eps", self.eps, lambda v: v >= 0.0, "eps >= 0")
        _check_int("block_size", self.block_size, 1)
        _check_int("update_interval", self.update_interval, 1)
        if self.root_method not in ("eigh", "newton"):
            raise ValueError(
                f"invalid root_method: {self.root_method!r} (expected 'eigh' or 'newton')"
            )
        if self.tiling not in TILINGS:
            raise ValueError(f"invalid tiling: {self.tiling!r} (expected 'reference' or 'even')")
        if self.ridge not in ("relative", "absolute", "none"):
            raise ValueError(
                f"invalid ridge: {self.ridge!r} (expected 'relative', 'absolute' or 'none')"
            )
        if self.root_dtype not in (torch.float32, torch.float64):
            raise ValueError(
                f"invalid root_dtype: {self.root_dtype!r} (expected torch.float32 or float64)"
            )
        if not isinstance(self.precondition_vectors, bool):
            raise ValueError(
                f"invalid precondition_vectors: {self.precondition_vectors!r} (expected a bool)"
            )

    # ------------------------------------------------------------------ layout

    def plan(self, shape: tuple[int, ...]) -> BlockPlan | None:
        """The merge/block plan of a tensor of ``shape``, or ``None`` if it gets G = I."""
        plan = plan_blocks(tuple(shape), self.block_size, self.tiling)
        min_rank = 1 if self.precondition_vectors else 2
        return plan if plan.rank >= min_rank else None

    def _plans(self, layout: FlatLayout) -> list[tuple[int, BlockPlan]]:
        # A plain loop: torch.compile cannot trace a walrus in a comprehension (funnel fast path).
        out = []
        for i, shape in enumerate(layout.shapes):
            plan = self.plan(shape)
            if plan is not None:
                out.append((i, plan))
        return out

    def _work(self, layout: FlatLayout, like: Tensor) -> tuple[Tensor, Tensor]:
        """Two reusable flat buffers, each large enough for the biggest block group."""
        chains = math.prod(layout.batch_shape)
        sizes = [g.num_blocks * g.block_numel for _, p in self._plans(layout) for g in p.groups]
        need = chains * max(sizes, default=0)
        key = (like.dtype, like.device)
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < 2 * need:
            buf = torch.empty(2 * need, dtype=like.dtype, device=like.device)
            self._scratch[key] = buf
        return buf[:need], buf[need : 2 * need]

    # ------------------------------------------------------------------ contract

    def init(self, layout: FlatLayout, like: Tensor) -> Stats:
        stats: Stats = {}
        for i, plan in self._plans(layout):
            for g, group in enumerate(plan.groups):
                for a, s in enumerate(group.sizes):
                    shape = (*layout.batch_shape, group.num_blocks, s, s)
                    eye = torch.eye(s, dtype=like.dtype, device=like.device).expand(shape)
                    stats[_key("factor", g, a, i)] = eye * self.eps
                    stats[_key("grad_root", g, a, i)] = eye.clone()
                    stats[_key("noise_root", g, a, i)] = eye.clone()
        return stats

    @property
    def refresh_interval(self) -> int:
        """The roots are recomputed by the step engine every ``update_interval`` steps."""
        return self.update_interval

    def refresh(self, stats: Stats, layout: FlatLayout) -> None:
        """Recompute the inverse roots (the engine calls this every ``update_interval`` steps)."""
        self.compute_roots(stats, layout)

    def update(self, stats: Stats, layout: FlatLayout, grad: Tensor, step: int | Tensor) -> None:
        """H_i ← decay·H_i + (1−decay)·X_(i)X_(i)ᵀ per block (roots: :meth:`refresh`)."""
        chains = math.prod(layout.batch_shape)
        segments = layout.segments(grad)
        work, _ = self._work(layout, grad)
        for i, plan in self._plans(layout):
            x = segments[i].reshape(chains, *plan.merged)
            for g, group in enumerate(plan.groups):
                blocks = self._blocks(x, group, plan, work)
                for a in range(plan.rank):
                    self._fold(stats[_key("factor", g, a, i)], blocks, a)

    def inverse(self, stats: Stats, layout: FlatLayout, grad: Tensor) -> Tensor:
        """G⁻¹g = (⊗_i (H_i + rI)^{−1/(2k)}) g per block, in place."""
        return self._precondition(stats, layout, grad, "grad_root")

    def inverse_sqrt(self, stats: Stats, layout: FlatLayout, noise: Tensor) -> Tensor:
        """G^{-1/2}ξ = (⊗_i (H_i + rI)^{−1/(4k)}) ξ per block, in place."""
        return self._precondition(stats, layout, noise, "noise_root")

    def compute_roots(self, stats: Stats, layout: FlatLayout) -> None:
        """Recompute both inverse roots of every factor now (the engine calls this on schedule).

        Grad roots (H_i + rI)^{−1/(2k)} and noise roots (H_i + rI)^{−1/(4k)}, computed in
        ``root_dtype`` (``eigh``, float64 by default, retried in float64 if a lower precision
        fails) or in the statistics' dtype (``newton``, which forms the 1/(4k) root and squares
        it, as the reference), stored in the statistics' dtype. The factors are only read.

        Factors of equal size and rank across all tensors form one bucket, decomposed by one
        batched call (one ``eigh`` per bucket instead of one per factor group: on a GPU the
        refresh is then a handful of launches).
        """
        buckets: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        for i, plan in self._plans(layout):
            for g, group in enumerate(plan.groups):
                for a, s in enumerate(group.sizes):
                    buckets.setdefault((s, plan.rank), []).append((i, g, a))
        for (s, k), members in buckets.items():
            factors = [stats[_key("factor", g, a, i)].reshape(-1, s, s) for i, g, a in members]
            batch = factors[0] if len(factors) == 1 else torch.cat(factors)
            if self.root_method == "eigh":
                grad_root, noise_root = inverse_roots_eigh(
                    batch,
                    (1.0 / (2 * k), 1.0 / (4 * k)),
                    ridge=self.ridge,
                    eps=self.eps,
                    dtype=self.root_dtype,
                )
            else:
                noise_root = inverse_root_newton(batch, 4 * k, ridge=self.ridge, eps=self.eps)
                grad_root = noise_root @ noise_root
            sizes = [f.shape[0] for f in factors]
            for name, value in (("grad_root", grad_root), ("noise_root", noise_root)):
                for (i, g, a), part in zip(members, value.split(sizes), strict=True):
                    target = stats[_key(name, g, a, i)]
                    target.copy_(part.view(target.shape))

    # ------------------------------------------------------------------ kernels

    @staticmethod
    def _blocks(x: Tensor, group: BlockGroup, plan: BlockPlan, work: Tensor) -> Tensor:
        """The group's blocks of ``x`` (``(chains, *merged)``) as ``(chains·count, *sizes)``.

        A tensor that is a single block is only viewed; otherwise the blocks are copied into
        ``work`` (one permuted copy per group).
        """
        chains = x.shape[0]
        if len(plan.groups) == 1 and group.num_blocks == 1:
            return x  # sizes == merged
        n = chains * group.num_blocks
        out = work[: n * group.block_numel].view(chains, group.num_blocks, *group.sizes)
        return group.gather(x, out).view(n, *group.sizes)

    def _fold(self, factor: Tensor, blocks: Tensor, axis: int) -> None:
        """factor ← decay·factor + (1−decay)·X_(axis)X_(axis)ᵀ, batched over blocks.

        The first and last axes are strided views of the blocks (no copy).
        """
        n, sizes = blocks.shape[0], blocks.shape[1:]
        s = sizes[axis]
        h = factor.view(n, s, s)
        if axis == 0:
            unfold = blocks.reshape(n, s, -1)
        elif axis == len(sizes) - 1:
            unfold = blocks.reshape(n, -1, s).mT
        else:  # a middle axis (rank ≥ 3, conv kernels: small)
            unfold = blocks.movedim(axis + 1, 1).reshape(n, s, -1)
        h.baddbmm_(unfold, unfold.mT, beta=self.decay, alpha=1.0 - self.decay)

    def _precondition(self, stats: Stats, layout: FlatLayout, x: Tensor, root: str) -> Tensor:
        """Apply ⊗_i R_i to every block of ``x`` in place, R_i = ``stats[root_i]``.

        A block's axes are contracted one at a time with the cyclic trick of the reference:
        view the block as (s_0, rest), contract s_0 with R_0 into (rest, s_0), which is the block
        with its axes rotated by one; after k contractions the axis order is back. The transposed
        operand is only a strided view, so each contraction is one batched GEMM.
        """
        chains = math.prod(layout.batch_shape)
        segments = layout.segments(x)
        work = self._work(layout, x)
        for i, plan in self._plans(layout):
            xi = segments[i].view(chains, *plan.merged)  # a view: written in place below
            for g, group in enumerate(plan.groups):
                y = self._blocks(xi, group, plan, work[0])
                n = y.shape[0]
                numel = n * group.block_numel
                for a, s in enumerate(group.sizes):
                    r = stats[_key(root, g, a, i)].reshape(n, s, s)
                    out = work[(a + 1) % 2][:numel].view(n, -1, s)
                    y = torch.bmm(y.reshape(n, s, -1).mT, r, out=out)
                if len(plan.groups) == 1 and group.num_blocks == 1:
                    xi.copy_(y.view(xi.shape))
                else:
                    group.scatter(y, xi)
        return x
