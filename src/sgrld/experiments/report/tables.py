"""``sgrld table RUN_DIRS...``: runs grouped by config without the seed, the mean and population
std (ddof = 0) over seeds of their final-epoch metrics, in the paper's layout, the long layout,
CSV and MCMC diagnostics (``docs/experiments.md``, "Tables").
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from sgrld.chain_health import Health, health
from sgrld.evaluation.trace import diagnostics_of
from sgrld.experiments.report.paper import paper_entry
from sgrld.experiments.run.choices import Names
from sgrld.experiments.run.config import TUNED_FIELDS
from sgrld.experiments.run.naming import run_label, tuned_text
from sgrld.experiments.run.options import by_field
from sgrld.experiments.run.results import ResultsError, impossible_values, read_results
from sgrld.likelihoods import Likelihood, get_likelihood, likelihood_names, scored_by
from sgrld.metrics import get_metric, metric_names

#: The sampler whose metric is G = I: the baseline of the paper's selection rule.
IDENTITY = next(n for n in metric_names() if not get_metric(n).preconditions)
SAMPLER_ORDER = ("identity", "wenzel", "rmsprop", "monge", "shampoo")


def identity_at(sampler: str) -> str:
    """Where ``sampler``'s metric is G = I (``"α² = 0"`` for Monge), empty if nowhere."""
    if sampler not in metric_names():
        return ""
    metric = get_metric(sampler)
    at = metric.identity_at.items()
    return ", ".join(f"{metric.symbols.get(name, name)} = {value:g}" for name, value in at)


def sampler_title(name: str) -> str:
    """The paper's name of a sampler: its metric's class name less ``Metric`` (``RMSprop``)."""
    if name not in metric_names():
        return name.capitalize()
    return get_metric(name).__name__.removesuffix("Metric")


PRIOR_ORDER = ("gaussian", "horseshoe", "correlated")
PRIOR_SHORT = {"gaussian": "G", "horseshoe": "HS", "correlated": "corr"}
#: Aggregated quantities besides each likelihood's table scores (:func:`_score` reads them).
TEST, VAL, RUN = ("test_lp",), ("val_lp",), ("seconds_per_epoch", "curvature", "num_samples")
#: Config fields that pick a row/column inside a setting's table (the rest define the setting):
#: the metrics' tuned options among them, read from the registry when used.
WITHIN_SETTING: Sequence[str] = Names(lambda: ("prior", "sampler", "lr", *TUNED_FIELDS))


class TableError(ValueError):
    """No usable runs, or unreadable results."""


def _score(results: dict[str, Any], name: str) -> float:
    if name in ("seconds_per_epoch", "num_samples"):
        value = results.get(name)
    elif name == "curvature":
        value = (results.get("curvature") or {}).get("mean")
    else:
        split, metric = name.split("_", 1)
        value = results["final"][split].get(metric)  # a score of another likelihood: NaN
    return math.nan if value is None else float(value)


@dataclass
class Group:
    """The runs of one configuration: the shared config (no ``seed``) and the ``results.json``
    contents of every run, broken-down ones included."""

    config: dict[str, Any]
    runs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def seeds(self) -> list[int]:
        return sorted(int(r["seed"]) for r in self.runs)

    @property
    def completed(self) -> list[dict[str, Any]]:
        return [r for r in self.runs if r["status"] == "completed"]

    @property
    def num_broken(self) -> int:
        return sum(r["status"] == "broken_down" for r in self.runs)

    @cached_property
    def diagnostics(self) -> dict[str, Any]:
        """R-hat and ESS of the completed runs' traces, seeds as chains (one run: its halves)."""
        traces = [r["trace"] for r in self.completed if r.get("trace")]
        if not traces:
            return {"available": False, "reason": "no traced samples (results without 'trace')"}
        return diagnostics_of(traces)

    def stat(self, name: str) -> tuple[float, float]:
        """Mean and std (ddof = 0) of a metric over the completed runs (NaN without any value;
        the std NaN with fewer than two)."""
        values = np.array([_score(r, name) for r in self.completed], dtype=np.float64)
        if values.size == 0 or np.isnan(values).all():
            return math.nan, math.nan
        values = values[~np.isnan(values)]
        spread = float(values.std(ddof=0)) if values.size > 1 else math.nan
        return float(values.mean()), spread


