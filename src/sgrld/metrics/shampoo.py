"""Shampoo metric: a blocked Kronecker-factored RMSprop metric (paper §3.2).

Each parameter tensor, reshaped to its merged shape of rank k and cut into blocks
(:mod:`sgrld.metrics._blocking`), carries per block X one factor H_i per axis i:

    H_i ← decay·H_i + (1 − decay)·X_(i) X_(i)ᵀ,      H_i(0) = eps·I,

and G = ⊗_i (H_i + rI)^{1/(2k)}, so G⁻¹g = (⊗_i (H_i + rI)^{−1/(2k)}) g and
G^{-1/2}ξ = (⊗_i (H_i + rI)^{−1/(4k)}) ξ. The roots are recomputed when
``step % update_interval == 0`` and are the identity before (the first steps are SGLD, as in the
reference). Blocks of one shape form a bucket across tensors, handled by batched matmuls that
contract one axis at a time; only the root refresh syncs with the host (``docs/performance.md``,
"Shampoo: blocks stacked across tensors").
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

from sgrld.core.contract import (
    Metric,
    PerTensor,
    StatKind,
    Stats,
    check_bool,
    check_choice,
    check_int,
    check_range,
    host_reads,
    register,
)
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


def _current_roots(
    stats: Stats, members: list[tuple[int, int, int]], size: int
) -> tuple[Tensor, Tensor]:
    """A bucket's grad and noise roots as they stand, stacked as its factors are."""
    grad, noise = (
        torch.cat([stats[_key(name, g, a, i)].reshape(-1, size, size) for i, g, a in members])
        for name in ("grad_root", "noise_root")
    )
    return grad, noise


class ShampooRootError(FloatingPointError):
    """A root refresh failed (``eigh`` did not converge, or a root is not finite); nothing was
    changed: the roots are those of the previous refresh."""


def _key(stat: str, group: int, axis: int, index: int) -> str:
    """Key of a per-tensor statistic (:class:`~sgrld.core.contract.PerTensor`)."""
    return PerTensor(f"{stat}_{group}_{axis}", index).key


