"""Shape merging and blocking of the Shampoo metric (Gupta et al. 2018 §5).

A tensor is reshaped to its *merged* shape (consecutive small dims fused, size-1 dims dropped);
each merged dim larger than ``block_size`` is cut into chunks of ``block_size`` plus a remainder
(``tiling="reference"``) or into the fewest near-equal chunks (``"even"``: 784 → 7 × 112). Blocks
of equal shape form a :class:`BlockGroup`, moved with one view + permute + copy; across tensors,
groups of equal block shape form a :class:`Bucket` (:func:`plan_buckets`).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from torch import Tensor


def merge_small_dims(shape: Sequence[int], max_dim: int) -> tuple[int, ...]:
    """Fuse consecutive dims while their product stays ≤ ``max_dim``; size-1 dims vanish.

    Examples:
        >>> merge_small_dims([16, 16, 3, 3], 128)
        (16, 48, 3)
    """
    merged: list[int] = []
    product = 1
    for d in shape:
        if product * d <= max_dim:
            product *= d
        else:
            if product > 1:
                merged.append(product)
            product = d
    if product > 1:
        merged.append(product)
    return tuple(merged)


def merge_rows(whole: Sequence[int], max_dim: int, rows: int) -> tuple[tuple[int, ...], int]:
    """The merged shape of ``rows`` rows of a tensor of shape ``whole``, with the whole tensor's
    grouping of dims, and the first merged dim's elements per row (0 where dim 0 is 1).

    A shard is merged as its whole tensor is (only the first merged dim shorter), so its merged
    rank, hence G's exponent, is the whole tensor's; ``rows = 0`` gives an empty first dim.

    Examples:
        >>> merge_small_dims((16, 16, 3, 3), 128), merge_rows((16, 16, 3, 3), 128, 8)
        ((16, 48, 3), ((8, 48, 3), 1))
        >>> merge_rows((4, 2, 50), 128, 3)  # dim 0 merged with dim 1: 3 rows of 2
        ((6, 50), 2)
    """
    merged = merge_small_dims(whole, max_dim)
    if not whole or whole[0] <= 1 or not merged:
        # dim 0 is 1 (dropped with its group, or cut into 1 or 0 rows: the whole or nothing)
        return merged, 0
    product = whole[0]  # dim 0's group: the dims after it that join it
    for d in whole[1:]:
        if product * d > max_dim:
            break
        product *= d
    per = product // whole[0]
    return (rows * per, *merged[1:]), per


Tiling = Literal["reference", "even"]
TILINGS: tuple[str, ...] = ("reference", "even")


def _regions(n: int, block_size: int, tiling: Tiling) -> list[tuple[int, int, int]]:
    """A merged dim of size ``n`` as runs ``(start, count, size)`` of equal chunks (≤ 2 runs)."""
    if n == 0:  # an empty shard's first dim
        return []
    if tiling == "reference":
        chunk = min(n, block_size)
        count, rem = divmod(n, chunk)
        return [(0, count, chunk)] + ([(count * chunk, 1, rem)] if rem else [])
    count = -(-n // block_size)  # fewest chunks of ≤ block_size
    small, larger = divmod(n, count)  # first `larger` chunks of small + 1, then of small
    if not larger:
        return [(0, count, small)]
    return [(0, larger, small + 1), (larger * (small + 1), count - larger, small)]


def block_slices(
    merged: Sequence[int], block_size: int, tiling: Tiling = "reference"
) -> list[tuple[slice, ...]]:
    """All blocks of a merged shape as index slices, in row-major product order."""
    per_dim = []
    for n in merged:
        per_dim.append(
            [
                slice(start + j * size, start + (j + 1) * size)
                for start, count, size in _regions(n, block_size, tiling)
                for j in range(count)
            ]
        )
    return list(itertools.product(*per_dim))


@dataclass(frozen=True)
class BlockGroup:
    """Blocks of one shape: per dim, ``counts[i]`` chunks of ``sizes[i]`` from ``starts[i]``."""

    starts: tuple[int, ...]
    counts: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def num_blocks(self) -> int:
        return math.prod(self.counts)

    @property
    def block_numel(self) -> int:
        return math.prod(self.sizes)

    def _blocks_first(self, x: Tensor) -> Tensor:
        """The group's part of ``x`` (``(B, *merged)``) as ``(*counts, B, *sizes)`` (a view)."""
        k = len(self.sizes)
        dims = zip(self.starts, self.counts, self.sizes, strict=True)
        index = (slice(None), *(slice(st, st + c * s) for st, c, s in dims))
        split = [d for cs in zip(self.counts, self.sizes, strict=True) for d in cs]
        region = x[index].view(x.shape[0], *split)
        return region.permute(*range(1, 2 * k, 2), 0, *range(2, 2 * k + 1, 2))

    def gather(self, x: Tensor, out: Tensor) -> Tensor:
        """Copy the group out of ``x`` (``(B, *merged)``) into ``out`` (``(count, B, *sizes)``)."""
        out.view(*self.counts, x.shape[0], *self.sizes).copy_(self._blocks_first(x))
        return out

    def scatter(self, blocks: Tensor, x: Tensor) -> None:
        """Write ``blocks`` (``(count, B, *sizes)`` or any view of it) back into ``x``."""
        self._blocks_first(x).copy_(blocks.reshape(*self.counts, x.shape[0], *self.sizes))


