"""``results.json``: the typed format of a run's results, its one writer and its one reader.

Nothing here imports torch at import time (sweeps, tables and reports read results without
it); what a likelihood declares its scores to be (:mod:`sgrld.likelihoods`) is read when a
function needs it. A reader refuses a ``format`` version it does not know, naming it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from sgrld.experiments.base.files import read_file, write_atomic

if TYPE_CHECKING:
    from sgrld.likelihoods import Likelihood

RESULTS_FILE = "results.json"
RESULTS_FORMAT = "sgrld-sample-results/1"
#: The formats this version reads.
RESULTS_FORMATS = (RESULTS_FORMAT,)
STATUSES = ("running", "failed", "completed", "broken_down")
#: Statuses after which a run is not continued (a broken-down run is a result of the protocol).
FINISHED = ("completed", "broken_down")
SPLITS = ("val", "test")


def scored_by(scores: Iterable[str]) -> type[Likelihood]:
    """The likelihood whose scores these are (:func:`sgrld.likelihoods.scored_by`)."""
    from sgrld.likelihoods import scored_by as declared  # torch: only when a run is read

    return declared(scores)


def short_name(score: str) -> str:
    """A score's short label in one-line summaries (``"LP"``, ``"acc"``, ``"RMSE"``)."""
    from sgrld.likelihoods import get_likelihood, likelihood_names

    labels = {"lp": "LP"}
    for name in likelihood_names():
        labels |= {s: label for label, s in get_likelihood(name).headline.items()}
    return labels.get(score, score)


class BrokenDown(TypedDict):
    """Where a chain met a non-finite potential or gradient."""

    epoch: int  # epochs completed before the failing one
    update: int  # the failing update, 1-based over the run
    global_step: int  # updates completed (its state is the last)
    reason: str
    hint: str | None


class Curvature(TypedDict):
    mean: float | None
    std: float | None
    num_samples: int


class Telemetry(TypedDict):
    per_epoch: dict[str, list[Any]]  # figure → one value per epoch
    state_bytes: int | None


class Results(TypedDict):
    """The contents of ``results.json`` (NaN written as ``null``)."""

    format: str
    config: dict[str, Any]  # RunConfig.to_dict()
    seed: int
    seeds: dict[str, int]  # the derived streams: init, chain, data_order, curvature
    status: str  # one of STATUSES
    broken_down: BrokenDown | None
    failure: str | None  # why an output could not be written (status "failed")
    epochs_completed: int
    global_steps: int
    steps_per_epoch: int
    num_data: int
    num_samples: int
    warmup: dict[str, Any]  # adapt_until, samples_adapting (drawn while the metric adapted)
    final: dict[str, dict[str, Any]]  # split → score → value (a number, or None for NaN)
    curvature: Curvature | None
    seconds_per_epoch: float | None
    schedule: dict[str, Any] | None
    timing: dict[str, Any]
    curves: dict[str, list[Any]]  # epoch, global_step, num_samples, <split>_<score>, curvature
    telemetry: Telemetry
    trace: dict[str, Any]
    diagnostics: dict[str, Any]
    environment: dict[str, str]


class ResultsError(ValueError):
    """A ``results.json`` that cannot be read as this format (one line naming the file)."""


def nan_to_none(value: Any) -> Any:
    """JSON has no NaN: floats that are not finite become ``None``, recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: nan_to_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [nan_to_none(v) for v in value]
    return value


def write_results(folder: Path, results: Results) -> None:
    """``folder/results.json``, atomically, strict JSON (no NaN)."""
    text = json.dumps(nan_to_none(results), indent=1, allow_nan=False)
    write_atomic(folder / RESULTS_FILE, text + "\n")


def read_results(path: Path) -> Results:
    """One ``results.json``, checked for the fields every reader relies on.

    Raises:
        ResultsError: unreadable, not a sgrld results file, a newer format, or a missing field.
    """
    try:
        results = json.loads(read_file(path).decode("utf-8"))
    except OSError as exc:
        raise ResultsError(f"{path}: cannot read results ({exc.strerror or exc})") from exc
    except UnicodeDecodeError:
        raise ResultsError(f"{path}: not a sgrld results file (not UTF-8 text)") from None
    except ValueError as exc:
        raise ResultsError(f"{path}: not a sgrld results file (not JSON: {exc})") from None
    if not isinstance(results, dict) or not str(results.get("format", "")).startswith(
        "sgrld-sample-results/"
    ):
        raise ResultsError(f"{path}: not a sgrld sample results file")
    if results["format"] not in RESULTS_FORMATS:
        raise ResultsError(
            f"{path}: results format {results['format']!r} is newer than this sgrld reads "
            f"({', '.join(RESULTS_FORMATS)}); upgrade sgrld"
        )
    config, final = results.get("config"), results.get("final")
    if results.get("status") not in STATUSES:
        raise ResultsError(f"{path}: no valid status (one of {', '.join(STATUSES)})")
    if not isinstance(config, dict) or not isinstance(config.get("seed"), int):
        raise ResultsError(f"{path}: no valid config (with its seed)")
    if not isinstance(final, dict) or not all(isinstance(final.get(s), dict) for s in SPLITS):
        raise ResultsError(f"{path}: no final val and test metrics")
    return results  # type: ignore[return-value]  # checked above where readers rely on it


def impossible_values(results: dict[str, Any]) -> list[str]:
    """What no run can have produced in a ``results.json``'s final scores, each as ``"test lp
    5.0"``: a discrete observation's log-probability above 0, a fraction outside [0, 1], a
    negative RMSE, or NaN/Inf in a completed run (in LP or the headline score beside it)."""
    found = []
    final = results.get("final")
    if not isinstance(final, dict):
        return ["no final metrics"]
    for split in SPLITS:
        scores = final.get(split)
        if not isinstance(scores, dict) or "lp" not in scores:
            return [f"no final {split} lp"]
        likelihood = scored_by(scores)
        required = ("lp", likelihood.second())
        for name, value in scores.items():
            if value is None:
                if results.get("status") == "completed" and name in required:
                    found.append(f"{split} {name} NaN")
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                found.append(f"{split} {name} {value!r}")
            elif not math.isfinite(value):
                found.append(f"{split} {name} {value}")
            elif name == "lp" and likelihood.discrete and value > 0.0:
                found.append(f"{split} {name} {value} > 0")
            elif name in likelihood.nonnegative and value < 0.0:
                found.append(f"{split} {name} {value} < 0")
            elif name in likelihood.fractions and not 0.0 <= value <= 1.0:
                found.append(f"{split} {name} {value} outside [0, 1]")
    return found
