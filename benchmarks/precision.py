"""Stationary variance of low-precision chains against the exact one (a Gaussian target).

Target N(μ = 1.01, s² = 0.05²) in each of D coordinates, per-datum potential (θ − μ)²/(2s²)
(num_data = 1), started at stationarity; ℓ is chosen per sampler so that the effective step
h = ℓ·G⁻¹/s² is about 1e-3, where drift and noise of a step are both below half a bfloat16 ulp
at 1 (the regime where round-to-nearest loses moves). The metric adapts for ``--warmup`` steps
and is then frozen, and θ restarts from the target (a frozen G leaves N(μ, s²) invariant up to
O(h)), so only the rounding is tested; the restart also exercises the master copies' re-seeding
from assigned parameters. Prints, per sampler, dtype and ``low_precision`` mode, the variance of
the parameters (what the model sees) over the exact s²/(1 − h/2) of the float64 chain, with its
Monte-Carlo standard error from batch means.

    python benchmarks/precision.py [--steps 30000] [--dim 4096] [--samplers sgld,rmsprop]
"""

from __future__ import annotations

import argparse
import math
import warnings

import torch

import sgrld

# μ is no bfloat16/float16 number: a coordinate that rounds onto μ would have a gradient of
# exactly 0, and RMSprop's G^{-1/2} = (√V + ε)^{-1/2} is then ε^{-1/2} = 10⁴ (its noise explodes)
MU, S, H = 1.01, 0.05, 1e-3
#: ℓ multiplier per sampler: the typical eigenvalue of its G on this target (G⁻¹ shrinks h)
SCALE = {"sgld": 1.0, "wenzel": 1.0, "monge": 1.0, "rmsprop": 1.0 / S, "shampoo": 1.0 / S}
MODES = ("master", "stochastic", "nearest")
OPTIMIZERS = {
    "sgld": (sgrld.SGLD, {}),
    "rmsprop": (sgrld.RMSpropSGLD, {}),
    "wenzel": (sgrld.WenzelSGLD, {"refresh_every": 100}),
    "monge": (sgrld.MongeSGLD, {}),
    "shampoo": (sgrld.ShampooSGLD, {"block_size": 64}),
}


def make(name: str, params: list[torch.Tensor], mode: str, seed: int) -> sgrld.SGRLDOptimizer:
    lr = H * S * S * SCALE[name]
    cls, options = OPTIMIZERS[name]
    gen = torch.Generator().manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # 'nearest' warns, as it should
        return cls(params, lr=lr, num_data=1, generator=gen, low_precision=mode, **options)


def run(
    name: str, dtype: torch.dtype, mode: str, dim: int, steps: int, warmup: int, seed: int = 0
) -> tuple[float, float]:
    """(variance ratio to exact, its standard error) of one chain of ``dim`` coordinates."""
    side = math.isqrt(dim)
    gen = torch.Generator().manual_seed(seed)
    theta = MU + S * torch.randn(side, side, generator=gen, dtype=torch.float64)
    p = torch.nn.Parameter(theta.to(dtype))
    opt = make(name, [p], mode, seed + 1)
    batches, per = 20, steps // 20
    sums = torch.zeros(batches, dtype=torch.float64)
    squares = torch.zeros(batches, dtype=torch.float64)
    with warnings.catch_warnings():
        # h is ~1e-3 on purpose and θ starts (and restarts) at stationarity, so the health
        # watch's "lr is too small" (long relaxation) is right but beside the point here
        warnings.filterwarnings("ignore", ".*lr is too small", sgrld.HealthWarning)
        for t in range(warmup + steps):
            p.grad = ((p.detach().double() - MU) / S**2).to(dtype)
            opt.step()
            if t == warmup - 1:
                # freeze G, then restart θ from the target, independent of G: an adapted G is a
                # function of where θ was (RMSprop's V ≈ g² there), and coordinates frozen far out
                # with a small G⁻¹ would take many relaxation times to forget it (a transient, not
                # the stationary law, which is N(μ, s²) up to O(h) for any frozen G)
                opt.freeze_metric()
                with torch.no_grad():
                    fresh = MU + S * torch.randn(side, side, generator=gen, dtype=torch.float64)
                    p.copy_(fresh.to(dtype))
            if t >= warmup:
                b = min((t - warmup) // per, batches - 1)
                x = p.detach().double()
                sums[b] += x.sum()
                squares[b] += (x * x).sum()
    n = per * dim
    means = sums / n
    variances = squares / n - means**2
    exact = S**2 / (1.0 - H / 2.0)
    ratios = variances / exact
    return float(ratios.mean()), float(ratios.std() / math.sqrt(batches))


def safe_run(
    name: str, dtype: torch.dtype, mode: str, dim: int, steps: int, warmup: int
) -> tuple[float | None, float | None]:
    """:func:`run`, or ``(None, None)`` where the chain breaks down (a non-finite gradient)."""
    try:
        return run(name, dtype, mode, dim, steps, warmup)
    except sgrld.NonFiniteGradientError:
        return None, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30_000)
    parser.add_argument("--warmup", type=int, default=2_000)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--samplers", default="sgld,rmsprop,wenzel,monge,shampoo")
    parser.add_argument("--dtypes", default="bfloat16,float16")
    args = parser.parse_args()
    print(f"D = {args.dim}, {args.steps} steps after {args.warmup} of warm-up, h ≈ {H}")
    print("| sampler | dtype | float32 | master | stochastic | nearest |")
    print("|---|---|---|---|---|---|")
    for name in args.samplers.split(","):
        ref = run(name, torch.float32, "master", args.dim, args.steps, args.warmup)
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            cells = [safe_run(name, dtype, m, args.dim, args.steps, args.warmup) for m in MODES]
            text = " | ".join(
                "breaks down" if r is None else f"{r:.3f} ± {e:.3f}" for r, e in [ref, *cells]
            )
            print(f"| {name} | {dtype_name} | {text} |", flush=True)


if __name__ == "__main__":
    main()
