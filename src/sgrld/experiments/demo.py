"""``sgrld demo``: all five samplers on an ill-conditioned Gaussian target, as a table.

The target is N(μ, Σ) over a (4, 6) weight matrix and a bias vector of 6, written as a per-datum
potential u(θ) = ½(θ−μ)ᵀΣ⁻¹(θ−μ)/n with n = ``--num-data`` (so the samplers see the same scaling
as on a neural network). K chains run in one batched call per sampler; the table reports how
close the pooled draws' mean and covariance are to the truth.

Monge's α² is kept small here: its metric follows the gradient, so it changes with θ, and with
the Γ term dropped (as in the paper) the chain's stationary law moves away from the target as α²
grows (paper §4.1, Theorem 1). With α² = 0 it reproduces SGLD bit for bit.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

import sgrld

SETTINGS: dict[str, dict[str, float]] = {
    "identity": {"lr": 0.005},
    "rmsprop": {"lr": 0.002, "decay": 0.99},
    "wenzel": {"lr": 0.005},
    "monge": {"lr": 0.005, "alpha2": 0.05},
    "shampoo": {"lr": 0.002, "update_interval": 50},
}
SHAPES = {"weight": (4, 6), "bias": (6,)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=4000, help="steps per chain (default 4000)")
    parser.add_argument("--chains", type=int, default=64, help="chains per sampler (default 64)")
    parser.add_argument("--seed", type=int, default=0)


def _target(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    d = sum(math.prod(s) for s in SHAPES.values())
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    precision = q @ torch.diag(torch.logspace(0, 1.5, d, dtype=torch.float64)) @ q.T
    return torch.randn(d, generator=gen, dtype=torch.float64), precision


def run(args: argparse.Namespace) -> int:
    if args.steps < 1 or args.chains < 2:
        print("sgrld demo: --steps must be >= 1 and --chains >= 2", flush=True)
        return 2
    torch.set_num_threads(1)  # tiny batched ops: threads only add overhead
    num_data = 100.0
    mu, precision = _target(args.seed)
    cov = torch.linalg.inv(precision) / num_data  # posterior covariance of exp(−n·u)
    sizes = [math.prod(s) for s in SHAPES.values()]
    print(
        f"Gaussian target, D = {mu.numel()}, condition number 10^1.5, n = {num_data:g}; "
        f"{args.chains} chains x {args.steps} steps, second half kept"
    )
    print(f"{'sampler':<10}{'|mean err|/sd':>15}{'cov rel. err':>15}{'seconds':>10}")
    for name, opts in SETTINGS.items():
        opts = dict(opts)
        sampler = sgrld.build(name, num_data=num_data, **opts)  # type: ignore[arg-type]
        gen = torch.Generator().manual_seed(args.seed + 1)
        start = mu + 0.1 * torch.randn(args.chains, mu.numel(), generator=gen, dtype=torch.float64)
        params = {
            k: v.reshape(args.chains, *s).clone()
            for (k, s), v in zip(SHAPES.items(), start.split(sizes, dim=-1), strict=True)
        }
        state = sampler.init(params, num_chains=args.chains, generator=gen)
        kept = []
        t0 = time.perf_counter()
        for step in range(args.steps):
            theta = torch.cat([v.reshape(args.chains, -1) for v in state.params.values()], -1)
            g = ((theta - mu) @ precision).split(sizes, dim=-1)
            state = sampler.step(
                state,
                {
                    k: v.reshape(args.chains, *s)
                    for (k, s), v in zip(SHAPES.items(), g, strict=True)
                },
            )
            if name == "wenzel" and step % 100 == 99:
                sampler.refresh(state)
            if step >= args.steps // 2:
                kept.append(theta)
        seconds = time.perf_counter() - t0
        draws = torch.cat(kept)
        mean_err = float(((draws.mean(0) - mu) / cov.diagonal().sqrt()).abs().max())
        emp = torch.cov(draws.T)
        cov_err = float(torch.linalg.norm(emp - cov) / torch.linalg.norm(cov))
        print(f"{name:<10}{mean_err:>15.3f}{cov_err:>15.3f}{seconds:>10.2f}", flush=True)
    return 0
