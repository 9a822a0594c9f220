"""``sgrld demo``: the funnel experiment, shortened (the project's main job, ``make demo``).

The four samplers of the paper's Figure 2 (Identity, RMSprop, Monge, Shampoo; Wenzel's metric is
Identity's on the funnel, whose θ is one tensor) on the funnel, :data:`DEMO_CHAINS` independent
chains per sampler batched in one state, 2×10⁴ steps each instead of 2×10⁶, run eagerly
(compiling would take longer than these steps do; ``--compile`` turns it on), one process per
core. It prints each sampler's distances to the exact v-marginal N(0, 80) with their spread over
the chains, a legend of the columns, one line per sampler saying what the numbers show against
the truth (or that this run cannot show it, and the command that does), and writes
``funnel.png``, ``funnel.json`` and ``funnel_samples.npz`` to ``--out`` (default ``out/demo``).
Every option of ``sgrld funnel`` applies; ``sgrld funnel --out DIR`` is the full-length run.
"""

from __future__ import annotations

import argparse

from sgrld.experiments.base import exits
from sgrld.experiments.commands import funnel

#: 2×10⁴ steps × 32 chains: the chains cost little more than one (the funnel's θ is a
#: 2-vector; a step is launch-bound), and the four samplers fit in 30 s on 2 cores.
DEMO_STEPS = 20_000
DEMO_CHAINS = 32


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``sgrld funnel``'s options with demo defaults (``--steps 20000 --chains 32 --no-compile
    --out out/demo``)."""
    funnel.add_arguments(
        parser,
        default_steps=DEMO_STEPS,
        default_out="out/demo",
        default_compile=False,
        default_chains=DEMO_CHAINS,
    )
    parser.epilog = exits.epilog("demo")


def run(args: argparse.Namespace) -> int:
    """Entry point of ``sgrld demo``."""
    return funnel.execute(args, "demo")
