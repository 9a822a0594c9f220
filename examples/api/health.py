"""Example of sgrld.health, sgrld.Health and sgrld.HealthWarning: is the chain healthy? From an
optimizer's telemetry (telemetry=True)."""

import warnings

import torch

import sgrld

w = torch.zeros(10, requires_grad=True)
opt = sgrld.SGLD([w], lr=1e-2, num_data=100, telemetry=True)
for _ in range(200):
    opt.zero_grad()
    (0.5 * (w**2).sum()).backward()
    opt.step()
verdict = sgrld.health(opt)  # a sgrld.Health
print(verdict.verdict, verdict.ok, verdict.reason)  # 'healthy' True ...
# a chain the optimizer's own watch finds sick warns once with a sgrld.HealthWarning;
# promote it to an error to stop such a run:
warnings.simplefilter("error", sgrld.HealthWarning)
