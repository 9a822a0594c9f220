"""The sampling run loop: thinning schedule, streaming evaluation, exact resume, failures."""

from __future__ import annotations

import io
import itertools
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

import sgrld
from conftest import state_tensors
from sgrld.data import Splits
from sgrld.experiments.run.checkpoint import load_checkpoint
from sgrld.experiments.run.config import (
    CHECKPOINT_FILE,
    TUNED_FIELDS,
    RunConfig,
    derive_seed,
    is_sample_step,
    num_samples_after,
)
from sgrld.experiments.run.loop import SamplingRun, run_sampling
from sgrld.experiments.run.observers import ProgressBar, RunObserver
from sgrld.experiments.run.results import RESULTS_FILE

#: Every registered sampler runs through the experiment loops (a new metric needs no edit here).
SAMPLERS = tuple(sgrld.metric_names())


def synthetic_splits(num_train: int = 200, num_eval: int = 50, seed: int = 0) -> Splits:
    """MNIST-shaped data (784 inputs, 10 classes) with a learnable signal."""
    g = torch.Generator().manual_seed(seed)

    def part(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.randint(0, 10, (n,), generator=g)
        x = 0.3 * torch.rand(n, 784, generator=g)
        x[torch.arange(n), 78 * y] += 1.0
        return x, y

    (xt, yt), (xv, yv), (xs, ys) = part(num_train), part(num_eval), part(num_eval)
    return Splits(x_train=xt, y_train=yt, x_val=xv, y_val=yv, x_test=xs, y_test=ys)


def tiny_config(**overrides: Any) -> RunConfig:
    values: dict[str, Any] = {
        "dataset": "mnist",
        "model": "fc",
        "prior": "horseshoe",
        "sampler": "identity",
        "lr": 0.05,
        "epochs": 4,
        "width": 8,
        "batch_size": 20,  # 10 steps per epoch on 200 points
        "burnin": 5,
        "thinning": 5,
        "eval_batch_size": 16,
    }
    values.update(overrides)
    if values["sampler"] == "monge":
        values.setdefault("alpha2", 1.0)
    tuned = {n: values.pop(n) for n in TUNED_FIELDS if n in values}  # as the files write them
    return RunConfig(**values, tuned=tuned)


# --- schedule ---------------------------------------------------------------------------------


def reference_sample_steps(num_epochs: int, batches: int) -> list[int]:
    """Spec §4.2: saved after the update when (i+1) % 100 == 0 and step > 1000 (0-based)."""
    steps, step = [], 0
    for _ in range(num_epochs):
        for i in range(batches):
            if (i + 1) % 100 == 0 and step > 1000:
                steps.append(step + 1)  # as a count of updates
            step += 1
    return steps


@pytest.mark.parametrize("batches, expected_total", [(500, 1990), (400, 1590)])
def test_schedule_matches_reference_and_sample_counts(batches: int, expected_total: int) -> None:
    ours = [k for k in range(1, 12 * batches + 1) if is_sample_step(k)]
    assert ours == reference_sample_steps(12, batches)
    assert ours[0] == 1100  # first sample after 1,100 updates
    assert all(b - a == 100 for a, b in itertools.pairwise(ours))
    assert num_samples_after(400 * batches) == expected_total
    assert num_samples_after(12 * batches) == len(ours)
    assert num_samples_after(1099) == 0 and num_samples_after(1100) == 1


def test_first_sample_after_1100_updates_end_to_end() -> None:
    # 100 steps per epoch with the paper's burn-in and thinning: epochs 0-9 have no sample,
    # epoch 10 ends at update 1,100 with the first.
    config = tiny_config(epochs=12, batch_size=10, burnin=1000, thinning=100, sampler="identity")
    run = SamplingRun(config, synthetic_splits(num_train=1000, num_eval=20))
    (results,) = run.run()
    assert results["curves"]["num_samples"] == [0] * 10 + [1, 2]
    assert results["curves"]["global_step"][-1] == 1200
    assert results["curves"]["val_lp"][:10] == [None] * 10  # NaN before the first sample
    assert results["num_samples"] == 2
    # Timing keeps only steps after the first 1,000.
    assert results["timing"]["steps_after_skip"] == 200
    assert results["timing"]["steps_all"] == 1200
    assert results["seconds_per_epoch"] > 0


def test_thinning_by_global_step_across_uneven_epochs() -> None:
    # 7 steps per epoch (130 points, batch 20, last batch of 10): samples at updates 6, 9, 12, ...
    config = tiny_config(epochs=3, burnin=5, thinning=3)
    results = SamplingRun(config, synthetic_splits(num_train=130)).run()[0]
    assert results["steps_per_epoch"] == 7
    expected = [sum(is_sample_step(k, 5, 3) for k in range(1, 7 * e + 1)) for e in (1, 2, 3)]
    assert results["curves"]["num_samples"] == expected == [1, 3, 6]


# --- resume -----------------------------------------------------------------------------------


class KillAt(RunObserver):
    """Simulates a kill (Ctrl-C) right after update ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step(self, run: SamplingRun) -> None:
        if run.global_step == self.step:
            raise KeyboardInterrupt


def deterministic(results: dict[str, Any]) -> dict[str, Any]:
    """Everything in results.json except wall-clock timings."""
    return {k: v for k, v in results.items() if k not in ("timing", "seconds_per_epoch")}


@pytest.mark.parametrize(
    ("sampler", "noise", "compile"),
    [(s, "torch", False) for s in SAMPLERS]
    + [("shampoo", "philox", False), ("rmsprop", "torch", True)],
)
def test_resume_after_kill_equals_uninterrupted_run(
    tmp_path: Path, sampler: str, noise: str, compile: bool
) -> None:
    config = tiny_config(
        sampler=sampler, curvature=True, curvature_points=10, noise=noise, compile=compile
    )
    splits = synthetic_splits()
    straight = run_sampling(config, splits, tmp_path / "straight")[0]

    killed = tmp_path / "killed"
    with pytest.raises(KeyboardInterrupt):  # mid-epoch 3, after the epoch-2 checkpoint
        run_sampling(config, splits, killed, observer=KillAt(27))
    partial = json.loads((killed / RESULTS_FILE).read_text())
    assert partial["status"] == "running" and partial["epochs_completed"] == 2
    resumed = run_sampling(config, splits, killed, resume=True)[0]

    assert resumed["status"] == "completed"
    assert deterministic(resumed) == deterministic(straight)
    on_disk = json.loads((killed / RESULTS_FILE).read_text())
    assert (
        on_disk["curves"]
        == json.loads((tmp_path / "straight" / RESULTS_FILE).read_text())["curves"]
    )
    a, b = (load_checkpoint(d / CHECKPOINT_FILE) for d in (tmp_path / "straight", killed))
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    sa, sb = (state_tensors(ck["optimizer"]) for ck in (a, b))
    assert sa.keys() == sb.keys()
    assert all(torch.equal(v, sb[k]) for k, v in sa.items())


def test_resume_extends_a_completed_run(tmp_path: Path) -> None:
    splits = synthetic_splits()
    config = tiny_config(sampler="wenzel", epochs=2)
    run_sampling(config, splits, tmp_path / "a")
    extended = run_sampling(replace(config, epochs=4), splits, tmp_path / "a", resume=True)[0]
    straight = run_sampling(replace(config, epochs=4), splits, tmp_path / "b")[0]
    assert deterministic(extended) == deterministic(straight)
    # A completed run resumed with the same epochs does no work and keeps its results.
    again = run_sampling(replace(config, epochs=4), splits, tmp_path / "b", resume=True)[0]
    assert deterministic(again) == deterministic(straight)


def test_resume_refuses_another_config(tmp_path: Path) -> None:
    splits = synthetic_splits()
    run_sampling(tiny_config(epochs=1), splits, tmp_path)
    with pytest.raises(ValueError, match=r"lr: 0\.05 vs 0\.1"):
        run_sampling(tiny_config(epochs=2, lr=0.1), splits, tmp_path, resume=True)


# --- evaluation, curvature, failures ----------------------------------------------------------


def test_curvature_has_its_own_generator_and_never_perturbs_the_chain() -> None:
    splits = synthetic_splits()
    plain = SamplingRun(tiny_config(), splits).run()[0]
    measured = SamplingRun(tiny_config(curvature=True, curvature_points=20), splits).run()[0]
    for key, curve in plain["curves"].items():
        if key != "curvature":
            assert measured["curves"][key] == curve, key
    assert all(c is None for c in plain["curves"]["curvature"])
    assert measured["curvature"]["num_samples"] == measured["num_samples"] == 7
    assert measured["curvature"]["mean"] > 0


def test_streaming_ensemble_equals_stored_samples() -> None:
    # Re-evaluate each sample from a copy of the state at sampling time: the cumulative-ensemble
    # LP of the accumulators must equal the brute-force average of the stored predictives.
    splits = synthetic_splits()
    stored: list[torch.Tensor] = []

    class Keep(RunObserver):
        def on_step(self, run: SamplingRun) -> None:
            if is_sample_step(run.global_step, run.config.burnin, run.config.thinning):
                run.stepper.model.eval()
                with torch.no_grad():
                    stored.append(
                        torch.log_softmax(run.stepper.model(splits.x_test).double(), dim=1)
                    )
                run.stepper.model.train()

    results = SamplingRun(tiny_config(epochs=2), splits, observer=Keep()).run()[0]
    log_mean = torch.logsumexp(torch.stack(stored), dim=0) - math.log(len(stored))
    lp = float(log_mean.gather(1, splits.y_test[:, None]).mean())
    accuracy = float((log_mean.argmax(1) == splits.y_test).double().mean())
    assert results["final"]["test"]["lp"] == pytest.approx(lp, abs=1e-12)
    assert results["final"]["test"]["accuracy"] == accuracy


def test_model_is_back_in_train_mode_after_evaluation() -> None:
    modes: list[bool] = []

    class Watch(RunObserver):
        def on_step(self, run: SamplingRun) -> None:
            modes.append(run.stepper.model.training)

    SamplingRun(tiny_config(epochs=1), synthetic_splits(), observer=Watch()).run()
    assert modes and all(modes)


def test_wenzel_refreshed_at_each_epoch_end() -> None:
    run = SamplingRun(tiny_config(sampler="wenzel", epochs=3), synthetic_splits())
    run.run()
    assert run.records[0].timing["refreshes"] == 3
    scale = run.stepper.optimizer.sampler_states[0].stats["scale"]
    assert float(scale.min()) < 1.0 and float(scale.max()) == 1.0


def test_nan_potential_stops_the_run_as_broken_down(tmp_path: Path) -> None:
    splits = synthetic_splits()
    splits.x_train[57] = math.nan  # some batch of the first epoch holds it
    results = run_sampling(tiny_config(epochs=3), splits, tmp_path)[0]
    assert results["status"] == "broken_down"
    assert results["epochs_completed"] == 0
    assert results["broken_down"]["epoch"] == 0
    assert "potential is nan" in results["broken_down"]["reason"]
    assert results["global_steps"] < 10
    on_disk = json.loads((tmp_path / RESULTS_FILE).read_text())  # strict JSON, NaN as null
    assert on_disk["status"] == "broken_down"


def test_progress_bar_prints_running_ensemble_metrics() -> None:
    stream = io.StringIO()
    SamplingRun(tiny_config(epochs=2), synthetic_splits(), observer=ProgressBar(stream)).run()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2  # not a terminal: one line per epoch
    assert lines[1].startswith("epoch 2/2") and "val LP -" in lines[1] and "S=3" in lines[1]


def test_seeds_recorded_and_distinct_per_stream() -> None:
    results = SamplingRun(tiny_config(epochs=1, seed=3), synthetic_splits()).run()[0]
    assert results["seed"] == 3
    assert results["seeds"] == {s: derive_seed(3, s) for s in results["seeds"]}
    assert len(set(results["seeds"].values())) == 4


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"sampler": "sgld"}, "unknown sampler"),
        ({"lr": 0.0}, "lr must be"),
        ({"lr": -1.0}, "lr must be"),
        ({"lr": math.nan}, "lr must be"),
        ({"width": 0}, "width must be"),
        ({"epochs": 0}, "epochs must be"),
        ({"sampler": "monge", "alpha2": -1.0}, "alpha2"),
        ({"alpha2": 1.0}, "alpha2 is a Monge option"),
        ({"model": "resnet20"}, "does not fit dataset"),
        ({"prior": "correlated"}, "convolutions"),
        ({"thinning": 0}, "thinning must be"),
        ({"noise": "numpy"}, "unknown noise"),
        ({"sampler": "shampoo", "compile": True}, "compile=True is not offered"),
    ],
)
def test_config_validation(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tiny_config(**overrides)


@pytest.mark.parametrize("sampler", ["monge", "shampoo"])
def test_results_hold_per_epoch_telemetry_and_the_state_size(tmp_path: Path, sampler: str) -> None:
    """results.json: the optimizer's telemetry of every epoch (drift, noise, their ratio and the
    metric's own figure) and the sampler state's bytes."""
    config = tiny_config(sampler=sampler, epochs=2)
    results = run_sampling(config, synthetic_splits(), tmp_path)[0]
    per_epoch = results["telemetry"]["per_epoch"]
    assert per_epoch["steps"] == [10.0, 10.0]
    assert all(v > 0 for v in per_epoch["drift_rms"] + per_epoch["noise_rms"])
    assert len(per_epoch["drift_to_noise"]) == 2
    assert len(per_epoch["stretch" if sampler == "monge" else "factor_condition"]) == 2
    assert results["telemetry"]["state_bytes"] > 0
