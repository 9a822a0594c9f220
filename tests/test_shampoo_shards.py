"""Shampoo's plan of FSDP2 row shards, without processes: a shard is merged with the whole
tensor's grouping of dims (only the first merged dim cut at its rows), blocked within the
shard, and gets G = I exactly when the whole tensor does; one process with ``row_shards=W``
has the W ranks' blocks and moves as they do together."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import sgrld
from sgrld.core.layout import FlatLayout
from sgrld.core.shards import ShardSpec, rows_of
from sgrld.metrics import ShampooMetric, TensorBlocks
from sgrld.metrics._blocking import merge_rows, plan_blocks


def sharded_layout(shapes: list[tuple[int, ...]], rank: int, world: int) -> FlatLayout:
    """Rank ``rank``'s layout of whole tensors ``shapes`` sharded over ``world`` ranks, as
    :meth:`ShardSpec.of` builds it under FSDP2 (no mesh: Shampoo sums nothing over it)."""
    names = tuple(f"t{i}" for i in range(len(shapes)))
    local, starts, offset = [], [], 0
    for shape in shapes:
        first, count = rows_of(shape[0], world, rank)
        local.append((count, *shape[1:]))
        starts.append(offset + first * math.prod(shape[1:]))
        offset += math.prod(shape)
    spec = ShardSpec(names, tuple(shapes), tuple(starts), rank, world, None, ())
    return FlatLayout(names, tuple(local), (), spec)


def partitions(metric: ShampooMetric, shape: tuple[int, ...], world: int) -> list[TensorBlocks]:
    return [metric.partition(sharded_layout([shape], r, world))[0] for r in range(world)]


def test_a_conv_shard_keeps_the_whole_tensors_merge() -> None:
    """ResNet-20's (16, 16, 3, 3) merges to (16, 48, 3) whole; a shard of 8 or 6 rows to
    (8, 48, 3) or (6, 48, 3), not to (128, 9): 3 factors per rank, each no larger than the
    whole tensor's."""
    metric = ShampooMetric()
    (whole,) = metric.partition(FlatLayout(("w",), ((16, 16, 3, 3),)))
    assert whole.merged == (16, 48, 3) and whole.blocks == ((16, 48, 3),)
    assert whole.factor_numel == 16**2 + 48**2 + 3**2
    expect = {2: [(8, 48, 3)] * 2, 3: [(6, 48, 3), (6, 48, 3), (4, 48, 3)]}
    for world, merged in expect.items():
        ranks = partitions(metric, (16, 16, 3, 3), world)
        assert [t.merged for t in ranks] == merged
        assert [t.blocks for t in ranks] == [(m,) for m in merged]  # one block: 3 factors
        assert [t.rows for t in ranks] == [rows_of(16, world, r) for r in range(world)]
        assert all(t.factor_numel < whole.factor_numel for t in ranks)
        stats = metric.init(sharded_layout([(16, 16, 3, 3)], 0, world), torch.zeros(()))
        factors = {k: tuple(v.shape) for k, v in stats.items() if k.startswith("factor")}
        assert factors == {f"factor_0_{a}@0": (1, s, s) for a, s in enumerate(merged[0])}


def test_an_empty_shard_has_no_blocks_and_no_factors() -> None:
    """(2, 8) over 3 ranks: rows 1, 1, 0. The last rank holds nothing of it, and no factor;
    the others keep the whole tensor's two axes (a 1 × 1 factor for the one row), where
    planning the (1, 8) shard as a tensor of its own would merge it to (8,), G = I."""
    metric = ShampooMetric(block_size=4)
    ranks = partitions(metric, (2, 8), 3)
    assert [t.rows for t in ranks] == [(0, 1), (1, 1), (2, 0)]
    assert [t.merged for t in ranks] == [(1, 8), (1, 8), ()]
    assert [t.blocks for t in ranks] == [((1, 4), (1, 4))] * 2 + [()]
    assert metric.plan((1, 8)) is None  # as a tensor of its own: G = I
    nothing = sharded_layout([(2, 8)], 2, 3)
    assert metric.init(nothing, torch.zeros(())) == {}  # no warning: G = I is the whole
    # tensor's decision, and it has factors on the other ranks; a step changes nothing
    metric.update({}, nothing, torch.zeros(0), step=1)
    metric.refresh({}, nothing)
    assert metric.inverse({}, nothing, torch.zeros(0)).shape == (0,)
    layout = sharded_layout([(2, 8), (6, 5)], 2, 3)  # the other tensor: rows 4:6 of 6
    stats = metric.init(layout, torch.zeros((), dtype=torch.float64))
    assert {k.rsplit("@", 1)[1] for k in stats} == {"1"}
    g = torch.randn(layout.size, dtype=torch.float64)
    metric.update(stats, layout, g, step=1)
    metric.refresh(stats, layout)
    assert metric.inverse(stats, layout, g.clone()).shape == g.shape


def test_a_2d_weight_is_cut_along_rows_then_blocked_within_the_shard() -> None:
    """(400, 784), block 128, W = 2: each shard (200, 784) blocked 128 + 72 by 6 × 128 + 16,
    14 blocks per rank where the whole tensor has 28 in 4 × 7; with the even tiling 2 × 100
    by 7 × 112."""
    ranks = partitions(ShampooMetric(), (400, 784), 2)
    assert [t.merged for t in ranks] == [(200, 784)] * 2
    for t in ranks:
        assert len(t.blocks) == 14
        assert sorted(set(t.blocks)) == [(72, 16), (72, 128), (128, 16), (128, 128)]
    even = partitions(ShampooMetric(tiling="even"), (400, 784), 2)
    assert all(t.blocks == ((100, 112),) * 14 for t in even)


