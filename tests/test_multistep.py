"""The compiled block runner (:mod:`sgrld.core.multistep`) keeps the chain runner's rules: its
gradient evaluations are charged to an account, a breakdown is the runner's one message."""

from __future__ import annotations

import math

import pytest
import torch

import sgrld
from sgrld.core.multistep import BlockRunner
from sgrld.core.runner import Account


def _runner(grad_fn: object, chains: int = 3) -> BlockRunner:
    sampler = sgrld.build("identity", lr=0.01, num_data=1.0, adapt_until=None)
    state = sampler.init(
        {"theta": torch.zeros(chains, 2, dtype=torch.float64)},
        num_chains=chains,
        generator=torch.Generator().manual_seed(0),
    )
    return BlockRunner(
        sampler, state, grad_fn, grad_generator=torch.Generator().manual_seed(1),  # type: ignore[arg-type]
        block=4, compile=False, chunk=8,
    )  # fmt: skip


def test_block_runner_charges_its_gradient_evaluations() -> None:
    runner = _runner(lambda theta, noise: theta + noise)
    account = Account(budget=3 * 20)
    runner.run(20, lambda first, it: None, account=account)
    assert account.spent == 60  # K = 3 chains, 20 steps
    with pytest.raises(RuntimeError, match=r"^budget overdrawn: 60 \+ 3 gradient evaluations"):
        runner.run(1, lambda first, it: None, account=account)


def test_block_runner_names_each_broken_chain_and_its_first_step() -> None:
    """Chain 2's gradient is infinite from its eleventh step (the second chunk): the runner's
    message names it and that step, and no chunk with it reaches the caller."""
    calls = []

    def grad_fn(theta: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        calls.append(None)
        grad = theta + noise
        if len(calls) >= 11:
            grad[2] = math.inf
        return grad

    seen: list[int] = []
    runner = _runner(grad_fn)
    message = (
        r"^non-finite loss or gradient in chain 2 at step 11; those chains were stopped there, "
        r"the run stopped at the end of that chunk$"
    )
    with pytest.raises(sgrld.NonFiniteGradientError, match=message):
        runner.run(24, lambda first, it: seen.append(first))
    assert seen == [0]
