"""``--lr tuned:DIR``: the ℓ (and tuned options) that ``sgrld tune`` chose for the run's sampler
(``DIR/tune.json``: one :class:`sgrld.TuneResult` per sampler)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sgrld.experiments.base.exits import UsageError

__all__ = ["PREFIX", "TUNE_FILE", "lr_value", "read_tune", "tuned_options"]

PREFIX = "tuned:"
TUNE_FILE = "tune.json"


def lr_value(text: str) -> float | str:
    """One ℓ from its text: a number, or ``tuned:DIR`` (kept as text until the sampler is
    known; raises ValueError without ``DIR/tune.json``)."""
    if text.startswith(PREFIX):
        path = Path(text.removeprefix(PREFIX)) / TUNE_FILE
        if not path.is_file():
            raise ValueError(f"{text}: no {path} (run sgrld tune --out DIR)")
        return text
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"not a number or tuned:DIR: {text!r}") from None


def read_tune(folder: Path) -> dict[str, Any]:
    """The contents of ``folder/tune.json`` (UsageError: unreadable or not a tune file)."""
    path = folder / TUNE_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data.get("samplers"), dict):
            raise ValueError("no samplers")
    except (OSError, ValueError, AttributeError) as exc:
        raise UsageError(f"cannot read the tuned options in {path}: {exc}") from exc
    return data


def tuned_options(value: str, sampler: str) -> dict[str, Any]:
    """The options ``tuned:DIR`` holds for ``sampler``: ``lr``, the tuned options and the fixed
    ones they were chosen with (UsageError: none for ``sampler``)."""
    folder = Path(value.removeprefix(PREFIX))
    samplers = read_tune(folder)["samplers"]
    if sampler not in samplers:
        raise UsageError(
            f"--lr {value}: {folder / TUNE_FILE} has no tuned ℓ for {sampler} (it has "
            f"{', '.join(sorted(samplers)) or 'none'}): run sgrld tune --sampler {sampler}"
        )
    return dict(samplers[sampler]["options"])
