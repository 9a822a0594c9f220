"""The one chain runner (:mod:`sgrld.core.runner`): what one path of ``sgrld.llc`` and
``sgrld.tune`` refuses or does, every path does, with the same message; the tuner's budget is
counted where it is spent."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch

import sgrld
from sgrld.core.runner import Account, passes
from sgrld.tuning.data import Batches
from sgrld.tuning.runs import Problem, run_round

torch.set_num_threads(1)

N = 240
PATHS = {
    "vectorised": {},
    "sequential": {"vectorize": False},
    "optimizer": {"masks": "every"},
}


def data(n: int = N) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, generator=g, dtype=torch.float64)
    y = torch.bernoulli(
        torch.sigmoid(x @ torch.tensor([1.0, -1.0, 0.5], dtype=x.dtype)), generator=g
    )
    return [(x[i : i + 40], y[i : i + 40]) for i in range(0, n, 40)]


def bce(model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    x, y = batch[0], batch[1]
    return torch.nn.functional.binary_cross_entropy_with_logits(model(x).squeeze(-1), y)


def llc(model: torch.nn.Module, path: str, loader: Any, loss: Any = bce) -> Any:
    options: dict[str, Any] = dict(PATHS[path])
    if options.get("masks") == "every":
        options["masks"] = {
            p: torch.ones_like(p, dtype=torch.bool) for p in model.parameters() if p.requires_grad
        }
    # 12 steps: what each path samples, not an estimate (its verdict would warn)
    return sgrld.llc(model, loss, loader, num_data=N, num_chains=2, num_steps=12, lr=1e-3,
                     init_batches=2, warn=False, **options)  # fmt: skip


def linear() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 1, dtype=torch.float64)


@pytest.mark.parametrize("path", PATHS)
def test_frozen_parameters_are_not_sampled_on_any_path(path: str) -> None:
    """With the bias frozen every path samples the weight alone (the same chains), and a model
    with every parameter frozen is refused in one line."""
    model = linear()
    model.bias.requires_grad_(False)
    seen: list[torch.Tensor] = []

    def watched(m: torch.nn.Module, batch: Any) -> torch.Tensor:
        seen.append(m.bias.detach().clone())
        return bce(m, batch)

    got = llc(model, path, data(), watched)
    assert all(torch.equal(b, model.bias.detach()) for b in seen)
    reference = llc(model, "sequential", data())
    torch.testing.assert_close(got.trace, reference.trace, rtol=1e-10, atol=0)
    model.weight.requires_grad_(False)
    with pytest.raises(ValueError, match=r"^the model has no parameter to sample: every one has "
                       r"requires_grad=False$"):  # fmt: skip
        llc(model, path, data())


@pytest.mark.parametrize("path", PATHS)
def test_an_iterator_loader_is_refused_on_every_path(path: str) -> None:
    """``itertools.cycle`` never ends its pass and a generator is read once: refused alike."""
    for loader in (itertools.cycle(data()), (b for b in data())):
        with pytest.raises(ValueError, match=r"^the loader is an iterator .*DataLoader or a list"):
            llc(linear(), path, loader)


def test_the_tuner_refuses_an_endless_loader_at_once() -> None:
    model = linear()
    with pytest.raises(ValueError, match=r"^the loader is an iterator \(cycle\)"):
        sgrld.tune("sgld", model, bce, itertools.cycle(data()), num_data=N, steps=100,
                   budget=10_000)  # fmt: skip


@pytest.mark.parametrize("path", PATHS)
def test_a_non_finite_loss_stops_the_chains_with_one_message(path: str) -> None:
    """A batch whose loss is +∞ (its gradient finite) stops every chain at that step, on every
    path with the same message, and the model is left as it was."""
    model = linear()
    before = [p.detach().clone() for p in model.parameters()]
    poisoned = [(x, y, torch.tensor(math.inf if i == 2 else 0.0)) for i, (x, y) in
                enumerate(data())]  # fmt: skip

    def loss(m: torch.nn.Module, batch: Any) -> torch.Tensor:
        return bce(m, batch) + batch[2]

    message = (
        r"^non-finite loss or gradient in chain 0 \(seed 0\) at step 3, chain 1 \(seed 1\) at "
        r"step 3; those chains were stopped there, the others went on$"
    )
    with pytest.raises(sgrld.NonFiniteGradientError, match=message):
        llc(model, path, poisoned, loss)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


class _Scaled(torch.nn.Module):
    """A linear model with a 0-d parameter (as a horseshoe's scale or a learned log σ)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = linear()
        self.scale = torch.nn.Parameter(torch.tensor(1.0, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale


@pytest.mark.parametrize("path", PATHS)
def test_a_zero_dimensional_parameter_stops_with_its_chain(path: str) -> None:
    """A non-finite loss poisons a 0-d gradient too (one chain's ``(1,)`` flag, the
    experiments' single run's horseshoe scales): the same message on every path."""
    poisoned = [(x, y, torch.tensor(math.inf if i == 2 else 0.0)) for i, (x, y) in
                enumerate(data())]  # fmt: skip

    def loss(m: torch.nn.Module, batch: Any) -> torch.Tensor:
        return bce(m, batch) + batch[2]

    with pytest.raises(sgrld.NonFiniteGradientError, match=r"chain 0 \(seed 0\) at step 3, "):
        llc(_Scaled(), path, poisoned, loss)


def test_passes_mark_the_end_of_each_pass() -> None:
    got = list(itertools.islice(passes([1, 2, 3]), 7))
    assert got == [(1, False), (2, False), (3, True), (1, False), (2, False), (3, True), (1, False)]
    with pytest.raises(ValueError, match="yielded no batch"):
        next(passes([]))


def test_an_account_refuses_to_overdraw() -> None:
    account = Account(budget=10)
    account.spend(6)
    with pytest.raises(RuntimeError, match=r"^budget overdrawn: 6 \+ 5 gradient evaluations > 10"):
        account.spend(5)
    assert account.spent == 6


@pytest.mark.parametrize("validated", [False, True])
@pytest.mark.parametrize("scored", [False, True])
def test_a_round_spends_what_the_search_forecasts(scored: bool, validated: bool) -> None:
    """The tuner's rounds count their gradient evaluations where they spend them (steps,
    scoring and validation batches); the forecast it plans with is that count."""
    model = linear()
    batches = Batches(data(), score_points=80, device=torch.device("cpu"))

    def log_likelihood(m: torch.nn.Module, batch: Any) -> torch.Tensor:
        return -torch.nn.functional.binary_cross_entropy_with_logits(
            m(batch[0]).squeeze(-1), batch[1], reduction="none"
        )

    validation = (data(80), log_likelihood) if validated else None
    problem = Problem("identity", model, bce, batches, float(N), {}, torch.arange(4), 0, 2, 4,
                      validation)  # fmt: skip
    candidates = [{"lr": 1e-3}, {"lr": 1e-2}, {"lr": 1e-1}]
    records = run_round(problem, candidates, 20, scored=scored)
    assert len(records) == 3 and len(batches.scoring) == 2
    assert problem.account.spent == problem.cost(3, 20, scored=scored)
    assert problem.account.spent > 3 * 2 * 20 or not scored


def test_a_frozen_parameter_is_not_tuned() -> None:
    """The tuner's chains leave a frozen parameter where it is (its scored coordinates are the
    sampled ones)."""
    model = linear()
    model.bias.requires_grad_(False)
    batches = Batches(data(), score_points=80, device=torch.device("cpu"))
    problem = Problem("identity", model, bce, batches, float(N), {}, torch.arange(3), 0, 1, 4)
    chains = problem.build([{"lr": 1e-2}], 20)
    assert list(chains.params) == ["weight"] and "bias" in chains.frozen


@pytest.mark.parametrize("name", ["identity", "rmsprop"])
def test_a_parameter_listed_twice_is_refused(name: str) -> None:
    """Listed twice, a parameter would be stepped twice per step (SGLD moving 0.8 for 0.9)."""
    w = torch.nn.Parameter(torch.ones(3))
    for params in ([w, w], [{"params": [w, w]}], [("w", w), ("w2", w)]):
        with pytest.raises(ValueError, match=r"^duplicate parameter: .* listed twice in one group"):
            sgrld.SGRLDOptimizer(params, lr=0.1, num_data=10, metric=name)
    sgrld.SGRLDOptimizer(iter([w]), lr=0.1, num_data=10, metric=name)  # a generator is fine


def test_sampler_run_is_a_client_of_the_runner() -> None:
    """``Sampler.run`` counts its gradient evaluations into an account, refuses a budget it would
    overdraw, freezes a chain whose gradient is not finite while the others go on, and raises
    the runner's one message (the sampling paths' wording) at the end."""
    sampler = sgrld.build("identity", lr=0.05, num_data=N, noise="philox")
    start = torch.zeros(3, 2, dtype=torch.float64)

    def grad_fn(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"w": params["w"] - 1.0}

    reference = sampler.init({"w": start.clone()}, num_chains=3, seeds=[0, 1, 2])
    account = Account(budget=30)
    sampler.run(reference, grad_fn, 8, account=account)
    assert account.spent == 24
    overdrawn = r"^budget overdrawn: 30 \+ 3 gradient evaluations > 30$"  # at the third step
    with pytest.raises(RuntimeError, match=overdrawn):
        sampler.run(reference, grad_fn, 8, account=account)

    state = sampler.init({"w": start.clone()}, num_chains=3, seeds=[0, 1, 2])
    frozen: list[torch.Tensor] = []

    def poisoned(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        grads = grad_fn(params)
        if state.step == 4:  # the fifth step: chain 1's gradient is NaN
            frozen.append(params["w"][1].clone())
            grads["w"][1, 0] = math.nan
        return grads

    message = r"^non-finite loss or gradient in chain 1 at step 5; those chains were stopped there"
    with pytest.raises(sgrld.NonFiniteGradientError, match=message):
        sampler.run(state, poisoned, 8)
    assert torch.equal(state.params["w"][1], frozen[0])
    assert torch.equal(state.params["w"][[0, 2]], reference_at(sampler, start, grad_fn, 8)[[0, 2]])


def reference_at(sampler: Any, start: torch.Tensor, grad_fn: Any, steps: int) -> torch.Tensor:
    state = sampler.init({"w": start.clone()}, num_chains=3, seeds=[0, 1, 2])
    for _ in range(steps):
        sampler.step(state, grad_fn(state.params))
    return state.params["w"]


class Halves:
    """Two ranks in one process: each holds half of the potential; the sums double it back."""

    def __init__(self) -> None:
        self.summed: list[int] = []

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        return value.detach() * 2

    def sum_gradients(self, params: list[torch.Tensor]) -> None:
        self.summed.append(len(params))
        for p in params:
            assert p.grad is not None
            p.grad.mul_(2)


def test_an_optimizer_chain_over_ranks_reads_the_summed_loss_and_sums_the_gradients() -> None:
    """With ``ranks`` (the eager step of ``sgrld sample``) the step is the one-process step of
    the ranks' summed potential; a non-finite sum is refused before the backward, nothing moved."""
    from sgrld.core.runner import OptimizerChain

    batch = data()[0]
    ranks = Halves()
    models, chains = [], []
    for half, via in ((False, None), (True, ranks)):
        model = linear()
        generator = torch.Generator().manual_seed(1)
        opt = sgrld.SGLD(model.parameters(), lr=1e-3, num_data=N, generator=generator)
        loss = (lambda m, b: bce(m, b) / 2) if half else bce
        models.append(model)
        chains.append(OptimizerChain(model, loss, opt, ranks=via))
    for _ in range(3):
        whole, halves = (chain.step(batch) for chain in chains)
        assert torch.equal(whole, halves * 2)
    assert ranks.summed == [2, 2, 2]
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(a, b)
    before = [p.clone() for p in models[1].parameters()]
    with pytest.raises(sgrld.NonFiniteGradientError, match=r"^potential is nan$"):
        chains[1].step((batch[0] * math.nan, batch[1]))
    assert ranks.summed == [2, 2, 2]
    for a, b in zip(before, models[1].parameters(), strict=True):
        assert torch.equal(a, b)
