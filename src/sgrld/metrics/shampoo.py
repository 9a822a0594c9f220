"""Shampoo metric: a blocked Kronecker-factored RMSprop metric (paper §3.2).

Per parameter tensor, reshaped to its merged shape of rank k and cut into blocks
(:mod:`sgrld.metrics._blocking`), every block X carries one factor H_i per axis i:

    H_i ← decay·H_i + (1 − decay)·X_(i) X_(i)ᵀ,      H_i(0) = eps·I,

with X_(i) the unfolding of X along axis i. The metric of a block is G = ⊗_i (H_i + rI)^{1/(2k)},
so

    G⁻¹g = (⊗_i (H_i + rI)^{−1/(2k)}) g,       G^{-1/2}ξ = (⊗_i (H_i + rI)^{−1/(4k)}) ξ.

The two roots of every factor are recomputed only when ``step % update_interval == 0`` and are
the identity before the first refresh (so the first ``update_interval − 1`` steps are SGLD, as in
the reference). Roots never modify the statistics. How G⁻¹ and G^{-1/2} enter
the step (ℓ, n, τ) is fixed once in ``docs/conventions.md``.

Speed (performance.md): blocks of equal shape are stacked and handled with batched matmuls; each
Kronecker product is applied by k matmuls contracting one axis at a time (the cyclic "tensordot"
trick: no copy per axis); work buffers are reused across steps; nothing in ``update``,
``inverse`` or ``inverse_sqrt`` syncs with the host, only the root refresh does. Blocks of one
shape form a *bucket* across all tensors of the layout (:func:`~sgrld.metrics._blocking.
plan_buckets`), and each statistic of a bucket's axis is one tensor whose per-tensor keys are
views (state dicts unchanged). On an accelerator a step is then one gather of every bucket's
blocks (an index kernel), k batched matmuls per bucket and one scatter: a few launches per
bucket instead of per tensor. On CPU (launches are cheap, the work is GEMM-bound) the same
kernels run one tensor group at a time, each gathered just before its matmuls, which measured
fastest there (performance.md, "Shampoo: blocks stacked across tensors").

Measured (2 CPU threads, fp32, MLP 784-400-400-10, D = 478,410, defaults): ``update`` 1.7 ms,
``inverse`` 1.9 ms, ``inverse_sqrt`` 1.9 ms per step, ≈ 150 GFLOP/s, near the GEMM rate (block
128 costs 0.73 GFLOP per step). A root refresh of all 96 factors takes 68-71 ms (float64
``eigh``, both roots), i.e. 0.7 ms per step at ``update_interval=100``, and 180-240 ms with
``root_method="newton"`` (see :mod:`sgrld.metrics._linalg`).
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from sgrld.core.contract import Metric, PerTensor, StatKind, Stats, check_range, register
from sgrld.core.layout import FlatLayout
from sgrld.core.shards import rows_of
from sgrld.metrics._blocking import (
    TILINGS,
    BlockPlan,
    Bucket,
    Member,
    Tiling,
    plan_blocks,
    plan_buckets,
)
from sgrld.metrics._linalg import Ridge, inverse_root_newton, inverse_roots_eigh


def _check_int(name: str, value: int, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"invalid {name}: {value!r} (expected an integer >= {low})")


def _key(stat: str, group: int, axis: int, index: int) -> str:
    """Key of a per-tensor statistic (:class:`~sgrld.core.contract.PerTensor`)."""
    return PerTensor(f"{stat}_{group}_{axis}", index).key


@register
@dataclass(frozen=True, kw_only=True)
class ShampooMetric(Metric):
    """Blocked Kronecker-factored metric G = ⊗_i H_i^{1/(2k)} per block (paper §3.2).

    With the defaults this is the reference ``ShampooSGLD`` with its bugs fixed: an explicit
    step counter, roots computed on a copy, in float64 ``eigh``.
    Tensors of merged rank ≤ 1 (biases, scalars) get G = I unless ``precondition_vectors``.

    The funnel's full-matrix RMSprop is
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
            ``block_size`` plus a remainder, as in the paper's code) or ``"even"`` (the
            fewest chunks of ≤ ``block_size``, sizes differing by ≤ 1: 784 → 7 × 112; faster,
            a different but equally valid metric).
        ridge: r added to each factor before its root: ``"relative"`` r = ε·λ_max(H_i) (the
            reference), ``"absolute"`` r = ε, or ``"none"`` r = 0 (the funnel).
        damping: δ ≥ 0 adds δ·tr(H_i)/s_i (δ times the mean eigenvalue) to the ridge, so that
            directions the statistics have barely seen do not get a huge G⁻¹; 0 (the paper's)
            by default; ``docs/posterior.md`` measures what it buys (``root_method="eigh"``).
        root_dtype: the precision of ``eigh`` (float64, the default; float32 is much faster on
            a GPU and is retried in float64 for a bucket whose decomposition fails).
        row_shards: W ≥ 1: plan every tensor as the W shards that FSDP2 cuts it into along
            dim 0 (``torch.chunk``'s rows, :func:`sgrld.core.shards.rows_of`), so that one
            process has the block partition of a chain sharded over W ranks (no block crosses a
            shard) and is that chain. Sharded parameters are always planned by their shards;
            there it must be 1 or the mesh's size. 1 (the default): whole tensors.

    Sharded parameters (FSDP2, ``docs/distributed.md``): a rank's shard of a tensor is merged
    with the *whole* tensor's grouping of dims, only the first merged dim cut at the shard's
    rows (:func:`~sgrld.metrics._blocking.merge_rows`), then blocked within the shard; it gets
    G = I exactly when the whole tensor does (its merged rank, which the shard keeps, is ≤ 1
    without ``precondition_vectors``), and an empty shard has no blocks. :meth:`partition`
    reports the merged shape and blocks of each tensor.

    References:
        Yu et al. (2023) §3.2; Gupta, Koren & Singer (2018), Shampoo; reference.md §2.5.

    Examples:
        >>> import torch
        >>> from sgrld.core.layout import FlatLayout
        >>> layout = FlatLayout(("w",), ((3, 200),))  # merged (3, 200): (3, 4) would be (12,)
        >>> metric = ShampooMetric(update_interval=1)
        >>> stats = metric.init(layout, torch.zeros(600))
        >>> g = torch.randn(600)
        >>> metric.update(stats, layout, g, step=1)
        >>> metric.refresh(stats, layout)  # the step engine does this every update_interval
        >>> metric.inverse(stats, layout, g.clone()).shape
        torch.Size([600])
    """

    name = "shampoo"
    aliases = ("shampoosgld",)
    decay: float = 0.99
    eps: float = 1e-8
    block_size: int = 128
    update_interval: int = 100
    root_method: Literal["eigh", "newton"] = "eigh"
    precondition_vectors: bool = False
    ridge: Ridge = "relative"
    damping: float = 0.0
    tiling: Tiling = "reference"
    root_dtype: torch.dtype = torch.float64
    row_shards: int = 1
    # Work buffers reused across steps (not state: results never depend on them).
    _scratch: dict[tuple[torch.dtype, torch.device], Tensor] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    # Per layout (shapes, chains): its buckets, and the gather index per device (not state).
    _stackings: dict[tuple[object, ...], _Stacking] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _indices: dict[tuple[object, ...], Tensor] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        check_range("decay", self.decay, lambda v: 0.0 <= v < 1.0, "0 <= decay < 1")
        check_range("eps", self.eps, lambda v: v >= 0.0, "eps >= 0")
        check_range("damping", self.damping, lambda v: v >= 0.0, "damping >= 0")
        if self.damping and self.root_method != "eigh":
            raise ValueError("damping needs root_method='eigh' (Newton's iteration has no damping)")
        _check_int("block_size", self.block_size, 1)
        _check_int("update_interval", self.update_interval, 1)
        _check_int("row_shards", self.row_shards, 1)
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

    def plan(
        self,
        shape: tuple[int, ...],
        whole: tuple[int, ...] | None = None,
        row_splits: tuple[int, ...] | None = None,
    ) -> BlockPlan | None:
        """The merge/block plan of a tensor of ``shape``, or ``None`` if it gets G = I (or, as
        an empty shard, has no blocks).

        ``shape`` may be rows of a tensor of shape ``whole`` (a shard), cut into pieces of
        ``row_splits`` rows (:func:`~sgrld.metrics._blocking.plan_blocks`); G = I is then
        decided on the whole tensor, so that every rank's shard of a tensor decides alike.
        """
        decided = plan_blocks(tuple(whole or shape), self.block_size, self.tiling)
        min_rank = 1 if self.precondition_vectors else 2
        if decided.rank < min_rank:
            return None
        if whole is None and row_splits is None:
            return decided
        plan = plan_blocks(tuple(shape), self.block_size, self.tiling, whole, row_splits)
        return plan if plan.num_blocks else None

    def _plans(self, layout: FlatLayout) -> list[tuple[int, BlockPlan]]:
        # A plain loop: torch.compile cannot trace a walrus in a comprehension (funnel fast path).
        out = []
        cut = self._cut(layout)
        for i, shape in enumerate(layout.shapes):
            plan = self._plan_of(layout, i) if cut else self.plan(shape)
            if plan is not None:
                out.append((i, plan))
        return out

    def _cut(self, layout: FlatLayout) -> bool:
        """Whether ``layout``'s tensors are planned as row shards (sharded, or ``row_shards``)."""
        shards = layout.shards
        if shards is not None and self.row_shards not in (1, shards.world):
            raise ValueError(
                f"row_shards={self.row_shards} on parameters sharded over {shards.world} ranks: "
                "a sharded chain's blocks are its shards' (row_shards must be 1 or the mesh size)"
            )
        return shards is not None or self.row_shards > 1

    def _plan_of(self, layout: FlatLayout, i: int) -> BlockPlan | None:
        """Tensor ``i``'s plan as a rank's shard (whole tensor: ``layout.shards``) or as the
        ``row_shards`` shards of one process."""
        shape = layout.shapes[i]
        if layout.shards is not None:
            return self.plan(shape, layout.shards.full_shapes[i])
        if not shape:  # a scalar has no rows to cut
            return self.plan(shape)
        splits = tuple(rows_of(shape[0], self.row_shards, r)[1] for r in range(self.row_shards))
        return self.plan(shape, row_splits=splits)

    def partition(self, layout: FlatLayout) -> list[TensorBlocks]:
        """How each tensor of ``layout`` is merged and blocked (on this rank, if sharded).

        One :class:`TensorBlocks` per tensor, in layout order: its whole shape, the rows held,
        the merged shape and every block's shape in order (none where G = I or the shard is
        empty). ``ShampooSGLD.partition()`` gives it for an optimizer's parameters.

        Examples:
            >>> layout = FlatLayout(("conv", "bias"), ((16, 16, 3, 3), (16,)))
            >>> [(t.merged, t.blocks) for t in ShampooMetric(row_shards=2).partition(layout)]
            [((16, 48, 3), ((8, 48, 3), (8, 48, 3))), ((), ())]
        """
        shards, out = layout.shards, []
        plans = dict(self._plans(layout))
        for i, (name, shape) in enumerate(zip(layout.names, layout.shapes, strict=True)):
            whole = shape if shards is None else shards.full_shapes[i]
            first = 0
            if shards is not None and whole:
                first = rows_of(whole[0], shards.world, shards.rank)[0]
            plan = plans.get(i)
            blocks = () if plan is None else tuple(
                g.sizes for g in plan.groups for _ in range(g.num_blocks)
            )  # fmt: skip
            merged = () if plan is None else plan.merged
            rows = (first, shape[0] if shape else 1)
            out.append(TensorBlocks(name, tuple(whole), rows, merged, blocks))
        return out

    def _key_of(self, layout: FlatLayout) -> tuple[object, ...]:
        """What a layout's plans depend on: the (local) shapes, the chains, and the whole
        shapes of a sharded layout."""
        shards = layout.shards
        return (layout.shapes, layout.batch_shape, None if shards is None else shards.full_shapes)

    def _stacking(self, layout: FlatLayout) -> _Stacking:
        """The buckets of ``layout`` and where each lies in a work region (cached by shapes)."""
        key = self._key_of(layout)
        stacking = self._stackings.get(key)
        if stacking is None:
            stacking = _Stacking.build(plan_buckets(self._plans(layout)), layout.batch_shape)
            self._stackings[key] = stacking
        return stacking

    def _work(self, stacking: _Stacking, layout: FlatLayout, like: Tensor) -> _Work:
        """The gather index (or ``None``) and the reusable flat regions for the blocks: three
        holding every bucket with an index, two holding the largest tensor group without."""
        index = self._index(stacking, layout, like)
        # one region per gathered, intermediate and transformed blocks; without an index the
        # transformed blocks end in one of the first two (and are scattered piece by piece)
        need, count = (stacking.size, 3) if index is not None else (stacking.largest, 2)
        key = (like.dtype, like.device)
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < count * need:
            buf = torch.empty(count * need, dtype=like.dtype, device=like.device)
            self._scratch[key] = buf
        regions = [buf[j * need : (j + 1) * need] for j in range(count)]
        return _Work(index, regions[0], regions[1], regions[-1] if index is not None else None)

    def _index(self, stacking: _Stacking, layout: FlatLayout, x: Tensor) -> Tensor | None:
        """Flat positions in ``x`` of every bucket's blocks in work-region order (the gather and
        scatter of all buckets in one kernel each), or ``None`` where the blocks are copied one
        tensor at a time: on CPU (faster there, see :meth:`_pieces`), while traced (inductor
        fuses the copies), for a strided ``x``, and while a CUDA graph is captured before the
        index exists (it is made once, outside any graph)."""
        if x.device.type == "cpu" or torch.compiler.is_compiling() or not x.is_contiguous():
            return None
        key = (*self._key_of(layout), x.device)
        index = self._indices.get(key)
        if index is None and not torch.cuda.is_current_stream_capturing():
            index = stacking.positions(layout, x.device)
            self._indices[key] = index
        return index

    # ------------------------------------------------------------------ contract

    def init(self, layout: FlatLayout, like: Tensor) -> Stats:
        """ε·I factors and identity roots, one key per tensor, group, axis and statistic.

        Each statistic of a bucket's axis is one ``(blocks, *batch, s, s)`` tensor and the
        per-tensor keys are views of it, so that a step updates and applies a whole bucket with one
        batched matmul while state dicts keep their per-tensor keys and shapes.
        """
        whole = layout.shapes if layout.shards is None else layout.shards.full_shapes
        if (
            all(self.plan(shape) is None for shape in whole)  # not a rank's empty shards
            and self._stackings.get(self._key_of(layout)) is None
        ):
            warnings.warn(
                "ShampooMetric: every parameter tensor has merged rank <= 1 "
                f"(shapes {[tuple(sh) for sh in layout.shapes]}, block_size {self.block_size}) "
                "and precondition_vectors=False, so G = I everywhere: this is SGLD. Pass "
                "precondition_vectors=True to give them full-matrix factors",
                UserWarning,
                stacklevel=2,
            )
        stacking = self._stacking(layout)
        batch, nb = layout.batch_shape, len(layout.batch_shape)
        views: dict[tuple[str, int, int, int], Tensor] = {}
        for bucket in stacking.buckets:
            for a, s in enumerate(bucket.sizes):
                eye = torch.eye(s, dtype=like.dtype, device=like.device)
                eye = eye.expand(bucket.num_blocks, *batch, s, s)
                for stat in _STATS:
                    value = eye * self.eps if stat == "factor" else eye
                    base = value.clone(memory_format=torch.contiguous_format)  # own memory
                    for m in bucket.members:
                        part = base.narrow(0, m.start, m.group.num_blocks).movedim(0, nb)
                        views[stat, m.index, a, m.tensor] = part
        return {_key(*k): views[k] for k in self._stat_names(layout)}

    def _stat_names(self, layout: FlatLayout) -> Iterator[tuple[str, int, int, int]]:
        """(statistic, group, axis, tensor) of every factor and root, in the state's order."""
        for i, plan in self._plans(layout):
            for g, group in enumerate(plan.groups):
                for a in range(len(group.sizes)):
                    for stat in _STATS:
                        yield stat, g, a, i

    def stat_kinds(self, layout: FlatLayout) -> dict[str, StatKind]:
        """Every factor and root belongs to one tensor (:class:`~sgrld.core.contract.PerTensor`)."""
        kinds = (PerTensor(f"{s}_{g}_{a}", i) for s, g, a, i in self._stat_names(layout))
        return {kind.key: kind for kind in kinds}

    @property
    def refresh_interval(self) -> int:
        """The roots are recomputed by the step engine every ``update_interval`` steps."""
        return self.update_interval

    def refresh(self, stats: Stats, layout: FlatLayout) -> None:
        """Recompute the inverse roots (the engine calls this every ``update_interval`` steps)."""
        self.compute_roots(stats, layout)

    def diagnostics(self, stats: Stats, layout: FlatLayout) -> dict[str, Tensor]:
        """``factor_condition``: the largest condition number λ_max/λ_min of any factor H_i, one
        per chain (float64 eigenvalues; a singular factor gives inf): how hard the roots' ridge
        works."""
        worst = torch.zeros(layout.batch_shape, dtype=torch.float64)
        for key, value in stats.items():
            if key.startswith("factor_"):  # (*batch, blocks, s, s)
                lam = torch.linalg.eigvalsh(value.detach().to("cpu", torch.float64))
                cond = (lam[..., -1] / lam[..., 0].clamp_min(0.0)).nan_to_num(torch.inf)
                worst = torch.maximum(worst, cond.amax(-1))
        return {"factor_condition": worst}

    def update(self, stats: Stats, layout: FlatLayout, grad: Tensor, step: int | Tensor) -> None:
        """H_i ← decay·H_i + (1−decay)·X_(i)X_(i)ᵀ per block (roots: :meth:`refresh`).

        Per bucket and axis one batched matmul over the bucket's blocks of every tensor (see
        :meth:`_pieces` for how the blocks are gathered on each device).
        """
        nb = len(layout.batch_shape)
        stacking = self._stacking(layout)
        work = self._work(stacking, layout, grad)
        for piece, blocks, _ in self._pieces(stacking, layout, grad, work, scatter=False):
            for a in range(piece.bucket.rank):
                factor, copied_from = stacking.piece_stat(stats, "factor", piece, a, nb)
                self._fold(factor, blocks, a)
                if copied_from is not None:
                    _write_back(factor, copied_from)

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
                    damping=self.damping,
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

    def _pieces(
        self, stacking: _Stacking, layout: FlatLayout, x: Tensor, work: _Work, scatter: bool
    ) -> Iterator[tuple[_Piece, Tensor, Tensor | None]]:
        """Each piece's blocks of ``x`` as ``(piece, blocks, result)``: ``blocks`` is
        ``(count·chains, *sizes)``, block-major; ``result`` is where the caller's k cyclic
        matmuls, alternating between the scratch and the gathered region, write the transformed
        blocks so that they reach ``x`` (``None`` for a piece used in place, which the caller
        writes itself). Only with ``scatter`` are the results written back into ``x``.

        With a gather index (accelerators) a piece is a whole bucket: one kernel gathers every
        bucket before the first piece and one scatters them all after the last. Without one (CPU,
        traced steps) a piece is one tensor's group of blocks, gathered just before and scattered
        just after it is used, or one whole tensor used in place, as before the buckets: on CPU,
        where launches are cheap, stacking saved nothing and cost up to 5 % in cache misses and
        copies of whole tensors (docs/performance.md, "Shampoo: blocks stacked across
        tensors").
        """
        if work.positions is not None:
            assert work.result is not None
            torch.index_select(x.view(-1), 0, work.positions, out=work.gathered)
            for piece in stacking.stacked:
                blocks = work.gathered[piece.span].view(piece.rows_count, *piece.bucket.sizes)
                yield piece, blocks, work.result[piece.span]
            if scatter:
                x.view(-1).index_copy_(0, work.positions, work.result)
            return
        segments = layout.segments(x)
        for piece in stacking.split:
            m = piece.member
            assert m is not None
            xi = segments[m.tensor].view(stacking.chains, *m.merged)
            if m.whole:
                yield piece, xi.view(piece.rows_count, *piece.bucket.sizes), None
                continue
            gathered = work.gathered[piece.span]
            m.group.gather(xi, gathered)
            # the last of the k matmuls that alternate between the two regions writes this one
            result = (work.scratch, work.gathered)[(piece.bucket.rank - 1) % 2][piece.span]
            yield piece, gathered.view(piece.rows_count, *piece.bucket.sizes), result
            if scatter:
                m.group.scatter(result, xi)

    def _fold(self, factor: Tensor, blocks: Tensor, axis: int) -> None:
        """factor ← decay·factor + (1−decay)·X_(axis)X_(axis)ᵀ, batched over blocks.

        The first and last axes are strided views of the blocks (no copy).
        """
        n, sizes = blocks.shape[0], blocks.shape[1:]
        s = sizes[axis]
        if axis == 0:
            unfold = blocks.reshape(n, s, -1)
        elif axis == len(sizes) - 1:
            unfold = blocks.reshape(n, -1, s).mT
        else:  # a middle axis (rank ≥ 3, conv kernels: small)
            unfold = blocks.movedim(axis + 1, 1).reshape(n, s, -1)
        factor.baddbmm_(unfold, unfold.mT, beta=self.decay, alpha=1.0 - self.decay)

    def _precondition(self, stats: Stats, layout: FlatLayout, x: Tensor, root: str) -> Tensor:
        """Apply ⊗_i R_i to every block of ``x`` in place, R_i = ``stats[root_i]``.

        A block's axes are contracted one at a time with the cyclic trick of the reference:
        view the block as (s_0, rest), contract s_0 with R_0 into (rest, s_0), which is the block
        with its axes rotated by one; after k contractions the axis order is back. The transposed
        operand is only a strided view, so each contraction is one batched GEMM over a bucket's
        blocks of every tensor (:meth:`_pieces`).
        """
        nb = len(layout.batch_shape)
        stacking = self._stacking(layout)
        work = self._work(stacking, layout, x)
        for piece, y, result in self._pieces(stacking, layout, x, work, scatter=True):
            bucket = piece.bucket
            rs = [stacking.piece_stat(stats, root, piece, a, nb)[0] for a in range(bucket.rank)]
            span = piece.span
            if result is not None:  # intermediates in scratch and the gathered copy
                _kron_apply(y, rs, (work.scratch[span], work.gathered[span]), result)
            elif bucket.rank == 1:  # in place, a vector: one matmul into scratch, copied back
                y.copy_(_kron_apply(y, rs, (), work.scratch[span]).view(y.shape))
            else:  # in place: intermediates in the two regions, the last matmul writes the tensor
                _kron_apply(y, rs, (work.scratch[span], work.gathered[span]), y)
        return x


_STATS = ("factor", "grad_root", "noise_root")


class TensorBlocks(NamedTuple):
    """How one tensor is merged and blocked (:meth:`ShampooMetric.partition`).

    Attributes:
        name: the parameter's name.
        shape: the whole tensor's shape (of all ranks together, when sharded).
        rows: ``(first row, row count)`` along dim 0 that this rank holds (all rows unsharded).
        merged: the merged shape of the rows held (the whole tensor's grouping of dims, the
            first merged dim cut at the rows); ``()`` where G = I or there are no blocks.
        blocks: each block's shape, in the plan's order; ``()`` where G = I or the shard is
            empty.
    """

    name: str
    shape: tuple[int, ...]
    rows: tuple[int, int]
    merged: tuple[int, ...]
    blocks: tuple[tuple[int, ...], ...]

    @property
    def factor_numel(self) -> int:
        """Elements of the blocks' factors H_i (one s × s matrix per block and axis; the two
        roots take as many each)."""
        return sum(s * s for block in self.blocks for s in block)


def _kron_apply(y: Tensor, roots: list[Tensor], scratch: tuple[Tensor, ...], out: Tensor) -> Tensor:
    """(⊗_i R_i) applied to each block of ``y`` (``(n, *sizes)``), written into ``out``.

    Contraction ``a`` reads the previous result and writes ``scratch[a % 2]`` (the last one
    ``out``), so no matmul reads the memory it writes: ``scratch`` must not overlap ``out``, and
    ``y`` may be one of them only where it is not written while read.
    """
    n, k = y.shape[0], len(roots)
    for a, r in enumerate(roots):
        s = r.shape[-1]
        target = out if a == k - 1 else scratch[a % 2]
        y = torch.bmm(y.reshape(n, s, -1).mT, r, out=target.view(n, -1, s))
    return y


def _common_base(parts: list[Tensor], bucket: Bucket) -> Tensor | None:
    """The contiguous tensor that ``parts`` are consecutive block ranges of, or ``None``."""
    base = parts[0]._base
    if base is None or base.shape[0] != bucket.num_blocks or not base.is_contiguous():
        return None
    origin, per_block, stride = base.storage_offset(), base.stride(0), base.stride()
    for m, part in zip(bucket.members, parts, strict=True):
        if (
            part._base is not base
            or part.storage_offset() != origin + m.start * per_block
            or part.shape[0] != m.group.num_blocks
            or part.stride() != stride
            or part.shape[1:] != base.shape[1:]
        ):
            return None
    return base


def _write_back(stacked: Tensor, parts: list[Tensor]) -> None:
    """Copy a statistic that was stacked by copying (``piece_stat``) back into ``parts``."""
    rows = [p.shape[0] * math.prod(p.shape[1:-2]) for p in parts]
    for part, value in zip(parts, stacked.split(rows), strict=True):
        part.copy_(value.view(part.shape))


class _Work(NamedTuple):
    positions: Tensor | None
    gathered: Tensor
    scratch: Tensor
    result: Tensor | None


@dataclass(frozen=True)
class _Piece:
    """Blocks of bucket number ``number`` handled by one matmul per axis: the whole bucket
    (``member`` None) or one member's group (``member``; a whole tensor is used in place).

    Attributes:
        position: the member's index in the bucket's members (-1: the whole bucket).
        span: the piece's elements in a work region.
        rows_count: blocks × chains.
    """

    bucket: Bucket
    number: int
    member: Member | None
    position: int
    span: slice
    rows_count: int


@dataclass(frozen=True)
class _Stacking:
    """How a layout's blocks are stacked: its buckets, as pieces with a gather index
    (``stacked``: a bucket each, back to back in ``size`` elements of a work region) and
    without one (``split``: one member each, from offset 0 of ``largest`` elements)."""

    buckets: tuple[Bucket, ...]
    stacked: tuple[_Piece, ...]
    split: tuple[_Piece, ...]
    size: int
    largest: int
    chains: int
    _keys: dict[tuple[str, int, int], list[str]]
    # per statistic: the per-tensor tensors last found to be views of one base, and that base
    # (weak references: a state that is dropped is not kept alive by its metric)
    _verified: dict[tuple[str, int, int], tuple[list[weakref.ref[Tensor]], weakref.ref[Tensor]]]

    @staticmethod
    def build(buckets: tuple[Bucket, ...], batch_shape: tuple[int, ...]) -> _Stacking:
        chains = math.prod(batch_shape)
        stacked, split, size, largest = [], [], 0, 0
        for b, bucket in enumerate(buckets):
            numel, rows = bucket.block_numel, chains * bucket.num_blocks
            stacked.append(_Piece(bucket, b, None, -1, slice(size, size + rows * numel), rows))
            size += rows * numel
            for j, m in enumerate(bucket.members):
                count = chains * m.group.num_blocks
                split.append(_Piece(bucket, b, m, j, slice(0, count * numel), count))
                largest = max(largest, count * numel)
        keys = {
            (stat, b, a): [_key(stat, m.index, a, m.tensor) for m in bucket.members]
            for b, bucket in enumerate(buckets)
            for stat in _STATS
            for a in range(bucket.rank)
        }
        return _Stacking(buckets, tuple(stacked), tuple(split), size, largest, chains, keys, {})

    def __getstate__(self) -> dict[str, object]:
        # weak references do not pickle; the checks are redone after a copy
        return {**self.__dict__, "_verified": {}}

    def piece_stat(
        self, stats: Stats, stat: str, piece: _Piece, axis: int, nbatch: int
    ) -> tuple[Tensor, list[Tensor] | None]:
        """Statistic ``stat`` of ``piece``'s blocks, one axis, as one ``(rows, s, s)`` tensor
        (block-major), and ``None``, or the views to write it back to where it is a copy.

        A member's statistic is its own tensor (a view of the bucket's, as :meth:`ShampooMetric.
        init` makes it: no copy). A whole bucket's is the tensor that its members' statistics
        are views of (checked once, then by identity); statistics that are not views of one
        tensor (cloned, stacked by a caller, or while ``torch.compile`` traces, where a view's
        base cannot be read) are copied into one.
        """
        slot = (stat, piece.number, axis)
        keys = self._keys[slot]
        raw = (
            [stats[keys[piece.position]]] if piece.member is not None else [stats[k] for k in keys]
        )
        s = raw[0].shape[-1]
        tracing = torch.compiler.is_compiling()
        seen = None if tracing or piece.member is not None else self._verified.get(slot)
        if seen is not None:
            base = seen[1]()
            if base is not None and all(r() is t for r, t in zip(seen[0], raw, strict=True)):
                return base.view(-1, s, s), None
        parts = [p.movedim(nbatch, 0) for p in raw] if nbatch else raw
        if len(parts) == 1 and parts[0].is_contiguous():
            return parts[0].view(-1, s, s), None
        if not tracing and piece.member is None:
            base = _common_base(parts, piece.bucket)
            if base is not None:
                self._verified[slot] = ([weakref.ref(t) for t in raw], weakref.ref(base))
                return base.view(-1, s, s), None
        return torch.cat(parts).view(-1, s, s), parts

    def positions(self, layout: FlatLayout, device: torch.device) -> Tensor:
        """The flat index into a contiguous ``(*batch, D)`` buffer of every element of a work
        region: the blocks gathered by the same code from a buffer of positions."""
        flat = torch.arange(self.chains * layout.size, device=device)
        segments = layout.segments(flat.view(self.chains, layout.size))
        pieces = [
            m.group._blocks_first(segments[m.tensor].view(self.chains, *m.merged)).reshape(-1)
            for bucket in self.buckets
            for m in bucket.members
        ]
        return torch.cat(pieces)
