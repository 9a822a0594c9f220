"""The runner's deferred step mode (no host read per step; what CUDA captures), run eagerly on
CPU: the same chain, samples, breakdowns and checkpoints as the eager loop; the CLI's
``--no-graph``. The captured (``"graph"``) mode itself is tested in ``test_cuda.py``."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import sgrld
from conftest import state_tensors
from sgrld.capture import GraphedStep
from sgrld.cli import main
from sgrld.data import Splits
from sgrld.experiments.commands import sweep
from sgrld.experiments.run import single as runner_module
from sgrld.experiments.run.checkpoint import load_checkpoint
from sgrld.experiments.run.config import CHECKPOINT_FILE, derive_seed
from sgrld.experiments.run.loop import GROWTH_CHECK_EVERY, SamplingRun, run_sampling
from sgrld.experiments.run.observers import RunObserver
from sgrld.experiments.run.options import MACHINE_OPTIONS
from sgrld.experiments.run.results import RESULTS_FILE
from sgrld.experiments.run.single import resolve_step_mode
from sgrld.experiments.sweep.grid import run_defaults
from sgrld.experiments.sweep.jobs import Machine
from test_runner import KillAt, deterministic, synthetic_splits, tiny_config

SAMPLERS = ("identity", "wenzel", "rmsprop", "monge", "shampoo")
SPLIT_FIELDS = ("x_train", "y_train", "x_val", "y_val", "x_test", "y_test")
NUM_TRAIN = 195  # batch 10: 19 full batches and a short one of 5 per epoch


def config(sampler: str, **overrides: Any) -> Any:
    """120 updates (Shampoo refreshes its roots at update 100), a sample every 5 from update 10.

    ℓ = 0.01: at 0.05 RMSprop's statistics (zeros at first, so G^{-1/2} = 10⁴ on coordinates
    whose gradient stayed 0) amplify rounding differences until the chains part. The metric
    adapts throughout (the paper's protocol): frozen after the 5-update burn-in, a G made from
    five gradients amplifies the float32 rounding of the two loops the same way (the float64
    test checks the warm-up path, to 1e-12)."""
    values: dict[str, Any] = {"batch_size": 10, "epochs": 6, "lr": 0.01, "adapt": "always"}
    return tiny_config(sampler=sampler, **{**values, **overrides})


def gap(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Largest difference of the final metrics and of every metric curve."""
    final = [abs(a["final"][s][m] - b["final"][s][m]) for s in a["final"] for m in a["final"][s]]
    curves = [
        abs(x - y)
        for key, curve in a["curves"].items()
        if key.startswith(("val_", "test_"))
        for x, y in zip(curve, b["curves"][key], strict=True)
        if x is not None or y is not None
    ]
    return max(final + curves)


def counts(results: dict[str, Any]) -> dict[str, Any]:
    """What must match exactly between the loops (schedule, samples, breakdown, timing counts)."""
    broken = results["broken_down"]
    return {
        "status": results["status"],
        "epochs_completed": results["epochs_completed"],
        "global_steps": results["global_steps"],
        "num_samples": results["num_samples"],
        "curve_steps": (results["curves"]["global_step"], results["curves"]["num_samples"]),
        "broken_down": None if broken is None else {k: broken[k] for k in ("epoch", "update")},
        "broken_at": None if broken is None else broken["global_step"],
        "steps_timed": (results["timing"]["steps_all"], results["timing"]["steps_after_skip"]),
        "refreshes": results["timing"]["refreshes"],
        "trace_samples": len(results["trace"]["test_loglik"]),
    }


# --- the same chain ---------------------------------------------------------------------------


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_deferred_loop_equals_eager_loop(sampler: str) -> None:
    c = config(sampler, curvature=True, curvature_points=10)
    eager = SamplingRun(c, synthetic_splits(num_train=NUM_TRAIN), step_mode="eager")
    deferred = SamplingRun(c, synthetic_splits(num_train=NUM_TRAIN), step_mode="deferred")
    (a,), (b,) = eager.run(), deferred.run()
    assert (a["timing"]["step_mode"], b["timing"]["step_mode"]) == ("eager", "deferred")
    assert counts(a) == counts(b)
    assert b["status"] == "completed" and b["global_steps"] == 120 and b["num_samples"] == 23
    assert gap(a, b) < 1e-6  # float32; ℓ as a tensor rounds σ and the move differently
    assert a["curvature"]["num_samples"] == b["curvature"]["num_samples"] == 23
    for p, q in zip(
        eager.stepper.model.parameters(), deferred.stepper.model.parameters(), strict=True
    ):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-5)  # a few ulps per update
    assert deferred.stepper.optimizer.capturable and not eager.stepper.optimizer.capturable
    assert isinstance(deferred.stepper.optimizer.param_groups[0]["lr"], torch.Tensor)
    if sampler == "shampoo":  # the roots were refreshed (update 100) inside a deferred step
        stats = deferred.stepper.optimizer.sampler_states[0].stats
        roots = [v for k, v in stats.items() if k.startswith("grad_root")]
        assert any(not torch.equal(r, torch.eye(r.shape[-1]).expand_as(r)) for r in roots)


