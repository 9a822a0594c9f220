"""``sgrld report``: the paper's selection rule over a sweep, every table and figure."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from sgrld.experiments.base import exits
from sgrld.experiments.base.exits import UsageError
from sgrld.experiments.base.files import (
    DirectoryLockedError,
    check_out_dir,
    locked_out_dir,
    write_atomic,
)
from sgrld.experiments.commands.common import add_strict_argument, fail, report_problems
from sgrld.experiments.report.build import (
    build_tables,
    plural,
    select_all,
    selection_csv,
    setting_label,
)
from sgrld.experiments.report.tables import Group, TableError, aggregate, find_results, load_checked
from sgrld.experiments.report.tuning import tuning_table
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
        check_out_dir(args.out)
    except UsageError as exc:
        return fail("report", str(exc), exits.USAGE)
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
        with locked_out_dir(args.out, "sgrld report"):
            written = write_report(groups, args, left_out=problems)
            if tuning is not None:
                write_atomic(args.out / "tuning.md", tuning)
                written.append(args.out / "tuning.md")
                print(tuning, end="")
    except (UsageError, DirectoryLockedError) as exc:
        return fail("report", str(exc), exits.USAGE)
    except OSError as exc:
        return fail("report", str(exc), exits.IO_ERROR)
    print(f"{plural(len(runs), 'run')}; wrote {', '.join(p.name for p in written)} to {args.out}")
    return exits.FAILED if args.strict and problems else exits.OK


def write_report(
    groups: Sequence[Group], args: argparse.Namespace, left_out: Sequence[str]
) -> list[Path]:
    """Select, then write every table, figure, ``selection.csv`` and ``report.md`` to ``--out``
    (each file atomically, never through a link planted at its name); ``left_out`` lists the
    runs left out and why."""
    out = args.out
    choices = select_all(groups)
    tables = build_tables(choices, paper=args.paper)
    written = []
    for table in tables:
        for suffix, text in (("md", table.markdown() + "\n"), ("csv", table.csv())):
            path = out / f"table{table.number}.{suffix}"
            write_atomic(path, text)
            written.append(path)
    write_atomic(out / "selection.csv", selection_csv(choices))
    written.append(out / "selection.csv")
    if not args.no_figures:
        from sgrld.experiments.report.figures import draw_figures  # matplotlib: only if asked

        written += draw_figures(choices, out)
    warnings = [
        f"- {setting_label(c.setting)} {c.prior} {c.sampler}: {w}"
        for c in choices
        for w in c.warnings
    ]
    body = "\n\n".join(t.markdown() for t in tables)
    notes = "\n".join(warnings) if warnings else "none"
    figure_list = "\n".join(f"- {p.name}" for p in written if p.suffix == ".png") or "none"
    dropped = "\n".join(f"- {line}" for line in left_out) or "none"
    text = (
        f"# Report of {plural(sum(len(g.runs) for g in groups), 'run')}\n\n{body}\n\n"
        f"## Selection warnings\n\n{notes}\n\n## Runs left out\n\n{dropped}\n\n"
        f"## Figures\n\n{figure_list}\n"
    )
    write_atomic(out / "report.md", text)
    written.append(out / "report.md")
    for line in warnings:
        print(f"sgrld report: warning: {line[2:]}", file=sys.stderr)
    return written
