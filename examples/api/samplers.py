"""Example of sgrld.SGLD, sgrld.RMSpropSGLD, sgrld.WenzelSGLD, sgrld.MongeSGLD, sgrld.ShampooSGLD
and sgrld.SGRLDOptimizer: each sampler as a torch.optim optimizer on a linear regression."""

import torch

import sgrld

torch.manual_seed(0)
x = torch.randn(200, 3)
y = x @ torch.tensor([1.0, -2.0, 0.5]) + 0.5 * torch.randn(200)
n = len(x)

for make in (
    lambda p: sgrld.SGLD(p, lr=2e-2, num_data=n),
    lambda p: sgrld.RMSpropSGLD(p, lr=2e-2, num_data=n, decay=0.99),
    lambda p: sgrld.WenzelSGLD(p, lr=2e-2, num_data=n, batch_size=50),
    lambda p: sgrld.MongeSGLD(p, lr=2e-2, num_data=n, alpha2=0.1),
    lambda p: sgrld.ShampooSGLD(p, lr=2e-2, num_data=n, precondition_vectors=True),
    lambda p: sgrld.SGRLDOptimizer(p, lr=2e-2, num_data=n, metric="rmsprop"),
):
    w = torch.zeros(3, requires_grad=True)
    opt = make([w])
    for _ in range(50):
        for batch in torch.randperm(n).split(50):
            opt.zero_grad()
            # the per-datum potential: mean negative log-likelihood (σ = 0.5), flat prior
            loss = ((x[batch] @ w - y[batch]) ** 2).mean() / (2 * 0.5**2)
            loss.backward()
            opt.step()
    print(f"{type(opt).__name__:15s} w = {[round(v, 2) for v in w.tolist()]}")  # ≈ [1, -2, 0.5]
