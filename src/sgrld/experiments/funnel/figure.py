"""``funnel.png``: the paper's Figure 2 per sampler, then a row with the spread over chains of
its claim (the numbers :mod:`.verdict` words); ``docs/funnel.md`` describes it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import numpy as np

from sgrld.experiments.funnel.verdict import NECK, V_THRESHOLD, mean_and_error

__all__ = ["funnel_figure", "plot_funnel"]


class SamplerRun(Protocol):
    """What the figure reads of a :class:`~.funnel.run.SamplerRun` (run.py plots with this
    module, so it names the fields instead of importing the class)."""

    distances: dict[str, list[float]]
    scatter: np.ndarray
    hist_density: np.ndarray
    hist_edges: np.ndarray


LEVELS = [-10.0, -7.5, -5.0, -2.5]  # log-density contours, as the paper's figure


def _count(chains: int) -> str:
    return f"{chains} chain{'s' * (chains != 1)}"


def _sampler_panels(sub: Any, name: str, r: SamplerRun, grid: dict[str, Any]) -> None:
    chains = len(r.distances[NECK])
    ax, axh = sub.subplots(1, 2, gridspec_kw={"width_ratios": [2, 1], "wspace": 0.1})
    contours = ax.contour(
        grid["x0"], grid["x1"], grid["logp"], LEVELS, colors="0.45", linestyles="solid"
    )
    ax.clabel(contours, fontsize=8)
    ax.scatter(r.scatter[:, 0], r.scatter[:, 1], alpha=0.15, s=20, zorder=2, color="tab:blue")
    ax.axhline(grid["neck"], color="tab:red", ls=":", lw=1)
    ax.set_xlim(-5.0, 9.0)
    ax.set_ylim(-25.0, 25.0)
    ax.set_xlabel("θ₁")
    ax.set_ylabel("v")
    handles = [
        ax.plot([], [], color="0.45", label="log-density contours (−10 … −2.5)")[0],
        ax.scatter(
            [], [], color="tab:blue", label=f"{len(r.scatter)} iterates of {_count(chains)}"
        ),
        ax.plot([], [], color="tab:red", ls=":", label="v = −5: below it, the neck")[0],
    ]
    ax.legend(handles=handles, loc="lower right", fontsize=9)
    axh.barh(
        r.hist_edges[:-1],
        r.hist_density,
        height=np.diff(r.hist_edges),
        align="edge",
        color="tab:orange",
        label=f"v, {_count(chains)} pooled",
    )
    axh.plot(grid["true_density"], grid["x1"], color="tab:blue", label="exact N(0, 80)")
    axh.axhline(grid["neck"], color="tab:red", ls=":", lw=1)
    axh.set_ylim(-25.0, 25.0)
    axh.set_yticklabels([])
    axh.legend(loc="lower right", fontsize=9)
    mass, error = mean_and_error(r.distances[NECK])
    spread = "" if math.isnan(error) else f" ± {error:.0%}"
    neck = f"{grid['neck']:g}".replace("-", "−")
    sub.suptitle(
        f"{name}: {mass:.0%}{spread} of iterates below v = {neck} (truth {grid['truth']:.0%})"
    )


def _spread_panel(ax: Any, runs: Mapping[str, SamplerRun], key: str, truth: float | None) -> None:
    for i, r in enumerate(runs.values()):
        values = np.asarray(r.distances[key])
        jitter = np.linspace(-0.2, 0.2, values.size) if values.size > 1 else np.zeros(1)
        ax.scatter(i + jitter, values, s=12, alpha=0.5, color="tab:blue", label="one chain")
        mean, error = mean_and_error(values)
        ax.errorbar(
            i, mean, yerr=0.0 if math.isnan(error) else error, fmt="s", color="black",
            capsize=6, label="mean ± 2 standard errors",
        )  # fmt: skip
    if truth is not None:
        ax.axhline(truth, color="tab:red", ls="--", label=f"truth ({truth:.3f})")
    ax.set_xticks(range(len(runs)), list(runs))
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    ax.legend(unique.values(), unique.keys(), fontsize=9)


def plot_funnel(
    runs: Mapping[str, SamplerRun], path: Path | str | BinaryIO, *, title: str = ""
) -> None:
    """:func:`funnel_figure` saved as PNG to ``path`` (a path or a binary stream)."""
    funnel_figure(runs, title=title).savefig(path, dpi=80, format="png")


def funnel_figure(runs: Mapping[str, SamplerRun], *, title: str = "") -> Any:
    """The paper's Figure 2, one panel pair per sampler, then the spread over chains.

    Args:
        runs: per sampler, its run.
        title: what ran (chains, steps, start), shown over the spread's row.

    Returns:
        The matplotlib ``Figure``.
    """
    import torch
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    from sgrld.data.funnel import FunnelTarget

    target = FunnelTarget()
    x0, x1 = np.arange(-5.0, 9.0, 0.1), np.arange(-25.0, 25.0, 0.1)
    mesh = torch.from_numpy(np.stack(np.meshgrid(x0, x1), axis=-1))
    grid = {
        "x0": x0,
        "x1": x1,
        "logp": target.log_prob(mesh).numpy(),
        "true_density": target.v_pdf(torch.from_numpy(x1)).numpy(),
        "neck": V_THRESHOLD,
        "truth": target.prob_v_below(V_THRESHOLD),
    }
    n = len(runs)
    cols = 2 if n > 1 else 1
    rows = math.ceil(n / cols) + 1
    fig = Figure(figsize=(9 * cols, 6 * rows))
    bands: Any = fig.subfigures(rows, 1, squeeze=False)[:, 0]
    slots = [sub for band in bands[:-1] for sub in band.subfigures(1, cols, squeeze=False)[0]]
    for sub in slots[n:]:
        sub.set_visible(False)
    for sub, (name, r) in zip(slots, runs.items(), strict=False):
        _sampler_panels(sub, name, r, grid)
    left, right = bands[-1].subplots(1, 2)
    _spread_panel(left, runs, NECK, target.prob_v_below(-5.0))
    left.set_title("mass below v = −5 per chain")
    _spread_panel(right, runs, "min_v", None)
    right.set_title("deepest v reached per chain (lower: further into the neck)")
    bands[-1].suptitle(f"{title}: the spread over chains" if title else "the spread over chains")
    return fig
