"""The report's figures: Figure 3 (convergence) and Figure 4 (Monge's α² sensitivity).

matplotlib (extra ``plots``) is imported only when a figure is drawn.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from sgrld.experiments.base.files import save_figure
from sgrld.experiments.report.build import Choice, curves, setting_key, setting_label
from sgrld.experiments.report.tables import (
    IDENTITY,
    PRIOR_SHORT,
    Group,
    identity_at,
    lr_text,
    sampler_title,
)
from sgrld.experiments.run.plots import new_figure, plot_convergence, wrap_title
from sgrld.experiments.run.results import scored_by


def _slug(setting: str, prior: str) -> str:
    """``fc400-e3-sub2000_HS``: the setting's short label and the prior, for a file name."""
    label = setting_label(json.loads(setting), short=True) + f"_{PRIOR_SHORT.get(prior, prior)}"
    return re.sub(r"[^A-Za-z0-9.\-]+", "_", label).strip("_")


def _title(setting: str, prior: str) -> str:
    data = json.loads(setting)
    return f"{data['dataset']} {setting_label(data)}, {PRIOR_SHORT.get(prior, prior)} prior"


def _final(group: Group, metric: str) -> tuple[float, float]:
    values = curves(group, metric)[:, -1]
    return float(np.mean(values)), float(np.std(values))


def draw_figure4(monge: Choice, others: Sequence[Choice], path: Path, *, title: str = "") -> None:
    """Test LP and accuracy against α², each α² at its chosen ℓ, ±1.96 std; other samplers as
    horizontal lines with bands; a dashed segment from α² = 0 (Identity) to the first α²."""
    points = sorted(
        (float(s.alpha2), s.chosen)
        for s in monge.stages
        if s.kind == "lr" and s.alpha2 is not None and s.chosen is not None
    )
    alpha2 = np.array([a for a, _ in points])
    fig, axes = new_figure(12, 4, 2)
    second = scored_by(points[0][1].completed[0]["curves"] if points else ()).second()
    panels = (("test_lp", "test log-probability"), (f"test_{second}", f"test {second}"))
    for ax, (metric, title) in zip(axes, panels, strict=True):
        stats = np.array([_final(g, metric) for _, g in points])
        (line,) = ax.plot(alpha2, stats[:, 0], "o-", label="Monge")
        ax.fill_between(
            alpha2,
            stats[:, 0] - 1.96 * stats[:, 1],
            stats[:, 0] + 1.96 * stats[:, 1],
            alpha=0.2,
            color=line.get_color(),
            lw=0,
        )
        for other in others:
            if other.chosen is None:
                continue
            mean, std = _final(other.chosen, metric)
            name = sampler_title(other.sampler)
            (hline,) = ax.plot([0.0, alpha2[-1]], [mean, mean], lw=1, label=name)
            ax.axhspan(mean - 1.96 * std, mean + 1.96 * std, alpha=0.1, color=hline.get_color())
            if other.sampler == IDENTITY:
                ax.plot([0.0, alpha2[0]], [mean, stats[0, 0]], "--", color=line.get_color())
        ax.set_xlabel("α²")
        ax.set_title(f"final ensemble {title}")
    axes[0].legend()
    if title:
        fig.suptitle(wrap_title(title, width_inches=12))
    save_figure(fig, path, dpi=90)


def draw_figures(choices: Sequence[Choice], out: Path) -> list[Path]:
    """Figure 3 per setting and prior; Figure 4 where Monge ran with several α²."""
    cells: dict[tuple[str, str], list[Choice]] = {}
    for choice in choices:
        cells.setdefault((setting_key(choice.setting), choice.prior), []).append(choice)
    written = []
    for (setting, prior), members in cells.items():
        # As the tables: Monge's own best α² where the rule chooses Identity, marked †
        chosen = {
            f"{sampler_title(c.sampler)} ℓ {lr_text(group.config)}{' †' * c.identity_optimal}": (
                group.completed
            )
            for c in members
            if (group := c.best_own) is not None
        }
        if chosen:
            path = out / f"figure3_{_slug(setting, prior)}.png"
            title = f"Figure 3: {_title(setting, prior)}: the chosen configurations per epoch"
            if any(c.identity_optimal for c in members):
                title += " († Monge's own best α²; the rule chooses Identity)"
            plot_convergence(chosen, path, title=title)
            written.append(path)
        for monge in (c for c in members if identity_at(c.sampler)):
            tried = {s.alpha2 for s in monge.stages if s.kind == "lr" and s.chosen is not None}
            if len(tried) >= 2:
                path = out / f"figure4_{_slug(setting, prior)}.png"
                others = [c for c in members if c is not monge]
                title = f"Figure 4: {_title(setting, prior)}: Monge's α² at its chosen ℓ"
                draw_figure4(monge, others, path, title=title)
                written.append(path)
    return written
