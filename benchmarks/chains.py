"""Chain-steps per second of ``sgrld.Chains`` for K = 1, 2, 4, 10, ... against one plain chain.

One training step = per-chain forward + one backward + one sampler call (``Chains.step``), batch
100 per chain, random MNIST-like data (CIFAR-like for ResNet-20), float32, ``noise="philox"``.
For each model and sampler, the plain single run (an ``nn.Module``, autograd and
``Sampler.step``, no vmap) and every K are timed interleaved round by round, so that the ratios
are measured side by side. Reported per K: ms per step, chain-steps/s, the speed-up over the
plain single chain (target on a GPU: ≥ 8× at K = 10, ≥ 40× at K = 100; ResNet-20 ≥ 4× at
K = 10) and the per-chain cost relative to it (CPU target: ≤ 1 at K = 4).

    .venv/bin/python benchmarks/chains.py [--device cpu|cuda] [--threads 2] [--ks 1,2,4,10]
        [--widths 400,1200] [--resnet] [--samplers identity,monge] [--chain-batch 2]
        [--rounds 5] [--steps 10]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

import sgrld
from sgrld.models import build_model, potential

NUM_DATA, BATCH = 50_000, 100
SAMPLERS: dict[str, dict[str, Any]] = {  # the paper's MNIST settings (as benchmarks/step_time.py)
    "identity": {"lr": 0.05},
    "rmsprop": {"lr": 2.5e-4},
    "wenzel": {"lr": 0.05},
    "monge": {"lr": 0.05, "alpha2": 1.25},
    "shampoo": {"lr": 1e-3},
}


def loss_fn(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return potential(model, x, y, NUM_DATA)  # type: ignore[arg-type]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Plain:
    """One chain as a single run does it: module, autograd, ``Sampler.step``."""

    def __init__(
        self, make: Callable[[int], nn.Module], sampler: sgrld.Sampler, x: Tensor, y: Tensor
    ):
        self.model = make(0)
        self.params = dict(self.model.named_parameters())
        self.sampler = sampler
        self.state = sampler.init(self.params, seeds=[0])
        self.x, self.y = x[0], y[0]

    def step(self) -> None:
        loss = loss_fn(self.model, self.x, self.y)
        grads = torch.autograd.grad(loss, list(self.params.values()))
        with torch.no_grad():
            self.sampler.step(self.state, dict(zip(self.params, grads, strict=True)))


class Many:
    """K chains in one ``Chains``."""

    def __init__(
        self,
        make: Callable[[int], nn.Module],
        sampler: sgrld.Sampler,
        x: Tensor,
        y: Tensor,
        chain_batch: int | None = None,
    ):
        seeds = list(range(x.shape[0]))
        self.chains = sgrld.Chains(make, sampler, seeds, chain_batch=chain_batch)
        self.x, self.y = x, y

    def step(self) -> None:
        self.chains.step(loss_fn, self.x, self.y)


def bench(
    make: Callable[[int], nn.Module],
    shape: tuple[int, ...],
    sampler_name: str,
    ks: list[int],
    device: torch.device,
    rounds: int,
    steps: int,
    chain_batch: int | None = None,
) -> list[tuple[str, int, float]]:
    """Median seconds per step of the plain single run and of each K (interleaved rounds)."""
    sampler = sgrld.build(sampler_name, num_data=NUM_DATA, noise="philox", **SAMPLERS[sampler_name])
    gen = torch.Generator().manual_seed(0)
    kmax = max(ks)
    x = torch.randn(kmax, BATCH, *shape, generator=gen).to(device)
    y = torch.randint(0, 10, (kmax, BATCH), generator=gen).to(device)
    runs: dict[tuple[str, int], Any] = {("plain", 1): Plain(make, sampler, x, y)}
    for k in ks:
        runs[("chains", k)] = Many(make, sampler, x[:k], y[:k], chain_batch)
    times: dict[tuple[str, int], list[float]] = {key: [] for key in runs}
    for run in runs.values():  # warm-up: compile the noise kernel, allocate the work buffers
        run.step()
        run.step()
    for _ in range(rounds):
        for key, run in runs.items():
            sync(device)
            start = time.perf_counter()
            for _ in range(steps):
                run.step()
            sync(device)
            times[key].append((time.perf_counter() - start) / steps)
    return [(kind, k, statistics.median(t)) for (kind, k), t in times.items()]


def report(title: str, rows: list[tuple[str, int, float]]) -> None:
    plain = next(t for kind, _, t in rows if kind == "plain")
    print(f"\n{title}")
    print(f"{'run':>12} {'ms/step':>9} {'chain-steps/s':>14} {'× plain':>8} {'cost/chain':>11}")
    for kind, k, t in rows:
        label = "plain" if kind == "plain" else f"K={k}"
        speedup = (k / t) / (1 / plain)
        print(f"{label:>12} {t * 1e3:9.2f} {k / t:14.1f} {speedup:8.2f} {1 / speedup:11.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ks", default="1,2,4,10", help="comma list of chain counts K")
    parser.add_argument(
        "--widths", default="400", help="MLP hidden widths N (comma list; empty: no MLP)"
    )
    parser.add_argument("--resnet", action="store_true", help="also ResNet-20 (CIFAR-10 shapes)")
    parser.add_argument("--samplers", default=",".join(SAMPLERS), help="comma list")
    parser.add_argument("--chain-batch", type=int, default=None, help="Chains(chain_batch=)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="steps per round")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    ks = [int(k) for k in args.ks.split(",")]
    models: list[tuple[str, Callable[[int], nn.Module], tuple[int, ...]]] = []
    for width in (int(w) for w in args.widths.split(",") if w):

        def make_fc(seed: int, width: int = width) -> nn.Module:
            gen = torch.Generator().manual_seed(seed)
            return build_model("fc", width=width, generator=gen).to(device)

        models.append((f"MLP N={width}", make_fc, (784,)))
    if args.resnet:

        def make_resnet(seed: int) -> nn.Module:
            gen = torch.Generator().manual_seed(seed)
            return build_model("resnet20", generator=gen).to(device)

        models.append(("ResNet-20", make_resnet, (3, 32, 32)))
    print(
        f"device {device}, threads {args.threads}, batch {BATCH} per chain, float32, philox, "
        f"chain_batch {args.chain_batch or 'K'}"
    )
    for title, make, shape in models:
        for name in args.samplers.split(","):
            rows = bench(make, shape, name, ks, device, args.rounds, args.steps, args.chain_batch)
            report(f"{title}, {name}", rows)


if __name__ == "__main__":
    main()
