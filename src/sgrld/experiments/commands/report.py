"""``sgrld report``: the paper's selection rule over a sweep, every table and figure."""

from __future__ import annotations

import argparse
from pathlib import Path

from sgrld.experiments.base import exits
from sgrld.experiments.base.exits import UsageError
from sgrld.experiments.base.files import write_atomic
from sgrld.experiments.commands.common import add_strict_argument, fail, report_problems
from sgrld.experiments.report.build import plural
from sgrld.experiments.report.tables import TableError, aggregate, find_results, load_checked
from sgrld.experiments.report.tuning import tuning_table
from sgrld.experiments.report.write import write_report
from sgrld.experiments.run.tuned import read_tune


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``sgrld report`` options."""
    parser.add_argument("runs", nargs="+", metavar="RUNS", help="sweep or run folders")
    parser.add_argument("--out", type=Path, required=True, help="folder for tables and figures")
    parser.add_argument("--paper", action="store_true", help="the paper's numbers beside ours")
    parser.add_argument(
        "--no-figures", action="store_true", help="tables only (no figures, no matplotlib needed)"
    )
    parser.add_argument(
        "--tuned",
        type=Path,
        metavar="DIR",
        help="a sgrld tune folder: write tuning.md, the tuner's compute against the paper's grid",
    )
    add_strict_argument(parser)
    parser.epilog = exits.epilog("report")


def run(args: argparse.Namespace) -> int:
    """Load the runs, write the report, list what was written."""
    if not args.no_figures:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return fail(
                "report",
                "the figures need matplotlib: pip install 'sgrld[plots]', "
                "or pass --no-figures for the tables alone",
                2,
            )
    try:
        runs, problems = load_checked(find_results(args.runs), command="sgrld report")
        report_problems("report", problems)
        if not runs:
            raise TableError("no usable run (every run found is unfinished or left out)")
    except TableError as exc:
        return fail("report", str(exc), exits.USAGE)
    tuning = None
    if args.tuned is not None:
        try:
            tuning = tuning_table(read_tune(args.tuned))
        except UsageError as exc:
            return fail("report", str(exc), exits.USAGE)
    try:
        groups = aggregate(runs)
        written = write_report(
            groups, args.out, paper=args.paper, figures=not args.no_figures, left_out=problems
        )
        if tuning is not None:
            write_atomic(args.out / "tuning.md", tuning)
            written.append(args.out / "tuning.md")
            print(tuning, end="")
    except OSError as exc:
        return fail("report", str(exc), exits.IO_ERROR)
    print(f"{plural(len(runs), 'run')}; wrote {', '.join(p.name for p in written)} to {args.out}")
    return exits.FAILED if args.strict and problems else exits.OK