def likelihoods_of(groups: Sequence[Group]) -> list[type[Likelihood]]:
    """The likelihoods whose scores these runs have (as each declares them), registry order."""
    found = {scored_by(r["final"]["test"]) for g in groups for r in g.runs}
    return [get_likelihood(n) for n in likelihood_names() if get_likelihood(n) in found]


def is_paper(groups: Sequence[Group]) -> bool:
    """Whether every run is scored by the paper's likelihood (:attr:`Likelihood.paper`)."""
    return all(kind.paper for kind in likelihoods_of(groups))


def headline_likelihood(groups: Sequence[Group]) -> type[Likelihood]:
    """The likelihood whose headline scores the tables show: another than the paper's where
    the runs have one, else the paper's."""
    kinds = likelihoods_of(groups)
    others = [kind for kind in kinds if not kind.paper]
    papers = [get_likelihood(n) for n in likelihood_names() if get_likelihood(n).paper]
    return (others or kinds or papers)[0]


def table_columns(groups: Sequence[Group]) -> list[str]:
    """The aggregated quantities of these runs: the paper's likelihood's table scores beside
    LP, the run's own, then every other likelihood's."""
    kinds = likelihoods_of(groups)

    def scores(split: str, paper: bool) -> list[str]:
        return [f"{split}_{s}" for k in kinds if k.paper == paper for s in k.table_scores[split]]

    columns = [*TEST, *scores("test", True), *VAL, *scores("val", True), *RUN]
    return columns + scores("test", False) + scores("val", False)


def score_columns(groups: Sequence[Group]) -> dict[str, str]:
    """The Markdown layouts' score columns beside LP: label → aggregated quantity."""
    return {label: f"test_{s}" for label, s in headline_likelihood(groups).headline.items()}


def find_results(paths: Iterable[str | Path]) -> list[Path]:
    """``results.json`` files named by, or found under, ``paths`` (sorted, no duplicates).

    Raises:
        TableError: a path does not exist, or nothing was found.
    """
    found: set[Path] = set()

    def there(path: Path) -> bool:  # a link or a special file too: the reader refuses it
        return path.exists() or path.is_symlink()

    def named(path: Path) -> Path:  # absolute, a link at the name kept (never resolved)
        return Path(os.path.abspath(path))

    for raw in paths:
        path = Path(raw)
        if path.is_dir() and there(path / "results.json"):
            found.add(named(path / "results.json"))
        elif path.is_dir():
            found.update(named(p) for p in path.rglob("results.json"))
        elif there(path):
            found.add(named(path))
        else:
            raise TableError(f"{path} does not exist")
    if not found:
        raise TableError("no results.json found under " + ", ".join(map(str, paths)))
    return sorted(found)


def load_checked(
    files: Iterable[Path], *, include_partial: bool = False, command: str = "sgrld table"
) -> tuple[list[dict[str, Any]], list[str]]:
    """Read ``results.json`` files and leave out what would make a table wrong: impossible final
    values (:func:`~sgrld.experiments.run.results.impossible_values`), a completed run that blew
    up while finite (:func:`sgrld.health`), a config unlike its folder (its sweep manifest's
    entry or folder name), a second copy of a run. Unfinished runs are left out unless
    ``include_partial`` (``command`` names who says so on stderr).

    Returns:
        The runs to aggregate, and the problems as ``"PATH: why"``.

    Raises:
        TableError: a file is not a readable sgrld sampling result.
    """
    runs, problems = [], []
    seen: dict[str, Path] = {}
    manifests: dict[Path, dict[str, Any] | None] = {}
    for path in files:
        try:
            results: dict[str, Any] = dict(read_results(path))
        except ResultsError as exc:
            raise TableError(str(exc)) from None
        # a failed run (an output could not be written) stopped unfinished, like a running one
        if results["status"] in ("running", "failed") and not include_partial:
            print(f"{command}: skipping unfinished run {path.parent}", file=sys.stderr)
            continue
        bad = impossible_values(results)  # NaN counts only in a completed run
        verdict = health(results)  # blown up while finite, from before runs were judged
        if results["status"] == "completed" and isinstance(verdict, Health) and verdict.broken_down:
            bad = [*bad, f"broke down ({verdict.reason})"]
        bad = bad or _folder_mismatch(path, results["config"], manifests)
        key = json.dumps(results["config"], sort_keys=True)
        if not bad and key in seen:
            bad = [f"the same run (config and seed) as {seen[key].parent}"]
        if bad:
            problems.append(f"{path.parent}: left out: {'; '.join(bad)}")
            continue
        seen[key] = path
        if results["status"] in ("running", "failed"):
            results = {**results, "status": "completed"}
        runs.append(results)
    return runs, problems


