"""Maths owned by the Shampoo metric: merge/block rules, dense oracles, refresh schedule, roots.

The dense oracle (:func:`metric_cases.shampoo_dense`, also Shampoo's case of the generic oracle
tests) rebuilds G⁻¹ and G^{-1/2} from the gradient history with NumPy in float64 and its own
row-major blocking: every factor is an EMA from ε·I, every block's operator is ⊗_i (H_i + rI)^{−e},
scattered at the block's flat indices.
"""

from __future__ import annotations

import copy
import itertools
import math
import pickle

import numpy as np
import pytest
import torch

import sgrld
from metric_cases import row_major_blocks, shampoo_dense
from sgrld.core.contract import Metric, Stats
from sgrld.core.engine import refresh_due
from sgrld.core.layout import FlatLayout
from sgrld.metrics._blocking import block_slices, merge_small_dims, plan_blocks, plan_buckets
from sgrld.metrics._linalg import inverse_root_newton, inverse_roots_eigh, power_iteration
from sgrld.metrics.shampoo import ShampooMetric, ShampooRootError

# ----------------------------------------------------------------------------- oracle


def update_metric(
    metric: Metric, stats: Stats, layout: FlatLayout, grad: torch.Tensor, t: int
) -> None:
    """``metric.update`` then, when due at step ``t``, the scheduled refresh, as the engine's
    step calls them."""
    metric.update(stats, layout, grad, t)
    if refresh_due(metric, t):
        metric.refresh(stats, layout)


def dense_apply(metric: ShampooMetric, stats: dict, layout: FlatLayout, sqrt: bool) -> np.ndarray:
    """The metric's operator as a dense matrix.

    All D basis vectors are pushed through in one call, as D chains that share the statistics;
    a random vector through the single-chain path must agree with it.
    """
    d = layout.size
    dtype = next(iter(stats.values())).dtype
    chains = FlatLayout(layout.names, layout.shapes, (d,))
    shared = {k: v.expand(d, *v.shape).contiguous() for k, v in stats.items()}
    fn = metric.inverse_sqrt if sqrt else metric.inverse
    dense = fn(shared, chains, torch.eye(d, dtype=dtype)).mT.double().numpy()
    v = torch.randn(d, dtype=dtype, generator=torch.Generator().manual_seed(d))
    single = fn(stats, layout, v.clone()).double().numpy()
    np.testing.assert_allclose(single, dense @ v.double().numpy(), rtol=1e-5, atol=1e-6)
    return dense


def run(
    metric: ShampooMetric,
    layout: FlatLayout,
    grads: list[torch.Tensor],
    stats: dict | None = None,
    first_step: int = 1,
) -> dict:
    """Feed ``grads`` to ``update`` at steps first_step, first_step+1, ..."""
    if stats is None:
        stats = metric.init(layout, grads[0])
    for t, g in enumerate(grads, start=first_step):
        update_metric(metric, stats, layout, g.clone(), t)
    return stats


def random_grads(layout: FlatLayout, steps: int, dtype: torch.dtype, seed: int = 0) -> list:
    gen = torch.Generator().manual_seed(seed)
    # Non-isotropic per coordinate, so the factors are far from multiples of I.
    scale = torch.rand(layout.size, generator=gen, dtype=torch.float64) * 2 + 0.1
    shape = (*layout.batch_shape, layout.size)
    return [
        torch.randn(shape, generator=gen, dtype=torch.float64).mul_(scale).to(dtype)
        for _ in range(steps)
    ]


SMALL = [(5, 3), (4, 3, 2), (3, 130), (7,), ()]  # blocked with block_size=4, rank 1..3


def _layout(shapes: list[tuple[int, ...]], chains: int | None = None) -> FlatLayout:
    names = tuple(f"p{i}" for i in range(len(shapes)))
    return FlatLayout(names, tuple(shapes), () if chains is None else (chains,))


# ----------------------------------------------------------------------------- merge / block


MNIST_BLOCKS = {400: (28, 16, 4), 800: (49, 49, 7), 1200: (70, 100, 10)}


@pytest.mark.parametrize("width", sorted(MNIST_BLOCKS))
def test_mnist_block_counts(width: int) -> None:
    shapes = [(width, 784), (width, width), (10, width)]
    for shape, expected in zip(shapes, MNIST_BLOCKS[width], strict=True):
        plan = plan_blocks(shape, 128)
        assert plan.merged == shape
        assert plan.num_blocks == expected == len(block_slices(plan.merged, 128))


def test_mnist_w1_chunks() -> None:
    """W1 of N = 400: chunks 128, 128, 128, 16 by 6 × 128, 16."""
    blocks = block_slices((400, 784), 128)
    assert [b[0].stop - b[0].start for b in blocks[::7]] == [128, 128, 128, 16]
    assert [b[1].stop - b[1].start for b in blocks[:7]] == [128] * 6 + [16]


@pytest.mark.parametrize(
    ("shape", "merged"),
    [
        ((16, 3, 3, 3), (48, 9)),
        ((16, 16, 3, 3), (16, 48, 3)),
        ((32, 16, 3, 3), (32, 48, 3)),
        ((32, 32, 3, 3), (32, 96, 3)),
        ((64, 32, 3, 3), (64, 96, 3)),
        ((64, 64, 3, 3), (64, 64, 9)),
        ((32, 16, 1, 1), (32, 16)),
        ((64, 32, 1, 1), (64, 32)),
        ((10, 64), (10, 64)),
    ],
)
def test_resnet_merging(shape: tuple[int, ...], merged: tuple[int, ...]) -> None:
    plan = plan_blocks(shape, 128)
    assert plan.merged == merged and plan.num_blocks == 1 and len(plan.groups) == 1


def test_small_dims_vanish_and_vectors() -> None:
    assert merge_small_dims((1, 1), 128) == () and merge_small_dims((), 128) == ()
    assert merge_small_dims((1, 5, 1), 128) == (5,)
    metric = ShampooMetric()
    assert metric.plan((16,)) is None and metric.plan((16, 1, 1, 1)) is None  # BN, biases
    assert metric.plan(()) is None
    vec = ShampooMetric(precondition_vectors=True)
    assert vec.plan((2,)) is not None and vec.plan(()) is None


