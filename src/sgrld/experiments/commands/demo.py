"""``sgrld demo``: the funnel experiment shortened (``make demo``): ``sgrld funnel`` with
:data:`DEMO_CHAINS` chains of 2×10⁴ steps instead of 2×10⁶, eagerly (compiling would take longer
than these steps), to ``out/demo``.
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
    """``sgrld funnel``'s options with the demo's defaults."""
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
