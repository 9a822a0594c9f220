"""Example of sgrld.Chains, sgrld.chains.chain_batches, sgrld.evaluation.ChainEnsemble and
sgrld.evaluation.evaluate_chains: four chains of a classifier in one process, each with its own
data order, and each chain's ensemble predictive on a test set."""

import torch

import sgrld
from sgrld.chains import chain_batches
from sgrld.evaluation import ChainEnsemble, evaluate_chains

torch.manual_seed(0)
seeds, n = [0, 1, 2, 3], 256
x, y = torch.randn(n, 8), torch.randint(0, 3, (n,))
x_test, y_test = torch.randn(64, 8), torch.randint(0, 3, (64,))


def model(seed: int) -> torch.nn.Module:  # chain k starts where the single run with seed k does
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def nll(m: torch.nn.Module, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(m(xb), yb)


sampler = sgrld.build("rmsprop", lr=1e-2, num_data=n, noise="philox")
chains = sgrld.Chains(model, sampler, seeds)
orders = [torch.Generator().manual_seed(s) for s in seeds]
ensemble = ChainEnsemble(len(seeds), num_points=64, num_classes=3)
for _ in range(3):
    for index in chain_batches(n, 64, orders):  # (K, B) indices: x[index] is (K, B, 8)
        losses = chains.step(nll, x[index], y[index])  # (K,) losses
    evaluate_chains(lambda xb: chains(xb, shared=True), ensemble, x_test)  # one sample each
chains.check()  # raises naming any chain that broke down
print([round(m["lp"], 3) for m in ensemble.metrics(y_test)])  # one figure per chain