@register
@dataclass(frozen=True, kw_only=True)
class ShampooMetric(Metric):
    """Blocked Kronecker-factored metric G = ⊗_i H_i^{1/(2k)} per block (paper §3.2).

    The defaults are the reference ``ShampooSGLD`` with its bugs fixed (an explicit step counter,
    roots computed on a copy, in float64 ``eigh``). Tensors of merged rank ≤ 1 get G = I unless
    ``precondition_vectors``. The funnel's full-matrix RMSprop is ``ShampooMetric(decay=0.9995,
    eps=1e-6, update_interval=1, precondition_vectors=True, ridge="none", floor=0.0)``.

    Args:
        decay: EMA weight λ of the factors, in [0, 1).
        eps: ε ≥ 0: the factors start at ε·I, and ε sets the ridge r.
        block_size: largest merged dim and largest block side (integer ≥ 1).
        update_interval: the roots are recomputed at multiples of it (integer ≥ 1), I before.
        root_method: ``"eigh"`` (float64, tiny negative eigenvalues clamped to 0) or ``"newton"``
            (the reference's coupled Newton iteration, in the statistics' dtype).
        precondition_vectors: give tensors of merged rank 1 a full-matrix factor instead of I.
        tiling: ``"reference"`` (chunks of ``block_size`` plus a remainder) or ``"even"`` (the
            fewest near-equal chunks: 784 → 7 × 112; faster, a different but valid metric).
        ridge: r added before the root: ``"relative"`` ε·λ_max(H_i) (the reference),
            ``"absolute"`` ε, or ``"none"`` 0 (the funnel).
        damping: δ ≥ 0 adds δ·tr(H_i)/s_i to the ridge (``docs/posterior.md``; ``"eigh"`` only).
        floor: f ≥ 0, the least eigenvalue of G (absolute, in the gradient's units, as RMSprop's
            ε): every factor's eigenvalues after the ridge are raised to at least f², so
            G ≥ f·I and G⁻¹ ≤ I/f however small the factors (near-zero gradients at a minimum,
            where a ridge relative to the factors vanishes with them); larger eigenvalues are
            left as they were. 0 is the paper's metric (the paper's protocol runs with it);
            ``root_method="newton"`` raises its ridge to f² instead (it has no eigenvalues).
        root_dtype: the precision of ``eigh`` (float64; float32 is much faster on a GPU and is
            retried in float64 for a bucket whose decomposition fails).
        row_shards: W ≥ 1: plan every tensor as the W row shards FSDP2 cuts it into, so one
            process has the blocks of a chain sharded over W ranks; for sharded parameters 1 or
            the mesh's size (``docs/distributed.md``).

    References:
        Yu et al. (2023) §3.2; Gupta, Koren & Singer (2018), Shampoo; reference.md §2.5.

    Examples:
        >>> import torch
        >>> from sgrld.core.layout import FlatLayout
        >>> layout, metric = FlatLayout(("w",), ((3, 200),)), ShampooMetric(update_interval=1)
        >>> stats = metric.init(layout, torch.zeros(600))
        >>> metric.inverse(stats, layout, torch.randn(600)).shape
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
    floor: float = 0.1
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
        check_range("floor", self.floor, lambda v: 0.0 <= v < math.inf, "0 <= floor < inf")
        if self.damping and self.root_method != "eigh":
            raise ValueError("damping needs root_method='eigh' (Newton's iteration has no damping)")
        check_int("block_size", self.block_size, 1)
        check_int("update_interval", self.update_interval, 1)
        check_int("row_shards", self.row_shards, 1)
        check_choice("root_method", self.root_method, ("eigh", "newton"))
        check_choice("tiling", self.tiling, TILINGS)
        check_choice("ridge", self.ridge, ("relative", "absolute", "none"))
        if self.root_dtype not in (torch.float32, torch.float64):
            raise ValueError(
                f"invalid root_dtype: {self.root_dtype!r} (expected torch.float32 or float64)"
            )
        check_bool("precondition_vectors", self.precondition_vectors)

    # ------------------------------------------------------------------ layout

    def plan(
        self,
        shape: tuple[int, ...],
        whole: tuple[int, ...] | None = None,
        row_splits: tuple[int, ...] | None = None,
    ) -> BlockPlan | None:
        """The merge/block plan of a tensor of ``shape``, or ``None`` if it gets G = I (or is an
        empty shard). A shard (rows of ``whole``, or cut at ``row_splits``) gets G = I as its whole
        tensor does."""
        decided = plan_blocks(tuple(whole or shape), self.block_size, self.tiling)
        min_rank = 1 if self.precondition_vectors else 2
        if decided.rank < min_rank:
            return None
        if whole is None and row_splits is None:
            return decided
        plan = plan_blocks(tuple(shape), self.block_size, self.tiling, whole, row_splits)
        return plan if plan.num_blocks else None

    def _plans(self, layout: FlatLayout) -> list[tuple[int, BlockPlan]]:
        """Each planned tensor's ``(index, plan)``: whole, a rank's shard, or ``row_shards``."""
        shards = layout.shards
        if shards is not None and self.row_shards not in (1, shards.world):
            raise ValueError(
                f"row_shards={self.row_shards} on parameters sharded over {shards.world} ranks: "
                "a sharded chain's blocks are its shards' (row_shards must be 1 or the mesh size)"
            )
        # A plain loop: torch.compile cannot trace a walrus in a comprehension (funnel fast path).
        out = []
        for i, shape in enumerate(layout.shapes):
            if shards is not None:
                plan = self.plan(shape, shards.full_shapes[i])
            elif self.row_shards > 1 and shape:  # a scalar has no rows to cut
                rows = [rows_of(shape[0], self.row_shards, r)[1] for r in range(self.row_shards)]
                plan = self.plan(shape, row_splits=tuple(rows))
            else:
                plan = self.plan(shape)
            if plan is not None:
                out.append((i, plan))
        return out

    def partition(self, layout: FlatLayout) -> list[TensorBlocks]:
        """How each tensor of ``layout`` is merged and blocked (on this rank, if sharded), in layout
        order. ``ShampooSGLD.partition()`` gives it for an optimizer's parameters.

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
        """What a layout's plans depend on: shapes, chains, whole shapes."""
        shards = layout.shards
        return (layout.shapes, layout.batch_shape, None if shards is None else shards.full_shapes)

    def _stacking(self, layout: FlatLayout) -> _Stacking:
        """The buckets of ``layout`` and their work-region spans (cached)."""
        key = self._key_of(layout)
        stacking = self._stackings.get(key)
        if stacking is None:
            stacking = _Stacking.build(plan_buckets(self._plans(layout)), layout.batch_shape)
            self._stackings[key] = stacking
        return stacking

    def _work(self, stacking: _Stacking, layout: FlatLayout, like: Tensor) -> _Work:
        """The gather index (or ``None``) and the reusable work regions."""
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
        """Flat positions of every bucket's blocks (one gather and one scatter kernel), or ``None``
        where blocks are copied one tensor at a time: on CPU (faster there), while traced, for a
        strided ``x``, and while a CUDA graph is captured before the index exists."""
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
        """ε·I factors and identity roots; the per-tensor keys are views of one tensor per bucket
        axis.
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
        """(statistic, group, axis, tensor) of every factor and root."""
        for i, plan in self._plans(layout):
            for g, group in enumerate(plan.groups):
                for a in range(len(group.sizes)):
                    for stat in _STATS:
                        yield stat, g, a, i

    def stat_kinds(self, layout: FlatLayout) -> dict[str, StatKind]:
        """Every factor and root belongs to one tensor."""
        kinds = (PerTensor(f"{s}_{g}_{a}", i) for s, g, a, i in self._stat_names(layout))
        return {kind.key: kind for kind in kinds}

    @property
    def refresh_interval(self) -> int:
        """The roots are recomputed every ``update_interval`` steps."""
        return self.update_interval

    def refresh(self, stats: Stats, layout: FlatLayout) -> None:
        """Recompute the inverse roots (:meth:`compute_roots`)."""
        self.compute_roots(stats, layout)

    def diagnostics(self, stats: Stats, layout: FlatLayout) -> dict[str, Tensor]:
        """``factor_condition``: the largest condition number λ_max/λ_min of any factor, per
        chain.
        """
        worst = torch.zeros(layout.batch_shape, dtype=torch.float64)
        for key, value in stats.items():
            if key.startswith("factor_"):  # (*batch, blocks, s, s)
                lam = torch.linalg.eigvalsh(value.detach().to("cpu", torch.float64))
                cond = (lam[..., -1] / lam[..., 0].clamp_min(0.0)).nan_to_num(torch.inf)
                worst = torch.maximum(worst, cond.amax(-1))
        return {"factor_condition": worst}

    def update(self, stats: Stats, layout: FlatLayout, grad: Tensor, step: int | Tensor) -> None:
        """H_i ← decay·H_i + (1−decay)·X_(i)X_(i)ᵀ per block."""
        nb = len(layout.batch_shape)
        stacking = self._stacking(layout)
        work = self._work(stacking, layout, grad)
        for piece, blocks, _ in self._pieces(stacking, layout, grad, work, scatter=False):
            for a in range(piece.bucket.rank):
                factor, copied_from = stacking.piece_stat(stats, "factor", piece, a, nb)
                self._fold(factor, blocks, a)
                if copied_from is not None:  # stacked by copying: write it back
                    rows = [p.shape[0] * math.prod(p.shape[1:-2]) for p in copied_from]
                    for part, value in zip(copied_from, factor.split(rows), strict=True):
                        part.copy_(value.view(part.shape))

    def inverse(self, stats: Stats, layout: FlatLayout, grad: Tensor) -> Tensor:
        """G⁻¹g = (⊗_i (H_i + rI)^{−1/(2k)}) g per block, in place."""
        return self._precondition(stats, layout, grad, "grad_root")

    def inverse_sqrt(self, stats: Stats, layout: FlatLayout, noise: Tensor) -> Tensor:
        """G^{-1/2}ξ = (⊗_i (H_i + rI)^{−1/(4k)}) ξ per block, in place."""
        return self._precondition(stats, layout, noise, "noise_root")

    def compute_roots(self, stats: Stats, layout: FlatLayout) -> None:
        """Recompute both inverse roots of every factor now (the factors are only read).

        Grad roots (H_i + rI)^{−1/(2k)} and noise roots (H_i + rI)^{−1/(4k)}, by ``eigh`` in
        ``root_dtype`` or by ``newton`` in the statistics' dtype (the 1/(4k) root, squared, as the
        reference), one batched call per bucket of equal size and rank.
        """
        buckets: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        for i, plan in self._plans(layout):
            for g, group in enumerate(plan.groups):
                for a, s in enumerate(group.sizes):
                    buckets.setdefault((s, plan.rank), []).append((i, g, a))
        done = []  # every bucket's roots first: a failed refresh changes nothing
        for (s, k), members in buckets.items():
            factors = [stats[_key("factor", g, a, i)].reshape(-1, s, s) for i, g, a in members]
            batch = factors[0] if len(factors) == 1 else torch.cat(factors)

            # K chains: a factor that is not finite is a chain whose gradients blew up (its
            # failure flags hold it, or will at its first non-finite gradient); it keeps its
            # roots and the other chains refresh theirs. One chain: the error below names it.
            broken = None
            if layout.batch_shape:
                broken = ~torch.isfinite(batch).all(dim=(-2, -1))[:, None, None]
                batch = torch.where(broken, torch.eye(s, dtype=batch.dtype, device=batch.device),
                                    batch)  # fmt: skip
            try:
                grad_root, noise_root = self._roots(batch, k)
            except torch.linalg.LinAlgError as exc:
                raise self._root_error(layout, members, factors, f"eigh failed ({exc})") from None
            # finite in the statistics' dtype (the copy below casts as this does)
            roots = (grad_root.to(batch.dtype), noise_root.to(batch.dtype))
            # deferred checks, traced steps: no host read; a bad refresh keeps the old roots
            deferred = torch.compiler.is_compiling() or not host_reads.get()
            kept = _current_roots(stats, members, s) if deferred or broken is not None else None
            if broken is not None and kept is not None:
                roots = (torch.where(broken, kept[0], roots[0]),
                         torch.where(broken, kept[1], roots[1]))  # fmt: skip
            finite = torch.isfinite(roots[0]).all() & torch.isfinite(roots[1]).all()
            if not deferred:
                if not bool(finite):
                    raise self._root_error(layout, members, factors, "a root is not finite")
            elif kept is not None:
                roots = (torch.where(finite, roots[0], kept[0]),
                         torch.where(finite, roots[1], kept[1]))  # fmt: skip
            done.append((members, [f.shape[0] for f in factors], roots))
        for members, sizes, (grad_root, noise_root) in done:
            for name, value in (("grad_root", grad_root), ("noise_root", noise_root)):
                for (i, g, a), part in zip(members, value.split(sizes), strict=True):
                    target = stats[_key(name, g, a, i)]
                    target.copy_(part.view(target.shape))

    def _roots(self, batch: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """The grad and noise roots (H + rI)^{−1/(2k)}, (H + rI)^{−1/(4k)} of a bucket."""
        if self.root_method == "eigh":
            grad_root, noise_root = inverse_roots_eigh(
                batch,
                (1.0 / (2 * k), 1.0 / (4 * k)),
                ridge=self.ridge,
                eps=self.eps,
                damping=self.damping,
                dtype=self.root_dtype,
                floor=self.floor**2,
            )
            return grad_root, noise_root
        noise_root = inverse_root_newton(
            batch, 4 * k, ridge=self.ridge, eps=self.eps, floor=self.floor**2
        )
        return noise_root @ noise_root, noise_root

    def _root_error(
        self,
        layout: FlatLayout,
        members: list[tuple[int, int, int]],
        factors: list[Tensor],
        what: str,
    ) -> ShampooRootError:
        """The error of a failed refresh, naming the first damaged factor (else the bucket's
        first): its tensor, block and axis, its largest |entry|, and what to change."""
        bad = [j for j, f in enumerate(factors) if not bool(torch.isfinite(f).all())]
        i, g, a = members[bad[0] if bad else 0]
        factor = factors[bad[0] if bad else 0]
        where = f"tensor {layout.names[i]!r}, block {g}, axis {a}"
        state = "holds NaN or Inf" if bad else f"max |entry| {float(factor.abs().max()):.3g}"
        return ShampooRootError(
            f"Shampoo's root refresh failed: {what} for the factor of {where} "
            f"({len(members)} factors of size {factor.shape[-1]} in its bucket; that factor "
            f"{state}). Raise floor (G >= floor·I; now {self.floor:g}) or eps (the ridge's ε), "
            "keep ridge='relative' or 'absolute', or compute the roots in float64 "
            "(root_dtype=torch.float64)"
        )

    # ------------------------------------------------------------------ kernels

    def _pieces(
        self, stacking: _Stacking, layout: FlatLayout, x: Tensor, work: _Work, scatter: bool
    ) -> Iterator[tuple[_Piece, Tensor, Tensor | None]]:
        """Each piece's blocks of ``x`` as ``(piece, blocks, result)``; ``result`` is where the
        caller's matmuls must end for the blocks to reach ``x`` (``None``: used in place). With a
        gather index a piece is a whole bucket (one gather, one scatter); without (CPU, traced) one
        tensor's group, gathered just before and scattered just after (faster on CPU:
        ``docs/performance.md``)."""
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
        """factor ← decay·factor + (1−decay)·X_(axis)X_(axis)ᵀ, batched."""
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
        """Apply ⊗_i R_i to every block of ``x`` in place, one axis at a time (the reference's
        cyclic contraction: each one rotates the block's axes by one, a batched GEMM over a bucket's
        blocks)."""
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
        rows: ``(first row, row count)`` along dim 0 that this rank holds.
        merged: the merged shape of the rows held; ``()`` where G = I or there are no blocks.
        blocks: each block's shape, in the plan's order; ``()`` where G = I or none.
    """

    name: str
    shape: tuple[int, ...]
    rows: tuple[int, int]
    merged: tuple[int, ...]
    blocks: tuple[tuple[int, ...], ...]

    @property
    def factor_numel(self) -> int:
        """Elements of the blocks' factors H_i (each root takes as many)."""
        return sum(s * s for block in self.blocks for s in block)


