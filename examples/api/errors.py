"""Example of sgrld.NonFiniteGradientError: a NaN gradient stops the chain before it moves."""

import torch

import sgrld

w = torch.zeros(2, requires_grad=True)
opt = sgrld.SGLD([w], lr=1e-3, num_data=10, sync_checks=True)
w.grad = torch.tensor([float("nan"), 0.0])
try:
    opt.step()
except sgrld.NonFiniteGradientError as error:
    print("refused:", error)
print(w)  # unchanged
