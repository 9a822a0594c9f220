"""``sgrld report``'s tables: the selection rule's choices (:mod:`.selection`) per setting, prior
and sampler, laid out as the paper's Tables 1-10 (and 11, regression), with the paper's numbers
beside them; the outputs are in ``docs/experiments.md``.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from sgrld.experiments.report.paper import paper_entry, paper_numbers
from sgrld.experiments.report.selection import Choice, select_cell, val_lp
from sgrld.experiments.report.tables import (
    IDENTITY,
    PRIOR_ORDER,
    PRIOR_SHORT,
    SAMPLER_ORDER,
    Group,
    csv_text,
    format_stat,
    headline_likelihood,
    identity_at,
    in_order,
    is_paper,
    lr_text,
    markdown_table,
    position,
    sampler_title,
    setting_key,
)
from sgrld.experiments.run.config import TUNED_FIELDS
from sgrld.experiments.run.results import scored_by


@dataclass(frozen=True)
class Marked:
    """A table cell with a mark after it in markdown (the CSV keeps the bare value)."""

    cell: tuple[float, float] | float | str | None
    mark: str


#: A table cell: (mean, std), a number, or text, or one of them marked.
Cell = tuple[float, float] | float | str | None | Marked


def _marked(cell: Cell) -> Cell:
    """``cell`` with :data:`IDENTITY_MARK` after it (not a cell stating the rule's choice)."""
    if isinstance(cell, Marked) or cell == IDENTITY_OPTIMAL:
        return cell
    return Marked(cell, IDENTITY_MARK)


IDENTITY_OPTIMAL = "Identity (α² = 0) is optimal"


#: Fields that set a setting apart from the paper's protocol: (field, protocol value, how the
#: label names it, how a file name names it).
_SETTING_EXTRAS = (
    ("epochs", 400, "{} epochs", "e{}"),  # "1 epoch": see setting_label
    ("max_train", None, "--subset {}", "sub{}"),
    ("max_eval", None, "--eval-subset {}", "ev{}"),
    ("temperature", 1.0, "τ {}", "T{}"),
    ("burnin", 1000, "--burn-in {}", "b{}"),
    ("thinning", 100, "--thinning {}", "t{}"),
    ("noise", "philox", "--noise {}", "{}"),
    # results written before the warm-up existed adapted throughout: the paper's protocol
    ("adapt", "always", "--adapt {}", "a{}"),
)


def setting_label(setting: dict[str, Any], *, short: bool = False) -> str:
    """The model and the fields that differ from the paper's protocol: ``fc400 (3 epochs,
    --subset 2000)``, or (``short``) ``fc400-e3-sub2000`` for a file name."""
    model = f"fc{setting['width']}" if setting["model"] == "fc" else str(setting["model"])
    extras = [
        (long_form if not short else short_form).format(_value_text(setting[name]))
        for name, default, long_form, short_form in _SETTING_EXTRAS
        if setting.get(name, default) != default
    ]
    extras = ["1 epoch" if extra == "1 epochs" else extra for extra in extras]
    if short:
        return "-".join([model, *extras])
    return model + (f" ({', '.join(extras)})" if extras else "")


def _value_text(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _setting_order(key: str) -> tuple[str, str, int, str]:
    """Settings by dataset, model and width (400 before 1200), then the rest."""
    setting = json.loads(key)
    return setting["dataset"], setting["model"], int(setting.get("width") or 0), key


def select_all(groups: Sequence[Group]) -> list[Choice]:
    """A :class:`Choice` per setting, prior and sampler (Identity first, for Monge's α² = 0)."""
    cells: dict[tuple[str, str, str], list[Group]] = {}
    for group in groups:
        c = group.config
        cells.setdefault((setting_key(c), c["prior"], c["sampler"]), []).append(group)
    choices: dict[tuple[str, str, str], Choice] = {}
    keys = sorted(
        cells, key=lambda k: (k[0], position(k[1], PRIOR_ORDER), position(k[2], SAMPLER_ORDER))
    )
    for key in keys:
        key_text, prior, sampler = key
        identity = choices.get((key_text, prior, IDENTITY))
        identity_score = None
        if identity_at(sampler) and identity is not None and identity.chosen is not None:
            identity_score = val_lp(identity.chosen)
        chosen, stages, zero = select_cell(cells[key], identity_score=identity_score)
        choices[key] = Choice(
            json.loads(key_text), prior, sampler, chosen, stages, cells[key], zero
        )
    return list(choices.values())


@dataclass
class Table:
    """One of the paper's tables: a title, columns (name, digits) and rows of cells."""

    number: int
    title: str
    columns: list[tuple[str, int]]
    rows: list[list[Cell]]

    def markdown(self) -> str:
        def text(cell: Cell, digits: int) -> str:
            if isinstance(cell, Marked):
                return text(cell.cell, digits) + cell.mark
            if cell is None:
                return "–"
            if isinstance(cell, tuple):
                return format_stat(*cell, digits=digits)
            if isinstance(cell, float):
                return "–" if math.isnan(cell) else f"{cell:.{digits}f}"
            return str(cell)

        rows = [
            [text(c, d) for c, (_, d) in zip(row, self.columns, strict=True)] for row in self.rows
        ]
        marked = any(isinstance(c, Marked) for row in self.rows for c in row)
        note = f"\n\n{IDENTITY_NOTE}\n" if marked else ""  # a blank line: not a table row
        return (
            f"**Table {self.number}.** {self.title}\n\n"
            + markdown_table([name for name, _ in self.columns], rows)
            + note
        )

    def csv(self) -> str:
        bare = [[c.cell if isinstance(c, Marked) else c for c in row] for row in self.rows]
        tuples = {i for row in bare for i, c in enumerate(row) if isinstance(c, tuple)}
        header: list[str] = []
        for i, (name, _) in enumerate(self.columns):
            header += [f"{name} mean", f"{name} std"] if i in tuples else [name]
        rows = []
        for row in bare:
            values: list[Any] = []
            for i, cell in enumerate(row):
                pair = cell if isinstance(cell, tuple) else (cell, "")
                values += pair if i in tuples else [cell]
            rows.append(["" if isinstance(v, float) and math.isnan(v) else v for v in values])
        return csv_text(header, rows)


Column = tuple[str, int, Callable[[Choice], Cell]]


def _stat(metric: str) -> Callable[[Choice], Cell]:
    def cell(choice: Choice) -> Cell:
        group = choice.chosen if choice.chosen is not None else choice.best_own
        if group is None:
            return IDENTITY_OPTIMAL if choice.identity_optimal else "broke down"
        mean, std = group.stat(metric)
        return (mean, std) if metric.startswith(("test_", "val_")) else mean

    return cell


def _chosen_lr(choice: Choice) -> Cell:
    if choice.chosen is None:
        if choice.identity_optimal and choice.best_own is not None:
            return f"α² = 0 (Monge's best: {lr_text(choice.best_own.config)})"
        return "α² = 0" if choice.identity_optimal else "–"
    return lr_text(choice.chosen.config)


#: Marks a cell of Monge whose rule's choice is Identity (α² = 0); explained under the table.
IDENTITY_MARK = " †"
IDENTITY_NOTE = (
    "† The selection rule chooses Identity (α² = 0) for Monge here: Identity's validation LP is "
    "at least as good as that of every α² tried. The cell shows Monge's own best α² (its ℓ and "
    "α² are in Table 4; at equal time, in the table's ℓ column), as `sgrld table` does."
)


def _paper_lr(choice: Choice) -> Cell:
    width = choice.setting.get("width")
    entry = paper_entry(str(choice.setting["dataset"]), choice.prior, width, choice.sampler)
    if entry is None:
        return identity_at(choice.sampler) or "–"
    return lr_text(entry._asdict())


def _wide_table(
    number: int,
    title: str,
    choices: Sequence[Choice],
    columns: Sequence[Column],
    paper: Sequence[Column] = (),
) -> Table | None:
    """Rows (setting, sampler), and per prior the columns (and the paper's beside them)."""
    if not choices:
        return None
    priors = in_order([c.prior for c in choices], PRIOR_ORDER)
    by_key = {(setting_key(c.setting), c.prior, c.sampler): c for c in choices}
    settings = sorted({setting_key(c.setting) for c in choices}, key=_setting_order)
    header: list[tuple[str, int]] = [("setting", 0), ("sampler", 0)]
    for prior in priors:
        short = PRIOR_SHORT.get(prior, prior)
        header += [(f"{short} {name}", d) for name, d, _ in columns]
        header += [(f"{short} paper {name}", d) for name, d, _ in paper]
    rows: list[list[Cell]] = []
    for setting in settings:
        samplers = in_order(
            [c.sampler for c in choices if setting_key(c.setting) == setting], SAMPLER_ORDER
        )
        for sampler in samplers:
            row: list[Cell] = [
                setting_label(json.loads(setting)),
                sampler_title(sampler),
            ]
            for prior in priors:
                choice = by_key.get((setting, prior, sampler))
                if choice is not None and choice.identity_optimal and choice.best_own is None:
                    row += [IDENTITY_OPTIMAL] + [""] * (len(columns) - 1)
                elif choice is not None and choice.identity_optimal:  # the rule's and Monge's
                    row += [_marked(f(choice)) for _, _, f in columns]
                else:
                    row += [f(choice) if choice else "–" for _, _, f in columns]
                row += [f(choice) if choice else "–" for _, _, f in paper]
            rows.append(row)
    return Table(number, title, header, rows)


def curves(group: Group, metric: str) -> np.ndarray:
    """``(runs, epochs)`` of a per-epoch metric over the group's completed runs."""
    return np.array(
        [[np.nan if v is None else v for v in r["curves"][metric]] for r in group.completed],
        dtype=np.float64,
    )


@dataclass
class EqualTime:
    """One sampler's row at the common budget: the re-chosen configuration and its metrics."""

    setting: Any  # (ℓ, α²)
    metrics: dict[str, tuple[float, float]]
    budget_s: float


def _lr_and_tuned(group: Group) -> tuple[Any, ...]:
    """A candidate's ℓ and tuned options (α²), in :data:`~.run.config.TUNED_FIELDS` order."""
    return (group.config["lr"], *(group.config.get(n) for n in TUNED_FIELDS))


def equal_time(choices: Sequence[Choice]) -> dict[tuple[str, str, str], EqualTime]:
    """Re-select every sampler at ``epochs × T_fastest`` per setting and prior, each with the
    seconds per epoch of its chosen configuration (as the reference); broken-down
    configurations left out, Monge among its own α² (as the other tables, marked †)."""
    from sgrld.evaluation.equal_time import SamplerCurves, equal_time_table, mean_std_over_runs

    cells: dict[tuple[str, str], dict[str, SamplerCurves]] = {}
    for choice in choices:
        usable = [g for g in choice.candidates if g.num_broken == 0 and g.completed]
        own = choice.best_own
        if own is None or not usable:
            continue
        seconds = own.stat("seconds_per_epoch")[0]
        if not seconds > 0:
            continue
        key = _lr_and_tuned
        # LP and the second score of the likelihood: accuracy, or a regression's RMSE
        second = scored_by(usable[0].completed[0]["curves"]).second()
        stats = {
            key(g): {m: mean_std_over_runs(curves(g, f"test_{m}")) for m in ("lp", second)}
            for g in usable
        }
        cells.setdefault((setting_key(choice.setting), choice.prior), {})[choice.sampler] = (
            SamplerCurves(
                seconds_per_epoch=seconds,
                selection={key(g): curves(g, "val_lp").mean(axis=0) for g in usable},
                test_mean={k: {m: v[0] for m, v in s.items()} for k, s in stats.items()},
                test_std={k: {m: v[1] for m, v in s.items()} for k, s in stats.items()},
            )
        )
    result = {}
    for (setting, prior), cell in cells.items():
        epochs = {np.asarray(c).size for s in cell.values() for c in s.selection.values()}
        budget = max(epochs) * min(s.seconds_per_epoch for s in cell.values())
        for sampler, sampler_curves in cell.items():
            try:  # per sampler: one whose curves do not reach the budget loses only its row
                entry = equal_time_table({sampler: sampler_curves}, budget_s=budget)[sampler]
            except ValueError as exc:  # the budget outside its curve, or nothing finite there
                label = f"{setting_label(json.loads(setting))} {prior} {sampler}"
                print(f"sgrld report: no equal-time row for {label}: {exc}", file=sys.stderr)
                continue
            result[setting, prior, sampler] = EqualTime(entry.setting, entry.metrics, budget)
    return result


_FINAL = "final-epoch test metrics of the chosen ℓ (α²), mean (std, ddof = 0) over seeds"
TITLES = {
    1: "MNIST, fully connected: " + _FINAL,
    2: "MNIST: mean curvature C(θ) of the samples and seconds per epoch",
    3: "CIFAR-10, ResNet-20: " + _FINAL,
    4: "MNIST: chosen learning rate ℓ (and α²) by mean final validation LP",
    5: "CIFAR-10: chosen learning rate ℓ (and α²)",
    6: "MNIST at equal computation time (epochs × the fastest sampler's s/epoch; "
    "ℓ re-chosen on the interpolated validation LP)",
    7: "CIFAR-10 at equal computation time",
    8: "MNIST: ECE (30 bins, top label) of the final ensemble",
    9: "CIFAR-10: ECE (30 bins, top label)",
    10: "mean confidence (top-label probability) of the final ensemble on test",
    11: "Beyond the paper, regression (Gaussian likelihood): "
    + _FINAL
    + "; RMSE of the predictive mean and coverage of its central 50 % / 90 % intervals, "
    "in the targets' units",
}
#: The paper's metric of a column, by the column's name.
_PAPER_METRICS = {
    "LP": "test_lp",
    "acc": "test_accuracy",
    "curv": "curvature",
    "s/epoch": "seconds_per_epoch",
    "ECE": "test_ece",
    "confidence": "test_confidence",
}


def _from_paper(table: int, name: str) -> Callable[[Choice], Cell]:
    """The paper's number in ``table`` of a choice's column ``name``."""

    def cell(choice: Choice) -> Cell:
        dataset = str(choice.setting["dataset"])
        width = choice.setting.get("width") if dataset == "mnist" else None
        key = (table, dataset, width, choice.prior, choice.sampler, _PAPER_METRICS[name])
        value = paper_numbers().get(key)
        if value is None:
            return "–"
        return value if not math.isnan(value[1]) else value[0]

    return cell


def build_tables(choices: Sequence[Choice], *, paper: bool = False) -> list[Table]:
    """Every table the choices allow, in the paper's numbering."""
    mnist = [c for c in choices if c.setting["dataset"] == "mnist"]
    cifar = [c for c in choices if c.setting["dataset"] == "cifar10"]
    # the paper's tables hold the paper's likelihood's runs; Table 11 the others' (regression),
    # with their likelihood's headline scores
    regression = [c for c in choices if not is_paper(c.candidates)]
    classification = [c for c in choices if is_paper(c.candidates)]
    others = headline_likelihood([g for c in regression for g in c.candidates]).headline

    lp, acc = ("LP", 4, _stat("test_lp")), ("acc", 4, _stat("test_accuracy"))
    curv, spe = ("curv", 2, _stat("curvature")), ("s/epoch", 1, _stat("seconds_per_epoch"))
    ece, conf = ("ECE", 4, _stat("test_ece")), ("confidence", 4, _stat("test_confidence"))
    headline = [(label, 4, _stat(f"test_{score}")) for label, score in others.items()]
    ell = ("ℓ", 0, _chosen_lr)

    timed = equal_time(choices)

    def at_budget(metric: str) -> Callable[[Choice], Cell]:
        def cell(c: Choice) -> Cell:
            entry = timed.get((setting_key(c.setting), c.prior, c.sampler))
            if entry is None:
                return IDENTITY_OPTIMAL if c.identity_optimal else "–"
            if metric == "lr":
                lr, *tuned = entry.setting
                return lr_text({"lr": lr, **dict(zip(TUNED_FIELDS, tuned, strict=True))})
            if metric == "budget":
                return entry.budget_s
            return entry.metrics[metric]

        return cell

    timed_cols: list[Column] = [
        ("LP", 4, at_budget("lp")),
        ("acc", 4, at_budget("accuracy")),
        ("ℓ", 0, at_budget("lr")),
        ("budget s", 1, at_budget("budget")),
    ]
    # (table, its runs, its columns, the columns the paper's numbers stand beside)
    specs: list[tuple[int, list[Choice], list[Column], tuple[str, ...]]] = [
        (1, mnist, [lp, acc], ("LP", "acc")),
        (2, mnist, [curv, spe], ("curv", "s/epoch")),
        (3, cifar, [lp, acc, curv, spe, ell], ("LP", "acc", "s/epoch")),
        (4, mnist, [ell], ("ℓ",)),
        (5, cifar, [ell], ("ℓ",)),
        (6, mnist, timed_cols, ("LP", "acc")),
        (7, cifar, timed_cols, ("LP", "acc")),
        (8, mnist, [ece], ("ECE",)),
        (9, cifar, [ece], ("ECE",)),
        (10, classification, [conf], ("confidence",)),
        (11, regression, [lp, *headline, spe, ell], ()),
    ]
    tables = []
    for number, members, columns, paper_names in specs:
        if number in (2, 3) and not any(c.setting.get("curvature") for c in members):
            columns = [col for col in columns if col[0] != "curv"]
        paper_columns = [
            (name, digits, _paper_lr if name == "ℓ" else _from_paper(number, name))
            for name, digits, _ in columns
            if paper and name in paper_names
        ]
        table = _wide_table(number, TITLES[number], members, columns, paper_columns)
        cells = {(setting_key(c.setting), c.prior, c.sampler) for c in members}
        if table is not None and (number not in (6, 7) or cells & set(timed)):
            tables.append(table)
    return tables


#: The columns of ``selection.csv``.
SELECTION_COLUMNS = ["setting", "prior", "sampler", "choice", "for_alpha2", "chosen"]
SELECTION_COLUMNS += ["val_lp_mean", "val_lp_std", "runs", "candidates", "broken_down", "warning"]


def selection_csv(choices: Sequence[Choice]) -> str:
    """Every choice: the cell, the stage, the chosen value, its validation score, the candidates."""
    rows = []
    for choice in choices:
        for stage in choice.stages:
            chosen = stage.chosen
            mean, std = chosen.stat("val_lp") if chosen is not None else (math.nan, math.nan)
            if stage.kind == "alpha2" and choice.identity_optimal:
                mean, std = stage.scores[0.0], math.nan
            value = stage.value
            rows.append(
                [
                    setting_label(choice.setting),
                    choice.prior,
                    choice.sampler,
                    "ℓ" if stage.kind == "lr" else "α²",
                    "" if stage.alpha2 is None else f"{stage.alpha2:g}",
                    "" if value is None else f"{value:g}",
                    "" if math.isnan(mean) else repr(mean),
                    "" if math.isnan(std) else repr(std),
                    len(chosen.completed) if chosen is not None else "",
                    " ".join(
                        f"{k:g}:{'' if math.isnan(v) else f'{v:.6f}'}"
                        for k, v in sorted(stage.scores.items())
                    ),
                    " ".join(f"{v:g}" for v in stage.broken),
                    stage.warning or "",
                ]
            )
    return csv_text(SELECTION_COLUMNS, rows)
