"""``sgrld table``: aggregate runs into the paper's table format."""

from __future__ import annotations

import argparse
from pathlib import Path

from sgrld.experiments.base import exits
from sgrld.experiments.base.files import write_atomic
from sgrld.experiments.commands.common import add_strict_argument, fail, report_problems
from sgrld.experiments.report.tables import (
    TableError,
    aggregate,
    csv_table,
    find_results,
    group_label,
    load_checked,
    markdown_diagnostics,
    markdown_long_layout,
    markdown_paper_layout,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``sgrld table`` options."""
    parser.epilog = exits.epilog("table")
    parser.add_argument(
        "runs", nargs="+", metavar="RUN_DIR", help="run directories, or folders holding them"
    )
    parser.add_argument(
        "--layout",
        choices=("paper", "long"),
        default="paper",
        help="paper: Table 1 layout, best ℓ per sampler by validation LP (default); "
        "long: one row per configuration",
    )
    parser.add_argument("--paper", action="store_true", help="add the paper's numbers")
    parser.add_argument("--markdown", type=Path, help="also write the Markdown to this file")
    parser.add_argument("--csv", type=Path, help="write every configuration as CSV to this file")
    parser.add_argument(
        "--include-partial", action="store_true", help="use unfinished runs' last epoch too"
    )
    parser.add_argument(
        "--plot",
        type=Path,
        help="draw every configuration's test LP / accuracy per epoch, mean ± 1.96 std "
        "(Figure 3 layout), to this PNG",
    )
    add_strict_argument(parser)


def run(args: argparse.Namespace) -> int:
    """Aggregate, print the Markdown, write the requested files."""
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return fail(
                "table",
                "--plot needs matplotlib: pip install 'sgrld[plots]', or leave out --plot",
                2,
            )
    try:
        runs, problems = load_checked(find_results(args.runs), include_partial=args.include_partial)
        report_problems("table", problems)
        if not runs:
            raise TableError("no usable run (see --include-partial for unfinished ones)")
    except TableError as exc:
        return fail("table", str(exc), exits.USAGE)
    groups = aggregate(runs)
    if args.layout == "paper":
        text = markdown_paper_layout(groups, paper=args.paper)
    else:
        text = markdown_long_layout(groups)
    diagnostics = markdown_diagnostics(groups)
    if diagnostics:
        text += "\n" + diagnostics
    print(text, end="")
    try:
        if args.markdown is not None:
            write_atomic(args.markdown, text)
        if args.csv is not None:
            write_atomic(args.csv, csv_table(groups))
        if args.plot is not None:
            from sgrld.experiments.run.plots import plot_convergence

            plot_convergence(
                {group_label(g): g.completed for g in groups if g.completed}, args.plot
            )
    except OSError as exc:
        return fail("table", str(exc), exits.IO_ERROR)
    return exits.FAILED if args.strict and problems else exits.OK
