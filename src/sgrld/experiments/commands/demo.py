"""``sgrld demo``: the funnel experiment, shortened (the README's main job).

The four samplers of the paper's Figure 2 (Identity, RMSprop, Monge, Shampoo; Wenzel's metric is
Identity's on the funnel, whose θ is one tensor) on the funnel, 3×10⁴ steps each instead of
2×10⁶, run eagerly (compiling would take longer than these steps do; ``--compile`` turns it
on), one process per core. It prints each sampler's distance to the exact v-marginal N(0, 80)
(Wasserstein-1, Kolmogorov–Smirnov, the mass below v = −5 and the minimum v), the kernel Stein
discrepancy of v, the ESS of v per second of sampling, the seconds spent sampling, a legend of
these columns, and writes ``funnel.png``, ``funnel.json`` and ``funnel_samples.npz`` to
``--out`` (default ``out/demo``). Every option of ``sgrld funnel`` applies; ``sgrld funnel
--out DIR`` is the full-length run (compiled).
"""

from __future__ import annotations

import argparse

from sgrld.experiments.base import exits
from sgrld.experiments.commands import funnel

DEMO_STEPS = 30_000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``sgrld funnel``'s options with demo defaults (``--steps 30000 --no-compile --out
    out/demo``)."""
    funnel.add_arguments(
        parser, default_steps=DEMO_STEPS, default_out="out/demo", default_compile=False
    )
    parser.epilog = exits.epilog("demo")


def run(args: argparse.Namespace) -> int:
    """Entry point of ``sgrld demo``."""
    return funnel.execute(args, "demo")
