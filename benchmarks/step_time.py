"""Time per full training step (forward + backward + sampler step) of every sampler, as ratios.

Models: MLP 784-N-N-10 (N = 400 or 1200, batch 100) or ResNet-20 (batch 128), random data.
Every sampler (eager, default options, whose noise is ``"torch"``; with ``noise="philox"``; with
``capturable=True``; the compilable ones with ``compile=True`` and Philox noise, drawn inside the
fused call; Shampoo also with ``tiling="even"``), ``torch.optim.SGD`` (foreach, eager) and the
*floor* — SGD's step plus drawing D normals with the counter-based kernel, the cost every sampler
with ``noise="philox"`` pays — run on their own copy of the model, interleaved round by round in
shuffled order, so that every ratio is measured side by side under the same machine conditions. In
the same rounds, the noise draw alone (D normals: the counter-based kernel and torch's
``normal_``; on CPU also the kernel in each lane width, int64 and int32, whatever this CPU would
choose) is timed against a ``copy_`` of D values, the memory-bandwidth figure of this machine.
``ATEN_CPU_CAPABILITY=avx2`` emulates a CPU without AVX-512 on one that has it: ATen's kernels
(``normal_``) and inductor's code (the Philox kernel) then use AVX2 only; this script also sets
inductor's ``cpp.simdlen`` to match, which is part of inductor's cache key (the variable alone is
not: a kernel compiled for AVX-512 earlier would be reused from the cache). The load average is
printed before and after (a shared machine's figures are only comparable at the same load). On CUDA
each sampler also runs as a captured CUDA graph (:class:`sgrld.capture.GraphedStep`), and host syncs
per optimizer step are counted with ``torch.cuda.set_sync_debug_mode``.

Targets of the step engine: on CPU, SGLD ≤ 1.3x SGD, RMSprop, Wenzel, Monge ≤ 1.4x SGD and
Shampoo ≤ 4.5x SGD; on a GPU, eager SGLD, RMSprop, Wenzel, Monge ≤ 1.10x SGD, Shampoo ≤ 1.5x
SGD (MLP 400) or 1.15x SGLD (ResNet-20), captured ≤ 0.3x eager SGD.

    .venv/bin/python benchmarks/step_time.py [--device cpu|cuda] [--model mlp400|mlp1200|resnet20]
        [--rounds 15] [--steps 40] [--threads 2] [--only SGLD,RMSprop] [--defaults-only]
        [--clock wall|cpu] [--telemetry] [--compiled-step] [--competitor T]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch._inductor.config
from torch import nn

import sgrld
from sgrld.core import noise
from sgrld.core.noise import NoiseBuffer, keys_from_seeds
from sgrld.models.resnet20 import ResNet20

NUM_DATA = 50_000

#: name → (optimizer class, ℓ, options): the paper's MNIST settings
BASE: dict[str, tuple[type[sgrld.SGRLDOptimizer], float, dict[str, Any]]] = {
    "SGLD": (sgrld.SGLD, 0.05, {}),
    "RMSprop": (sgrld.RMSpropSGLD, 2.5e-4, {}),
    "Wenzel": (sgrld.WenzelSGLD, 0.05, {}),
    "Monge": (sgrld.MongeSGLD, 0.05, {"alpha2": 1.25}),
    "Shampoo": (sgrld.ShampooSGLD, 1e-3, {}),
}
COMPILABLE = ("SGLD", "RMSprop", "Wenzel")


def make(name: str, device: str, variant: str = "", **kw: Any) -> Callable[..., Any]:
    """A factory ``params -> optimizer`` of sampler ``name`` in ``variant``."""
    cls, lr, options = BASE[name]
    if variant in ("capturable", "graph"):
        kw |= {"noise": "philox", "capturable": True, "lr": torch.tensor(lr, device=device)}
    elif variant == "philox":
        kw |= {"noise": "philox"}
    elif variant == "compile":
        kw |= {"compile": True, "noise": "philox"}
    kw.setdefault("lr", lr)
    return partial(cls, num_data=NUM_DATA, **options, **kw)


def samplers(
    device: str, compiled_step: bool = False, telemetry: bool = False
) -> dict[str, Callable[[list[nn.Parameter]], Any]]:
    out: dict[str, Callable[[list[nn.Parameter]], Any]] = {
        "SGD": lambda p: torch.optim.SGD(p, lr=1e-3, foreach=True),
    }
    for name in BASE:
        out[name] = make(name, device)
        for variant in ("philox", "capturable"):
            out[f"{name}/{variant}"] = make(name, device, variant)
        if name in COMPILABLE and device == "cpu":
            out[f"{name}/compile"] = make(name, device, "compile")
        if device == "cuda":
            out[f"{name}/graph"] = make(name, device, "graph")
        if compiled_step:
            out[f"{name}/compiled-step"] = make(name, device, "capturable")
        if telemetry:
            out[f"{name}/telemetry"] = make(name, device, telemetry=True)
    out |= peers()
    out["Shampoo/even"] = make("Shampoo", device, tiling="even")
    out["Shampoo/frozen"] = make("Shampoo", device)  # G kept: the sampling phase after warm-up
    return out


def peers() -> dict[str, Callable[[list[nn.Parameter]], Any]]:
    """devinterp's samplers (the most used SGLD in PyTorch today) at the same ℓ and nβ = n, where
    installed (``make venv`` installs devinterp 2.0.1 for the tests): ``devinterp`` its ``SGLD``
    class, ``devinterp.sgld``/``.rmsprop`` its ``SGMCMC`` factories; they draw their noise with
    torch's ``normal_``, as ours do by default."""
    try:
        from devinterp.optim.sgld import SGLD as DevSGLD
        from devinterp.optim.sgmcmc import SGMCMC
    except ImportError:
        return {}
    return {
        "devinterp": lambda p: DevSGLD(p, lr=0.05, nbeta=NUM_DATA),
        "devinterp.sgld": lambda p: SGMCMC.sgld(p, lr=0.05, nbeta=NUM_DATA),
        "devinterp.rmsprop": lambda p: SGMCMC.rmsprop_sgld(p, lr=2.5e-4, nbeta=NUM_DATA),
    }