@dataclass(frozen=True)
class BlockPlan:
    """How one parameter tensor is merged (``merged``, of rank k) and blocked (``groups`` by
    shape).
    """

    shape: tuple[int, ...]
    merged: tuple[int, ...]
    groups: tuple[BlockGroup, ...]

    @property
    def rank(self) -> int:
        return len(self.merged)

    @property
    def num_blocks(self) -> int:
        return sum(g.num_blocks for g in self.groups)


@functools.lru_cache(maxsize=1024)
def plan_blocks(
    shape: tuple[int, ...],
    block_size: int,
    tiling: Tiling = "reference",
    whole: tuple[int, ...] | None = None,
    row_splits: tuple[int, ...] | None = None,
) -> BlockPlan:
    """Merge ``shape`` and split it into blocks of at most ``block_size`` per dim.

    ``whole``: the tensor that ``shape`` is rows of (a shard, merged as :func:`merge_rows`);
    ``row_splits``: row counts of consecutive pieces along dim 0, blocked piece by piece so that no
    block crosses a piece (the W shards of one chain in one process).

    Examples:
        >>> plan = plan_blocks((400, 784), 128)
        >>> plan.merged, plan.num_blocks, len(plan.groups)
        ((400, 784), 28, 4)
        >>> even = plan_blocks((400, 784), 128, "even")
        >>> even.num_blocks, [g.sizes for g in even.groups]
        (28, [(100, 112)])
        >>> two = plan_blocks((16, 16, 3, 3), 128, row_splits=(8, 8))  # both shards' blocks
        >>> two.merged, [(g.counts, g.sizes) for g in two.groups]
        ((16, 48, 3), [((2, 1, 1), (8, 48, 3))])
    """
    if whole is None and row_splits is None:
        merged = merge_small_dims(shape, block_size)
        regions_per_dim = [_regions(n, block_size, tiling) for n in merged]
    else:
        whole = tuple(shape) if whole is None else whole
        splits = (shape[0],) if row_splits is None else row_splits
        if not shape or len(whole) != len(shape) or tuple(whole[1:]) != tuple(shape[1:]):
            raise ValueError(f"a shape {shape} is not rows of a tensor of shape {whole}")
        if sum(splits) != shape[0] or any(r < 0 for r in splits):
            raise ValueError(f"row_splits {splits} do not split the {shape[0]} rows of {shape}")
        merged, per = merge_rows(whole, block_size, shape[0])
        regions_per_dim = [_regions(n, block_size, tiling) for n in merged]
        if math.prod(shape) == 0:
            regions_per_dim = [[]]  # an empty shard: no blocks
        elif per:  # the first merged dim blocked piece by piece
            first: list[tuple[int, int, int]] = []
            offset = 0
            for rows in splits:
                for start, count, size in _regions(rows * per, block_size, tiling):
                    last = first[-1] if first else None
                    if last is not None and last[2] == size:  # adjacent equal runs: one group
                        first[-1] = (last[0], last[1] + count, size)
                    else:
                        first.append((offset + start, count, size))
                offset += rows * per
            regions_per_dim[0] = first
    groups = tuple(
        BlockGroup(
            starts=tuple(r[0] for r in combo),
            counts=tuple(r[1] for r in combo),
            sizes=tuple(r[2] for r in combo),
        )
        for combo in itertools.product(*regions_per_dim)
    )
    return BlockPlan(tuple(shape), merged, groups)


@dataclass(frozen=True)
class Member:
    """One tensor's group of blocks inside a :class:`Bucket`: ``index`` is the group's index in the
    tensor's plan, ``start`` the bucket's first block of it, ``whole`` that the tensor is this one
    block (used in place).
    """

    tensor: int
    index: int
    group: BlockGroup
    merged: tuple[int, ...]
    start: int
    whole: bool


@dataclass(frozen=True)
class Bucket:
    """The groups of one block shape across a layout's tensors, block after block."""

    sizes: tuple[int, ...]
    members: tuple[Member, ...]

    @property
    def rank(self) -> int:
        return len(self.sizes)

    @property
    def num_blocks(self) -> int:
        return sum(m.group.num_blocks for m in self.members)

    @property
    def block_numel(self) -> int:
        return math.prod(self.sizes)


def plan_buckets(plans: Sequence[tuple[int, BlockPlan]]) -> tuple[Bucket, ...]:
    """Group the blocks of ``plans`` (``(index, plan)`` pairs) by block shape, in order of first
    block.

    Examples:
        >>> plans = [(0, plan_blocks((400, 784), 128)), (1, plan_blocks((400, 400), 128))]
        >>> [(b.sizes, b.num_blocks, len(b.members)) for b in plan_buckets(plans)][:2]
        [((128, 128), 27, 2), ((128, 16), 6, 2)]
    """
    found: dict[tuple[int, ...], list[Member]] = {}
    for i, plan in plans:
        whole = plan.num_blocks == 1
        for g, group in enumerate(plan.groups):
            members = found.setdefault(group.sizes, [])
            start = sum(m.group.num_blocks for m in members)
            members.append(Member(i, g, group, plan.merged, start, whole))
    return tuple(Bucket(sizes, tuple(members)) for sizes, members in found.items())
