"""Example of sgrld.build, sgrld.Sampler and sgrld.SamplerState: the functional core, one state
that owns the parameters' statistics, the step counter and the random generator."""

import torch

import sgrld

params = {"w": torch.zeros(3)}
sampler = sgrld.build("rmsprop", lr=1e-2, num_data=100, decay=0.99)  # a sgrld.Sampler
state = sampler.init(params, generator=torch.Generator().manual_seed(0))  # a sgrld.SamplerState
for _ in range(100):
    grads = {"w": state.params["w"] - 1.0}  # ĝ of the per-datum potential ½‖w − 1‖²
    sampler.step(state, grads)
print(state.step, state.params["w"])  # 100 steps; w near 1 (noise of scale √(τ/n) = 0.1)
saved = state.state_dict()  # parameters, statistics, step and generator: resumes exactly
