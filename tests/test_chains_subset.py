"""sgrld.Chains over a subset of the parameters: K chains sharing one frozen base."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

import sgrld

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import lora_chains


class Adapted(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(0)  # the shared base
        self.base = nn.Linear(6, 4).double()
        gen = torch.Generator().manual_seed(seed)
        self.lora_a = nn.Parameter(torch.randn(2, 6, generator=gen, dtype=torch.float64))
        self.lora_b = nn.Parameter(torch.zeros(4, 2, dtype=torch.float64))

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) + x @ self.lora_a.T @ self.lora_b.T


def loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return ((model(x) - y) ** 2).mean()


@pytest.mark.parametrize("metric", ["identity", "rmsprop", "monge", "shampoo"])
def test_subset_chains_are_single_runs_of_the_subset(metric: str) -> None:
    """Chain k samples the adapters exactly as a single run over them alone (seed k's key),
    the frozen base is one shared copy, untouched."""
    options = {"block_size": 2} if metric == "shampoo" else {}  # no merging into G = I
    sampler = sgrld.build(metric, lr=1e-2, num_data=100, noise="philox", **options)
    seeds = [3, 5, 8]
    chains = sgrld.Chains(Adapted, sampler, seeds, sample=lambda n: n.startswith("lora"))
    assert set(chains.params) == {"lora_a", "lora_b"}
    assert set(chains.frozen) == {"base.weight", "base.bias"}
    base = {n: t.clone() for n, t in chains.frozen.items()}
    gen = torch.Generator().manual_seed(0)
    xs = torch.randn(6, len(seeds), 5, 6, generator=gen, dtype=torch.float64)
    ys = torch.randn(6, len(seeds), 5, 4, generator=gen, dtype=torch.float64)
    for t in range(6):
        chains.step(loss, xs[t], ys[t])
    for k, seed in enumerate(seeds):
        model = Adapted(seed)
        params = {n: p for n, p in model.named_parameters() if n.startswith("lora")}
        state = sampler.init(params, seeds=[seed])
        for t in range(6):
            grads = torch.autograd.grad(loss(model, xs[t, k], ys[t, k]), list(params.values()))
            with torch.no_grad():
                sampler.step(state, dict(zip(params, grads, strict=True)))
        for name, p in params.items():
            torch.testing.assert_close(chains.params[name][k], p.detach(), rtol=1e-12, atol=1e-13)
    for name, t in chains.frozen.items():
        assert torch.equal(t, base[name])
    whole = chains.module(1)
    assert torch.equal(whole.base.weight, base["base.weight"])


def test_frozen_parameters_that_differ_between_chains_are_refused() -> None:
    def make(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Linear(3, 2)

    sampler = sgrld.build("identity", lr=1e-2, num_data=10, noise="philox")
    with pytest.raises(ValueError, match="'weight' is not sampled but differs"):
        sgrld.Chains(make, sampler, [0, 1], sample=lambda n: n == "bias")


def test_lora_transformer_example_memory(capsys: pytest.CaptureFixture[str]) -> None:
    """The documented example runs; memory is the base once plus K times the adapters; the loss
    is printed beside uniform guessing and the data's floor."""
    figures = lora_chains.main(["--chains", "3", "--steps", "2"])
    out = capsys.readouterr().out
    assert "ln 256 = 5.545" in out and "floor (its entropy): ln 16 = 2.773" in out
    per_chain = figures["adapter_bytes_per_chain"] + figures["sampler_state_bytes_per_chain"]
    assert figures["chains_bytes"] == figures["base_bytes"] + 3 * per_chain
    assert figures["chains_bytes"] < 0.5 * figures["full_copies_bytes"]


@pytest.mark.slow
def test_lora_example_learns_its_data() -> None:
    """The adapters learn the data's structure: after 40 steps of 2 chains the loss is below
    uniform guessing (ln 256 = 5.55) by more than 0.5 (measured: 3.52)."""
    figures = lora_chains.main(["--chains", "2", "--steps", "40"])
    assert figures["floor_loss"] < figures["mean_loss"] < figures["uniform_loss"] - 0.5
    assert figures["first_loss"] > figures["uniform_loss"]  # it starts at uniform guessing