_SWEEP_LABEL = re.compile(r"^lr[^/]*-seed\d+$")


def _folder_mismatch(
    path: Path, config: dict[str, Any], manifests: dict[Path, dict[str, Any] | None]
) -> list[str]:
    """How a run's config disagrees with its sweep manifest's entry, or its folder's name."""
    from sgrld.experiments.sweep import grid

    folder = path.parent
    for root in folder.parents:
        if root not in manifests:
            try:
                manifests[root] = grid.read_manifest(root / grid.MANIFEST_FILE)
            except grid.GridError:
                manifests[root] = None
        saved = manifests[root]
        if saved is None:
            continue
        entries = {r["path"]: r["config"] for r in saved["runs"]}
        expected = entries.get(folder.relative_to(root).as_posix())
        if expected is not None and expected != config:
            differ = sorted(k for k in expected if expected[k] != config.get(k))
            return [f"its config differs from {root / grid.MANIFEST_FILE}'s in {', '.join(differ)}"]
        break
    try:
        label = run_label(config)
    except (KeyError, TypeError, ValueError):
        return []
    if _SWEEP_LABEL.match(folder.name) and folder.name != label:
        return [f"its config is run {label}, not the {folder.name} its folder names"]
    return []


def aggregate(runs: Iterable[dict[str, Any]]) -> list[Group]:
    """Group runs by config without the seed, in a stable order."""
    groups: dict[str, Group] = {}
    for results in runs:
        config = {k: v for k, v in results["config"].items() if k != "seed"}
        key = json.dumps(config, sort_keys=True)
        groups.setdefault(key, Group(config)).runs.append(results)
    return sorted(groups.values(), key=_sort_key)


def _sort_key(group: Group) -> tuple[Any, ...]:
    c = group.config
    prior, sampler = position(c["prior"], PRIOR_ORDER), position(c["sampler"], SAMPLER_ORDER)
    return (setting_key(c), prior, sampler, c["lr"], *(c.get(n) or 0.0 for n in TUNED_FIELDS))


def position(value: str, order: Sequence[str]) -> int:
    """Where ``value`` stands in ``order`` (values not in it after all that are)."""
    return order.index(value) if value in order else 99


def in_order(values: Iterable[str], order: Sequence[str]) -> list[str]:
    """The distinct ``values`` by :func:`position`, then alphabetically."""
    return sorted(set(values), key=lambda v: (position(v, order), v))


def setting_key(config: dict[str, Any]) -> str:
    """The fields that define a setting (all but :data:`WITHIN_SETTING`), as JSON."""
    within = set(WITHIN_SETTING)
    return json.dumps({k: v for k, v in config.items() if k not in within}, sort_keys=True)


def format_stat(mean: float, std: float, digits: int = 4, bold: bool = False) -> str:
    if math.isnan(mean):
        return "–"
    text = f"{mean:.{digits}f}"
    if bold:
        text = f"**{text}**"
    return text if math.isnan(std) else f"{text} ({std:.{digits}f})"


def lr_text(config: Mapping[str, Any]) -> str:
    """``0.25`` or ``0.25, α² 1.25``: a configuration's ℓ (and its tuned options)."""
    return f"{config['lr']:g}{tuned_text(config)}"


def group_label(group: Group) -> str:
    c = group.config
    model = f"fc{c['width']}" if c["model"] == "fc" else c["model"]
    prior = PRIOR_SHORT.get(c["prior"], c["prior"])
    return f"{model} {prior} {sampler_title(c['sampler'])} ℓ {lr_text(c)}"


def _setting_title(config: dict[str, Any], groups: Sequence[Group]) -> str:
    model = f"fc N = {config['width']}" if config["model"] == "fc" else config["model"]
    counts = sorted({len(g.runs) for g in groups})
    seeds = str(counts[0]) if len(counts) == 1 else f"{counts[0]}–{counts[-1]}"
    plural = "" if counts[-1] == 1 else "s"
    spread = "no spread with one seed" if counts[-1] == 1 else "mean (std, ddof = 0)"
    options = by_field()  # the defaults
    extras = [
        f"{name} {config[name]}"
        for name in ("max_train", "max_eval", "temperature", "batch_size", "burnin", "thinning")
        if config.get(name, options[name].default) != options[name].default
    ]
    extra = f", {', '.join(extras)}" if extras else ""
    epochs = f"{config['epochs']} epoch{'s' * (config['epochs'] != 1)}"
    return (
        f"{config['dataset']}, {model}, {epochs}{extra} — {seeds} seed{plural} "
        f"per cell; final-epoch test metrics, {spread}"
    )


