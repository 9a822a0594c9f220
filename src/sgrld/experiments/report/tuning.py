"""The tuner's compute against the grid it replaces: a table from ``sgrld tune``'s tune.json."""

from __future__ import annotations

from typing import Any

__all__ = ["tuning_table"]


def tuning_table(data: dict[str, Any]) -> str:
    """Markdown: per sampler the tuned ℓ (and α²), the gradient evaluations the search spent
    (and as runs of the chain's length; its wall time where recorded), the paper's ℓ grid for
    the setting (runs of one seed, their gradient evaluations) and the ratio."""
    c = data["config"]
    lines = [
        f"Tuning ({c['dataset']}, {c['model']} N = {c['width']}, {c['prior']} prior, "
        f"{c['epochs']} epochs, score {c['score']}, seed {c['seed']}): gradient evaluations are "
        "minibatch gradients of one chain.",
        "",
        "| sampler | tuned options | tuner | tuner in runs | paper's grid (runs × steps) | "
        "tuner / grid |",
        "|---|---|---|---|---|---|",
    ]
    for name, result in data["samplers"].items():
        grid = result.get("grid")
        if grid:
            per_run = grid["evaluations"] // grid["runs"]
            cells = f"{grid['evaluations']} ({grid['runs']} × {per_run})"
            share = f"{result['spent'] / grid['evaluations']:.2f}"
        else:
            cells, share = "no paper grid for this setting", "–"
        chosen = ", ".join(
            f"{'ℓ' if n == 'lr' else n} {result['options'][n]:.3g}"
            for n in result.get("searched", ["lr"])
        )
        steps, seconds = result.get("steps"), result.get("seconds")
        runs = f"{result['spent'] / steps:.1f}" if steps else "–"
        runs += f" ({seconds:.0f} s)" if isinstance(seconds, (int, float)) else ""
        lines.append(f"| {name} | {chosen} | {result['spent']} | {runs} | {cells} | {share} |")
    return "\n".join(lines) + "\n"
