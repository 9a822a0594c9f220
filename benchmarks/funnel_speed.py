"""Speed of the funnel reproduction (issue: 4 samplers × 2×10⁶ steps in ≤ 60 s on 2 cores).

Two measurements, side by side in one run:

1. Per sampler, one process, one thread: µs per step of the eager library step
   (``sampler.step`` in a Python loop, gradient included), of the compiled fast path
   (:class:`sgrld.core.multistep.BlockRunner`, compile excluded; median of ``--repeats``
   runs of ``--fast-steps`` steps) and the compile seconds, with the speed-up.
2. The full reproduction end to end (``run_funnel``: worker processes, compilation, every iterate
   kept, distances), in wall seconds, as ``sgrld funnel`` runs it.

Usage::

    python benchmarks/funnel_speed.py                 # both parts, 2×10⁶ steps, 2 jobs
    python benchmarks/funnel_speed.py --skip-full     # part 1 only
    python benchmarks/funnel_speed.py --steps 200000  # the demo's length
    python benchmarks/funnel_speed.py --wrapper python --skip-full  # inductor's Python wrapper

The first run on a machine includes inductor's cold compilation; later runs hit its cache
(``/tmp/torchinductor_$USER``). The machine's load matters: the numbers are wall clock.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
from typing import Any

import torch

import sgrld
from sgrld.core.multistep import BlockRunner
from sgrld.data.funnel import FunnelTarget
from sgrld.experiments.funnel import run as funnel


def eager_us_per_step(name: str, steps: int) -> float:
    s = funnel.SETTINGS[name]
    sampler = sgrld.build(s.metric, lr=s.lr, num_data=1.0, adapt_until=None, **s.options)
    theta = torch.ones(1, 2, dtype=torch.float64)
    state = sampler.init({"theta": theta}, num_chains=1, generator=torch.Generator().manual_seed(0))
    target, gen = FunnelTarget(), torch.Generator().manual_seed(1)
    noise = torch.randn(steps, 1, 2, generator=gen, dtype=torch.float64)
    t0 = time.perf_counter()
    for k in range(steps):
        sampler.step(state, {"theta": target.potential_grad(theta, noise[k])})
    return (time.perf_counter() - t0) / steps * 1e6


def fast_us_per_step(
    name: str, steps: int, repeats: int, block: int, options: dict[str, Any] | None
) -> tuple[float, float, str | None]:
    s = funnel.SETTINGS[name]
    sampler = sgrld.build(s.metric, lr=s.lr, num_data=1.0, adapt_until=None, **s.options)
    theta = torch.ones(1, 2, dtype=torch.float64)
    state = sampler.init({"theta": theta}, num_chains=1, generator=torch.Generator().manual_seed(0))
    runner = BlockRunner(
        sampler,
        state,
        FunnelTarget().potential_grad,
        grad_generator=torch.Generator().manual_seed(1),
        block=block,
        inductor_options=options,
    )
    runner.run(2 * block, lambda first, it: None)  # compile (and the possible recompile)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        runner.run(steps, lambda first, it: None)
        times.append((time.perf_counter() - t0) / steps * 1e6)
    return statistics.median(times), runner.compile_seconds, runner.compile_error


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process and of its finished children (the workers)."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2_000_000, help="full-run steps per sampler")
    parser.add_argument("--samplers", default=",".join(funnel.SETTINGS))
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--eager-steps", type=int, default=2000)
    parser.add_argument("--fast-steps", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--wrapper",
        choices=("default", "cpp", "python"),
        default="default",
        help="inductor wrapper: the runner's default (C++, else Python), or only one of them",
    )
    parser.add_argument("--skip-full", action="store_true", help="only the per-step table")
    args = parser.parse_args()
    names = funnel.parse_samplers(args.samplers)
    torch.set_num_threads(1)
    options: dict[str, Any] | None = {
        "default": None,
        "cpp": {"cpp_wrapper": True},
        "python": {},
    }[args.wrapper]

    print(
        f"torch {torch.__version__}, {os.cpu_count()} cores, block {args.block}, "
        f"wrapper {args.wrapper}"
    )
    print(
        f"{'sampler':<10}{'eager µs':>10}{'fast µs':>10}{'speed-up':>10}{'compile s':>11}"
        f"{'2e6 steps s':>13}"
    )
    total = 0.0
    for name in names:
        eager = eager_us_per_step(name, args.eager_steps)
        fast, compile_s, error = fast_us_per_step(
            name, args.fast_steps, args.repeats, args.block, options
        )
        total += fast * 2e6 / 1e6
        note = f"  (compile failed, eager: {error})" if error else ""
        print(
            f"{name:<10}{eager:>10.1f}{fast:>10.2f}{eager / fast:>10.1f}{compile_s:>11.1f}"
            f"{fast * 2e6 / 1e6:>13.1f}{note}",
            flush=True,
        )
    print(f"sum of the fast paths for 4 × 2e6 steps, one process, compile excluded: {total:.1f} s")

    if args.skip_full:
        return
    config = funnel.FunnelConfig(steps=args.steps, block=args.block)  # the runner's defaults
    cpu0 = _cpu_seconds()
    t0 = time.perf_counter()
    runs = funnel.run_funnel(names, config, jobs=args.jobs, progress=False)
    wall = time.perf_counter() - t0
    cpu = _cpu_seconds() - cpu0
    print(
        f"\nfull reproduction: {len(names)} samplers × {args.steps} steps, {args.jobs} jobs: "
        f"{wall:.1f} s wall, {cpu:.1f} CPU s (compile included; on otherwise idle cores the "
        f"wall time is about CPU s / {args.jobs})"
    )
    for name, r in runs.items():
        seconds = f"{r.wall_seconds:6.1f} s in its worker (compile {r.compile_seconds:.1f} s)"
        print(f"  {name:<10} {seconds}")


if __name__ == "__main__":
    main()