def _kron_apply(y: Tensor, roots: list[Tensor], scratch: tuple[Tensor, ...], out: Tensor) -> Tensor:
    """(⊗_i R_i) applied to each block of ``y`` into ``out``; contraction ``a`` writes
    ``scratch[a % 2]`` (the last ``out``), so no matmul reads what it writes.
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


class _Work(NamedTuple):
    positions: Tensor | None
    gathered: Tensor
    scratch: Tensor
    result: Tensor | None


@dataclass(frozen=True)
class _Piece:
    """One matmul per axis over a whole bucket (``member`` None, ``position`` -1) or one member's
    group; ``span`` is its part of a work region, ``rows_count`` blocks × chains.
    """

    bucket: Bucket
    number: int
    member: Member | None
    position: int
    span: slice
    rows_count: int


@dataclass(frozen=True)
class _Stacking:
    """A layout's buckets as pieces with a gather index (``stacked``) and without."""

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
        """Statistic ``stat`` of ``piece`` for one axis as one ``(rows, s, s)`` tensor, and
        ``None``, or the views to write it back to where it is a copy (not views of one base, or
        while traced)."""
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
        """Flat index into a ``(*batch, D)`` buffer of every work-region element."""
        flat = torch.arange(self.chains * layout.size, device=device)
        segments = layout.segments(flat.view(self.chains, layout.size))
        pieces = [
            m.group._blocks_first(segments[m.tensor].view(self.chains, *m.merged)).reshape(-1)
            for bucket in self.buckets
            for m in bucket.members
        ]
        return torch.cat(pieces)
