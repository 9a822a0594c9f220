"""Kernel Stein discrepancy: an autograd oracle of the Stein kernel, and what it must detect."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sgrld.data.funnel import FunnelTarget
from sgrld.evaluation.stein import kernel_stein_discrepancy


def _oracle(x: np.ndarray, s: np.ndarray, c: float, beta: float) -> float:
    """k₀ by autograd of k(x, y) = (c² + ‖x−y‖²)^β, pair by pair (no hand-derived terms)."""
    xt, st = torch.tensor(x), torch.tensor(s)
    total = 0.0
    for i in range(len(x)):
        for j in range(len(x)):
            a = xt[i].clone().requires_grad_(True)
            b = xt[j].clone().requires_grad_(True)
            k = (c * c + ((a - b) ** 2).sum()) ** beta
            (ga,) = torch.autograd.grad(k, a, create_graph=True)
            gb = torch.autograd.grad(k, b, retain_graph=True)[0]
            trace = sum(torch.autograd.grad(ga[d], b, retain_graph=True)[0][d] for d in range(2))
            total += float((st[i] @ st[j] * k + st[i] @ gb + st[j] @ ga + trace).detach())
    return math.sqrt(total) / len(x)


@pytest.mark.parametrize(("c", "beta"), [(1.0, -0.5), (0.5, -0.3)])
def test_stein_kernel_matches_autograd_oracle(c: float, beta: float) -> None:
    rng = np.random.default_rng(0)
    x, s = rng.standard_normal((7, 2)), rng.standard_normal((7, 2))
    value = kernel_stein_discrepancy(x, s, c=c, beta=beta, block=3)
    assert value == pytest.approx(_oracle(x, s, c, beta), rel=1e-12)


def test_single_point_at_the_mode() -> None:
    # r = 0 and s = 0 leave the trace term −2βd c^{2β−2}: 1 for d = 1, c = 1, β = −½.
    assert kernel_stein_discrepancy([[0.0]], [[0.0]]) == pytest.approx(1.0)


def test_exact_gaussian_draws_shrink_and_biased_ones_do_not() -> None:
    rng = np.random.default_rng(1)
    exact = [
        kernel_stein_discrepancy(x, -x) for x in (rng.standard_normal((m, 2)) for m in (100, 1600))
    ]
    assert exact[1] < exact[0] / 2.5  # O(m^{-1/2}): a 16x larger sample, about a quarter
    shifted = rng.standard_normal((1600, 2)) + 1.0
    assert kernel_stein_discrepancy(shifted, -shifted) > 5 * exact[1]


def test_funnel_v_marginal_too_narrow_is_detected() -> None:
    # The funnel table's KSD is that of v/σ against N(0, 1): the v-marginal is exact N(0, σ²).
    target = FunnelTarget()
    draws = target.sample(1500, generator=torch.Generator().manual_seed(2))
    u = draws[:, 1:].numpy() / target.v_std
    exact = kernel_stein_discrepancy(u, -u)
    squeezed = 0.5 * u  # v too concentrated: the neck and the mouth under-visited
    assert kernel_stein_discrepancy(squeezed, -squeezed) > 3 * exact
    # Why not the joint score: in the neck it reaches ~1e11 and the V-statistic is ruled by those
    # few points, so a sampler that misses the neck would score better than exact draws.
    joint = [
        kernel_stein_discrepancy(d.numpy(), target.grad_log_prob(d).numpy())
        for d in (draws, torch.stack([draws[:, 0], 0.5 * draws[:, 1]], dim=1))
    ]
    assert joint[1] < joint[0] / 100


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match=r"\(m, d\)"):
        kernel_stein_discrepancy(np.zeros((3, 2)), np.zeros((3, 1)))
    with pytest.raises(ValueError, match="beta"):
        kernel_stein_discrepancy(np.zeros((3, 2)), np.zeros((3, 2)), beta=0.5)