def float64_run(sampler: str, mode: str) -> SamplingRun:
    """A run built in float64: the model in the default dtype, here float64 while the run is
    made and float32 again while it runs (the compiled noise kernel guards on the default
    dtype; a float64 default would make it compile once more for nothing)."""
    splits = synthetic_splits(num_train=NUM_TRAIN)
    double = {f: getattr(splits, f) for f in SPLIT_FIELDS}
    double = {f: t.double() if t.is_floating_point() else t for f, t in double.items()}
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return SamplingRun(config(sampler, adapt="burnin"), Splits(**double), step_mode=mode)
    finally:
        torch.set_default_dtype(previous)


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_deferred_loop_equals_eager_loop_in_float64(sampler: str) -> None:
    """In float64 the two loops agree to 1e-12 over the same 120 updates: what separates them
    in float32 is rounding (ℓ as a tensor), not the schedule, the batches, the noise or the end
    of the metric's warm-up (the default, after the 5-update burn-in).

    Shampoo's bound is its roots' conditioning: G is frozen from the inverse roots of factors
    built from five gradients over an ε = 1e-8 ridge, whose small eigenvalues (~ε) take an
    absolute rounding of ~1e-16·λ_max as a relative change of ~1e-8 (measured: roots 1.0e-9,
    parameters 4.5e-10, results 1.1e-12 apart). Before the warm-up's end refreshed the roots,
    Shampoo's G here stayed I and this compared SGLD.
    """
    bound = 1e-8 if sampler == "shampoo" else 1e-12
    eager, deferred = float64_run(sampler, "eager"), float64_run(sampler, "deferred")
    (a,), (b,) = eager.run(), deferred.run()
    assert counts(a) == counts(b)
    assert gap(a, b) < bound
    for p, q in zip(
        eager.stepper.model.parameters(), deferred.stepper.model.parameters(), strict=True
    ):
        assert p.dtype == q.dtype == torch.float64
        assert float((q - p).detach().abs().max()) <= bound * float(p.detach().abs().max())


def test_deferred_loop_reads_the_flags_only_before_samples_and_at_epoch_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reads: list[int] = []
    read = runner_module.first_failures

    def counted(flags: Any) -> Any:
        reads.append(run.global_step)
        return read(flags)

    monkeypatch.setattr(runner_module, "first_failures", counted)
    run = SamplingRun(config("monge"), synthetic_splits(num_train=NUM_TRAIN), step_mode="deferred")
    (results,) = run.run()
    samples = [k for k in range(1, 121) if k > 5 and k % 5 == 0]
    epoch_ends = list(range(20, 121, 20))
    # and every GROWTH_CHECK_EVERY steps, before the chains' ‖θ‖ is judged against its start
    growth = list(range(GROWTH_CHECK_EVERY, 121, GROWTH_CHECK_EVERY))
    assert reads == sorted(samples + epoch_ends + growth)  # epoch ends are samples: read twice
    assert results["timing"]["steps_all"] == 120


