"""``sgrld report``: the selection rule's edge cases, tables, figures and the paper's numbers."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sgrld.cli import main
from sgrld.experiments.report.build import (
    IDENTITY_OPTIMAL,
    Marked,
    build_tables,
    equal_time,
    paper_numbers,
    select_all,
)
from sgrld.experiments.report.selection import Choice
from sgrld.experiments.report.tables import aggregate

EPOCHS = 4


def fake_run(
    sampler: str,
    lr: float,
    seed: int,
    val_lp: float,
    *,
    alpha2: float | None = None,
    prior: str = "horseshoe",
    width: int = 400,
    status: str = "completed",
    seconds: float = 1.0,
) -> dict[str, Any]:
    """A results.json whose curves rise linearly to ``val_lp`` (test LP = val LP - 0.01)."""
    ramp = np.linspace(2.0, 1.0, EPOCHS) * val_lp
    curves = {
        "epoch": list(range(EPOCHS)),
        "val_lp": list(ramp),
        "test_lp": list(ramp - 0.01),
        "test_accuracy": [0.9 + 0.01 * e for e in range(EPOCHS)],
    }
    final = {
        "val": {"lp": val_lp, "accuracy": 0.9, "ece": 0.02, "confidence": 0.95},
        "test": {"lp": val_lp - 0.01, "accuracy": 0.93, "ece": 0.03, "confidence": 0.96},
    }
    config = {
        "dataset": "mnist",
        "model": "fc",
        "prior": prior,
        "sampler": sampler,
        "lr": lr,
        "epochs": EPOCHS,
        "seed": seed,
        "width": width,
        "alpha2": alpha2,
        "curvature": False,
    }
    return {
        "format": "sgrld-sample-results/1",
        "config": config,
        "seed": seed,
        "status": status,
        "final": final,
        "curves": curves,
        "seconds_per_epoch": seconds,
        "num_samples": 10,
        "curvature": None,
    }


def choices(runs: list[dict[str, Any]]) -> dict[str, Choice]:
    return {c.sampler: c for c in select_all(aggregate(runs))}


def test_best_mean_validation_lp_wins() -> None:
    runs = [
        fake_run("rmsprop", lr, s, v + 0.01 * s)
        for lr, v in ((1e-4, -0.2), (5e-4, -0.1), (1e-3, -0.3))
        for s in (0, 1)
    ]
    choice = choices(runs)["rmsprop"]
    assert choice.chosen is not None and choice.chosen.config["lr"] == 5e-4
    assert choice.warnings == []  # an interior value
    assert choice.stages[0].scores == {
        1e-4: pytest.approx(-0.195),
        5e-4: pytest.approx(-0.095),
        1e-3: pytest.approx(-0.295),
    }


def test_ties_go_to_the_smaller_lr() -> None:
    runs = [fake_run("identity", lr, 0, -0.1) for lr in (0.5, 0.1, 0.25)]
    choice = choices(runs)["identity"]
    assert choice.chosen is not None and choice.chosen.config["lr"] == 0.1
    assert "smallest" in choice.warnings[0]


def test_a_broken_down_configuration_is_never_chosen() -> None:
    runs = [fake_run("identity", 0.1, s, -0.2) for s in (0, 1)]
    runs += [
        fake_run("identity", 0.25, 0, -0.05),
        fake_run("identity", 0.25, 1, -0.05, status="broken_down"),
    ]
    runs += [fake_run("identity", 0.5, s, -0.3) for s in (0, 1)]
    choice = choices(runs)["identity"]
    assert choice.chosen is not None and choice.chosen.config["lr"] == 0.1
    assert choice.stages[0].broken == [0.25]
    only_broken = choices([fake_run("wenzel", 0.1, 0, -0.1, status="broken_down")])["wenzel"]
    assert only_broken.chosen is None and "broke down" in only_broken.warnings[0]


def test_a_single_lr_is_chosen_with_a_warning() -> None:
    choice = choices([fake_run("shampoo", 0.005, s, -0.06) for s in range(3)])["shampoo"]
    assert choice.chosen is not None and choice.chosen.config["lr"] == 0.005
    assert "only value tried" in choice.warnings[0]


def test_lr_then_alpha2_for_monge_only() -> None:
    runs = [
        fake_run("identity", lr, 0, v) for lr, v in ((0.1, -0.09), (0.25, -0.08), (0.5, -0.085))
    ]
    grid = {  # α² → ℓ → val LP: the best ℓ differs per α²
        0.5: {0.1: -0.075, 0.25: -0.07, 0.5: -0.072},
        1.0: {0.1: -0.066, 0.25: -0.065, 0.5: -0.06},
        2.0: {0.1: -0.068, 0.25: -0.069, 0.5: -0.07},
    }
    runs += [
        fake_run("monge", lr, 0, v, alpha2=a) for a, row in grid.items() for lr, v in row.items()
    ]
    found = choices(runs)
    assert [s.kind for s in found["identity"].stages] == ["lr"]
    monge = found["monge"]
    per_alpha2 = {s.alpha2: s.value for s in monge.stages if s.kind == "lr"}
    assert per_alpha2 == {0.5: 0.25, 1.0: 0.5, 2.0: 0.1}
    assert monge.chosen is not None and (
        monge.chosen.config["alpha2"],
        monge.chosen.config["lr"],
    ) == (1.0, 0.5)
    assert monge.stages[-1].kind == "alpha2" and not monge.identity_optimal
    assert any("ℓ (for α² = 1) = 0.5 is the largest" in w for w in monge.warnings)
    assert not any(w.startswith("α²") for w in monge.warnings)  # α² = 1 is interior


def test_identity_optimal_when_no_alpha2_beats_it() -> None:
    runs = [fake_run("identity", lr, 0, v) for lr, v in ((0.1, -0.05), (0.25, -0.04), (0.5, -0.06))]
    runs += [fake_run("monge", 0.25, 0, v, alpha2=a) for a, v in ((0.1, -0.041), (1.0, -0.05))]
    monge = choices(runs)["monge"]
    assert monge.chosen is None and monge.identity_optimal
    tables = {t.number: t for t in build_tables(select_all(aggregate(runs)))}
    # Both: the rule's choice (Identity) and Monge's own best cell (α² 0.1), as sgrld table shows.
    text = tables[1].markdown()
    monge_row = next(line for line in text.splitlines() if "| Monge |" in line)
    assert "-0.0510 †" in monge_row and "0.9300 †" in monge_row
    assert "† The selection rule chooses Identity (α² = 0) for Monge here" in text
    assert "α² = 0 (Monge's best: 0.25, α² 0.1)" in tables[4].markdown()
    assert "†" not in tables[1].csv() and "-0.051" in tables[1].csv()
    # Table 6 (equal time) as its footnote says: Monge's own best, re-chosen at the budget.
    table6 = tables[6].markdown()
    monge_row = next(line for line in table6.splitlines() if "| Monge |" in line)
    assert "-0.0510 (0.0000) †" in monge_row and "0.25, α² 0.1 †" in monge_row
    assert "|\n\n† The selection rule" in table6  # the note is a paragraph, not a table row
    for table in tables.values():  # no marked cell says the opposite of the mark's note
        for row in table.rows:
            assert not any(isinstance(c, Marked) and c.cell == IDENTITY_OPTIMAL for c in row)


def test_equal_time_reselects_at_the_fastest_budget() -> None:
    # identity: 1 s/epoch; shampoo: 2 s/epoch, so at the 4 s budget its epoch-2 end counts.
    runs = [fake_run("identity", 0.1, s, -0.1, seconds=1.0) for s in (0, 1)]
    runs += [
        fake_run("shampoo", lr, s, v, seconds=2.0)
        for lr, v in ((0.005, -0.05), (0.01, -0.06))
        for s in (0, 1)
    ]
    timed = equal_time(select_all(aggregate(runs)))
    entry = next(v for (_, _, sampler), v in timed.items() if sampler == "shampoo")
    assert entry.budget_s == EPOCHS * 1.0
    lp = np.linspace(2.0, 1.0, EPOCHS) * -0.05 - 0.01  # the chosen ℓ's test LP curve
    assert entry.metrics["lp"][0] == pytest.approx(lp[1])  # epoch 2 ends at 4 s
    assert entry.setting == (0.005, None)


def test_paper_numbers_are_transcribed() -> None:
    numbers = paper_numbers()
    assert numbers[1, "mnist", 400, "horseshoe", "monge", "test_lp"] == (-0.0629, 0.0009)
    assert numbers[3, "cifar10", None, "correlated", "shampoo", "test_accuracy"] == (0.8668, 0.0023)
    assert numbers[6, "mnist", 1200, "horseshoe", "shampoo", "test_lp"] == (-0.0599, 0.0005)
    assert numbers[9, "cifar10", None, "gaussian", "wenzel", "test_ece"][0] == 0.1006
    assert numbers[10, "mnist", 400, "horseshoe", "rmsprop", "test_confidence"][0] == 0.9684
    assert (1, "mnist", 400, "gaussian", "monge", "test_lp") not in numbers  # Identity optimal


def write_runs(folder: Path, runs: list[dict[str, Any]]) -> None:
    for i, run in enumerate(runs):
        path = folder / f"run{i}"
        path.mkdir(parents=True)
        (path / "results.json").write_text(json.dumps(run))


def test_report_writes_tables_figures_and_selection(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = [
        fake_run("identity", lr, s, v) for lr, v in ((0.1, -0.09), (0.25, -0.08)) for s in (0, 1)
    ]
    runs += [
        fake_run("monge", 0.25, s, v, alpha2=a)
        for a, v in ((0.5, -0.07), (1.25, -0.06), (2.0, -0.075))
        for s in (0, 1)
    ]
    write_runs(tmp_path / "runs", runs)
    out = tmp_path / "report"
    assert main(["report", str(tmp_path / "runs"), "--out", str(out), "--paper"]) == 0
    assert "warning" in capsys.readouterr().err  # identity's ℓ = 0.25 is at the edge
    names = {p.name for p in out.iterdir()}
    assert {"table1.md", "table1.csv", "table4.md", "table6.md", "table8.md", "table10.md"} <= names
    assert {"selection.csv", "report.md"} <= names
    assert {n for n in names if n.startswith("figure")} == {
        "figure3_fc400-e4_HS.png",
        "figure4_fc400-e4_HS.png",
    }
    table1 = (out / "table1.md").read_text()
    assert "-0.0629 (0.0009)" in table1  # the paper's Monge HS400 beside ours
    with open(out / "table1.csv", encoding="utf-8") as handle:
        rows = {r["sampler"]: r for r in csv.DictReader(handle)}
    assert float(rows["Monge"]["HS LP mean"]) == pytest.approx(-0.07)
    assert float(rows["Monge"]["HS paper LP mean"]) == -0.0629
    with open(out / "selection.csv", encoding="utf-8") as handle:
        selection = list(csv.DictReader(handle))
    alpha2_row = next(r for r in selection if r["choice"] == "α²")
    assert alpha2_row["chosen"] == "1.25" and float(alpha2_row["val_lp_mean"]) == pytest.approx(
        -0.06
    )
    assert "0:-0.080000" in alpha2_row["candidates"]  # Identity is α² = 0


def test_report_of_nothing_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "r")]) == 2
    assert "no results.json" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_settings_in_the_papers_order() -> None:
    runs = [fake_run("identity", 0.1, 0, -0.1, width=w) for w in (1200, 400, 800)]
    (table1,) = [t for t in build_tables(select_all(aggregate(runs))) if t.number == 1]
    assert [row[0] for row in table1.rows] == [
        "fc400 (4 epochs)",
        "fc800 (4 epochs)",
        "fc1200 (4 epochs)",
    ]


def test_report_without_matplotlib_says_so_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import sys

    write_runs(tmp_path / "runs", [fake_run("identity", 0.1, 0, -0.1)])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert main(["report", str(tmp_path / "runs"), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        "sgrld report: error: the figures need matplotlib: pip install 'sgrld[plots]', or pass "
        "--no-figures for the tables alone"
    ]
    assert (
        main(["report", str(tmp_path / "runs"), "--out", str(tmp_path / "r"), "--no-figures"]) == 0
    )
    assert (tmp_path / "r" / "report.md").read_text().startswith("# Report of 1 run\n")
    assert "1 run; wrote" in capsys.readouterr().out
    plot = ["table", str(tmp_path / "runs"), "--plot", str(tmp_path / "c.png")]
    assert main(plot) == 2
    assert "--plot needs matplotlib: pip install 'sgrld[plots]'" in capsys.readouterr().err


def test_report_names_itself_in_warnings_and_titles_its_figures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from sgrld.experiments.run import plots

    runs = [fake_run("identity", 0.1, s, -0.1) for s in (0, 1)]
    runs.append(fake_run("identity", 0.1, 2, -0.1, status="running"))
    write_runs(tmp_path / "runs", runs)
    titles = []
    monkeypatch.setattr(
        plots, "plot_convergence", lambda groups, path, *, title: titles.append(title)
    )
    from sgrld.experiments.report import figures as report_figures

    monkeypatch.setattr(report_figures, "plot_convergence", plots.plot_convergence)
    assert main(["report", str(tmp_path / "runs"), "--out", str(tmp_path / "r")]) == 0
    err = capsys.readouterr().err
    assert "sgrld report: skipping unfinished run" in err and "sgrld table" not in err
    assert titles == [
        "Figure 3: mnist fc400 (4 epochs), HS prior: the chosen configurations per epoch"
    ]


def test_a_one_epoch_report_figure_shows_every_sampler_with_markers_and_its_whole_title(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from sgrld.experiments.report import figures as report_figures
    from sgrld.experiments.run.plots import convergence_figure

    runs = [fake_run("identity", lr, 0, v) for lr, v in ((0.1, -0.05), (0.25, -0.04))]
    runs += [fake_run("monge", 0.25, 0, v, alpha2=a) for a, v in ((0.1, -0.041), (1.0, -0.05))]
    for run in runs:  # a short sweep of one epoch: every curve is one point
        run["config"] |= {"epochs": 1, "max_train": 2000, "burnin": 50, "thinning": 5}
        run["curves"] = {key: values[:1] for key, values in run["curves"].items()}
    drawn: list[tuple[Any, str]] = []
    monkeypatch.setattr(
        report_figures,
        "plot_convergence",
        lambda groups, path, *, title: drawn.append((groups, title)),
    )
    report_figures.draw_figures(select_all(aggregate(runs)), tmp_path)
    ((groups, title),) = drawn
    assert "(1 epoch, --subset 2000" in title and "1 epochs" not in title
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = convergence_figure(groups, title=title)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    for ax in fig.get_axes():
        labels = [line.get_label() for line in ax.get_lines()]
        assert labels == ["Identity ℓ 0.25", "Monge ℓ 0.25, α² 0.1 †"]  # as the tables
        assert all(line.get_marker() not in (None, "None", "") for line in ax.get_lines())
    drawn_box, page = fig.get_tightbbox(canvas.get_renderer()), fig.bbox_inches  # title included
    assert page.x0 <= drawn_box.x0 and drawn_box.x1 <= page.x1 and drawn_box.y1 <= page.y1
