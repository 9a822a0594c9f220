"""Time per training step (forward + backward + sampler step) of every sampler, as ratios.

MLP 784-400-400-10 (478,410 parameters), batch 100, random MNIST-like data, float32. Every
sampler, with its defaults and with ``noise="philox"`` (Shampoo also with ``tiling="even"``), and
the torch.optim.SGD baseline run on their own copy of the model, interleaved round by round so
that all ratios are measured side by side under the same machine conditions. Reports the median
step time, its ratios to SGD and to SGLD, the issue's target (a variant row is held to
SGLD with the same variant), and the sampler's memory (statistics + work buffers) per parameter.

    .venv/bin/python benchmarks/step_time.py [--rounds 15] [--steps 40] [--threads 2]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

import sgrld

NUM_DATA = 50_000

BASE: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "SGLD": lambda p, **kw: sgrld.SGLD(p, lr=0.05, num_data=NUM_DATA, **kw),
    "RMSprop": lambda p, **kw: sgrld.RMSpropSGLD(p, lr=2.5e-4, num_data=NUM_DATA, **kw),
    "Wenzel": lambda p, **kw: sgrld.WenzelSGLD(p, lr=0.05, num_data=NUM_DATA, **kw),
    "Monge": lambda p, **kw: sgrld.MongeSGLD(p, lr=0.05, num_data=NUM_DATA, alpha2=1.25, **kw),
    "Shampoo": lambda p, **kw: sgrld.ShampooSGLD(p, lr=1e-3, num_data=NUM_DATA, **kw),
}
# Every sampler with its defaults and with noise="philox" (sgrld.core.noise); Shampoo also with
# tiling="even" (sgrld.metrics._blocking).
VARIANTS: dict[str, dict[str, Any]] = {
    "philox": {"noise": "philox"},
    "compile": {"compile": True},
    "compile+philox": {"compile": True, "noise": "philox"},
}
SHAMPOO_VARIANTS = {
    "even": {"tiling": "even"},
    "even+philox": {"tiling": "even", "noise": "philox"},
}
SAMPLERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "SGD": lambda p: torch.optim.SGD(p, lr=1e-3),
    **{name: make for name, make in BASE.items()},
    **{
        f"{n}/{v}": partial(make, **kw)
        for n, make in BASE.items()
        for v, kw in VARIANTS.items()
        if not (n in ("Monge", "Shampoo") and "compile" in kw)  # metric.compilable is False
    },
    **{f"Shampoo/{v}": partial(BASE["Shampoo"], **kw) for v, kw in SHAMPOO_VARIANTS.items()},
}
# (reference sampler, maximum ratio) from issue 2; a philox row is compared with SGLD/philox
TARGETS = {
    "SGLD": ("SGD", 1.6),
    "RMSprop": ("SGLD", 1.10),
    "Monge": ("SGLD", 1.10),
    "Wenzel": ("SGLD", 1.05),
    "Shampoo": ("SGD", 4.5),
}


def target_of(name: str) -> tuple[str, float] | None:
    base, _, variant = name.partition("/")
    if base not in TARGETS:
        return None
    ref, limit = TARGETS[base]
    if ref == "SGD" or not variant or variant in ("even", "even+philox"):
        return ref, limit
    return f"{ref}/{variant}", limit


def mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(784, 400), nn.ReLU(), nn.Linear(400, 400), nn.ReLU(), nn.Linear(400, 10)
    )


def state_bytes(opt: torch.optim.Optimizer) -> int:
    if not isinstance(opt, sgrld.SGRLDOptimizer):
        return 0
    total = 0
    for state in opt._group_states:
        if state is None:
            continue
        total += sum(v.numel() * v.element_size() for v in state.stats.values())
        if state.workspace is not None:
            total += sum(
                b.numel() * b.element_size()
                for b in (state.workspace.grad, state.workspace.noise.blocks)
            )
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=40, help="timed steps per round")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    gen = torch.Generator().manual_seed(0)
    pool = 32  # cycle through 32 random batches so that the statistics see varied gradients
    xs = torch.rand(pool, 100, 784, generator=gen)
    xs[..., :67] = 0.0  # dead pixels, as in MNIST
    ys = torch.randint(0, 10, (pool, 100), generator=gen)
    counter = dict.fromkeys(SAMPLERS, 0)
    models = {name: mlp(0) for name in SAMPLERS}
    opts = {name: make(list(models[name].parameters())) for name, make in SAMPLERS.items()}
    num_params = sum(p.numel() for p in models["SGD"].parameters())

    def train_step(name: str) -> None:
        model, opt = models[name], opts[name]
        i = counter[name] = (counter[name] + 1) % pool
        opt.zero_grad(set_to_none=False)
        nn.functional.cross_entropy(model(xs[i]), ys[i]).backward()
        opt.step()

    for name in SAMPLERS:  # warm-up, includes Shampoo's first root refresh at step 100
        for _ in range(110):
            train_step(name)
    times: dict[str, list[float]] = {name: [] for name in SAMPLERS}
    order = list(SAMPLERS)
    shuffle = random.Random(0)
    for _ in range(args.rounds):
        shuffle.shuffle(order)  # no sampler always runs after the same neighbour
        for name in order:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                train_step(name)
            times[name].append((time.perf_counter() - t0) / args.steps)
    med = {name: statistics.median(ts) for name, ts in times.items()}

    print(
        f"MLP 784-400-400-10, batch 100, {num_params:,} parameters, {args.threads} threads, "
        f"torch {torch.__version__}; median of {args.rounds} interleaved rounds "
        f"x {args.steps} steps"
    )
    print(
        "ratio: median over rounds of the paired per-round ratio to the target's reference, "
        "with its quartiles; ok: the median meets the target (yes!: so does the upper quartile)"
    )
    print(
        f"{'sampler':<20}{'ms/step':>8}{'x SGD':>7}{'x SGLD':>7}  "
        f"{'target':<31}{'ratio [q1, q3]':<20}{'ok':<5}{'B/param':>8}"
    )
    for name in SAMPLERS:
        target, ratio, ok = "", "", ""
        spec = target_of(name)
        if spec is not None:
            ref, limit = spec
            paired = [a / b for a, b in zip(times[name], times[ref], strict=True)]
            q1, value, q3 = statistics.quantiles(paired, n=4) if len(paired) > 1 else paired * 3
            target, ratio = f"<= {limit:.2f} x {ref}", f"{value:.2f} [{q1:.2f}, {q3:.2f}]"
            ok = ("yes!" if q3 <= limit else "yes") if value <= limit else "NO"
        print(
            f"{name:<20}{1e3 * med[name]:>8.3f}{med[name] / med['SGD']:>7.2f}"
            f"{med[name] / med['SGLD']:>7.2f}  {target:<31}{ratio:<20}{ok:<5}"
            f"{state_bytes(opts[name]) / num_params:>8.1f}"
        )


if __name__ == "__main__":
    main()
