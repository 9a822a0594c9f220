"""Example of sgrld.llc and sgrld.LLCEstimate: the local learning coefficient of a trained
model, from 4 chains of SGLD localised at its parameters."""

import torch

import sgrld

torch.manual_seed(0)
x = torch.randn(512, 4)
y = x @ torch.tensor([1.0, -1.0, 0.5, 2.0])
model = torch.nn.Linear(4, 1)
opt = torch.optim.Adam(model.parameters(), lr=0.05)
for _ in range(300):  # train to a minimum first
    opt.zero_grad()
    ((model(x).squeeze(1) - y) ** 2).mean().backward()
    opt.step()


def loss(m: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    xb, yb = batch
    return ((m(xb).squeeze(1) - yb) ** 2).mean()


loader = list(zip(x.split(64), y.split(64), strict=True))
estimate = sgrld.llc(model, loss, loader, num_data=len(x), num_chains=4, num_steps=2000)
print(estimate)  # an sgrld.LLCEstimate: λ̂ ± se and its verdict; per_chain and trace too
print(estimate.summary())
