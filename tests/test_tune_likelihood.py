"""The likelihood a potential alone is consistent with (``sgrld.tuning.likelihood``): found
where the potential's data term is it, refused where it is anything else (tempered, smoothed,
another family, a stochastic forward), the model and torch's random state left as they were."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sgrld.tuning.likelihood import consistent_likelihood

N = 256


def _prior(m: nn.Module) -> Tensor:
    return sum((p * p).sum() for p in m.parameters()) / (2 * N)


def _classification() -> tuple[nn.Module, list[tuple[Tensor, Tensor]]]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N, 6, generator=gen)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    return net, [(x[i : i + 64], y[i : i + 64]) for i in range(0, N, 64)]


def _regression() -> tuple[nn.Module, list[tuple[Tensor, Tensor]]]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(N, 5, generator=gen)
    y = x @ torch.randn(5, generator=gen) + 0.3 * torch.randn(N, generator=gen)
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 1))
    return net, [(x[i : i + 64], y[i : i + 64]) for i in range(0, N, 64)]


def _categorical(m: nn.Module, b: Any, temper: float = 1.0, smooth: float = 0.0) -> Tensor:
    return temper * F.cross_entropy(m(b[0]), b[1], label_smoothing=smooth) + _prior(m)


def _gaussian(m: nn.Module, b: Any, var: float = 0.09) -> Tensor:
    return (0.5 * (m(b[0]).squeeze(-1) - b[1]) ** 2).mean() / var + _prior(m)


def _cauchy(m: nn.Module, b: Any) -> Tensor:
    return torch.log1p((m(b[0]).squeeze(-1) - b[1]) ** 2).mean() + _prior(m)


def test_a_categorical_potential_is_found_and_its_log_likelihood_is_the_datum_s() -> None:
    net, batches = _classification()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    rng = torch.get_rng_state()
    found = consistent_likelihood(net, _categorical, batches)
    assert found is not None and found[0] == "categorical"
    x, y = batches[0]
    exact = -F.cross_entropy(net(x), y, reduction="none")
    assert torch.allclose(found[1](net, (x, y)), exact)
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_gaussian_potential_is_found_with_its_precision() -> None:
    net, batches = _regression()
    found = consistent_likelihood(net, _gaussian, batches)
    assert found is not None and found[0] == "gaussian"
    x, y = batches[1]
    f = net(x).squeeze(-1)
    exact = -0.5 * (f - y) ** 2 / 0.09 - 0.5 * math.log(2 * math.pi * 0.09)
    assert torch.allclose(found[1](net, (x, y)), exact, atol=1e-4)


def test_a_bernoulli_potential_is_found_and_batch_norm_s_figures_stay() -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(N, 4, generator=gen)
    y = (x[:, 0] + 0.5 * torch.randn(N, generator=gen) > 0).float()
    torch.manual_seed(2)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
    batches = [(x[i : i + 64], y[i : i + 64]) for i in range(0, N, 64)]

    def potential(m: nn.Module, b: Any) -> Tensor:
        logit = m(b[0]).squeeze(-1)
        return F.binary_cross_entropy_with_logits(logit, b[1]) + _prior(m)

    before = {k: v.clone() for k, v in net.state_dict().items()}
    found = consistent_likelihood(net, potential, batches)
    assert found is not None and found[0] == "bernoulli"
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    xb, yb = batches[0]
    exact = -F.binary_cross_entropy_with_logits(net(xb).squeeze(-1), yb, reduction="none")
    assert torch.allclose(found[1](net, (xb, yb)), exact)


def _heavy(m: nn.Module, b: Any, temper: float = 1.0) -> Tensor:
    """A potential its prior term dominates (about 4 × 10³ per datum at the start)."""
    return temper * F.cross_entropy(m(b[0]), b[1]) + 1000.0 * N * _prior(m) + 100.0


def test_a_potential_its_prior_dominates_is_found_and_a_tempered_one_is_not() -> None:
    net, batches = _classification()
    found = consistent_likelihood(net, _heavy, batches)
    assert found is not None and found[0] == "categorical"
    # the residuals' rule alone (1e-4 of a potential of ~10³) would let 0.99 through
    assert consistent_likelihood(net, lambda m, b: _heavy(m, b, 0.99), batches) is None


@pytest.mark.parametrize(
    ("case", "potential"),
    [("classification", lambda m, b: _categorical(m, b, temper=0.99)),
     ("classification", lambda m, b: _categorical(m, b, smooth=0.05)),
     ("classification", lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="sum") + _prior(m)),
     ("regression", _cauchy)],
    ids=["tempered-0.99", "label-smoothing", "summed-not-per-datum", "cauchy"],
)  # fmt: skip
def test_a_potential_of_another_likelihood_matches_none(case: str, potential: Any) -> None:
    net, batches = _classification() if case == "classification" else _regression()
    assert consistent_likelihood(net, potential, batches) is None


def test_batches_that_cannot_tell_or_a_stochastic_forward_match_none() -> None:
    net, batches = _classification()
    # one batch of one datum: fewer than three parts to compare
    one = [(batches[0][0][:1], batches[0][1][:1])]
    assert consistent_likelihood(net, _categorical, one) is None
    # not (x, y) pairs
    assert consistent_likelihood(net, _categorical, [{"x": x, "y": y} for x, y in batches]) is None
    # a potential that cannot take a half batch (it reshapes to the loader's batch size)
    fixed = lambda m, b: _categorical(m, (b[0].reshape(64, 6), b[1]))  # noqa: E731
    assert consistent_likelihood(net, fixed, batches) is None
    dropout = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.5), nn.Linear(16, 3))
    rng = torch.get_rng_state()
    assert consistent_likelihood(dropout, _categorical, batches) is None
    assert torch.equal(torch.get_rng_state(), rng)  # its draws did not move torch's state
