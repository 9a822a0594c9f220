"""What one chain's run records and reports: accumulators, curves, timing, ``results.json``
(:meth:`RunRecord.results` writes it for every chain, alone or one of K, alike)."""

from __future__ import annotations

import dataclasses
import math
import platform
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from sgrld.chain_health import Health, health
from sgrld.core.replicas import world
from sgrld.core.warmup import Windows, drawn_while_adapting
from sgrld.data import Splits, dataset_info
from sgrld.evaluation import EnsemblePredictive, SampleTrace, measure_curvature
from sgrld.experiments.run.build import build_likelihood
from sgrld.experiments.run.checkpoint import tensor_mismatches
from sgrld.experiments.run.config import (
    SEED_STREAMS,
    TIMING_SKIP_STEPS,
    RunConfig,
    check_collects_samples,
    derive_seed,
    num_samples_after,
)
from sgrld.experiments.run.results import (
    RESULTS_FORMAT,
    SPLITS,
    BrokenDown,
    Curvature,
    Results,
    nan_to_none,
)
from sgrld.metrics import get_metric

__all__ = ["RunRecord", "restrict_splits"]


def restrict_splits(splits: Splits, config: RunConfig) -> Splits:
    """The data of a run: the first ``max_train`` training and ``max_eval`` evaluation points."""
    rows = {"train": config.max_train, "val": config.max_eval, "test": config.max_eval}
    kept = {f"{v}_{s}": getattr(splits, f"{v}_{s}")[:n] for s, n in rows.items() for v in "xy"}
    return dataclasses.replace(splits, **kept)  # the target scaling (regression) comes along


