"""Example of sgrld.SampleStore, sgrld.posterior_predictive, sgrld.log_predictive_density and
sgrld.log_density: keep posterior samples, then predict with their ensemble."""

import torch

import sgrld
from sgrld.models import BayesianModel

torch.manual_seed(0)
x = torch.randn(300, 5)
y = (x[:, 0] > 0).long()
n = 250
model = BayesianModel(torch.nn.Linear(5, 2), "gaussian")  # a network and its prior
opt = sgrld.SGLD(model.parameters(), lr=0.05, num_data=n)
store = sgrld.SampleStore(burnin=100, thinning=5, max_samples=40)
for _ in range(40):
    for batch in torch.randperm(n).split(50):
        opt.zero_grad()
        # −log_density / n: the per-datum potential, −mean log-lik − log-prior / n
        (-sgrld.log_density(model, x[batch], y[batch], n) / n).backward()
        opt.step()
        store.observe(model)
probs = sgrld.posterior_predictive(model, store, x[n:])  # (50, 2), averaged over the samples
lp = sgrld.log_predictive_density(model, store, x[n:], y[n:])
accuracy = (probs.argmax(1) == y[n:]).float().mean()
print(f"{len(store)} samples, held-out LP {lp:.3f}, accuracy {accuracy:.2f}")
