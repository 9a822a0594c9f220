"""The ``sgrld`` commands' outputs equal their goldens in ``tests/data/golden`` (timings aside).

A before/after check for refactors of ``sgrld.experiments``: the cases, the normalisation and how
to regenerate are in ``tests/golden_outputs.py`` and ``docs/experiments.md``. The funnel case
needs no data and is fast; the others need MNIST and take 15-30 s each (marked ``slow``).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from golden_outputs import (
    CASES,
    UNSEEDED,
    Case,
    blank_fields,
    compare,
    differences,
    golden_path,
    normalise,
)


def _check(case: Case, data: Path | None) -> None:
    assert golden_path(case.name).is_file(), f"no golden for {case.name}: see golden_outputs.py"
    diff = compare(case, data)
    assert not diff, f"{case.name} differs from its golden:\n" + "\n".join(diff)


@pytest.mark.parametrize("case", [c for c in CASES if c.name == "funnel"], ids=lambda c: c.name)
def test_funnel_outputs_equal_golden(case: Case) -> None:
    _check(case, None)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if c.name != "funnel"], ids=lambda c: c.name)
def test_outputs_equal_golden(case: Case, request: pytest.FixtureRequest) -> None:
    # the conftest fixture finds MNIST through SGRLD_MNIST_DIR and skips without it
    data = request.getfixturevalue("mnist_dir") if case.mnist else None
    _check(case, data)


def test_normalise_drops_what_varies_and_keeps_the_rest() -> None:
    results = {
        "seconds_per_epoch": 0.25,
        "timing": {"sampling_seconds": [1.0], "hardware": "AMD EPYC", "threads": 1},
        "ess_bulk_per_second": 3.0,
        "torch": "2.13.0",
        "out": "/tmp/abc/run/results.json",
        "lp": -2.5,
    }
    assert normalise(results, (("/tmp/abc", "{root}"),)) == {
        "timing": {"threads": 1},
        "out": "{root}/run/results.json",
        "lp": -2.5,
    }


def test_differences_compare_floats_bit_for_bit() -> None:
    assert list(differences({"a": [1.0, math.nan]}, {"a": [1.0, math.nan]})) == []
    assert list(differences(0.0, -0.0)) == [": golden 0.0, now -0.0 (difference -0)"]
    (line,) = differences({"a": {"b": 0.1}}, {"a": {"b": 0.1 + 2**-56}})
    assert line.startswith("/a/b: golden 0.1, now 0.10000000000000002")
    assert list(differences({"x": 1}, {"x": 1.0})) == ["/x: golden 1, now 1.0"]
    renamed = ["/f: missing now (golden 1)", "/g: new (now 1)"]
    assert list(differences({"f": 1}, {"g": 1})) == renamed


def test_unseeded_fields_are_blanked_where_the_pattern_says_only() -> None:
    files = {"ck.pt": {"samplers": [{"generator": "a", "stats": "b"}, {"generator": "c"}]}}
    blanked = blank_fields(files, ("ck.pt", "samplers", "*", "generator"))
    assert blanked == {
        "ck.pt": {"samplers": [{"generator": UNSEEDED, "stats": "b"}, {"generator": UNSEEDED}]}
    }
