"""Write a report: every table, figure, ``selection.csv`` and ``report.md``, each atomically."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from sgrld.experiments.base.files import write_atomic
from sgrld.experiments.report.build import (
    build_tables,
    plural,
    select_all,
    selection_csv,
    setting_label,
)
from sgrld.experiments.report.tables import Group


def write_report(
    groups: Sequence[Group],
    out: Path,
    *,
    paper: bool,
    figures: bool,
    left_out: Sequence[str] = (),
) -> list[Path]:
    """Select, then write every table, figure, ``selection.csv`` and ``report.md`` to ``out``
    (each file atomically, never through a link planted at its name); ``left_out`` lists the
    runs left out and why."""
    choices = select_all(groups)
    tables = build_tables(choices, paper=paper)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for table in tables:
        for suffix, text in (("md", table.markdown() + "\n"), ("csv", table.csv())):
            path = out / f"table{table.number}.{suffix}"
            write_atomic(path, text)
            written.append(path)
    write_atomic(out / "selection.csv", selection_csv(choices))
    written.append(out / "selection.csv")
    if figures:
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
