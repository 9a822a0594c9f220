"""``--lr tuned:DIR``: the ℓ (and tuned options) that ``sgrld tune`` chose for the run's sampler
(``DIR/tune.json``: the setting it tuned for, and one :class:`sgrld.TuneResult` per sampler).

Every reader (``sample``, ``sweep``, ``report --tuned``) goes through :func:`read_tune`, which
reads the file with the checked reader and refuses a hand-edited file in one line; a run takes
the folder's choice only for the setting it was tuned for (:func:`check_setting`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeGuard

from sgrld.experiments.base.exits import UsageError
from sgrld.experiments.base.files import read_json

__all__ = [
    "HARMLESS",
    "PREFIX",
    "SETTING",
    "TUNE_FILE",
    "check_setting",
    "lr_value",
    "read_tune",
    "tuned_options",
]

PREFIX = "tuned:"
TUNE_FILE = "tune.json"

#: the fields of ``tune.json``'s ``config`` an ℓ depends on: a run that differs is refused
#: (n: h = ℓ/n; the batch size: the gradient noise the tuner judged)
SETTING = ("dataset", "model", "width", "prior", "batch_size", "num_train")
#: fields that differ without changing the chain's stability: a warning says so (the run's
#: length; when an adaptive metric freezes, which follows the burn-in)
HARMLESS = ("epochs", "adapt_until")
#: the setting fields ``report --tuned`` prints (required), and their types
_REPORTED = {"dataset": str, "model": str, "width": int, "prior": str, "epochs": int}
_REPORTED |= {"score": str, "seed": int}
_TYPES: dict[str, type] = {**_REPORTED, "batch_size": int, "num_train": int, "max_train": int}


def lr_value(text: str) -> float | str:
    """One ℓ from its text: a number, or ``tuned:DIR`` (kept as text until the sampler is
    known; raises ValueError without ``DIR/tune.json``)."""
    if text.startswith(PREFIX):
        path = Path(text.removeprefix(PREFIX)) / TUNE_FILE
        if not (path.exists() or path.is_symlink()):  # what is there: read_tune judges it
            raise ValueError(f"{text}: no {path} (run sgrld tune --out DIR)")
        return text
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"not a number or tuned:DIR: {text!r}") from None


def _is_real(value: Any) -> TypeGuard[float]:
    """A JSON number (never a bool: ``true`` is not 1)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _problem(data: Any) -> str | None:
    """What in a ``tune.json`` value is not what ``sgrld tune`` writes, or ``None``."""
    if not isinstance(data, dict):
        return f"it holds a JSON {type(data).__name__}, not an object"
    config, samplers = data.get("config"), data.get("samplers")
    if not isinstance(config, dict):
        return "no config object (the setting it was tuned for)"
    for key, kind in _TYPES.items():
        value = config.get(key)
        if key in _REPORTED and value is None:
            return f"config has no {key}"
        wrong = isinstance(value, bool) or not isinstance(value, kind)
        if value is not None and wrong:
            return f"config.{key} is {value!r}, not {'a number' if kind is int else 'text'}"
    if not isinstance(samplers, dict) or not samplers:
        return "no samplers object"
    for name, result in samplers.items():
        if not isinstance(result, dict):
            return f"samplers.{name} is {result!r}, not an object"
        options = result.get("options")
        if not isinstance(options, dict):
            return f"samplers.{name}.options is {options!r}, not an object"
        lr = options.get("lr")
        if not (_is_real(lr) and math.isfinite(lr) and lr > 0):
            return f"samplers.{name}.options.lr is {lr!r}, not a finite number > 0"
        for key, value in options.items():
            if isinstance(value, (dict, list)) or (_is_real(value) and not math.isfinite(value)):
                return f"samplers.{name}.options.{key} is {value!r}, not a finite number or text"
        searched = result.get("searched", ["lr"])
        if not isinstance(searched, list) or not all(
            isinstance(s, str) and _is_real(options.get(s)) for s in searched
        ):
            return f"samplers.{name}.searched is {searched!r}, not names of its numeric options"
        spent = result.get("spent")
        if not (_is_real(spent) and spent >= 0):
            return f"samplers.{name}.spent is {spent!r}, not a count"
        grid = result.get("grid")
        if grid is not None and not (
            isinstance(grid, dict)
            and all(_is_real(grid.get(k)) and grid[k] >= 1 for k in ("runs", "evaluations"))
        ):
            return f"samplers.{name}.grid is {grid!r}, not null or runs and evaluations >= 1"
    return None


