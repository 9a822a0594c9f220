"""Tables, JSON and figures of the experiments beyond the paper (docs/results/beyond.md).

Usage::

    python benchmarks/beyond_report.py RUNS_DIR docs/results

reads ``RUNS_DIR/alpha2/*/results.json`` and ``RUNS_DIR/cyclical/*/results.json`` (written by
``docs/results/beyond_mnist.sh``) and ``RUNS_DIR/funnel-*/funnel.json`` (``beyond_funnel.sh``),
and writes ``beyond_{alpha2,cyclical,funnel}.json``, ``beyond_{...}.png`` and the tables as
Markdown on stdout (pasted into ``beyond.md``). Means and population std over seeds; a run that
broke down counts as such and is left out of the means.
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np


def _load(pattern: str, root: Path) -> dict[str, dict[str, Any]]:
    return {p.parent.name: json.loads(p.read_text()) for p in sorted(root.glob(pattern))}


def _cell(values: list[float]) -> dict[str, Any]:
    arr = np.asarray(values, dtype=float)
    return {
        "mean": float(arr.mean()) if arr.size else None,
        "std": float(arr.std()) if arr.size else None,
        "values": [float(v) for v in arr],
    }


def _group(runs: dict[str, dict[str, Any]], key: re.Pattern[str]) -> dict[str, Any]:
    groups: dict[str, dict[str, Any]] = defaultdict(lambda: defaultdict(list))
    for name, r in runs.items():
        match = key.fullmatch(name)
        if match is None:
            continue
        if r["status"] not in ("completed", "broken_down"):  # still running
            continue
        g = groups[match.group(1)]
        g["seeds"].append(r["seed"])
        if r["status"] == "broken_down":
            g["broken_down"].append(r["seed"])
            continue
        for split in ("val", "test"):
            for metric in ("lp", "accuracy", "ece"):
                g[f"{split}_{metric}"].append(r["final"][split][metric])
        g["num_samples"].append(r["num_samples"])
        g["seconds_per_epoch"].append(r["seconds_per_epoch"])
    out = {}
    for name, g in groups.items():
        out[name] = {
            "seeds": g["seeds"],
            "broken_down": g["broken_down"],
            **{k: _cell(v) for k, v in g.items() if k not in ("seeds", "broken_down")},
        }
    return out


def _fmt(cell: dict[str, Any] | None, digits: int = 4) -> str:
    if not cell or cell["mean"] is None:
        return "–"
    return f"{cell['mean']:.{digits}f} ± {cell['std']:.{digits}f}"


def alpha2_report(root: Path, out: Path) -> None:
    runs = _load("alpha2/*/results.json", root)
    cells = _group(runs, re.compile(r"(.*)-s\d+"))
    (out / "beyond_alpha2.json").write_text(json.dumps(cells, indent=1) + "\n")
    print("\n### Normalized vs fixed α² (Monge, MNIST)\n")
    print("| prior | N | rule | α² or c | val LP | test LP | test acc | broke down |")
    print("|---|---|---|---|---|---|---|---|")
    parsed = []
    for name, c in cells.items():
        m = re.fullmatch(r"(\w+)-N(\d+)-(fixed|norm)([\d.]+)", name)
        if m:
            parsed.append((m.group(1), int(m.group(2)), m.group(3), float(m.group(4)), c))
    parsed.sort(key=lambda t: (t[0], t[1], t[2], t[3]))
    for prior, width, rule, value, c in parsed:
        broke = f"{len(c['broken_down'])}/{len(c['seeds'])}"
        print(
            f"| {prior} | {width} | {'fixed' if rule == 'fixed' else 'normalized'} | {value:g} "
            f"| {_fmt(c.get('val_lp'))} | {_fmt(c.get('test_lp'))} "
            f"| {_fmt(c.get('test_accuracy'))} | {broke} |"
        )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    priors = sorted({p[0] for p in parsed})
    fig, axes = plt.subplots(1, len(priors), figsize=(6 * len(priors), 4), squeeze=False)
    for ax, prior in zip(axes[0], priors, strict=True):
        for rule, color, label in (("fixed", "tab:blue", "fixed α²"), ("norm", "tab:red", "c")):
            rows = [
                p
                for p in parsed
                if p[0] == prior and p[1] == 400 and p[2] == rule and p[4].get("test_lp")
            ]
            for p in rows:
                if p[3] == 0:  # α² = 0 is SGLD: a line, the axis is logarithmic
                    lp = p[4]["test_lp"]["mean"]
                    ax.axhline(lp, color="gray", ls="--", label="α² = 0 (SGLD)")
            rows = [p for p in rows if p[3] > 0]
            x = [p[3] for p in rows]
            y = [p[4]["test_lp"]["mean"] for p in rows]
            e = [p[4]["test_lp"]["std"] for p in rows]
            ax.errorbar(x, y, yerr=e, marker="o", color=color, label=label, capsize=3)
        ax.set_xscale("log")
        ax.set_xlabel("α² (fixed rule) or c (normalized rule)")
        ax.set_ylabel("test LP (ensemble)")
        ax.set_title(f"Monge, MNIST N=400, {prior}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "beyond_alpha2.png", dpi=100)
    plt.close(fig)


def cyclical_report(root: Path, out: Path) -> None:
    runs = _load("cyclical/*/results.json", root)
    cells = _group(runs, re.compile(r"(.*)-s\d+"))
    schedules = {name: r["schedule"] for name, r in runs.items() if r.get("schedule") is not None}
    doc = {"cells": cells, "schedules": schedules}
    (out / "beyond_cyclical.json").write_text(json.dumps(doc, indent=1) + "\n")
    print("\n### Cyclical vs constant ℓ (MNIST N=400, horseshoe)\n")
    print("| sampler | schedule | samples | val LP | test LP | test acc | test ECE |")
    print("|---|---|---|---|---|---|---|")
    for name in sorted(cells):
        c = cells[name]
        sampler, schedule = name.rsplit("-", 1)
        samples = c["num_samples"]["mean"] if c.get("num_samples") else 0
        print(
            f"| {sampler} | {schedule} | {samples:g} | {_fmt(c.get('val_lp'))} "
            f"| {_fmt(c.get('test_lp'))} | {_fmt(c.get('test_accuracy'))} "
            f"| {_fmt(c.get('test_ece'))} |"
        )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in sorted(runs.items()):
        color = {"identity": "tab:blue", "monge": "tab:red", "shampoo": "tab:green"}
        sampler = name.split("-")[0]
        style = "-" if "-cyclical-" in name else ":"
        y = [np.nan if v is None else v for v in r["curves"]["test_lp"]]
        ax.plot(np.arange(1, len(y) + 1), y, style, color=color.get(sampler, "k"), alpha=0.8)
    ax.set_xlabel("epoch")
    ax.set_ylabel("test LP of the ensemble so far")
    ax.set_title("solid: cyclical, dotted: constant (blue Identity, red Monge, green Shampoo)")
    fig.tight_layout()
    fig.savefig(out / "beyond_cyclical.png", dpi=100)
    plt.close(fig)


def funnel_report(root: Path, out: Path) -> None:
    files = sorted(root.glob("funnel-*/funnel.json"))
    table: dict[str, Any] = {}
    print("\n### Funnel, exact gradients, exact starts (ℓ = 0.003; Identity 0.001; lr0.001)\n")
    print("| run | sampler | W1(v) per chain | pooled W1(v) | pooled KS | pooled P(v<−5) | min v |")
    print("|---|---|---|---|---|---|---|")
    for path in files:
        doc = json.loads(path.read_text())
        run = path.parent.name.removeprefix("funnel-")
        table[run] = {"config": doc["config"], "samplers": doc["samplers"]}
        for name, s in doc["samplers"].items():
            pooled = s["pooled_distances"] or {}
            w1 = s["distances"]["wasserstein1"]
            print(
                f"| {run} | {name} | {w1['mean']:.2f} ± {w1['std']:.2f} "
                f"| {pooled.get('wasserstein1', float('nan')):.3f} "
                f"| {pooled.get('ks', float('nan')):.4f} "
                f"| {pooled.get('frac_v_below_minus5', float('nan')):.4f} "
                f"| {s['distances']['min_v']['min']:.1f} |"
            )
    (out / "beyond_funnel.json").write_text(json.dumps(table, indent=1) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, w1s, necks = [], [], []
    for run, doc in table.items():
        for name, s in doc["samplers"].items():
            if s["pooled_distances"]:
                labels.append(f"{name}\n({run})")
                w1s.append(s["pooled_distances"]["wasserstein1"])
                necks.append(s["pooled_distances"]["frac_v_below_minus5"])
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    a.barh(labels, w1s, color="tab:blue")
    a.set_xscale("log")  # two runs diverged: W1 in the hundreds
    a.set_xlabel("pooled W1(v) to N(0, 80), log scale")
    b.barh(labels, necks, color="tab:orange")
    b.axvline(0.2881, color="k", ls="--", label="truth 0.288")
    b.set_xlabel("pooled P(v < −5)")
    b.set_yticklabels([])
    b.legend()
    fig.tight_layout()
    fig.savefig(out / "beyond_funnel.png", dpi=100)
    plt.close(fig)


def main(argv: list[str]) -> int:
    root, out = Path(argv[0]), Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    alpha2_report(root, out)
    cyclical_report(root, out)
    funnel_report(root, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
