"""The paper's selected hyper-parameters (Tables 4-5) and reference numbers (Tables 1-3 and 6-10,
``sgrld/configs/paper_numbers.csv``)."""

from __future__ import annotations

import csv
import math
from functools import cache
from importlib import resources
from typing import NamedTuple

Setting = tuple[str, str, int | None]


class PaperEntry(NamedTuple):
    """One sampler's row of Tables 1-5: the selected ℓ (and α²), test LP / accuracy, s/epoch."""

    lr: float
    alpha2: float | None
    lp: float
    accuracy: float
    seconds_per_epoch: float


#: The paper's ℓ per setting (Table 4: MNIST, fc of the width; Table 5: CIFAR-10, ResNet-20) and
#: sampler, ``ℓ/α²`` for Monge; "-" where the paper found α² = 0 (Identity) optimal for Monge.
CHOSEN = """\
dataset prior      width identity wenzel rmsprop shampoo monge
mnist   gaussian   400   0.05     0.075  0.00025 0.0025  -
mnist   horseshoe  400   0.25     0.75   0.0005  0.005   0.25/1.25
mnist   gaussian   800   0.05     0.05   0.0005  0.0075  -
mnist   horseshoe  800   0.5      0.5    0.0005  0.005   0.25/0.5
mnist   gaussian   1200  0.025    0.05   0.0005  0.0075  0.025/0.75
mnist   horseshoe  1200  0.25     0.25   0.0005  0.005   0.25/0.075
cifar10 gaussian   -     0.1      0.5    0.0005  0.01    -
cifar10 correlated -     0.1      0.75   0.0005  0.01    -
"""


@cache
def paper_numbers() -> dict[tuple[int, str, int | None, str, str, str], tuple[float, float]]:
    """``(table, dataset, width, prior, sampler, metric) → (mean, std)`` from the paper."""
    text = resources.files("sgrld.configs").joinpath("paper_numbers.csv").read_text("utf-8")
    rows = csv.DictReader(line for line in text.splitlines() if not line.startswith("#"))
    return {
        (
            int(r["table"]),
            r["dataset"],
            int(r["width"]) if r["width"] else None,
            r["prior"],
            r["sampler"],
            r["metric"],
        ): (float(r["mean"]), float(r["std"]) if r["std"] else math.nan)
        for r in rows
    }


@cache
def _entries() -> dict[Setting, dict[str, PaperEntry]]:
    header, *rows = (line.split() for line in CHOSEN.splitlines())
    numbers = paper_numbers()
    entries: dict[Setting, dict[str, PaperEntry]] = {}
    for dataset, prior, width_text, *chosen in rows:
        width = None if width_text == "-" else int(width_text)
        # Table 1 (LP, accuracy) and 2 (s/epoch) for MNIST, Table 3 for CIFAR-10
        scores, timing = (1, 2) if dataset == "mnist" else (3, 3)
        for sampler, text in zip(header[3:], chosen, strict=True):
            if text == "-":
                continue
            lr, _, alpha2 = text.partition("/")
            key = (dataset, width, prior, sampler)
            entries.setdefault((dataset, prior, width), {})[sampler] = PaperEntry(
                float(lr),
                float(alpha2) if alpha2 else None,
                numbers[(scores, *key, "test_lp")][0],
                numbers[(scores, *key, "test_accuracy")][0],
                numbers[(timing, *key, "seconds_per_epoch")][0],
            )
    return entries


def paper_entry(dataset: str, prior: str, width: int | None, sampler: str) -> PaperEntry | None:
    """The paper's row for a setting (``width`` is ignored for CIFAR-10), or ``None``."""
    key = (dataset, prior, width if dataset == "mnist" else None)
    return _entries().get(key, {}).get(sampler)