def read_tune(folder: Path) -> dict[str, Any]:
    """The contents of ``folder/tune.json``, checked (read as every input is, by
    :func:`~sgrld.experiments.base.files.read_json`).

    Raises:
        UsageError: unreadable (a link, a FIFO, a device, too large), not JSON, or not what
            ``sgrld tune`` writes; one line naming the file and the field.
    """
    path = folder / TUNE_FILE
    data = read_json(path, "the tuned options")
    problem = _problem(data)
    if problem is not None:
        raise UsageError(
            f"cannot read the tuned options in {path}: {problem} (not as sgrld tune writes it: "
            "run sgrld tune again)"
        )
    result: dict[str, Any] = data
    return result


def tuned_options(value: str, sampler: str) -> dict[str, Any]:
    """The options ``tuned:DIR`` holds for ``sampler``: ``lr``, the tuned options and the fixed
    ones they were chosen with (UsageError: none for ``sampler``, or a damaged file)."""
    folder = Path(value.removeprefix(PREFIX))
    samplers = read_tune(folder)["samplers"]
    if sampler not in samplers:
        raise UsageError(
            f"--lr {value}: {folder / TUNE_FILE} has no tuned ℓ for {sampler} (it has "
            f"{', '.join(sorted(samplers)) or 'none'}): run sgrld tune --sampler {sampler}"
        )
    return dict(samplers[sampler]["options"])


def check_setting(value: str, run: Mapping[str, Any], fixed: Mapping[str, Any]) -> list[str]:
    """Compare the setting ``tuned:DIR`` was tuned for with the run's.

    Args:
        value: ``tuned:DIR``.
        run: the run's setting (:data:`SETTING` and :data:`HARMLESS` fields).
        fixed: the run's values of the options the tuner kept fixed (τ, the sampler's options),
            by the names ``tune.json`` records them under.

    Returns:
        One warning per harmless difference (:data:`HARMLESS`).

    Raises:
        UsageError: naming every field that differs and would change the chain (ℓ was chosen
            for another dataset, model, width, prior, batch size, n, τ or fixed option).
    """
    folder = Path(value.removeprefix(PREFIX))
    data = read_tune(folder)
    recorded = data["config"]
    sampler = run.get("sampler")
    options = data["samplers"].get(sampler, {}).get("options", {})
    searched = set(data["samplers"].get(sampler, {}).get("searched", ["lr"]))
    theirs = {**options, **{k: v for k, v in recorded.items() if v is not None}}
    mine = {**fixed, **run}
    differ = [
        f"{key} {theirs[key]!r} (this run: {mine[key]!r})"
        for key in (*SETTING, *fixed)
        if key in theirs
        and key in mine
        and key not in (*searched, *HARMLESS)
        and not _same(theirs[key], mine[key])
    ]
    if differ:
        raise UsageError(
            f"--lr {value}: {folder / TUNE_FILE} was tuned for another setting: "
            + "; ".join(differ)
            + ". An ℓ depends on these: run sgrld tune for this setting, or give --lr"
        )
    return [
        f"--lr {value}: tuned with {key} = {theirs[key]!r}, this run has {mine[key]!r} "
        "(harmless: the chain's stability does not depend on it); ℓ is kept"
        for key in HARMLESS
        if key in theirs and key in mine and not _same(theirs[key], mine[key])
    ]


def _same(theirs: Any, mine: Any) -> bool:
    if _is_real(theirs) and _is_real(mine):
        return math.isclose(float(theirs), float(mine), rel_tol=1e-12, abs_tol=0.0)
    return bool(theirs == mine)
