"""Example of sgrld.models.BayesianModel, sgrld.models.potential and sgrld.__version__: a network
with a prior over its weights and the per-datum potential a sampler steps on."""

import torch

import sgrld
from sgrld.models import BayesianModel, potential

print(sgrld.__version__)
torch.manual_seed(0)
x, y = torch.randn(100, 4), torch.randint(0, 2, (100,))
net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
model = BayesianModel(net, "gaussian")  # the prior's parameters live in the model
opt = sgrld.SGLD(model.parameters(), lr=1e-3, num_data=len(x))
for batch in torch.randperm(len(x)).split(20):
    opt.zero_grad()
    value = potential(model, x[batch], y[batch], len(x))  # −mean log-lik − log-prior / n
    value.backward()
    opt.step()
print(float(value.detach()))
