"""``sgrld geodesics``: Monge-metric geodesics on the funnel (Figure 1)."""

from __future__ import annotations

import argparse
import io
import math
from pathlib import Path

from sgrld.experiments.base import exits
from sgrld.experiments.base.exits import UsageError
from sgrld.experiments.base.files import DirectoryLockedError, locked_out_dir
from sgrld.experiments.commands.common import fail
from sgrld.experiments.funnel.geodesics import (
    BASE_POINTS,
    compute_panel,
    plot_panel,
    write_set,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``sgrld geodesics`` options."""
    parser.epilog = exits.epilog("geodesics")
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    parser.add_argument("--alpha2", type=float, default=1.0, help="α² of the metric (1.0)")
    parser.add_argument(
        "--directions", type=int, default=500, help="geodesics for the red end-point curve (500)"
    )


def run(args: argparse.Namespace) -> int:
    """Entry point of ``sgrld geodesics``."""
    if not (math.isfinite(args.alpha2) and args.alpha2 >= 0) or args.directions < 2:
        return fail("geodesics", "need --alpha2 >= 0 and --directions >= 2", 2)
    try:
        import matplotlib  # noqa: F401
        import scipy.integrate  # noqa: F401
    except ImportError as exc:
        return fail("geodesics", f"{exc.name} is needed (pip install scipy 'sgrld[plots]')", 2)
    try:
        with locked_out_dir(args.out, "sgrld geodesics"):
            return _draw(args)
    except (UsageError, DirectoryLockedError) as exc:
        return fail("geodesics", str(exc), exits.USAGE)
    except OSError as exc:  # the lock cannot be taken: a read-only --out
        return fail("geodesics", str(exc), exits.IO_ERROR)


def _draw(args: argparse.Namespace) -> int:
    """Every figure in memory, then the set written at once (``--out`` locked)."""
    files = {}
    for name, base in BASE_POINTS.items():  # every figure first, in memory
        print(f"geodesics at {name} x̂ = {base}, α² = {args.alpha2:g}", flush=True)
        buffer = io.BytesIO()
        plot_panel(base, *compute_panel(base, args.alpha2, args.directions), buffer)
        files[f"geodesics_{name}.png"] = buffer.getvalue()
    try:
        written = write_set(args.out, files, {"alpha2": args.alpha2, "directions": args.directions})
    except OSError as exc:
        return fail("geodesics", f"writing failed: {exc}", exits.IO_ERROR)
    print("wrote " + ", ".join(str(p) for p in written))
    return exits.OK
