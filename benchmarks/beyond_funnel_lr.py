"""Monge with m = ∇u(θ) on the funnel at other ℓ, with and without Γ.

Separates the dropped term from discretisation: if the bias left with Γ shrinks with ℓ, it is
the Euler step's. Usage::

    python benchmarks/beyond_funnel_lr.py OUT_DIR LR [STEPS] [CHAINS]

writes ``OUT_DIR/funnel-lr<LR>/funnel.json`` (the format of ``sgrld funnel``; exact gradients,
exact starts, seed 1, fixed α² = 0.1).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from sgrld.experiments.funnel.exact import run_current
from sgrld.experiments.funnel.run import FunnelConfig, print_table, write_outputs
from sgrld.metrics import MongeMetric


def main(argv: list[str]) -> int:
    out, lr = Path(argv[0]), float(argv[1])
    steps = int(argv[2]) if len(argv) > 2 else 100_000
    chains = int(argv[3]) if len(argv) > 3 else 10
    torch.set_num_threads(1)
    config = FunnelConfig(steps=steps, chains=chains, start="exact", seed=1, compile=False)
    metric = MongeMetric(alpha2=0.1)
    runs = {}
    for correction in (False, True):
        run = run_current(config, metric, lr, correction)
        runs[run.name] = run
    print_table(runs)
    write_outputs(runs, config, out / f"funnel-lr{lr:g}", plot=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