def test_groups_tile_the_tensor_in_row_major_block_order() -> None:
    plan = plan_blocks((3, 130), 4)
    x = torch.arange(3 * 130.0).reshape(1, 3, 130)  # distinct values: a block is its first value
    expected = {x[(0, *s)][0, 0].item(): x[(0, *s)] for s in block_slices(plan.merged, 4)}
    assert plan.num_blocks == len(expected) == 33 and len(plan.groups) == 2
    gathered = {}
    y = torch.zeros_like(x)
    for group in plan.groups:
        blocks = group.gather(x, torch.empty(1, group.num_blocks, *group.sizes))[0]
        # Within a group, blocks come in row-major chunk order.
        firsts = [blocks[j].flatten()[0].item() for j in range(group.num_blocks)]
        assert firsts == sorted(firsts)
        gathered |= {b.flatten()[0].item(): b for b in blocks}
        group.scatter(blocks, y)
    assert gathered.keys() == expected.keys()
    assert all(torch.equal(gathered[k], expected[k]) for k in expected)
    assert torch.equal(y, x)  # the groups tile the tensor


# ----------------------------------------------------------------------------- dense oracle


@pytest.mark.parametrize(
    ("ridge", "tiling", "block_size"),
    [
        ("relative", "reference", 4),
        ("absolute", "reference", 4),
        ("none", "reference", 4),
        ("relative", "even", 4),
        ("relative", "even", 5),
    ],
)
def test_dense_oracle_blocked(ridge: str, tiling: str, block_size: int) -> None:
    metric = ShampooMetric(
        decay=0.8,
        eps=1e-3,
        block_size=block_size,
        update_interval=3,
        precondition_vectors=True,
        ridge=ridge,  # type: ignore[arg-type]
        tiling=tiling,  # type: ignore[arg-type]
    )
    layout = _layout(SMALL)
    grads = random_grads(layout, 3, torch.float64, seed=block_size)
    stats = run(metric, layout, grads)
    ginv, ginv_sqrt = shampoo_dense(metric, list(layout.shapes), [g.numpy() for g in grads])
    got_inv = dense_apply(metric, stats, layout, sqrt=False)
    got_sqrt = dense_apply(metric, stats, layout, sqrt=True)
    np.testing.assert_allclose(got_inv, ginv, rtol=1e-9, atol=1e-9 * np.abs(ginv).max())
    np.testing.assert_allclose(got_sqrt, ginv_sqrt, rtol=1e-9, atol=1e-9 * np.abs(ginv_sqrt).max())
    # (G^{-1/2})² = G⁻¹, and both are symmetric.
    np.testing.assert_allclose(got_sqrt @ got_sqrt, got_inv, atol=1e-9 * np.abs(ginv).max())
    np.testing.assert_allclose(got_inv, got_inv.T, atol=1e-9 * np.abs(ginv).max())


@pytest.mark.parametrize(
    ("n", "b", "sizes"),
    # 130 = 33 chunks of ≤ 4: 31 of 4, then 2 of 3 (the larger first, as numpy.array_split)
    [(784, 128, [112] * 7), (400, 128, [100] * 4), (130, 4, [4] * 31 + [3] * 2), (10, 128, [10])],
)
def test_even_tiling_sizes(n: int, b: int, sizes: list[int]) -> None:
    got = [s[0].stop - s[0].start for s in block_slices((n,), b, "even")]
    assert got == sizes and sum(got) == n
    assert [g.sizes for g in plan_blocks((n,), b, "even").groups] == sorted(
        {(s,) for s in sizes}, reverse=True
    )
    assert plan_blocks((400, 784), 128, "even").num_blocks == 28
    assert len(plan_blocks((400, 784), 128, "even").groups) == 1


def test_dense_oracle_default_blocking_vectors_unpreconditioned() -> None:
    metric = ShampooMetric(decay=0.9, eps=1e-4, update_interval=2)
    # Under block 128, (20, 10) and (2, 65, 2) keep rank 2 and 3; (5, 3) merges to (15,).
    shapes = [(20, 10), (2, 1, 65, 2), (6,), (1, 5), (5, 3)]
    layout = _layout(shapes)
    grads = random_grads(layout, 4, torch.float64, seed=1)
    stats = run(metric, layout, grads)
    ginv, ginv_sqrt = shampoo_dense(metric, shapes, [g.numpy() for g in grads])
    np.testing.assert_allclose(
        dense_apply(metric, stats, layout, False), ginv, rtol=1e-9, atol=1e-12
    )
    np.testing.assert_allclose(
        dense_apply(metric, stats, layout, True), ginv_sqrt, rtol=1e-9, atol=1e-12
    )
    # The merged rank-1 tensors (6,), (1, 5) and (5, 3) keep G = I exactly.
    assert [k for k in stats if k.startswith("factor")] == [
        "factor_0_0@0",
        "factor_0_1@0",
        "factor_0_0@1",
        "factor_0_1@1",
        "factor_0_2@1",
    ]
    np.testing.assert_array_equal(dense_apply(metric, stats, layout, False)[-26:, -26:], np.eye(26))


def test_funnel_full_matrix_rmsprop() -> None:
    """Reference §5.3: 2-vector, H ← λH + (1−λ)ggᵀ from εI, G⁻¹ = H^{−1/2}, G^{-1/2} = H^{−1/4}."""
    metric = ShampooMetric(
        decay=0.9995, eps=1e-6, update_interval=1, precondition_vectors=True, ridge="none",
        floor=0.0,
    )  # fmt: skip
    layout = _layout([(2,)])
    stats = metric.init(layout, torch.zeros(2, dtype=torch.float64))
    h = 1e-6 * np.eye(2)
    gen = torch.Generator().manual_seed(3)
    for t in range(1, 6):
        g = torch.randn(2, generator=gen, dtype=torch.float64) * torch.tensor([1.0, 5.0])
        update_metric(metric, stats, layout, g.clone(), t)
        h = 0.9995 * h + 0.0005 * np.outer(g.numpy(), g.numpy())
        w, q = np.linalg.eigh(h)
        np.testing.assert_allclose(
            metric.inverse(stats, layout, g.clone()).numpy(), (q * w**-0.5) @ q.T @ g.numpy()
        )
        np.testing.assert_allclose(
            metric.inverse_sqrt(stats, layout, g.clone()).numpy(), (q * w**-0.25) @ q.T @ g.numpy()
        )