# --- breakdowns -------------------------------------------------------------------------------


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_huge_lr_breaks_down_at_the_same_update(sampler: str, tmp_path: Path) -> None:
    c = config(sampler, lr=1e5)
    splits = synthetic_splits(num_train=NUM_TRAIN)
    a = run_sampling(c, splits, tmp_path / "eager", step_mode="eager")[0]
    b = run_sampling(c, splits, tmp_path / "deferred", step_mode="deferred")[0]
    assert b["status"] == "broken_down"
    assert counts(a) == counts(b)
    assert "non-finite potential or gradient" in b["broken_down"]["reason"]
    assert f"at update {b['broken_down']['update']}" in b["broken_down"]["reason"]
    assert a["curves"] == b["curves"]


class PoisonAfter(RunObserver):
    """Makes one training point NaN after epoch ``epoch`` (its batch then breaks the chain)."""

    def __init__(self, epoch: int, point: int) -> None:
        self.epoch, self.point = epoch, point

    def on_epoch(self, run: SamplingRun) -> None:
        if run.epoch == self.epoch:
            run.splits.x_train[self.point] = math.nan


def failing_update(epoch: int, point: int) -> int:
    """The update of epoch ``epoch`` (0-based) whose minibatch holds ``point`` (batch 10)."""
    order = torch.Generator().manual_seed(derive_seed(0, "data_order"))
    for _ in range(epoch + 1):
        permutation = torch.randperm(NUM_TRAIN, generator=order)
    position = int((permutation == point).nonzero())
    return epoch * 20 + position // 10 + 1


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_breakdown_mid_epoch_after_samples_is_recorded_as_by_the_eager_loop(
    sampler: str, tmp_path: Path
) -> None:
    c = config(sampler)
    update = failing_update(2, 1)
    assert update % 20 > 10  # samples were taken in the failing epoch before it broke
    results, checkpoints = [], []
    for mode in ("eager", "deferred"):
        out = tmp_path / mode
        observer = PoisonAfter(2, 1)
        splits = synthetic_splits(num_train=NUM_TRAIN)
        results.append(run_sampling(c, splits, out, observer=observer, step_mode=mode)[0])
        checkpoints.append(load_checkpoint(out / CHECKPOINT_FILE))
        assert json.loads((out / RESULTS_FILE).read_text())["status"] == "broken_down"
    a, b = results
    assert counts(a) == counts(b)
    assert b["broken_down"]["update"] == update and b["broken_down"]["epoch"] == 2
    assert b["global_steps"] == b["timing"]["steps_all"] == update - 1
    assert b["num_samples"] == sum(k > 5 and k % 5 == 0 for k in range(1, update))
    assert gap(a, b) < 1e-6
    assert "'net.fc1.weight'" in b["broken_down"]["reason"]
    # the checkpoint holds the state after the last good update, as the eager loop's does
    for name, tensor in checkpoints[0]["model"].items():
        torch.testing.assert_close(checkpoints[1]["model"][name], tensor, rtol=0, atol=1e-5)
    firsts = [ck["optimizer"]["state"][0] for ck in checkpoints]
    assert int(firsts[0]["step"]) == int(firsts[1]["step"]) == update - 1
    assert not firsts[1]["check_flags"].any()
    assert isinstance(checkpoints[1]["optimizer"]["param_groups"][0]["lr"], float)
    # resuming a broken-down run does nothing and reports the same
    again = run_sampling(c, synthetic_splits(num_train=NUM_TRAIN), tmp_path / "deferred",
                         resume=True, step_mode="deferred")[0]  # fmt: skip
    assert deterministic(again) == deterministic(b)