def targets(device: str, model: str) -> dict[str, tuple[str, float]]:
    """(reference row, maximum ratio) of each row."""
    compiled = {f"{name}/compiled-step": (name, 1.0) for name in BASE}  # no slower than eager
    # per-step telemetry: three reductions over D, a few percent of a step
    compiled |= {f"{name}/telemetry": (name, 1.10) for name in BASE}
    if device == "cpu":
        return {
            "SGLD": ("SGD", 1.3),
            "RMSprop": ("SGD", 1.4),
            "Wenzel": ("SGD", 1.4),
            "Monge": ("SGD", 1.4),
            "Shampoo": ("SGD", 4.5),
            **compiled,
        }
    out: dict[str, tuple[str, float]] = {
        name: ("SGD", 1.10) for name in ("SGLD", "RMSprop", "Wenzel", "Monge")
    }
    out["Shampoo"] = ("SGLD", 1.15) if model == "resnet20" else ("SGD", 1.5)
    for name in BASE:
        out[f"{name}/graph"] = ("SGD", 0.3)
    return {**out, **compiled}


def build(model: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if model == "resnet20":
        return ResNet20(10)
    width = int(model.removeprefix("mlp"))
    return nn.Sequential(
        nn.Linear(784, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
    )


def batches(model: str, device: str, pool: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    if model == "resnet20":
        xs = torch.randn(pool, 128, 3, 32, 32, generator=gen)
        ys = torch.randint(0, 10, (pool, 128), generator=gen)
    else:
        xs = torch.rand(pool, 100, 784, generator=gen)
        xs[..., :67] = 0.0  # dead pixels, as in MNIST
        ys = torch.randint(0, 10, (pool, 100), generator=gen)
    return xs.to(device), ys.to(device)


class Row:
    """One model + optimizer pair and its training step (eager, or a captured graph)."""

    def __init__(
        self, name: str, factory: Callable[..., Any] | None, model: str, device: str
    ) -> None:
        self.name = name
        self.model = build(model, 0).to(device)
        self.model.train()
        params = list(self.model.parameters())
        self.floor = name == "floor"
        self.opt = torch.optim.SGD(params, lr=1e-3) if factory is None else factory(params)
        self.noise = NoiseBuffer((sum(p.numel() for p in params),), torch.float32, params[0].device)
        self.keys = keys_from_seeds([0], params[0].device)[0]
        self.step = torch.zeros((), dtype=torch.int64, device=params[0].device)
        self.x: torch.Tensor | None = None
        self.y: torch.Tensor | None = None
        self.graphed: Any = None
        self.compiled: Any = None
        if name.endswith("/compiled-step"):  # the user's whole step under torch.compile
            self.compiled = torch.compile(self._forward_backward_step)

    def _forward_backward_step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.opt.zero_grad(set_to_none=False)
        nn.functional.cross_entropy(self.model(x), y).backward()
        self.opt.step()

    def eager(self) -> None:
        assert self.x is not None and self.y is not None
        self.opt.zero_grad(set_to_none=False)
        nn.functional.cross_entropy(self.model(self.x), self.y).backward()
        self.opt.step()
        if self.floor:  # the counter-based kernel's draw (noise='philox')
            self.noise.draw(torch.Generator(), "philox", self.keys, self.step)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if self.graphed is not None:
            assert self.x is not None and self.y is not None
            self.x.copy_(x)
            self.y.copy_(y)
            self.graphed()
            return
        self.x, self.y = x, y
        if self.compiled is not None:
            self.compiled(x, y)
            self.opt.refresh_if_due()  # capturable Shampoo: the root refresh runs on the host
            return
        self.eager()

    def capture(self, x: torch.Tensor, y: torch.Tensor) -> None:
        from sgrld.capture import GraphedStep

        self.x, self.y = x.clone(), y.clone()
        self.graphed = GraphedStep(self.eager, self.opt)


class Draw:
    """The noise draw alone, D values per call: the Philox kernel (``philox/int64``,
    ``philox/int32``: in that lane width, not the CPU's choice), ``normal_``, or a ``copy_`` of D
    values (what a pass over memory costs on this machine)."""

    def __init__(self, kind: str, size: int, device: str) -> None:
        self.buf = NoiseBuffer((size,), torch.float32, torch.device(device))
        self.src = torch.randn(size, device=device)
        self.gen = torch.Generator(device).manual_seed(0)
        self.keys = keys_from_seeds([0], torch.device(device))[0]
        self.step = torch.zeros((), dtype=torch.int64, device=device)
        self.kind = kind

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if self.kind == "copy_":
            self.buf.flat.copy_(self.src)
        elif self.kind == "normal_":
            self.buf.draw(self.gen, "torch")
        elif self.kind == "philox":
            self.buf.draw(self.gen, "philox", self.keys, self.step)
        else:  # the lane width is read when dynamo traces (and guards on it): one graph each
            choice, noise.INT32_LANES = noise.INT32_LANES, self.kind.endswith("int32")
            try:
                self.buf.draw(self.gen, "philox", self.keys, self.step)
            finally:
                noise.INT32_LANES = choice


DRAWS = ("copy_", "philox", "normal_")
LANES = ("philox/int64", "philox/int32")
#: inductor's vector width (bits) for each ``ATEN_CPU_CAPABILITY``
SIMDLEN = {"avx2": 256, "avx512": 512}


#: the competing process of ``--competitor T``: the same MLP trained with SGD on T threads, forever
COMPETITOR = """
import sys, torch
from torch import nn
torch.set_num_threads(int(sys.argv[1]))
model = nn.Sequential(nn.Linear(784, 400), nn.ReLU(), nn.Linear(400, 400), nn.ReLU(),
                      nn.Linear(400, 10))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x, y = torch.rand(100, 784), torch.randint(0, 10, (100,))
print("ready", flush=True)
while True:
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
"""


def syncs_per_step(row: Row, x: torch.Tensor, y: torch.Tensor, steps: int = 5) -> float:
    """Host syncs per optimizer step on CUDA (torch's sync debug mode warns on each)."""
    row(x, y)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                row.opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in seen) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--model", choices=["mlp400", "mlp1200", "resnet20"], default="mlp400")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=40, help="timed steps per round")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", default="", help="comma list of row prefixes to keep")
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: this process's CPU time (time.process_time), which other jobs' load does not "
        "inflate; with --threads 1 on a shared machine (OpenMP workers spin on CPU time)",
    )
    parser.add_argument(
        "--defaults-only",
        action="store_true",
        help="only the samplers with default options (no philox, capturable, compile rows)",
    )
    parser.add_argument(
        "--compiled-step",
        action="store_true",
        help="add rows with the whole training step under torch.compile (capturable=True)",
    )
    parser.add_argument(
        "--competitor",
        type=int,
        default=0,
        metavar="T",
        help="run a second process (SGD on the same MLP, T threads) during the timed rounds: "
        "two jobs on one machine",
    )
    parser.add_argument(
        "--telemetry",
        action="store_true",
        help="add rows with telemetry=True (per-step drift/noise/θ norms on the device)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    capability = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
    if capability in SIMDLEN:
        torch._inductor.config.cpp.simdlen = SIMDLEN[capability]
    device = args.device
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter

    makes = {"floor": None, **samplers(device, args.compiled_step, args.telemetry)}
    if args.only:
        keep = ("SGD", "floor", *args.only.split(","))
        makes = {k: v for k, v in makes.items() if k.startswith(keep)}
    if args.defaults_only:  # (the telemetry rows, when asked for, are default options + it)
        makes = {k: v for k, v in makes.items() if "/" not in k or k.endswith("/telemetry")}
    pool = 16
    xs, ys = batches(args.model, device, pool)
    load_before = os.getloadavg()
    rows: dict[str, Any] = {
        name: Row(name, factory, args.model, device) for name, factory in makes.items()
    }
    for name, row in rows.items():
        if name.endswith("/graph"):
            row.capture(xs[0], ys[0])
        for i in range(110):  # warm-up: compiles, Shampoo's first refresh at step 100
            row(xs[i % pool], ys[i % pool])
        if name.endswith("/frozen"):  # G kept from here: the sampling phase after adapt_until
            row.opt.freeze_metric()
    syncs = {}
    if device == "cuda":
        syncs = {n: syncs_per_step(r, xs[0], ys[0]) for n, r in rows.items() if r.graphed is None}
    num_params = sum(p.numel() for p in rows["SGD"].model.parameters())
    kinds = DRAWS + (LANES if device == "cpu" else ())
    draws = {f"draw: {kind}": Draw(kind, num_params, device) for kind in kinds}
    for draw in draws.values():
        draw(xs[0], ys[0])  # compiles the kernel
    rows |= draws
    competitor = None
    if args.competitor:
        competitor = subprocess.Popen(
            [sys.executable, "-c", COMPETITOR, str(args.competitor)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert competitor.stdout is not None
        competitor.stdout.readline()  # its set-up is done: it computes from here on
    times: dict[str, list[float]] = {name: [] for name in rows}
    order = list(rows)
    shuffle = random.Random(0)
    counter = 0
    for _ in range(args.rounds):
        shuffle.shuffle(order)  # no row always runs after the same neighbour
        for name in order:
            row = rows[name]
            sync()
            t0 = clock()
            for _ in range(args.steps):
                counter = (counter + 1) % pool
                row(xs[counter], ys[counter])
            sync()
            times[name].append((clock() - t0) / args.steps)
    if competitor is not None:
        competitor.kill()
        competitor.wait()
    med = {name: statistics.median(ts) for name, ts in times.items()}
    goal = targets(device, args.model)
    load_after = os.getloadavg()
    print(" ".join(sys.argv))
    print(
        f"{args.model}, {num_params:,} parameters, {device} "
        f"({torch.cuda.get_device_name() if device == 'cuda' else f'{args.threads} threads'}), "
        f"torch {torch.__version__}, {args.clock} clock, {os.cpu_count()} CPUs "
        f"({torch.backends.cpu.get_cpu_capability()}; Philox in "
        f"{'int32' if noise.INT32_LANES else 'int64'} lanes), "
        f"{f'a competing process on {args.competitor} threads, ' if args.competitor else ''}"
        "load average "
        f"(1, 5, 15 min) {_load(load_before)} before, {_load(load_after)} after; median of "
        f"{args.rounds} interleaved rounds x {args.steps} "
        "steps. ratio: median of the paired per-round ratios to the target's reference "
        "[quartiles]; ok: the median meets the target (yes!: so does the upper quartile)"
    )
    print(
        f"{'row':<22}{'ms/step':>9}{'x SGD':>7}{'x floor':>8}  {'target':<20}"
        f"{'ratio [q1, q3]':<20}{'ok':<5}{'syncs':>6}"
    )
    for name in rows:
        if name in draws:
            continue
        target, ratio, ok = "", "", ""
        if name in goal:
            ref, limit = goal[name]
            paired = [a / b for a, b in zip(times[name], times[ref], strict=True)]
            q1, value, q3 = statistics.quantiles(paired, n=4) if len(paired) > 1 else paired * 3
            target, ratio = f"<= {limit:.2f} x {ref}", f"{value:.2f} [{q1:.2f}, {q3:.2f}]"
            ok = ("yes!" if q3 <= limit else "yes") if value <= limit else "NO"
        sy = f"{syncs[name]:.1f}" if name in syncs else "-"
        print(
            f"{name:<22}{1e3 * med[name]:>9.3f}{med[name] / med['SGD']:>7.2f}"
            f"{med[name] / med['floor']:>8.2f}  {target:<20}{ratio:<20}{ok:<5}{sy:>6}"
        )
    copy = times["draw: copy_"]
    print(
        f"\nthe noise alone, {num_params:,} float32 values per call (same rounds); x copy_: median "
        "of the paired per-round ratios to a copy_ of as many values [quartiles]"
    )
    print(f"{'draw':<22}{'ms':>9}{'GB/s written':>14}  {'x copy_ [q1, q3]':<20}")
    for name in draws:
        q1, value, q3 = statistics.quantiles(
            [a / b for a, b in zip(times[name], copy, strict=True)], n=4
        )
        rate = 4 * num_params / med[name] / 1e9
        print(f"{name:<22}{1e3 * med[name]:>9.3f}{rate:>14.1f}  {value:.1f} [{q1:.1f}, {q3:.1f}]")


def _load(avg: tuple[float, float, float]) -> str:
    return "/".join(f"{a:.1f}" for a in avg)


if __name__ == "__main__":
    main()