# ----------------------------------------------------------------------------- schedule


def test_identity_until_first_refresh_then_every_interval() -> None:
    metric = ShampooMetric(decay=0.8, eps=1e-3, block_size=4, update_interval=3)
    layout = _layout(SMALL)
    grads = random_grads(layout, 7, torch.float64)
    stats = metric.init(layout, grads[0])
    v = torch.randn(layout.size, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    results = {}
    for t, g in enumerate(grads, start=1):
        update_metric(metric, stats, layout, g.clone(), t)
        results[t] = (
            metric.inverse(stats, layout, v.clone()),
            metric.inverse_sqrt(stats, layout, v.clone()),
        )
    for t in (1, 2):
        assert torch.equal(results[t][0], v) and torch.equal(results[t][1], v)
    for t in (4, 5):
        assert torch.equal(results[t][0], results[3][0]) and torch.equal(
            results[t][1], results[3][1]
        )
    assert not torch.allclose(results[3][0], v)
    assert not torch.allclose(results[6][0], results[3][0])
    assert torch.equal(results[7][0], results[6][0])
    # Step 6 uses the statistics of steps 1..6.
    ginv, _ = shampoo_dense(metric, list(layout.shapes), [g.numpy() for g in grads[:6]])
    np.testing.assert_allclose(results[6][0].numpy(), ginv @ v.numpy(), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("root_method", ["eigh", "newton"])
def test_refresh_leaves_statistics_and_global_rng_untouched(root_method: str) -> None:
    kw = {"decay": 0.9, "eps": 1e-3, "block_size": 4, "root_method": root_method}
    layout = _layout(SMALL[:3])
    grads = random_grads(layout, 4, torch.float32)
    with_refresh = run(ShampooMetric(update_interval=2, **kw), layout, grads[:1])
    without = run(ShampooMetric(update_interval=1000, **kw), layout, grads[:1])
    rng = torch.random.get_rng_state()
    run(ShampooMetric(update_interval=2, **kw), layout, grads[1:], with_refresh, first_step=2)
    run(ShampooMetric(update_interval=1000, **kw), layout, grads[1:], without, first_step=2)
    assert torch.equal(torch.random.get_rng_state(), rng)
    factors = [k for k in with_refresh if k.startswith("factor")]
    assert factors and all(torch.equal(with_refresh[k], without[k]) for k in factors)
    roots = [k for k in with_refresh if k.startswith("grad_root")]
    assert any(not torch.equal(with_refresh[k], without[k]) for k in roots)


def test_resume_from_cloned_stats_is_bit_identical() -> None:
    metric = ShampooMetric(decay=0.9, eps=1e-3, block_size=4, update_interval=2)
    layout = _layout(SMALL)
    grads = random_grads(layout, 6, torch.float32)
    stats = run(metric, layout, grads[:3])
    saved = {k: v.clone() for k, v in stats.items()}
    run(metric, layout, grads[3:], stats, first_step=4)
    fresh = copy.deepcopy(metric)  # new work buffers
    run(fresh, layout, grads[3:], saved, first_step=4)
    assert stats.keys() == saved.keys()
    assert all(torch.equal(stats[k], saved[k]) for k in stats)


# ----------------------------------------------------------------------------- chains, dtypes


def test_chains_equal_separate_runs() -> None:
    metric = ShampooMetric(
        decay=0.8, eps=1e-3, block_size=4, update_interval=2, precondition_vectors=True
    )
    chains = 3
    batched = _layout(SMALL, chains)
    single = _layout(SMALL)
    grads = random_grads(batched, 4, torch.float64)
    stats = run(metric, batched, grads)
    v = torch.randn(chains, single.size, dtype=torch.float64)
    got_inv = metric.inverse(stats, batched, v.clone())
    got_sqrt = metric.inverse_sqrt(stats, batched, v.clone())
    for c in range(chains):
        s = run(metric, single, [g[c] for g in grads])
        torch.testing.assert_close(
            got_inv[c], metric.inverse(s, single, v[c].clone()), rtol=1e-12, atol=0
        )
        torch.testing.assert_close(
            got_sqrt[c], metric.inverse_sqrt(s, single, v[c].clone()), rtol=1e-12, atol=0
        )


def test_float32_matches_float64() -> None:
    kw = {
        "decay": 0.8,
        "eps": 1e-3,
        "block_size": 4,
        "update_interval": 3,
        "precondition_vectors": True,
    }
    metric = ShampooMetric(**kw)
    layout = _layout(SMALL)
    grads = random_grads(layout, 3, torch.float32)
    stats32 = run(metric, layout, grads)
    stats64 = run(metric, layout, [g.double() for g in grads])
    assert all(v.dtype == torch.float32 for v in stats32.values())
    v = torch.randn(layout.size, generator=torch.Generator().manual_seed(1))
    for fn in ("inverse", "inverse_sqrt"):
        out32 = getattr(metric, fn)(stats32, layout, v.clone())
        out64 = getattr(metric, fn)(stats64, layout, v.double())
        assert out32.dtype == torch.float32
        torch.testing.assert_close(
            out32.double(), out64, rtol=1e-4, atol=1e-4 * out64.abs().max().item()
        )


# ----------------------------------------------------------------------------- roots


def _well_conditioned(n: int, dtype: torch.dtype, batch: int = 3) -> torch.Tensor:
    gen = torch.Generator().manual_seed(5)
    q, _ = torch.linalg.qr(torch.randn(batch, n, n, generator=gen, dtype=torch.float64))
    w = torch.linspace(0.5, 20.0, n, dtype=torch.float64)
    return ((q * w) @ q.mT).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("p", [4, 8, 12])
def test_newton_matches_eigh(dtype: torch.dtype, p: int) -> None:
    mat = _well_conditioned(24, dtype)
    before = mat.clone()
    (exact,) = inverse_roots_eigh(mat, (1.0 / p,))
    newton = inverse_root_newton(mat, p)
    assert torch.equal(mat, before)  # no in-place ridge
    err = torch.linalg.matrix_norm(newton.double() - exact) / torch.linalg.matrix_norm(exact)
    assert err.max() < 1e-4


def test_metric_newton_matches_eigh() -> None:
    kw = {"decay": 0.8, "eps": 1e-3, "block_size": 4, "update_interval": 3, "ridge": "absolute"}
    kw["floor"] = 0.0  # Newton raises its ridge to floor², eigh its eigenvalues: not one metric
    layout = _layout(SMALL[:3])
    grads = random_grads(layout, 3, torch.float64)
    v = torch.randn(layout.size, dtype=torch.float64)
    outs = {}
    for method in ("eigh", "newton"):
        metric = ShampooMetric(root_method=method, **kw)
        stats = run(metric, layout, grads)
        outs[method] = metric.inverse_sqrt(stats, layout, v.clone())
    torch.testing.assert_close(outs["newton"], outs["eigh"], rtol=1e-4, atol=1e-6)


def test_eigh_roots_and_ridge() -> None:
    mat = _well_conditioned(6, torch.float64, batch=2)
    grad_root, noise_root = inverse_roots_eigh(mat, (0.25, 0.125), ridge="relative", eps=1e-2)
    ridged = mat + 1e-2 * torch.linalg.eigvalsh(mat)[..., -1:, None] * torch.eye(6)
    torch.testing.assert_close(noise_root @ noise_root, grad_root)
    x = grad_root
    for _ in range(3):
        x = x @ grad_root
    torch.testing.assert_close(x @ ridged, torch.eye(6, dtype=torch.float64).expand(2, 6, 6))
    # A zero matrix (no ridge possible) gives the identity instead of inf.
    (zero_root,) = inverse_roots_eigh(torch.zeros(1, 3, 3), (0.5,), ridge="none")
    assert torch.equal(zero_root, torch.eye(3, dtype=torch.float64)[None])


@pytest.mark.parametrize("ridge", ["relative", "absolute", "none"])
def test_closed_form_2x2_roots_match_eigh(ridge: str) -> None:
    """The 2 × 2 closed form (funnel factors) against the general eigh path, edge cases included.

    Both are backward stable, so they may differ by rounding amplified by the conditioning:
    a relative change ≈ 1e-16·κ of the smallest ridged eigenvalue, κ = (λ₁ + r)/(λ₂ + r), moves
    the largest root entry by about e·1e-16·κ. The tolerance is 1e-13·κ, floor 1e-12.
    """
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(200, 2, 3, generator=gen, dtype=torch.float64)
    scale = torch.logspace(-6, 6, 200, dtype=torch.float64)[:, None, None]
    mats = [
        scale * (x @ x.mT),  # generic, 12 decades of scale
        torch.tensor(
            [[[3.0, 0.0], [0.0, 3.0]], [[2.0, 0.0], [0.0, 5.0]], [[5.0, 0.0], [0.0, 2.0]]]
        ),
        torch.tensor([[[1.0, 1e-9], [1e-9, 1.0 + 1e-12]]]),  # nearly degenerate
        torch.tensor([[[4.0, -2.0], [-2.0, 3.0]]]),  # negative off-diagonal
    ]
    if ridge != "none":  # singular matrices have a root only with a ridge
        mats += [scale * x[:, :, :1] @ x[:, :, :1].mT, torch.zeros(1, 2, 2)]
    for mat in mats:
        mat = mat.double()
        closed = inverse_roots_eigh(mat, (0.5, 0.25), ridge=ridge, eps=1e-6)  # type: ignore[arg-type]
        evals, evecs = torch.linalg.eigh(mat)
        evals = evals.clamp(min=0.0)
        evals = evals + {"relative": 1e-6 * evals[..., -1:], "absolute": 1e-6, "none": 0.0}[ridge]
        safe = torch.where(evals > 0, evals, torch.ones_like(evals))
        kappa = safe[..., -1] / safe[..., 0]
        for e, got in zip((0.5, 0.25), closed, strict=True):
            want = (evecs * safe.pow(-e).unsqueeze(-2)) @ evecs.mT
            size = want.abs().amax(dim=(-2, -1))
            err = (got - want).abs().amax(dim=(-2, -1)) / size
            assert bool((err <= torch.clamp(1e-13 * kappa, min=1e-12)).all()), float(err.max())
        assert all(r.dtype == torch.float64 and r.shape == mat.shape for r in closed)


def test_power_iteration() -> None:
    mat = _well_conditioned(10, torch.float64)
    torch.testing.assert_close(
        power_iteration(mat, tol=1e-12, max_iter=1000), torch.full((3,), 20.0, dtype=torch.float64)
    )


# ----------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    ("kw", "name"),
    [
        ({"decay": 1.0}, "decay"),
        ({"decay": -0.1}, "decay"),
        ({"eps": -1.0}, "eps"),
        ({"block_size": 0}, "block_size"),
        ({"block_size": 4.0}, "block_size"),
        ({"update_interval": 0}, "update_interval"),
        ({"update_interval": True}, "update_interval"),
        ({"root_method": "svd"}, "root_method"),
        ({"ridge": "big"}, "ridge"),
        ({"tiling": "odd"}, "tiling"),
    ],
)
def test_invalid_arguments(kw: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        ShampooMetric(**kw)


# ----------------------------------------------------------------------------- batched refresh


def test_batched_refresh_equals_the_per_factor_refresh() -> None:
    """One eigh per (size, rank) bucket across tensors = each factor on its own (float64)."""
    metric = ShampooMetric(decay=0.9, eps=1e-4, block_size=4, update_interval=1000)
    layout = _layout([*SMALL, (6, 4), (8, 4)], chains=2)
    stats = run(metric, layout, random_grads(layout, 5, torch.float64))
    metric.compute_roots(stats, layout)
    checked = 0
    for key, factor in stats.items():
        if not key.startswith("factor"):
            continue
        _, index = key.rsplit("@", 1)
        plan = metric.plan(layout.shapes[int(index)])
        assert plan is not None
        s = factor.shape[-1]
        expected = inverse_roots_eigh(
            factor.reshape(-1, s, s),
            (1 / (2 * plan.rank), 1 / (4 * plan.rank)),
            eps=1e-4,
            floor=metric.floor**2,
        )
        for name, want in zip(("grad_root", "noise_root"), expected, strict=True):
            got = stats[key.replace("factor", name)].reshape(-1, s, s)
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
            checked += 1
    assert checked > 10


def test_a_failing_float32_decomposition_is_retried_in_float64(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    layout = _layout([(6, 5), (5, 4)])
    grads = random_grads(layout, 3, torch.float64)
    reference = ShampooMetric(eps=1e-4, block_size=8, update_interval=1000)
    fast = ShampooMetric(eps=1e-4, block_size=8, update_interval=1000, root_dtype=torch.float32)
    a, b = run(reference, layout, grads), run(fast, layout, grads)
    eigh = torch.linalg.eigh
    calls: list[torch.dtype] = []

    def flaky(mat: torch.Tensor) -> object:
        calls.append(mat.dtype)
        if mat.dtype == torch.float32:
            raise torch.linalg.LinAlgError("eigh: did not converge (injected)")
        return eigh(mat)

    monkeypatch.setattr(torch.linalg, "eigh", flaky)
    reference.compute_roots(a, layout)
    fast.compute_roots(b, layout)
    assert torch.float32 in calls and torch.float64 in calls
    for key in a:
        assert torch.equal(a[key], b[key]), key
    with pytest.raises(ValueError, match="root_dtype"):
        ShampooMetric(root_dtype=torch.float16)


# ----------------------------------------------------------------------------- buckets

# An MLP 36-20-20-10 (blocks of 8: 128×128-like full blocks shared by W1 and W2, remainders) and
# a ResNet-20-like stack (equal convs, a 1×1 shortcut, BN vectors, the classifier).
MLP = [(20, 36), (20,), (20, 20), (20,), (10, 20), (10,)]
RESNET = [
    (16, 3, 3, 3),
    (16,),
    (16,),
    *[(16, 16, 3, 3), (16,), (16,)] * 3,
    (32, 16, 3, 3),
    (32, 32, 3, 3),
    (32, 32, 3, 3),
    (32, 16, 1, 1),
    (32,),
    (10, 32),
    (10,),
]


def test_buckets_group_equal_blocks_across_tensors() -> None:
    """MLP 784-400-400-10: the 10 groups of W1, W2 and W3 in 6 buckets, members in tensor order,
    each member's blocks right after the previous member's."""
    plans = [(i, plan_blocks(s, 128)) for i, s in enumerate([(400, 784), (400, 400), (10, 400)])]
    buckets = plan_buckets(plans)
    assert [b.sizes for b in buckets] == [
        (128, 128),
        (128, 16),
        (16, 128),
        (16, 16),
        (10, 128),
        (10, 16),
    ]
    assert [b.num_blocks for b in buckets] == [27, 6, 9, 2, 3, 1]
    for bucket in buckets:
        starts = [m.start for m in bucket.members]
        sizes = [m.group.num_blocks for m in bucket.members]
        assert starts == [sum(sizes[:j]) for j in range(len(sizes))]
        assert [m.tensor for m in bucket.members] == sorted(m.tensor for m in bucket.members)
        assert not any(m.whole for m in bucket.members)
    convs = [(i, plan_blocks((16, 16, 3, 3), 128)) for i in range(3)]
    (bucket,) = plan_buckets(convs)
    assert bucket.sizes == (16, 48, 3) and all(m.whole for m in bucket.members)


def _oracle_blocks(shape: tuple[int, ...], metric: ShampooMetric) -> list[tuple[int, int, list]]:
    """Per block of a tensor, in row-major order: (its group, its index in the group, ranges).

    A tensor's groups are its distinct block shapes, numbered in order of first appearance."""
    merged = merge_small_dims(shape, metric.block_size)
    order: dict[tuple[int, ...], int] = {}
    out = []
    for ranges in row_major_blocks(merged, metric.block_size, metric.tiling):
        sizes = tuple(len(r) for r in ranges)
        g = order.setdefault(sizes, len(order))
        out.append((g, sum(1 for gg, _, _ in out if gg == g), ranges))
    return out


def per_tensor_oracle(
    metric: ShampooMetric, layout: FlatLayout, grads: list[torch.Tensor]
) -> dict[str, np.ndarray]:
    """Each block's factors, one tensor, block, chain and axis at a time (float64 NumPy)."""
    chains = math.prod(layout.batch_shape)
    factors: dict[str, np.ndarray] = {}
    for i, (shape, offset) in enumerate(zip(layout.shapes, layout.offsets, strict=True)):
        if metric.plan(shape) is None:
            continue
        merged = merge_small_dims(shape, metric.block_size)
        numel = math.prod(shape)
        for g, j, ranges in _oracle_blocks(shape, metric):
            for c in range(chains):
                hs = [metric.eps * np.eye(len(r)) for r in ranges]
                for grad in grads:
                    flat = grad.reshape(chains, -1)[c].numpy()
                    x = flat[offset : offset + numel].reshape(merged)[np.ix_(*ranges)]
                    for a in range(len(ranges)):
                        xa = np.moveaxis(x, a, 0).reshape(len(ranges[a]), -1)
                        hs[a] = metric.decay * hs[a] + (1 - metric.decay) * xa @ xa.T
                for a, h in enumerate(hs):
                    factors[f"factor_{g}_{a}@{i}/{c}/{j}"] = h
    return factors


def per_tensor_apply(
    metric: ShampooMetric, layout: FlatLayout, stats: dict, v: torch.Tensor, root: str
) -> np.ndarray:
    """⊗_a R_a applied block by block with einsum, R_a read from ``stats`` (contracting R's
    first index, as the cyclic matmuls do); tensors without a plan are left as they are."""
    chains = math.prod(layout.batch_shape)
    out = v.reshape(chains, -1).numpy().copy()
    letters = "abcdefgh"
    for i, (shape, offset) in enumerate(zip(layout.shapes, layout.offsets, strict=True)):
        if metric.plan(shape) is None:
            continue
        merged = merge_small_dims(shape, metric.block_size)
        numel = math.prod(shape)
        for c in range(chains):
            src = out[c, offset : offset + numel].reshape(merged).copy()
            dst = out[c, offset : offset + numel].reshape(merged)
            for g, j, ranges in _oracle_blocks(shape, metric):
                k = len(ranges)
                roots = []
                for a in range(k):
                    r = stats[f"{root}_{g}_{a}@{i}"].reshape(
                        chains, -1, *stats[f"{root}_{g}_{a}@{i}"].shape[-2:]
                    )
                    roots.append(r[c, j].numpy())
                ins = [f"{letters[a]}{letters[a].upper()}" for a in range(k)]
                spec = ",".join(ins) + "," + letters[:k] + "->" + letters[:k].upper()
                dst[np.ix_(*ranges)] = np.einsum(spec, *roots, src[np.ix_(*ranges)], optimize=True)
    return out.reshape(v.shape)


@pytest.mark.parametrize("tiling", ["reference", "even"])
@pytest.mark.parametrize(
    ("shapes", "block_size", "vectors", "chains"),
    [
        (MLP, 8, True, None),
        (MLP, 8, False, 3),
        (RESNET, 128, True, 2),
        (RESNET, 16, False, None),
    ],
    ids=["mlp-vectors", "mlp-chains", "resnet-vectors-chains", "resnet-blocked"],
)
def test_buckets_equal_the_per_tensor_computation(
    shapes: list, block_size: int, vectors: bool, chains: int | None, tiling: str
) -> None:
    """Blocks of equal shape stacked across tensors (one batched matmul per bucket and axis)
    give each block's factors and G⁻¹, G^{-1/2} of a block-by-block computation to 1e-12."""
    metric = ShampooMetric(
        decay=0.8,
        eps=1e-3,
        block_size=block_size,
        update_interval=2,
        precondition_vectors=vectors,
        tiling=tiling,  # type: ignore[arg-type]
    )
    layout = _layout(shapes, chains)
    stacking = metric._stacking(layout)
    assert any(len(b.members) > 1 for b in stacking.buckets)  # the layout stacks across tensors
    grads = random_grads(layout, 3, torch.float64, seed=block_size)
    stats = run(metric, layout, grads)
    for b, bucket in enumerate(stacking.buckets):  # each statistic: views of one tensor
        for stat, a in itertools.product(("factor", "grad_root", "noise_root"), range(bucket.rank)):
            piece = stacking.stacked[b]
            assert stacking.piece_stat(stats, stat, piece, a, len(layout.batch_shape))[1] is None
    g = grads[-1].clone()
    metric.update(copy.deepcopy(stats), layout, g, 4)
    assert torch.equal(g, grads[-1])  # the engine applies G⁻¹ to the same buffer next
    want = per_tensor_oracle(metric, layout, grads)
    for name, h in want.items():
        key, c, j = name.split("/")
        got = stats[key].reshape(-1, *stats[key].shape[-3:])[int(c), int(j)].numpy()
        np.testing.assert_allclose(got, h, rtol=1e-12, atol=1e-12 * np.abs(h).max())
    v = torch.randn(grads[0].shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for fn, root in (("inverse", "grad_root"), ("inverse_sqrt", "noise_root")):
        expected = per_tensor_apply(metric, layout, stats, v, root)
        got = getattr(metric, fn)(stats, layout, v.clone()).numpy()
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12 * np.abs(expected).max())


def _bucket_case(chains: int | None = 2) -> tuple[ShampooMetric, FlatLayout, list[torch.Tensor]]:
    metric = ShampooMetric(
        decay=0.8, eps=1e-3, block_size=8, update_interval=2, precondition_vectors=True
    )
    layout = _layout([*MLP, (16, 16, 3, 3), (16, 16, 3, 3)], chains)
    return metric, layout, random_grads(layout, 3, torch.float64, seed=4)


def _steps(metric: ShampooMetric, layout: FlatLayout, stats: dict, grads: list) -> list:
    """update (+ refresh when due), G⁻¹ and G^{-1/2} of every gradient, as the engine calls them."""
    outs = []
    for t, g in enumerate(grads, start=1):
        update_metric(metric, stats, layout, g.clone(), t)
        outs += [
            metric.inverse(stats, layout, g.clone()),
            metric.inverse_sqrt(stats, layout, g * 2),
        ]
    return outs


def test_statistics_that_are_not_views_give_the_same_numbers() -> None:
    """Cloned statistics (clone_state, a caller's own tensors) are stacked by copies and written
    back: the same numbers, bit for bit, and the same keys and shapes in a state dict."""
    metric, layout, grads = _bucket_case()
    views = metric.init(layout, grads[0])
    clones = {k: v.clone() for k, v in views.items()}
    assert views[next(iter(views))]._base is not None
    assert all(v._base is None for v in clones.values())
    got = _steps(metric, layout, clones, grads)
    for a, b in zip(_steps(metric, layout, views, grads), got, strict=True):
        assert torch.equal(a, b)
    assert list(views) == list(clones)
    assert all(torch.equal(views[k], clones[k]) for k in views)


def test_checkpoint_of_per_tensor_statistics_loads_into_the_stacked_state() -> None:
    """A state dict holds one plain tensor per key, as before the buckets: loading it copies
    into the views (the buckets stay stacked) and the run continues as if never stopped."""
    metric, layout, grads = _bucket_case(None)
    stats = metric.init(layout, grads[0])
    _steps(metric, layout, stats, grads[:2])
    saved = {k: v.clone() for k, v in stats.items()}  # SamplerState.state_dict's format
    assert all(v.is_contiguous() and v._base is None for v in saved.values())
    after = _steps(metric, layout, stats, grads[2:])
    fresh = ShampooMetric(
        **{f: getattr(metric, f) for f in ("decay", "eps", "block_size")},
        update_interval=2,
        precondition_vectors=True,
    )
    loaded = fresh.init(layout, grads[0])
    for k, v in saved.items():
        loaded[k].copy_(v)  # SamplerState.apply_state_dict
    stacking = fresh._stacking(layout)
    assert all(
        stacking.piece_stat(loaded, "factor", piece, 0, 0)[1] is None for piece in stacking.stacked
    )
    resumed = []
    for t, g in enumerate(grads[2:], start=3):
        update_metric(fresh, loaded, layout, g.clone(), t)
        resumed += [
            fresh.inverse(loaded, layout, g.clone()),
            fresh.inverse_sqrt(loaded, layout, g * 2),
        ]
    assert all(torch.equal(a, b) for a, b in zip(after, resumed, strict=True))
    assert all(torch.equal(stats[k], loaded[k]) for k in stats)


def test_one_gather_and_scatter_path_gives_the_same_numbers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The accelerator path (every bucket gathered and scattered by one index kernel each,
    whole tensors stacked too) equals the CPU path, here forced on CPU."""
    metric, layout, grads = _bucket_case()
    expected = _steps(metric, layout, metric.init(layout, grads[0]), grads)

    def index(self: ShampooMetric, stacking: object, lay: FlatLayout, x: torch.Tensor) -> object:
        return stacking.positions(lay, x.device)  # type: ignore[attr-defined]

    monkeypatch.setattr(ShampooMetric, "_index", index)
    indexed = ShampooMetric(
        **{f: getattr(metric, f) for f in ("decay", "eps", "block_size")},
        update_interval=2,
        precondition_vectors=True,
    )
    got = _steps(indexed, layout, indexed.init(layout, grads[0]), grads)
    stacking = indexed._stacking(layout)
    assert any(len(b.members) > 1 for b in stacking.buckets)
    assert indexed._work(stacking, layout, grads[0]).positions is not None
    for a, b in zip(expected, got, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert pickle.loads(pickle.dumps(indexed)) == indexed  # its caches do not stop a pickle


@pytest.mark.slow
def test_traced_step_with_stacked_buckets_has_no_graph_break() -> None:
    """Under torch.compile(fullgraph=True) the views' base cannot be read: the buckets are
    stacked by copies and written back, with the eager numbers."""
    metric = ShampooMetric(
        decay=0.8, eps=1e-3, block_size=8, update_interval=2, precondition_vectors=True
    )
    layout = _layout([(8, 16), (8,), (8, 8), (8,), (2, 8, 3), (2, 8, 3)])
    grads = random_grads(layout, 3, torch.float64, seed=5)
    assert all(len(b.members) > 1 for b in metric._stacking(layout).buckets)
    eager = metric.init(layout, grads[0])
    traced = copy.deepcopy(eager)
    _steps(metric, layout, eager, grads[:2])
    _steps(metric, layout, traced, grads[:2])

    def step(stats: dict, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        metric.update(stats, layout, g, 3)
        return metric.inverse(stats, layout, g.clone()), metric.inverse_sqrt(stats, layout, g * 2)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    want = step(eager, grads[2].clone())
    got = compiled(traced, grads[2].clone())
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    for k in eager:
        torch.testing.assert_close(traced[k], eager[k], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("size", [2, 5])
def test_damping_adds_the_mean_eigenvalue_times_delta(size: int) -> None:
    """(A + (ε·λ_max + δ·tr(A)/s)·I)^(−e), on the general and the 2 × 2 closed-form paths."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, size, size + 1, generator=gen, dtype=torch.float64)
    mat = x @ x.mT
    (root,) = inverse_roots_eigh(mat, (0.5,), ridge="relative", eps=1e-3, damping=0.1)
    evals = torch.linalg.eigvalsh(mat)
    r = 1e-3 * evals[..., -1:] + 0.1 * evals.mean(-1, keepdim=True)
    damped = mat + r[..., None] * torch.eye(size, dtype=torch.float64)
    torch.testing.assert_close(
        root @ root @ damped, torch.eye(size, dtype=torch.float64).expand_as(mat)
    )


def test_damping_is_validated_and_needs_eigh() -> None:
    with pytest.raises(ValueError, match="damping"):
        ShampooMetric(damping=-1.0)
    with pytest.raises(ValueError, match="damping needs root_method='eigh'"):
        ShampooMetric(damping=0.1, root_method="newton")


def test_warns_once_when_every_tensor_gets_the_identity() -> None:
    """A (1, 30) weight and a bias merge to rank 1: without precondition_vectors G = I, i.e.
    SGLD; the user is told once per metric and layout, and not when any tensor is factored."""
    layout = FlatLayout(("weight", "bias"), ((1, 30), (1,)))
    metric = ShampooMetric()
    with pytest.warns(UserWarning, match="G = I everywhere"):
        metric.init(layout, torch.zeros(31))
    metric.init(layout, torch.zeros(31))  # once: filterwarnings=error would raise here
    ShampooMetric(precondition_vectors=True).init(layout, torch.zeros(31))
    ShampooMetric(block_size=4).init(FlatLayout(("w",), ((3, 4),)), torch.zeros(12))


# --- a floor that does not vanish with the factors; the library's error on a failed refresh ---


def _vector_sampler(**options: object) -> tuple[sgrld.Sampler, sgrld.SamplerState]:
    sampler = sgrld.build(
        "shampoo", lr=1e-2, num_data=10, precondition_vectors=True, update_interval=5,
        **options,
    )  # fmt: skip
    return sampler, sampler.init({"w": torch.zeros(6, dtype=torch.float64)})


@pytest.mark.parametrize("floor", [0.1, 1.0])
def test_floor_bounds_g_inverse_however_small_the_factors(floor: float) -> None:
    """Near-zero gradients (a model at a minimum) leave the factors at ~ε·λᵗ: a ridge relative to
    them vanishes with them, the floor does not: G ≥ floor·I, so ‖G⁻¹v‖ ≤ ‖v‖/floor."""
    sampler, state = _vector_sampler(floor=floor)
    for _ in range(5):  # the refresh after step 5 sees 1e-12-sized gradients
        sampler.step(state, {"w": torch.full((6,), 1e-12, dtype=torch.float64)})
    metric, v = sampler.metric, torch.linspace(-1.0, 1.0, 6, dtype=torch.float64)
    drift = metric.inverse(state.stats, state.layout, v.clone())
    noise = metric.inverse_sqrt(state.stats, state.layout, v.clone())
    # the factors are ε·I·0.99⁵ + tiny (1e-8 ≪ floor²): G = floor·I to 1e-8/floor²
    torch.testing.assert_close(drift, v / floor, rtol=1e-6, atol=0.0)
    torch.testing.assert_close(noise, v / math.sqrt(floor), rtol=1e-6, atol=0.0)
    paper, paper_state = _vector_sampler(floor=0.0)  # the paper's metric: G⁻¹ ~ 1e4
    for _ in range(5):
        paper.step(paper_state, {"w": torch.full((6,), 1e-12, dtype=torch.float64)})
    huge = paper.metric.inverse(paper_state.stats, paper_state.layout, v.clone())
    assert float(huge.abs().max()) > 1e3


def test_floor_leaves_large_factors_alone() -> None:
    """Where every eigenvalue of the ridged factor is above floor², the floor changes nothing."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(3, 5, 5, generator=gen, dtype=torch.float64)
    mat = a @ a.mT + 5.0 * torch.eye(5, dtype=torch.float64)
    plain = inverse_roots_eigh(mat, (0.5, 0.25), eps=1e-6)
    floored = inverse_roots_eigh(mat, (0.5, 0.25), eps=1e-6, floor=0.01)
    for x, y in zip(plain, floored, strict=True):
        assert torch.equal(x, y)


def test_a_failed_eigh_is_the_library_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's LinAlgError becomes the library's: which tensor, block and axis, which step, what
    to change; the roots are left as they were."""
    sampler, state = _vector_sampler()
    for _ in range(4):
        sampler.step(state, {"w": torch.ones(6, dtype=torch.float64)})
    before = {k: v.clone() for k, v in state.stats.items()}

    def fail(*args: object, **kwargs: object) -> None:
        raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge")

    monkeypatch.setattr(torch.linalg, "eigh", fail)
    with pytest.raises(ShampooRootError, match=r"step 5: .*tensor 'w', block 0, axis 0.*floor"):
        sampler.step(state, {"w": torch.ones(6, dtype=torch.float64)})
    for key in ("grad_root_0_0@0", "noise_root_0_0@0"):
        assert torch.equal(state.stats[key], before[key])


def test_a_damaged_factor_is_named() -> None:
    """A factor holding NaN (a damaged state) fails the refresh with the library's error naming
    it, whether eigh raises or returns NaN roots."""
    metric = ShampooMetric(precondition_vectors=True)
    layout = _layout([(3,), (4,)])
    stats = metric.init(layout, torch.zeros(7, dtype=torch.float32))
    stats["factor_0_0@1"][0, 2, 1] = math.nan  # the lower triangle, which eigh reads
    with pytest.raises(ShampooRootError, match=r"tensor 'p1', block 0, axis 0 .*holds NaN"):
        metric.compute_roots(stats, layout)


def test_a_broken_chains_factor_keeps_its_roots_and_the_others_refresh() -> None:
    """K chains: a factor that is not finite (a chain whose gradients overflowed) neither stops
    the refresh of the other chains (eigh fails on the whole bucket) nor changes its roots; the
    others' roots are those of a refresh without it, bit for bit."""
    metric = ShampooMetric(precondition_vectors=True)
    layout = _layout([(3,), (4,)], chains=3)
    gen = torch.Generator().manual_seed(0)
    stats = metric.init(layout, torch.zeros(3, 7, dtype=torch.float32))
    for key in [k for k in stats if k.startswith("factor_")]:
        a = torch.randn(stats[key].shape, generator=gen)
        stats[key].copy_(a @ a.mT + 0.1 * torch.eye(a.shape[-1]))
    clean = {k: v.clone() for k, v in stats.items()}
    metric.compute_roots(clean, layout)
    before = {k: v.clone() for k, v in stats.items()}
    stats["factor_0_0@1"][1, 0, 2, 1] = math.inf  # chain 1's factor of p1
    metric.compute_roots(stats, layout)
    for key in [k for k in stats if "root" in k]:
        assert torch.equal(stats[key][[0, 2]], clean[key][[0, 2]]), key
        chain1 = before[key][1] if key.endswith("@1") else clean[key][1]
        assert torch.equal(stats[key][1], chain1), key


def test_a_state_dict_without_the_floor_loads_the_papers_metric() -> None:
    """A ShampooSGLD state dict written before ``floor`` existed ran without one: it loads with
    floor 0 (its chain goes on as it did); a new one keeps its floor."""
    w = torch.zeros(200, 3, requires_grad=True)  # not merged into one vector
    opt = sgrld.ShampooSGLD([w], lr=0.01, num_data=10)
    state = opt.state_dict()
    assert state["param_groups"][0]["floor"] == 0.1
    del state["param_groups"][0]["floor"]
    older = sgrld.ShampooSGLD([torch.zeros(200, 3, requires_grad=True)], lr=0.01, num_data=10)
    older.load_state_dict(state)
    assert older.param_groups[0]["floor"] == 0.0 and older.group_metrics[0].floor == 0.0