MARK = -7.0  # a training input whose first pixel is MARK gets a NaN gradient


class _NaNGradientIfMarked(torch.autograd.Function):
    """The potential itself in the forward pass; a NaN gradient when the batch holds MARK."""

    @staticmethod
    def forward(ctx: Any, u: torch.Tensor, marked: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(marked)
        return u.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (marked,) = ctx.saved_tensors
        return grad * torch.where(marked, math.nan, 1.0), None


def nan_gradient_potential(model: Any, x: torch.Tensor, y: torch.Tensor, n: int) -> torch.Tensor:
    """A finite potential whose gradient is NaN on a marked batch (no host read: capturable)."""
    from sgrld.models import potential

    return _NaNGradientIfMarked.apply(potential(model, x, y, n), (x[:, 0] == MARK).any())


class MarkAfter(PoisonAfter):
    def on_epoch(self, run: SamplingRun) -> None:
        if run.epoch == self.epoch:
            run.splits.x_train[self.point, 0] = MARK


def patch_potential(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both loops' potential: a run in one process's (the deferred loop poisons it in the
    runner's :class:`~sgrld.core.runner.OptimizerChain`)."""
    from sgrld.experiments.run import parallel

    monkeypatch.setattr(parallel, "potential", nan_gradient_potential)


@pytest.mark.parametrize("sampler", ["identity", "shampoo"])
def test_nan_gradient_under_a_finite_potential_breaks_down_at_its_update(
    sampler: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    patch_potential(monkeypatch)
    results = {
        mode: SamplingRun(
            config(sampler),
            synthetic_splits(num_train=NUM_TRAIN),
            observer=MarkAfter(2, 1),
            step_mode=mode,
        ).run()[0]
        for mode in ("eager", "deferred")
    }
    assert counts(results["eager"]) == counts(results["deferred"])
    assert results["deferred"]["broken_down"]["update"] == failing_update(2, 1)
    assert "contains NaN or Inf" in results["eager"]["broken_down"]["reason"]  # the sync check
    assert "'net.fc1.weight'" in results["deferred"]["broken_down"]["reason"]


# --- resume -----------------------------------------------------------------------------------


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_resume_of_the_deferred_loop_is_bit_identical(sampler: str, tmp_path: Path) -> None:
    c = tiny_config(sampler=sampler, curvature=True, curvature_points=10)
    splits = synthetic_splits()
    straight = run_sampling(c, splits, tmp_path / "straight", step_mode="deferred")[0]
    killed = tmp_path / "killed"
    with pytest.raises(KeyboardInterrupt):  # mid-epoch 3, after the epoch-2 checkpoint
        run_sampling(c, splits, killed, observer=KillAt(27), step_mode="deferred")
    resumed = run_sampling(c, splits, killed, resume=True, step_mode="deferred")[0]
    assert resumed["status"] == "completed" and resumed["timing"]["step_mode"] == "deferred"
    assert deterministic(resumed) == deterministic(straight)
    a, b = (load_checkpoint(d / CHECKPOINT_FILE) for d in (tmp_path / "straight", killed))
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    sa, sb = (state_tensors(ck["optimizer"]) for ck in (a, b))
    assert int(sa["0.step"]) == int(sb["0.step"]) == 40
    assert sa.keys() == sb.keys()
    for name, tensor in sa.items():
        assert torch.equal(tensor, sb[name]), name


def test_checkpoints_move_between_step_modes(tmp_path: Path) -> None:
    """ℓ is saved as a float: an eager checkpoint resumes in the deferred loop and back."""
    c = config("monge", epochs=4)
    splits = synthetic_splits(num_train=NUM_TRAIN)
    straight = run_sampling(c, splits, tmp_path / "a", step_mode="eager")[0]
    run_sampling(config("monge", epochs=2), splits, tmp_path / "b", step_mode="eager")
    run_sampling(config("monge", epochs=3), splits, tmp_path / "b", resume=True,
                 step_mode="deferred")[0]  # fmt: skip
    mixed = run_sampling(c, splits, tmp_path / "b", resume=True, step_mode="eager")[0]
    assert counts(mixed) == counts(straight)
    assert gap(mixed, straight) < 1e-6


# --- modes, CLI, sweep ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "device", "expected"),
    [
        ({}, "cpu", "eager"),
        ({}, "cuda", "graph"),
        ({"noise": "torch"}, "cuda", "eager"),
        ({"schedule": "cyclical", "cycles": 2}, "cuda", "eager"),
        ({"compile": True}, "cuda", "eager"),
    ],
)
def test_auto_captures_on_cuda_when_the_config_allows(
    overrides: dict[str, Any], device: str, expected: str
) -> None:
    assert resolve_step_mode("auto", tiny_config(**overrides), torch.device(device)) == expected


@pytest.mark.parametrize(
    ("mode", "overrides", "message"),
    [
        ("deferred", {"noise": "torch"}, "noise 'torch'"),
        ("deferred", {"schedule": "cyclical", "cycles": 2}, "cyclical"),
        ("deferred", {"compile": True}, "compile"),
        ("graph", {}, "needs a CUDA device"),
        ("captured", {}, "unknown step_mode"),
    ],
)
def test_step_modes_refused_where_they_cannot_run(
    mode: str, overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingRun(tiny_config(**overrides), synthetic_splits(), step_mode=mode)


def test_graphed_step_refuses_what_it_cannot_capture() -> None:
    param = torch.nn.Parameter(torch.zeros(3))
    plain = sgrld.SGLD([param], lr=0.1, num_data=10, noise="philox")
    with pytest.raises(ValueError, match="capturable=True"):
        GraphedStep(lambda: None, plain)
    floats = sgrld.SGLD([param], lr=0.1, num_data=10, noise="philox", capturable=True)
    with pytest.raises(ValueError, match="lr as a tensor"):
        GraphedStep(lambda: None, floats)
    on_cpu = sgrld.SGLD([param], lr=torch.tensor(0.1), num_data=10, noise="philox", capturable=True)
    with pytest.raises(ValueError, match="CUDA device"):
        GraphedStep(lambda: None, on_cpu)


def test_cli_no_graph_on_cpu(tmp_path: Path, mnist_dir: Path) -> None:
    base = ["sample", "--sampler", "identity", "--lr", "0.1", "--width", "16"]
    base += ["--epochs", "1", "--subset", "500", "--eval-subset", "100", "--burn-in", "0"]
    base += ["--thinning", "5", "--data-dir", str(mnist_dir), "--no-progress", "--no-plot"]
    base += ["--threads", "1"]
    assert main([*base, "--no-graph", "--out", str(tmp_path / "a")]) == 0
    assert main([*base, "--out", str(tmp_path / "b")]) == 0
    a, b = (json.loads((tmp_path / d / RESULTS_FILE).read_text()) for d in "ab")
    assert a["timing"]["step_mode"] == b["timing"]["step_mode"] == "eager"  # CPU: never captured
    assert deterministic(a) == deterministic(b)


def test_sweep_keeps_no_graph_out_of_the_grid() -> None:
    """A machine option: parsed by ``sgrld sweep``, not a grid axis, carried by its Machine."""
    parser = argparse.ArgumentParser()
    sweep.add_arguments(parser)
    argv = ["--sampler", "identity", "--lr", "0.1", "--out", "unused"]
    assert parser.parse_args([*argv, "--no-graph"]).no_graph
    assert not parser.parse_args(argv).no_graph
    assert "no_graph" in MACHINE_OPTIONS and "no_graph" not in run_defaults()
    assert Machine(data_dir="d").graph and not Machine(data_dir="d", graph=False).graph
