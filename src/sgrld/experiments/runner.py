"""One Bayesian-neural-network sampling run: burn-in, thinning, streaming evaluation, checkpoints.

The loop of a run; its other rooms are :mod:`~sgrld.experiments.config` (what to run, validated),
:mod:`~sgrld.experiments.checkpoint` (reading and checking checkpoints),
:mod:`~sgrld.experiments.observers` (hooks and the progress display) and
:mod:`~sgrld.experiments._io` (atomic writes, locks). Their names are re-exported here.

The run loop of the paper's MNIST and CIFAR-10 experiments (spec §4), rebuilt so that a run is
exactly reproducible and resumable (spec §10 items 3, 7, 8, 9, 11, 13):

- **Schedule** (spec §4.2, §10.7). Minibatches of 100, reshuffled each epoch by a dedicated data-
  order generator. After update ``k`` (1-based, counted over the whole run) the current state is a
  posterior sample when ``k > burnin`` and ``k % thinning == 0``: with the paper's 1,000 / 100 the
  first sample comes after 1,100 updates, then one every 100 (1,990 samples in 400 MNIST epochs,
  1,590 on CIFAR-10). The chain is never reloaded from a sample.
- **Streaming evaluation** (spec §4.4, §10.8). Each sample is evaluated at once, in eval mode, on
  the validation and test sets and folded into float64 :class:`EnsemblePredictive` accumulators;
  the model then goes back to train mode and the chain continues. At every epoch end the
  cumulative ensemble's log-probability, accuracy, ECE (30 bins) and confidence are recorded.
- **Curvature** (optional, spec §4.5, §10.3): C(θ) of every sample on the first 1,000 test
  points, with its own generator, so that measuring never perturbs the chain.
- **Timing** (spec §4.6, §10.9). Each step (forward, backward, clamp, sampler step) is timed on
  its own, synchronised on CUDA; evaluation is excluded. ``seconds_per_epoch`` is the mean step
  time after the first 1,000 steps times the steps per epoch, plus Wenzel's mean refresh time.
- **Failure** (spec §1.1, §4.8). A non-finite potential (or gradient) stops the run; it is recorded
  as broken down, like a failed run of the reference.
- **Checkpoints.** At each epoch end the model, the sampler (statistics and noise generator), the
  data-order and curvature generators, the accumulators and the curves are written atomically,
  with the SHA-256 of the payload (:mod:`sgrld.experiments._io`); :func:`run_sampling` with
  ``resume=True`` checks it, refuses a checkpoint that is damaged, does not fit or holds NaN/Inf
  (:class:`CheckpointError`), and continues from there with the same results as a run that was
  never interrupted (timings aside). An output that cannot be written (disk full) ends the run
  with ``status: failed`` and an :class:`OutputError`; the last good checkpoint is kept.

The gradient handed to the sampler is that of the per-datum potential (``docs/conventions.md``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sgrld.core import NonFiniteGradientError
from sgrld.data import Splits
from sgrld.evaluation import EnsemblePredictive, SampleTrace, measure_curvature
from sgrld.experiments import _io
from sgrld.experiments._io import CheckpointError, OutputError
from sgrld.experiments.checkpoint import (
    check_checkpoint_fits,
    load_checkpoint,
    tensor_mismatches,
)
from sgrld.experiments.config import (
    CHECKPOINT_FILE,
    CHECKPOINT_FORMAT,
    GRAD_MAX,
    METRICS,
    NUM_CLASSES,
    OFFICIAL_TRAIN_SIZE,
    PRIOR_NAMES,
    RESULTS_FILE,
    RESULTS_FORMAT,
    SEED_STREAMS,
    SPLITS,
    TIMING_SKIP_STEPS,
    RunConfig,
    check_collects_samples,
    config_differences,
    derive_seed,
    is_sample_step,
    make_sampler,
    num_samples_after,
)
from sgrld.experiments.observers import (
    ProgressBar,
    RunObserver,
    breakdown_message,
)
from sgrld.models import build_model, potential
from sgrld.optim import WenzelSGLD
from sgrld.schedules import CyclicalLR

__all__ = [
    "CHECKPOINT_FILE",
    "RESULTS_FILE",
    "CheckpointError",
    "OutputError",
    "ProgressBar",
    "RunConfig",
    "RunObserver",
    "SamplingRun",
    "breakdown_message",
    "check_checkpoint_fits",
    "check_collects_samples",
    "config_differences",
    "derive_seed",
    "is_sample_step",
    "load_checkpoint",
    "make_sampler",
    "num_samples_after",
    "run_sampling",
]


class _BrokeDown(Exception):
    """The chain hit a non-finite potential or gradient (spec §4.8)."""


def _breakdown_hint(config: RunConfig, num_data: int) -> str | None:
    """Why a subset run diverges at a learning rate the full data tolerates (issue 13.14)."""
    full = OFFICIAL_TRAIN_SIZE[config.dataset] - config.num_val
    if config.max_train is None or num_data >= full:
        return None
    return (
        f"ℓ is per datum (h = ℓ/n, docs/conventions.md): with max_train={num_data} instead of "
        f"the full n = {full}, lr={config.lr:g} is a step {full / num_data:.3g}x larger than on "
        f"the full data; try lr={config.lr * num_data / full:.3g} for the same step size"
    )


def _restrict(splits: Splits, config: RunConfig) -> Splits:
    n_train, n_eval = config.max_train, config.max_eval
    return Splits(
        x_train=splits.x_train[:n_train],
        y_train=splits.y_train[:n_train],
        x_val=splits.x_val[:n_eval],
        y_val=splits.y_val[:n_eval],
        x_test=splits.x_test[:n_eval],
        y_test=splits.y_test[:n_eval],
    )


def _nan_to_none(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _nan_to_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_nan_to_none(v) for v in value]
    return value


def _hardware(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class SamplingRun:
    """The state of one run and its loop; see the module docstring for the protocol.

    Args:
        config: what to run.
        splits: the dataset (any device); restricted by ``max_train``/``max_eval`` and moved to
            ``device``.
        device: where the model, the data, the chain's noise and the accumulators live.
        out_dir: where ``checkpoint.pt`` and ``results.json`` go each epoch (``None``: nowhere).
        observer: progress hooks (e.g. :class:`ProgressBar`).
    """

    def __init__(
        self,
        config: RunConfig,
        splits: Splits,
        *,
        device: torch.device | str = "cpu",
        out_dir: str | os.PathLike[str] | None = None,
        observer: RunObserver | None = None,
    ) -> None:
        self.config = config
        self.device = torch.device(device)
        self.out_dir = None if out_dir is None else Path(out_dir)
        self.observer = observer if observer is not None else RunObserver()
        self.splits = _restrict(splits, config).to(self.device)
        self.num_data = self.splits.num_train
        self.steps_per_epoch = math.ceil(self.num_data / config.batch_size)
        check_collects_samples(config, self.num_data)  # the data may be smaller than official
        self.seeds = {stream: derive_seed(config.seed, stream) for stream in SEED_STREAMS}

        init_generator = torch.Generator().manual_seed(self.seeds["init"])
        self.model = build_model(
            config.model,
            prior=PRIOR_NAMES[config.prior],
            width=config.width,
            num_classes=NUM_CLASSES,
            generator=init_generator,
        ).to(self.device)
        self.model.train()
        chain_generator = torch.Generator(self.device).manual_seed(self.seeds["chain"])
        self.optimizer = make_sampler(
            config, list(self.model.parameters()), self.num_data, chain_generator
        )
        self.schedule: CyclicalLR | None = None  # ℓ (and τ) per step; None: constant
        if config.schedule == "cyclical":
            total = config.epochs * self.steps_per_epoch
            self.schedule = CyclicalLR(
                self.optimizer, total, config.cycles, config.explore_fraction
            )
        self.order_generator = torch.Generator().manual_seed(self.seeds["data_order"])
        self.curvature_generator = torch.Generator().manual_seed(self.seeds["curvature"])
        self.ensembles = {
            split: EnsemblePredictive(
                len(getattr(self.splits, f"y_{split}")), NUM_CLASSES, device=self.device
            )
            for split in SPLITS
        }
        self.trace = SampleTrace(len(self.splits.y_test))  # per-sample values (diagnostics)
        self.epoch = 0  # epochs completed
        self.global_step = 0  # updates done
        self.status = "running"
        self.broken_down: dict[str, Any] | None = None
        self.failure: str | None = None  # why an output could not be written (status "failed")
        self.curves: dict[str, list[Any]] = {
            key: []
            for key in (
                "epoch",
                "global_step",
                "num_samples",
                *(f"{s}_{m}" for s in SPLITS for m in METRICS),
                "curvature",
            )
        }
        self.curvature_means: list[float] = []  # C(θ) of every sample so far
        self.timing: dict[str, Any] = {
            "step_seconds_after_skip": 0.0,  # sum over steps > TIMING_SKIP_STEPS
            "steps_after_skip": 0,
            "step_seconds_all": 0.0,
            "steps_all": 0,
            "refresh_seconds": 0.0,
            "refreshes": 0,
            "sampling_seconds": [],  # per epoch: steps + Wenzel refresh
            "evaluation_seconds": [],  # per epoch: ensemble (+ curvature) evaluation
        }
        self._epoch_sampling = 0.0
        self._epoch_evaluation = 0.0
        self._epoch_curvatures: list[float] = []
        self.step_in_epoch = 0

    # --- timing -----------------------------------------------------------------------------

    def _clock(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _record_step_time(self, seconds: float) -> None:
        self._epoch_sampling += seconds
        self.timing["step_seconds_all"] += seconds
        self.timing["steps_all"] += 1
        if self.global_step > TIMING_SKIP_STEPS:
            self.timing["step_seconds_after_skip"] += seconds
            self.timing["steps_after_skip"] += 1

    @property
    def seconds_per_epoch(self) -> float:
        """Mean step time (after the first 1,000 steps, else all) × steps per epoch + refresh."""
        t = self.timing
        if t["steps_after_skip"]:
            step = t["step_seconds_after_skip"] / t["steps_after_skip"]
        elif t["steps_all"]:
            step = t["step_seconds_all"] / t["steps_all"]
        else:
            return math.nan
        refresh = t["refresh_seconds"] / t["refreshes"] if t["refreshes"] else 0.0
        return step * self.steps_per_epoch + refresh

    @property
    def seconds_per_epoch_basis(self) -> str:
        """How :attr:`seconds_per_epoch` was obtained: measured, or extrapolated from few steps."""
        t = self.timing
        if t["steps_after_skip"] >= self.steps_per_epoch:
            return f"mean of {t['steps_after_skip']} step times after the first {TIMING_SKIP_STEPS}"
        steps = t["steps_after_skip"] or t["steps_all"]
        if not steps:
            return "no step timed yet"
        warm = "" if t["steps_after_skip"] else f", warm-up included (< {TIMING_SKIP_STEPS + 1})"
        return (
            f"estimated from only {steps} step times{warm}, times {self.steps_per_epoch} "
            "steps per epoch"
        )

    # --- the loop ---------------------------------------------------------------------------

    def run(self, epochs: int | None = None) -> dict[str, Any]:
        """Run until ``epochs`` epochs are complete (default ``config.epochs``) or a breakdown.

        Returns:
            The results (as written to ``results.json``).
        """
        target = self.config.epochs if epochs is None else epochs
        self.observer.on_start(self)
        try:
            while self.status == "running" and self.epoch < target:
                self._run_epoch()
        except _BrokeDown as exc:
            self.status = "broken_down"
            self.broken_down = {
                "epoch": self.epoch,  # epochs completed before the failing one
                "update": self.global_step + 1,  # the failing update, 1-based over the run
                "global_step": self.global_step,  # updates completed (its state is the last)
                "reason": str(exc),
                "hint": _breakdown_hint(self.config, self.num_data),
            }
            self._save()
        except OutputError as exc:  # e.g. disk full: the last good checkpoint is kept
            self.status = "failed"
            self.failure = str(exc)
            with contextlib.suppress(OutputError):  # say so, if there is room for that
                self._save_results()
            raise
        self.observer.on_finish(self)
        return self.results()

    def _run_epoch(self) -> None:
        x_train, y_train = self.splits.x_train, self.splits.y_train
        order = torch.randperm(self.num_data, generator=self.order_generator).to(self.device)
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        self._epoch_sampling = self._epoch_evaluation = 0.0
        self._epoch_curvatures = []
        batch = self.config.batch_size
        for step, start in enumerate(range(0, self.num_data, batch), 1):
            self.step_in_epoch = step
            index = order[start : start + batch]
            x, y = x_train[index], y_train[index]
            started = self._clock()
            for p in params:
                p.grad = None
            loss = potential(self.model, x, y, self.num_data)
            if not bool(torch.isfinite(loss)):
                raise _BrokeDown(f"potential is {loss.item()}")
            loss.backward()
            for p in params:
                if p.grad is not None:
                    p.grad.clamp_(-GRAD_MAX, GRAD_MAX)
            exploring = self.schedule is not None and self.schedule.exploring  # τ = 0, no sample
            try:
                self.optimizer.step()
            except NonFiniteGradientError as exc:
                raise _BrokeDown(str(exc)) from exc
            if self.schedule is not None:
                self.schedule.step()
            self.global_step += 1
            self._record_step_time(self._clock() - started)
            sample = is_sample_step(self.global_step, self.config.burnin, self.config.thinning)
            if sample and not exploring:
                self._evaluate_sample()
            self.observer.on_step(self)
        try:  # deferred NaN/Inf checks (CUDA) are read once per epoch, before the checkpoint
            self.optimizer.check()
        except NonFiniteGradientError as exc:
            raise _BrokeDown(str(exc)) from exc
        if isinstance(self.optimizer, WenzelSGLD):  # refresh at each epoch end (spec §2.2)
            started = self._clock()
            self.optimizer.update_preconditioner()
            seconds = self._clock() - started
            self._epoch_sampling += seconds
            self.timing["refresh_seconds"] += seconds
            self.timing["refreshes"] += 1
        self._end_epoch()

    def _evaluate_sample(self) -> None:
        """Fold the current state into the ensembles (eval mode), then back to train mode."""
        started = self._clock()
        self.model.eval()
        try:
            with torch.no_grad():
                for split, ensemble in self.ensembles.items():
                    inputs = getattr(self.splits, f"x_{split}")
                    for start in range(0, len(inputs), self.config.eval_batch_size):
                        stop = start + self.config.eval_batch_size
                        logits = self.model(inputs[start:stop])
                        ensemble.add_batch(start, logits)
                        if split == "test":
                            self.trace.add_batch(start, logits, self.splits.y_test[start:stop])
                    ensemble.commit()
                self.trace.commit(self.model)
            if self.config.curvature:
                stats = measure_curvature(
                    self.model,
                    self.splits.x_test,
                    self.splits.y_test,
                    generator=self.curvature_generator,
                    num_points=min(self.config.curvature_points, len(self.splits.y_test)),
                )
                self.curvature_means.append(stats.mean)
                self._epoch_curvatures.append(stats.mean)
        finally:
            self.model.train()
        self._epoch_evaluation += self._clock() - started

    def _end_epoch(self) -> None:
        self.curves["epoch"].append(self.epoch)
        self.curves["global_step"].append(self.global_step)
        self.curves["num_samples"].append(self.ensembles["val"].num_samples)
        for split, ensemble in self.ensembles.items():
            values = ensemble.metrics(getattr(self.splits, f"y_{split}"))
            for metric in METRICS:
                self.curves[f"{split}_{metric}"].append(float(values[metric]))
        curv = self._epoch_curvatures
        self.curves["curvature"].append(sum(curv) / len(curv) if curv else math.nan)
        self.timing["sampling_seconds"].append(self._epoch_sampling)
        self.timing["evaluation_seconds"].append(self._epoch_evaluation)
        self.epoch += 1
        if self.epoch >= self.config.epochs:
            self.status = "completed"
        self._save()
        self.observer.on_epoch(self)

    # --- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the run exactly."""
        return {
            "format": CHECKPOINT_FORMAT,
            "config": self.config.to_dict(),
            "epoch": self.epoch,
            "global_step": self.global_step,
            "status": self.status,
            "broken_down": self.broken_down,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "schedule": None if self.schedule is None else self.schedule.state_dict(),
            "data_order_generator": self.order_generator.get_state(),
            "curvature_generator": self.curvature_generator.get_state(),
            "ensembles": {k: v.state_dict() for k, v in self.ensembles.items()},
            "curves": self.curves,
            "curvature_means": self.curvature_means,
            "timing": self.timing,
            "trace": self.trace.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`; its config must equal this run's except for ``epochs``.

        A larger ``config.epochs`` than the checkpoint's extends a completed run.
        """
        saved = RunConfig.from_dict(state["config"])
        differences = config_differences(saved, self.config)
        if differences:
            raise ValueError("checkpoint was made with another config: " + "; ".join(differences))
        try:
            wrong = self._mismatches(state)  # refuse what does not fit before restoring anything
            if not wrong:
                self._restore(state)
        except (KeyError, IndexError, TypeError, ValueError, RuntimeError, AttributeError) as exc:
            raise CheckpointError(f"{type(exc).__name__}: {exc}") from exc
        if wrong:
            raise CheckpointError("; ".join(wrong))

    def _mismatches(self, state: Mapping[str, Any]) -> list[str]:
        wrong = tensor_mismatches(state["model"], self.model.state_dict(), "model")
        for split, ensemble in self.ensembles.items():
            expected = {"log_sum_exp": ensemble.state_dict()["log_sum_exp"]}
            saved = {"log_sum_exp": state["ensembles"][split]["log_sum_exp"]}
            wrong += tensor_mismatches(saved, expected, f"ensembles.{split}")
        return wrong

    def _restore(self, state: Mapping[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.schedule is not None:  # same epochs (config_differences), same cycles
            self.schedule.load_state_dict(state["schedule"])
        self.order_generator.set_state(state["data_order_generator"])
        self.curvature_generator.set_state(state["curvature_generator"])
        for split, ensemble in self.ensembles.items():
            ensemble.load_state_dict(state["ensembles"][split])
        self.epoch = int(state["epoch"])
        self.global_step = int(state["global_step"])
        self.curves = {k: list(v) for k, v in state["curves"].items()}
        self.curvature_means = list(state["curvature_means"])
        if "trace" in state:  # checkpoints from before the trace have none
            self.trace.load_state_dict(state["trace"])
        self.timing = dict(state["timing"])
        self.timing["sampling_seconds"] = list(self.timing["sampling_seconds"])
        self.timing["evaluation_seconds"] = list(self.timing["evaluation_seconds"])
        self.broken_down = state["broken_down"]
        self.status = state["status"]
        if self.status == "completed" and self.epoch < self.config.epochs:
            self.status = "running"  # extended with more epochs

    def _save(self) -> None:
        if self.out_dir is None:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        state = self.state_dict()
        _io.save_checkpoint(self.out_dir / CHECKPOINT_FILE, state)
        self._save_results()

    def _save_results(self) -> None:
        assert self.out_dir is not None
        text = json.dumps(self.results(), indent=1, allow_nan=False)
        _io.write_atomic(self.out_dir / RESULTS_FILE, text + "\n")

    def final_metrics(self) -> dict[str, dict[str, float]]:
        """The last recorded epoch's ensemble metrics per split (NaN before the first epoch)."""
        return {
            split: {
                m: self.curves[f"{split}_{m}"][-1] if self.curves["epoch"] else math.nan
                for m in METRICS
            }
            for split in SPLITS
        }

    def results(self) -> dict[str, Any]:
        """The run's results as JSON values (NaN written as ``null``)."""
        curvature = None
        if self.config.curvature:
            values = np.asarray(self.curvature_means, dtype=np.float64)
            curvature = {
                "mean": float(values.mean()) if values.size else math.nan,
                "std": float(values.std()) if values.size else math.nan,
                "num_samples": int(values.size),
            }
        timing = {
            **self.timing,
            "seconds_per_epoch": self.seconds_per_epoch,
            "seconds_per_epoch_basis": self.seconds_per_epoch_basis,
            "skipped_steps": TIMING_SKIP_STEPS,
            "device": str(self.device),
            "hardware": _hardware(self.device),
            "threads": torch.get_num_threads(),
        }
        return _nan_to_none(
            {
                "format": RESULTS_FORMAT,
                "config": self.config.to_dict(),
                "seed": self.config.seed,
                "seeds": self.seeds,
                "status": self.status,
                "broken_down": self.broken_down,
                "failure": self.failure,
                "epochs_completed": self.epoch,
                "global_steps": self.global_step,
                "steps_per_epoch": self.steps_per_epoch,
                "num_data": self.num_data,
                "num_samples": self.ensembles["val"].num_samples,
                "final": self.final_metrics(),
                "curvature": curvature,
                "seconds_per_epoch": self.seconds_per_epoch,
                "schedule": None if self.schedule is None else self.schedule.describe(),
                "timing": timing,
                "curves": self.curves,
                "trace": self.trace.state_dict(),
                "diagnostics": self.trace.diagnostics(),
                "environment": {
                    "torch": torch.__version__,
                    "python": platform.python_version(),
                    "platform": platform.platform(),
                },
            }
        )


def run_sampling(
    config: RunConfig,
    splits: Splits,
    out_dir: str | os.PathLike[str] | None = None,
    *,
    device: torch.device | str = "cpu",
    resume: bool = False,
    observer: RunObserver | None = None,
) -> dict[str, Any]:
    """Run (or, with ``resume``, continue) a sampling run and return its results.

    Args:
        config: the run.
        splits: the dataset (see :func:`sgrld.data.load_dataset`).
        out_dir: where ``checkpoint.pt`` and ``results.json`` are written every epoch.
        device: compute device.
        resume: continue from ``out_dir/checkpoint.pt`` if it exists (its config must equal
            ``config`` except for ``epochs``, which may grow).
        observer: progress hooks.

    Returns:
        The results dict, also in ``out_dir/results.json``.
    """
    run = SamplingRun(config, splits, device=device, out_dir=out_dir, observer=observer)
    checkpoint = None if out_dir is None else Path(out_dir) / CHECKPOINT_FILE
    if resume and checkpoint is not None and checkpoint.is_file():
        state = load_checkpoint(checkpoint)
        try:
            run.load_state_dict(state)
        except CheckpointError as exc:
            raise CheckpointError(f"checkpoint {checkpoint} does not fit this run: {exc}") from None
        if run.status == "completed":  # nothing to do; refresh the results file
            run._save()
            return run.results()
    return run.run()