def test_a_first_merged_dim_of_several_dims_is_the_rows_times_the_rest() -> None:
    """(4, 2, 50) merges to (8, 50): dims 0 and 1 form the first merged dim. Over 3 ranks
    (rows 2, 2, 0) the shards are (4, 50), (4, 50) and empty."""
    assert merge_rows((4, 2, 50), 128, 2) == ((4, 50), 2)
    ranks = partitions(ShampooMetric(), (4, 2, 50), 3)
    assert [t.merged for t in ranks] == [(4, 50), (4, 50), ()]
    assert [t.blocks for t in ranks] == [((4, 50),), ((4, 50),), ()]


def test_g_is_the_identity_for_a_shard_exactly_when_for_its_whole_tensor() -> None:
    """Biases (rank 1) get G = I on every rank, also with precondition_vectors off; with it on,
    every non-empty shard of a vector gets a factor. A tensor whose dims all merge into one
    (here (8, 5) with block 40) is a vector whole and in every shard."""
    for shape, block in (((16,), 128), ((8, 5), 40), ((16, 1, 1, 1), 128)):
        assert all(not t.blocks for t in partitions(ShampooMetric(block_size=block), shape, 3))
    vectors = partitions(ShampooMetric(precondition_vectors=True), (16,), 3)
    assert [t.blocks for t in vectors] == [((6,),), ((6,),), ((4,),)]


def test_plans_of_shards_are_validated() -> None:
    with pytest.raises(ValueError, match="row_splits"):
        plan_blocks((4, 5), 4, row_splits=(3, 2))
    with pytest.raises(ValueError, match="not rows of"):
        plan_blocks((4, 5), 4, whole=(8, 6))
    layout = sharded_layout([(4, 5)], 0, 2)
    with pytest.raises(ValueError, match="row_shards=3 on parameters sharded over 2"):
        ShampooMetric(block_size=4, row_shards=3).init(layout, torch.zeros(()))
    with pytest.raises(ValueError, match="row_shards"):
        ShampooMetric(row_shards=0)
    same = ShampooMetric(block_size=4, row_shards=2).partition(layout)
    assert same == ShampooMetric(block_size=4).partition(layout) and same[0].blocks


SHAPES = [(16, 16, 3, 3), (10, 7), (2, 8), (5,), (4, 2, 3), (1, 6)]


@pytest.mark.parametrize("indexed", [False, True])
@pytest.mark.parametrize("world", [2, 3])
def test_one_process_with_row_shards_is_the_ranks_together(
    world: int, indexed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The blocks of ``row_shards=W`` on one process are the W ranks' blocks, and three steps
    of update, refresh and G⁻¹g on the whole flat gradient equal each rank's on its rows (the
    same numbers: every block sees the same rows of the same gradient). ``indexed``: the
    accelerator's path (all buckets gathered by one index), forced on CPU."""
    if indexed:

        def index(self: ShampooMetric, stacking: Any, lay: FlatLayout, x: torch.Tensor) -> Any:
            return stacking.positions(lay, x.device)

        monkeypatch.setattr(ShampooMetric, "_index", index)
    metric = ShampooMetric(block_size=4, update_interval=1, precondition_vectors=True)
    alone = ShampooMetric(block_size=4, update_interval=1, precondition_vectors=True,
                          row_shards=world)  # fmt: skip
    whole = FlatLayout(tuple(f"t{i}" for i in range(len(SHAPES))), tuple(SHAPES))
    ranks = [sharded_layout(SHAPES, r, world) for r in range(world)]
    for i, t in enumerate(alone.partition(whole)):
        per_rank = [metric.partition(lay)[i].blocks for lay in ranks]
        assert sorted(t.blocks) == sorted(b for blocks in per_rank for b in blocks), SHAPES[i]
    torch.manual_seed(0)
    grads = [torch.randn(whole.size, dtype=torch.float64) for _ in range(3)]
    stats = alone.init(whole, grads[0])
    assert (alone._work(alone._stacking(whole), whole, grads[0]).positions is not None) == indexed
    states = [metric.init(lay, grads[0]) for lay in ranks]

    def rows(flat: torch.Tensor, lay: FlatLayout) -> torch.Tensor:
        assert lay.shards is not None
        parts = flat.split(whole.numels)
        return torch.cat(
            [p[s - o : s - o + n] for p, s, o, n in
             zip(parts, lay.shards.starts, whole.offsets, lay.numels, strict=True)]
        )  # fmt: skip

    for step, g in enumerate(grads, 1):
        alone.update(stats, whole, g, step)
        alone.refresh(stats, whole)
        got = alone.inverse(stats, whole, g.clone())
        for lay, st in zip(ranks, states, strict=True):
            metric.update(st, lay, rows(g, lay), step)
            metric.refresh(st, lay)
            mine = metric.inverse(st, lay, rows(g, lay).clone())
            torch.testing.assert_close(mine, rows(got, lay), rtol=1e-12, atol=0)


def test_the_optimizer_reports_the_partition_by_name() -> None:
    model = torch.nn.Sequential(torch.nn.Conv2d(16, 16, 3), torch.nn.Linear(200, 2))
    opt = sgrld.ShampooSGLD(model.named_parameters(), lr=0.1, num_data=10, row_shards=2)
    report = opt.partition()
    assert list(report) == [n for n, _ in model.named_parameters()]
    conv = report["0.weight"]
    assert conv.shape == (16, 16, 3, 3) and conv.rows == (0, 16)
    assert conv.merged == (16, 48, 3) and conv.blocks == ((8, 48, 3), (8, 48, 3))
    assert report["0.bias"].blocks == () and report["1.weight"].merged == (2, 200)
    assert report["1.weight"].blocks == ((1, 128), (1, 128), (1, 72), (1, 72))
