"""Example of sgrld.tune and sgrld.TuneResult: choose the step size ℓ of a sampler for a chain
of a given length within a budget of gradient evaluations, then run the chain with it."""

import torch

import sgrld

torch.manual_seed(0)
x = torch.randn(256, 3)
y = x @ torch.tensor([1.0, -2.0, 0.5]) + 0.5 * torch.randn(256)
n = len(x)
model = torch.nn.Linear(3, 1)
loader = list(zip(x.split(32), y.split(32), strict=True))


def potential(m: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    xb, yb = batch  # per-datum potential: mean Gaussian negative log-likelihood (σ = 0.5)
    return ((m(xb).squeeze(1) - yb) ** 2).mean() / (2 * 0.5**2)


result = sgrld.tune("rmsprop", model, potential, loader, num_data=n, steps=400, budget=8000)
print(result.options)  # e.g. {'lr': ..., ...}: the sgrld.TuneResult's chosen options
opt = sgrld.SGRLDOptimizer(model.parameters(), metric="rmsprop", num_data=n, **result.options)