def breakdown_hint(config: RunConfig, num_data: int, update: int = 2) -> str | None:
    """What to do about a chain that broke down at ``update``: for a subset run, why it diverges
    at a learning rate the full data tolerates; else a smaller ℓ, or the tuner's (``None`` at
    update 1, a non-finite potential before any step: the start or the data, not ℓ)."""
    full = dataset_info(config.dataset).train_pool - config.num_val
    if config.max_train is None or num_data >= full:
        if update <= 1:
            return None
        return (
            f"ℓ too large: try lr <= {config.lr / 10:.3g}, or sgrld tune (it chooses ℓ for this "
            "setting; then --lr tuned:DIR)"
        )
    per_epoch = max(1, num_data // config.batch_size)
    return (
        f"ℓ scales with n: each step is h = ℓ/n (docs/conventions.md), so with max_train="
        f"{num_data} instead of the full n = {full}, lr={config.lr:g} takes steps "
        f"{full / num_data:.3g}x larger than on the full data. lr={config.lr * num_data / full:.3g}"
        f" keeps the full data's step size, but a subset also gives only {per_epoch} updates "
        "per epoch, so a short run then learns little; for a quick run that learns, keep the "
        'full data and shrink the model instead (docs/experiments.md, "A first run")'
    )


def hardware(device: torch.device) -> str:
    """The device's name (GPU) or the CPU's model name."""
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


def deferred_breakdown_reason(update: int, name: str) -> str:
    """The reason of a breakdown found by the device flags of a deferred loop."""
    return f"non-finite potential or gradient (first in {name!r}) at update {update}"


class RunRecord:
    """The record of one chain: what it has sampled, measured and reported.

    Args:
        config: the chain's run.
        splits: its data, already restricted (:func:`restrict_splits`) and on ``device``.
        device: where the accumulators live.
        chains_in_process: chains sharing the process's steps (timing divides by it).
    """

    def __init__(
        self,
        config: RunConfig,
        splits: Splits,
        device: torch.device,
        *,
        chains_in_process: int = 1,
    ) -> None:
        self.config = config
        self.device = device
        self.splits = splits
        self.num_data = splits.num_train
        self.steps_per_epoch = math.ceil(self.num_data / config.batch_size)
        check_collects_samples(config, self.num_data)  # the data may be smaller than official
        self.seeds = {stream: derive_seed(config.seed, stream) for stream in SEED_STREAMS}
        self.chains_in_process = chains_in_process
        self.stepper: Any = None  # the loop's Stepper: its step mode, state bytes, schedule
        self.chain = 0  # this chain's index among the stepper's (set by the loop)
        self.order_generator = torch.Generator().manual_seed(self.seeds["data_order"])
        self.curvature_generator = torch.Generator().manual_seed(self.seeds["curvature"])
        self.likelihood = build_likelihood(config, splits)
        self.scores = self.likelihood.score_names
        self.ensembles = {
            split: EnsemblePredictive(
                len(getattr(splits, f"y_{split}")), likelihood=self.likelihood, device=device
            )
            for split in SPLITS
        }
        self.trace = SampleTrace(len(splits.y_test))  # per-sample values (diagnostics)
        self.epoch = 0
        self.global_step = 0
        self.status = "running"
        self.broken_down: BrokenDown | None = None
        # ‖θ‖ before the first step, the growth reference: the seed's initialisation, measured
        # again on a resume (before the checkpoint is loaded), so no checkpoint holds it
        self.theta_start: float | None = None
        self.failure: str | None = None  # why an output could not be written (status "failed")
        self.curves: dict[str, list[Any]] = {
            key: []
            for key in (
                "epoch",
                "global_step",
                "num_samples",
                *(f"{s}_{m}" for s in SPLITS for m in self.scores),
                "curvature",
            )
        }
        self.curvature_means: list[float] = []  # C(θ) of every sample so far
        self.samples_adapting = 0  # samples drawn while the metric still adapted
        self._metric = get_metric(config.sampler)
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
        self.telemetry: dict[str, list[float]] = {}  # figure -> one value per epoch

    def record_refresh_time(self, seconds: float) -> None:
        """Count one explicit metric refresh (Wenzel's, at an epoch end)."""
        self._epoch_sampling += seconds
        self.timing["refresh_seconds"] += seconds
        self.timing["refreshes"] += 1

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
        shared = ""
        if self.chains_in_process > 1:
            shared = f"; the process's time divided by its {self.chains_in_process} chains"
        if t["steps_after_skip"] >= self.steps_per_epoch:
            return (
                f"mean of {t['steps_after_skip']} step times after the first "
                f"{TIMING_SKIP_STEPS}{shared}"
            )
        steps = t["steps_after_skip"] or t["steps_all"]
        if not steps:
            return "no step timed yet"
        warm = "" if t["steps_after_skip"] else f", warm-up included (< {TIMING_SKIP_STEPS + 1})"
        return (
            f"estimated from only {steps} step times{warm}, times {self.steps_per_epoch} "
            f"steps per epoch{shared}"
        )

    def add_logits(self, split: str, start: int, logits: Tensor) -> None:
        """Fold logits of evaluation points ``start:start+B`` of the current sample."""
        self.ensembles[split].add_batch(start, logits)
        if split == "test":
            stop = start + logits.shape[0]
            self.trace.add_batch(
                start, logits, self.splits.y_test[start:stop], self.likelihood.log_prob
            )

    def commit_sample(self, scalars: Mapping[str, float], module: Callable[[], nn.Module]) -> None:
        """Close the current sample (after every split's logits were added); with
        ``config.curvature`` measure C(θ) of ``module()``, the chain's network (eval mode)."""
        for ensemble in self.ensembles.values():
            ensemble.commit()
        if drawn_while_adapting(self._metric, self.global_step, self.warmup_end()):
            self.samples_adapting += 1
        self.trace.commit(scalars=scalars)
        if self.config.curvature:
            x, y = self.splits.x_test, self.splits.y_test
            points = min(self.config.curvature_points, len(y))
            curvature = measure_curvature(
                module(), x, y, generator=self.curvature_generator, num_points=points
            ).mean
            self.curvature_means.append(curvature)
            self._epoch_curvatures.append(curvature)

    def add_evaluation_time(self, seconds: float) -> None:
        """Count evaluation time (excluded from the step time)."""
        self._epoch_evaluation += seconds

    def end_epoch(self, figures: Mapping[str, float] | None) -> bool:
        """Record the epoch's telemetry (``SGRLDOptimizer.telemetry``), then, unless the run
        blew up while finite (:func:`sgrld.health`), its curves and timing; whether it did not.
        Without telemetry (``--compile``) the optimizer's own watch judges (a collective under
        FSDP, read by every rank alike)."""
        for key, value in (figures or {}).items():
            self.telemetry.setdefault(key, []).append(float(value))
        watch = self.stepper.watch
        if watch is not None and not self.telemetry:
            verdict = watch.health()
        else:
            verdict = health({**self.telemetry, "temperature": self.config.temperature})
            assert isinstance(verdict, Health)
        if verdict.broken_down:
            reason = f"blown up while finite: {verdict.reason}, over {verdict.steps} steps"
            self.record_breakdown(f"{reason} (sgrld.health)", blown_up=True)
            return False
        self.curves["epoch"].append(self.epoch)
        self.curves["global_step"].append(self.global_step)
        self.curves["num_samples"].append(self.ensembles["val"].num_samples)
        for split, ensemble in self.ensembles.items():
            values = ensemble.metrics(getattr(self.splits, f"y_{split}"))
            for score in self.scores:
                self.curves[f"{split}_{score}"].append(float(values[score]))
        curv = self._epoch_curvatures
        self.curves["curvature"].append(sum(curv) / len(curv) if curv else math.nan)
        self.timing["sampling_seconds"].append(self._epoch_sampling)
        self.timing["evaluation_seconds"].append(self._epoch_evaluation)
        self._epoch_sampling = self._epoch_evaluation = 0.0
        self._epoch_curvatures = []
        self.epoch += 1
        if self.epoch >= self.config.epochs:
            self.status = "completed"
        return True

    def credit_updates(self, updates: list[tuple[int, float]], failed_at: int | None) -> None:
        """Count the steps ``(update, seconds)`` up to, not including, ``failed_at``; after a
        failure :attr:`global_step` is the last good update, as in a loop that stopped there."""
        for update, seconds in updates:
            if failed_at is not None and update >= failed_at:
                break
            self.global_step = update
            self._epoch_sampling += seconds
            self.timing["step_seconds_all"] += seconds
            self.timing["steps_all"] += 1
            if update > TIMING_SKIP_STEPS:
                self.timing["step_seconds_after_skip"] += seconds
                self.timing["steps_after_skip"] += 1
        if failed_at is not None:
            self.global_step = failed_at - 1

    def record_breakdown(self, reason: str, *, blown_up: bool = False) -> None:
        """The chain hit a non-finite potential or gradient at update ``global_step + 1``, or
        (``blown_up``) its telemetry up to update ``global_step`` crossed a bound."""
        self.status = "broken_down"
        update = self.global_step + (0 if blown_up else 1)
        self.broken_down = {
            "epoch": self.epoch,
            "update": update,
            "global_step": self.global_step,
            "reason": reason,
            "hint": breakdown_hint(self.config, self.num_data, update + blown_up),
        }

    def record_state(self) -> dict[str, Any]:
        """The record's part of a checkpoint (a single run's adds model, optimizer, ...)."""
        return {
            "epoch": self.epoch,
            "global_step": self.global_step,
            "status": self.status,
            "broken_down": self.broken_down,
            "data_order_generator": self.order_generator.get_state(),
            "curvature_generator": self.curvature_generator.get_state(),
            "ensembles": {k: v.state_dict() for k, v in self.ensembles.items()},
            "curves": self.curves,
            "curvature_means": self.curvature_means,
            "timing": self.timing,
            "trace": self.trace.state_dict(),
            "telemetry": self.telemetry,
            "samples_adapting": self.samples_adapting,
        }

    def ensemble_mismatches(self, state: Mapping[str, Any]) -> list[str]:
        """What in a saved record does not fit these accumulators (checked before restoring)."""
        wrong: list[str] = []
        for split, ensemble in self.ensembles.items():
            saved = state["ensembles"][split]
            # a Gaussian's total keeps one mixture component per sample: its shape grows
            shape = self.likelihood.total_shape(
                (), ensemble.num_points, int(saved.get("num_samples", 0))
            )
            expected = {"log_sum_exp": torch.empty(shape, dtype=torch.float64)}
            wrong += tensor_mismatches(
                {"log_sum_exp": saved["log_sum_exp"]}, expected, f"ensembles.{split}"
            )
        return wrong

    def restore_record(self, state: Mapping[str, Any]) -> None:
        """Inverse of :meth:`record_state`."""
        self.order_generator.set_state(state["data_order_generator"])
        self.curvature_generator.set_state(state["curvature_generator"])
        for split, ensemble in self.ensembles.items():
            ensemble.load_state_dict(state["ensembles"][split])
        self.epoch = int(state["epoch"])
        self.global_step = int(state["global_step"])
        self.curves = {k: list(v) for k, v in state["curves"].items()}
        self.telemetry = {k: list(v) for k, v in state.get("telemetry", {}).items()}
        if "theta_rms" in self.telemetry:  # a checkpoint from before the rename: one column
            old = self.telemetry.pop("theta_rms")
            self.telemetry["theta_norm"] = old + self.telemetry.get("theta_norm", [])
        self.curvature_means = list(state["curvature_means"])
        self.samples_adapting = int(state.get("samples_adapting", self._adapting_before()))
        if "trace" in state:  # checkpoints from before the trace have none
            self.trace.load_state_dict(state["trace"])
        self.timing = {k: list(v) if isinstance(v, list) else v for k, v in state["timing"].items()}
        self.broken_down = state["broken_down"]
        self.status = state["status"]
        if self.status == "completed" and self.epoch < self.config.epochs:
            self.status = "running"  # extended with more epochs

    def warmup_end(self) -> int | None:
        """The last update that adapts this chain's metric as its warm-up stands (``None``:
        every update does): the config's ``adapt_until``, or for a :class:`~sgrld.core.warmup.
        Windows` warm-up the end of its last slow window, with the windows this chain waited for
        (:meth:`~sgrld.core.warmup.Arrival.freeze_steps`; the others of K chains may wait longer).
        Final once the update is past: a window is added at the end of the last one."""
        until = self.config.adapt_until
        if not isinstance(until, Windows):
            return until
        ends = until.slow_ends(self.windows_added() or 0)
        return ends[-1] if ends else until.adapts_until

    def windows_added(self) -> int | None:
        """The slow windows this chain's waiting warm-up added to its schedule (0: it had
        arrived by the end of the nominal ones); ``None`` where it cannot wait (G = I, or a
        captured or sharded step, which keeps Stan's fixed windows: :mod:`sgrld.core.warmup`)."""
        arrival, index = self.stepper.arrival(self.chain)
        return None if arrival is None else int(arrival.count.reshape(-1)[index])

    def _adapting_before(self) -> int:
        """Samples drawn adapting up to :attr:`global_step` (checkpoints from before the count:
        the schedule's sample steps within the warm-up)."""
        until = self.warmup_end()
        if not self._metric.preconditions:  # G = I has nothing to adapt
            return 0
        last = self.global_step if until is None else min(self.global_step, until)
        return num_samples_after(last, self.config.burnin, self.config.thinning)

    def warmup_record(self) -> dict[str, Any]:
        """``results.json``'s ``warmup``: ``adapt_until``, the last update that adapted (or
        adapts, as the warm-up stands; ``None``: every update), a plain integer (a waiting
        warm-up's, :meth:`warmup_end`, is known once the chain has arrived), and the samples
        drawn while the metric adapted; a waiting warm-up's (``adapt "wait"``) also the slow
        windows it added while the chain was still travelling."""
        record: dict[str, Any] = {"adapt_until": self.warmup_end()}
        if self.config.adapt == "wait":
            record["windows_added"] = self.windows_added()
        record["samples_adapting"] = self.samples_adapting
        return record

    def results(self) -> Results:
        """The run's results as JSON values (NaN written as ``null``)."""
        curvature: Curvature | None = None
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
            "hardware": hardware(self.device),
            "threads": torch.get_num_threads(),
            "chains_in_process": self.chains_in_process,
            "step_mode": self.stepper.step_mode,
        }
        schedule, processes = self.stepper.schedule, world()[1]
        if processes > 1:  # the run's job spread it over the ranks of a process group
            timing["processes"] = processes
        results: Results = {
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
            "warmup": self.warmup_record(),
            "final": {  # the last epoch's scores (NaN before the first)
                split: {
                    m: self.curves[f"{split}_{m}"][-1] if self.curves["epoch"] else math.nan
                    for m in self.scores
                }
                for split in SPLITS
            },
            "curvature": curvature,
            "seconds_per_epoch": self.seconds_per_epoch,
            "schedule": None if schedule is None else schedule.describe(),
            "timing": timing,
            "curves": self.curves,
            "telemetry": {"per_epoch": self.telemetry, "state_bytes": self.stepper.state_bytes},
            "trace": self.trace.state_dict(),
            "diagnostics": self.trace.diagnostics(),
            "environment": {
                "torch": torch.__version__,
                "python": platform.python_version(),
                "platform": platform.platform(),
            },
        }
        return nan_to_none(results)