def _by_setting(groups: Sequence[Group]) -> dict[str, list[Group]]:
    settings: dict[str, list[Group]] = {}
    for group in groups:
        settings.setdefault(setting_key(group.config), []).append(group)
    return settings


def select_best(candidates: Sequence[Group]) -> Group | None:
    """The configuration with the best mean final validation LP among those without failures
    (``None``: none)."""
    valid = [g for g in candidates if g.num_broken == 0 and not math.isnan(g.stat("val_lp")[0])]
    return max(valid, key=lambda g: g.stat("val_lp")[0]) if valid else None


def markdown_paper_layout(groups: Sequence[Group], *, paper: bool = False) -> str:
    """Table 1 layout: per setting, a row per sampler and per prior LP / acc / ECE / s/ep / ℓ."""
    blocks = []
    for setting_groups in _by_setting(groups).values():
        config = setting_groups[0].config
        priors = in_order((g.config["prior"] for g in setting_groups), PRIOR_ORDER)
        samplers = in_order((g.config["sampler"] for g in setting_groups), SAMPLER_ORDER)
        candidates: dict[tuple[str, str], list[Group]] = {}
        for g in setting_groups:
            candidates.setdefault((g.config["prior"], g.config["sampler"]), []).append(g)
        chosen = {cell: select_best(cands) for cell, cands in candidates.items()}
        scores = score_columns(setting_groups)
        header = ["sampler"]
        for prior in priors:
            p = PRIOR_SHORT.get(prior, prior)
            header += [f"{p} LP", *(f"{p} {label}" for label in scores), f"{p} s/epoch", f"{p} ℓ"]
            if paper:
                header += [f"{p} paper LP", f"{p} paper acc", f"{p} paper s/epoch"]
        best_lp = {
            prior: max(
                (c.stat("test_lp")[0] for s in samplers if (c := chosen.get((prior, s)))),
                default=math.nan,
            )
            for prior in priors
        }
        rows = []
        for sampler in samplers:
            row = [sampler_title(sampler)]
            for prior in priors:
                best, cands = chosen.get((prior, sampler)), candidates.get((prior, sampler), [])
                if best is None:
                    broken = sum(g.num_broken for g in cands)
                    total = sum(len(g.runs) for g in cands)
                    text = f"broke down ({broken}/{total} runs)" if broken else "–"
                    row += [text, *(["–"] * (len(scores) + 1))]
                    row.append(lr_text(cands[0].config) if cands else "–")
                else:
                    lp = best.stat("test_lp")
                    row += [
                        format_stat(*lp, bold=lp[0] == best_lp[prior] and len(samplers) > 1),
                        *(format_stat(*best.stat(column)) for column in scores.values()),
                        format_stat(*best.stat("seconds_per_epoch"), digits=1),
                        lr_text(best.config),
                    ]
                if paper:
                    ref = paper_entry(config["dataset"], prior, config.get("width"), sampler)
                    row += (
                        [f"{ref.lp:.4f}", f"{ref.accuracy:.4f}", f"{ref.seconds_per_epoch:.1f}"]
                        if ref is not None
                        else ["= Identity" if identity_at(sampler) else "–", "–", "–"]
                    )
            rows.append(row)
        title = _setting_title(config, setting_groups)
        if paper:
            title += "; paper: 400 epochs, 10 seeds"
        blocks.append(f"**{title}**\n\n" + markdown_table(header, rows))
    return "\n\n".join(blocks) + "\n"


