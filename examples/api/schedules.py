"""Example of sgrld.CyclicalLR: cosine-cyclical ℓ with exploration (τ = 0) and sampling phases;
keep samples only while not exploring."""

import torch

import sgrld

w = torch.zeros(5, requires_grad=True)
opt = sgrld.SGLD([w], lr=1e-2, num_data=100)
schedule = sgrld.CyclicalLR(opt, total_steps=400, cycles=4, explore_fraction=0.5)
kept = []
for _ in range(400):
    opt.zero_grad()
    (0.5 * (w**2).sum()).backward()
    opt.step()
    if not schedule.exploring:
        kept.append(w.detach().clone())
    schedule.step()
print(len(kept), "samples")  # half of every cycle samples
