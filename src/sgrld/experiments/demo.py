"""``sgrld demo``: the funnel experiment, shortened (the README's main job).

All four samplers of the paper's Figure 2 (Identity, RMSprop, Monge, Shampoo, reference §5.3) on
the funnel, 2×10⁵ steps each instead of 2×10⁶, on the library's samplers through the compiled
fast path, one process per core. It prints each sampler's distance to the exact v-marginal
N(0, 80) (Wasserstein-1, Kolmogorov–Smirnov, the mass below v = −5 and the minimum v), the
kernel Stein discrepancy of v, the ESS of v per second of sampling, and the seconds spent
sampling and compiling, apart, with a progress bar, and writes ``funnel.png``,
``funnel.json`` and ``funnel_samples.npz`` to ``--out`` (default ``out/demo``). Every option
of ``sgrld funnel`` applies; ``sgrld funnel --out DIR`` is the full-length run.

The first run compiles each sampler's step (tens of seconds on 2 cores, the "compile s"
column, not counted in "run s" or ESS/s); later runs reuse PyTorch's compile cache.
"""

from __future__ import annotations

import argparse

from sgrld.experiments import exits, funnel

DEMO_STEPS = 200_000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``sgrld funnel``'s options with demo defaults (``--steps 200000 --out out/demo``)."""
    funnel.add_arguments(parser, default_steps=DEMO_STEPS, default_out="out/demo")
    parser.epilog = exits.epilog("demo")


def run(args: argparse.Namespace) -> int:
    """Entry point of ``sgrld demo``."""
    return funnel.execute(args, "demo")
