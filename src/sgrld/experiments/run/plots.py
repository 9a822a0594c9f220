"""Figures of sampling runs (matplotlib, imported only when a figure is drawn): one run's
``curves.png``, and the paper's Figure 3 (:func:`convergence_figure`)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from sgrld.experiments.base.files import save_figure
from sgrld.experiments.run.naming import tuned_text
from sgrld.experiments.run.results import scored_by


def new_figure(width: float, height: float, ncols: int) -> tuple[Any, Any]:
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    fig = Figure(figsize=(width, height), layout="constrained")
    return fig, fig.subplots(1, ncols)


def _values(curve: Sequence[float | None]) -> np.ndarray:
    return np.array([np.nan if v is None else v for v in curve], dtype=np.float64)


def plot_run_curves(results: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    """Draw :func:`run_curves_figure` of a run's ``results.json`` content to ``path`` (PNG)."""
    save_figure(run_curves_figure(results), path, dpi=90)


#: The three score panels of ``curves.png``: classification's, and regression's.
_PANELS = (("lp", "log-probability"), ("accuracy", "accuracy"), ("ece", "ECE (30 bins)"))
_REGRESSION_PANELS = (("lp", "log density"), ("rmse", "RMSE"), ("coverage_90", "90 % coverage"))


def run_curves_figure(results: Mapping[str, Any]) -> Any:
    """The ``curves.png`` figure of one run: the ensemble's scores on validation and test per
    epoch (each a marked point: one epoch still shows), and the sampling seconds per epoch."""
    curves = results["curves"]
    epochs = np.asarray(curves["epoch"], dtype=np.float64) + 1
    empty = "no sample yet: nothing to draw"
    broken = results.get("broken_down")
    if broken is not None:
        update = broken.get("update", broken.get("global_step", -1) + 1)
        empty = f"no sample: the chain broke down\nat update {update}, before its first sample"
    fig, axes = new_figure(16, 3.6, 4)
    panels = _PANELS if "val_accuracy" in curves else _REGRESSION_PANELS
    for ax, (metric, title) in zip(axes[:3], panels, strict=True):
        for split, style in (("val", "--"), ("test", "-")):
            values = _values(curves[f"{split}_{metric}"])
            if np.isfinite(values).any():
                ax.plot(epochs, values, style, marker="o", markersize=3, label=split)
        if ax.lines:
            ax.legend()
        else:
            ax.text(0.5, 0.5, empty, ha="center", transform=ax.transAxes)
        ax.set_title(f"ensemble {title}")
        ax.set_xlabel("epoch")
    seconds = _values(results["timing"]["sampling_seconds"])
    axes[3].bar(np.arange(1, len(seconds) + 1), seconds, color="0.5")
    axes[3].set_title("sampling seconds per epoch")
    axes[3].set_xlabel("epoch")
    config = results["config"]
    alpha = tuned_text(config)
    fig.suptitle(
        wrap_title(
            f"{config['dataset']} {config['model']} {config['prior']}: {config['sampler']} "
            f"ℓ {config['lr']:g}{alpha}, seed {config['seed']} — {results['status']}, "
            f"{results['num_samples']} sample{'s' * (results['num_samples'] != 1)}",
            width_inches=16,
        )
    )
    return fig


def plot_convergence(
    groups: Mapping[str, Sequence[Mapping[str, Any]]],
    path: str | os.PathLike[str],
    *,
    title: str = "Test LP and accuracy per epoch (mean ± 1.96 std over seeds)",
) -> None:
    """:func:`convergence_figure` written to ``path`` (PNG)."""
    save_figure(convergence_figure(groups, title=title), path, dpi=90)


def convergence_figure(
    groups: Mapping[str, Sequence[Mapping[str, Any]]],
    *,
    title: str = "Test LP and accuracy per epoch (mean ± 1.96 std over seeds)",
) -> Any:
    """Figure 3 of the paper: test LP and accuracy per epoch, mean ± 1.96 std (ddof = 0) over
    seeds, as a matplotlib ``Figure``.

    Args:
        groups: label → the ``results.json`` contents of that configuration's runs (cut to the
            shortest).
        title: the figure's title (wrapped to the figure's width).
    """
    first = next(iter(groups.values()))[0]["curves"]
    second = scored_by(first).second()  # accuracy, or a regression's RMSE
    metrics = ("test_lp", f"test_{second}")
    fig, axes = new_figure(12, 4, 2)
    for label, runs in groups.items():
        length = min(len(r["curves"]["epoch"]) for r in runs)
        epochs = np.arange(1, length + 1)
        for ax, metric in zip(axes, metrics, strict=True):
            values = np.stack([_values(r["curves"][metric][:length]) for r in runs])
            mean, band = values.mean(axis=0), 1.96 * values.std(axis=0)
            # a marker on every epoch: a one-epoch run is one point, still visible
            (line,) = ax.plot(epochs, mean, marker="o", markersize=4, label=label)
            ax.fill_between(
                epochs, mean - band, mean + band, alpha=0.2, lw=0, color=line.get_color()
            )
    names = ("test log-probability", "test accuracy" if second == "accuracy" else "test RMSE")
    longest = max(len(r["curves"]["epoch"]) for runs in groups.values() for r in runs)
    for ax, name in zip(axes, names, strict=True):
        ax.set_title(f"cumulative ensemble {name}")
        ax.set_xlabel("epoch")
        ax.set_xlim(0.5, longest + 0.5)  # whole epochs, one alone included
        ax.set_xticks(np.arange(1, longest + 1, max(1, longest // 8)))
    axes[0].legend()
    fig.suptitle(wrap_title(title, width_inches=12))
    return fig


def wrap_title(title: str, *, width_inches: float) -> str:
    """``title`` in lines that fit a figure ``width_inches`` wide (a 12 pt suptitle: about 10
    characters per inch; 8.5 leaves a margin)."""
    import textwrap

    return "\n".join(textwrap.wrap(title, width=int(width_inches * 8.5)))
