"""Outputs written by main before the redesign of ``experiments/`` (commit 7e6ae7c) still read,
and its checkpoints still resume: ``tests/data/run_of_main_7e6ae7c`` is a 2-epoch run of that
commit (``sgrld sample --sampler monge --lr 0.05 --width 16 --epochs 2 --subset 300
--eval-subset 100 --burn-in 5 --thinning 3 --threads 1`` on real MNIST)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from sgrld.cli import main
from sgrld.experiments.run.config import RunConfig
from sgrld.experiments.run.results import impossible_values, read_results

OLD = Path(__file__).parent / "data" / "run_of_main_7e6ae7c"
ARGV = ["--threads", "1", "--no-progress", "--no-plot"]


def test_results_of_the_old_main_read_and_tabulate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = read_results(OLD / "results.json")
    assert results["format"] == "sgrld-sample-results/1" and not impossible_values(dict(results))
    config = RunConfig.from_dict(results["config"])
    assert config.to_dict() == results["config"]  # no field added by this version appears
    assert main(["table", str(OLD), "--layout", "long", "--include-partial"]) == 0
    assert f"{results['final']['test']['lp']:.4f}" in capsys.readouterr().out


def test_a_checkpoint_of_the_old_main_resumes_as_a_fresh_run(
    tmp_path: Path, mnist_dir: Path
) -> None:
    old = tmp_path / "old"
    shutil.copytree(OLD, old)
    data = ["--data-dir", str(mnist_dir)]
    assert main(["sample", "--resume", "--out", str(old), "--epochs", "3", *data, *ARGV]) == 0
    fresh = ["sample", "--sampler", "monge", "--lr", "0.05", "--width", "16", "--epochs", "3"]
    fresh += ["--subset", "300", "--eval-subset", "100", "--burn-in", "5", "--thinning", "3"]
    fresh += ["--adapt", "burnin"]  # its default then, which its config keeps (now: "wait")
    assert main([*fresh, *data, *ARGV, "--out", str(tmp_path / "new")]) == 0
    a, b = (json.loads((p / "results.json").read_text()) for p in (old, tmp_path / "new"))
    assert a["config"] == b["config"]
    if a["curves"]["val_lp"][1] == b["curves"]["val_lp"][1]:  # the CPU that wrote the checkpoint
        assert a["curves"] == b["curves"] and a["final"] == b["final"]
        return
    # Another CPU's float32 kernels (AVX2 here, the checkpoint's machine differed) sum in another
    # order: the fresh run's epoch 1 is 2e-9 (relative) off the stored one, and the resumed epoch
    # 2 carries that. Counts and accuracies stay exact, every score within 1e-7 relative.
    assert _close(a["curves"], b["curves"]) and _close(a["final"], b["final"])


def _close(a: object, b: object) -> bool:
    """Equal structure and integers, floats equal to 1e-7 relative."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-7)
    return a == b


def test_tuned_options_read_in_both_forms_and_write_the_old_one() -> None:
    old = json.loads((OLD / "results.json").read_text())["config"]  # Monge, "alpha2": 1.0
    config = RunConfig.from_dict(old)
    assert config.tuned == {"alpha2": 1.0}
    nested = {k: v for k, v in old.items() if k != "alpha2"} | {"tuned": {"alpha2": old["alpha2"]}}
    assert RunConfig.from_dict(nested) == config and config.to_dict() == old
    identity = RunConfig.from_dict({**old, "sampler": "identity", "alpha2": None})
    assert identity.tuned == {} and identity.to_dict()["alpha2"] is None  # as every file has it
    assert identity.label() == "identity ℓ=0.05 seed 0" and "α²=" in config.label()
    with pytest.raises(ValueError, match="alpha2 is a Monge option"):
        RunConfig.from_dict({**old, "sampler": "identity"})
    with pytest.raises(ValueError, match="monge needs alpha2"):
        RunConfig.from_dict({**old, "alpha2": None})