def markdown_long_layout(groups: Sequence[Group]) -> str:
    """One row per configuration, per setting."""
    blocks = []
    for setting_groups in _by_setting(groups).values():
        scores = score_columns(setting_groups)
        header = ["prior", "sampler", "ℓ", "runs", "broken", "test LP"]
        header += [f"test {label}" for label in scores]
        header += ["val LP", "s/epoch", "curvature", "samples"]
        rows = [
            [
                g.config["prior"],
                sampler_title(g.config["sampler"]),
                lr_text(g.config),
                str(len(g.runs)),
                str(g.num_broken),
                format_stat(*g.stat("test_lp")),
                *(format_stat(*g.stat(column)) for column in scores.values()),
                format_stat(*g.stat("val_lp")),
                format_stat(*g.stat("seconds_per_epoch"), digits=1),
                format_stat(*g.stat("curvature"), digits=2),
                f"{g.stat('num_samples')[0]:.0f}",
            ]
            for g in setting_groups
        ]
        title = _setting_title(setting_groups[0].config, setting_groups)
        blocks.append(f"**{title}**\n\n" + markdown_table(header, rows))
    return "\n\n".join(blocks) + "\n"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


#: The diagnostics of a row, with their digits: of the test LL, then the worst of every quantity.
_DIAGNOSTICS = (("rhat", 3), ("ess_bulk", 0), ("ess_tail", 0))


def _num(value: Any, digits: int) -> str:
    return "–" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def markdown_diagnostics(groups: Sequence[Group]) -> str:
    """One row per configuration: R-hat and bulk/tail ESS, seeds as chains ("" without ArviZ)."""
    from sgrld.evaluation.diagnostics import INSTALL_HINT, MIN_RELIABLE_DRAWS

    rows, few = [], False
    for group in groups:
        d = group.diagnostics
        if not d["available"]:
            continue
        ll = d["variables"]["test_loglik"]
        chains = d["chains"] if isinstance(d["chains"], int) else "1 (split)"
        worst = d["worst"]
        if not d.get("reliable", d["draws_per_chain"] >= MIN_RELIABLE_DRAWS):
            few = True
            none = {"rhat": None, "ess_bulk": None, "ess_tail": None}
            ll, worst = none, none
        stats = [_num(s[k], digits) for s in (ll, worst) for k, digits in _DIAGNOSTICS]
        rows.append([group_label(group), str(chains), str(d["draws_per_chain"]), *stats])
    if not rows:
        missing = [g for g in groups if "ArviZ" in g.diagnostics.get("reason", "")]
        if missing:
            return f"MCMC diagnostics (R̂, ESS) left out: they need ArviZ; {INSTALL_HINT}\n"
        return ""
    header = ["configuration", "chains (seeds)", "draws/chain", "R̂ test LL", "bulk ESS test LL"]
    header += ["tail ESS test LL", "max R̂", "min bulk ESS", "min tail ESS"]
    title = (
        "**MCMC diagnostics (ArviZ, rank-normalised split R̂ and ESS) of the per-sample test "
        "log-likelihood and, in the max/min columns, of every traced quantity (probe "
        "predictions, horseshoe scales); seeds are the chains**"
    )
    note = ""
    if few:
        note = (
            f"\n– : fewer than {MIN_RELIABLE_DRAWS} draws per chain, too few for R̂ and ESS to "
            "mean anything (more epochs, or a smaller --thinning, give more)\n"
        )
    return f"{title}\n\n{markdown_table(header, rows)}\n{note}"


def csv_table(groups: Sequence[Group]) -> str:
    """Every configuration as a CSV row: config, run counts, seeds, each metric's mean and std."""
    config_keys: list[str] = []
    for group in groups:
        config_keys += [k for k in group.config if k not in config_keys]
    header = [*config_keys, "runs", "completed", "broken_down", "seeds"]
    columns = table_columns(groups)
    header += [f"{metric}_{stat}" for metric in columns for stat in ("mean", "std")]
    header += ["rhat_test_loglik", "rhat_max", "ess_bulk_min", "ess_tail_min"]
    rows = []
    for group in groups:
        row: list[Any] = [group.config.get(k, "") for k in config_keys]
        row = ["" if v is None else v for v in row]
        row += [len(group.runs), len(group.completed), group.num_broken]
        row.append(" ".join(map(str, group.seeds)))
        row += ["" if math.isnan(v) else repr(v) for metric in columns for v in group.stat(metric)]
        d = group.diagnostics
        values = (
            [d["variables"]["test_loglik"]["rhat"], *d["worst"].values()]
            if d["available"]
            else [None] * 4
        )
        rows.append(row + ["" if v is None or math.isnan(v) else repr(v) for v in values])
    return csv_text(header, rows)


def csv_text(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """The CSV text of a header and rows, ``\\n`` line ends."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    return out.getvalue()
