"""One Bayesian-neural-network sampling run: burn-in, thinning, streaming evaluation, checkpoints.

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
  data-order and curvature generators, the accumulators and the curves are written atomically;
  :func:`run_sampling` with ``resume=True`` continues from there and produces the same results as
  a run that was never interrupted (timings aside).

The gradient handed to the sampler is that of the per-datum potential (``docs/conventions.md``).
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch
from torch import Tensor

from sgrld.core import NonFiniteGradientError
from sgrld.core.compiled import check_compilable
from sgrld.core.noise import NOISE_SOURCES
from sgrld.data import Splits
from sgrld.evaluation import EnsemblePredictive, measure_curvature
from sgrld.metrics import MongeMetric, get_metric
from sgrld.models import build_model, potential
from sgrld.optim import SGLD, MongeSGLD, RMSpropSGLD, SGRLDOptimizer, ShampooSGLD, WenzelSGLD
from sgrld.schedules import CyclicalLR, check_cyclical

__all__ = [
    "CHECKPOINT_FILE",
    "RESULTS_FILE",
    "ProgressBar",
    "RunConfig",
    "RunObserver",
    "SamplingRun",
    "config_differences",
    "derive_seed",
    "is_sample_step",
    "load_checkpoint",
    "make_sampler",
    "num_samples_after",
    "run_sampling",
]

SAMPLER_NAMES = ("identity", "wenzel", "rmsprop", "monge", "shampoo")
#: CLI prior name → :mod:`sgrld.priors` registry name.
PRIOR_NAMES = {"gaussian": "gaussian", "horseshoe": "horseshoe", "correlated": "convcorrnormal"}
#: The architecture each dataset is run with in the paper (spec §3.2, §3.3).
MODEL_FOR_DATASET = {"mnist": "fc", "cifar10": "resnet20"}
NUM_CLASSES = 10
GRAD_MAX = 1e6  # the reference clamps every gradient element to ±grad_max (spec §1.1)
TIMING_SKIP_STEPS = 1000  # the reference discards the first 1,000 step times (spec §4.6)
RESULTS_FILE = "results.json"
CHECKPOINT_FILE = "checkpoint.pt"
RESULTS_FORMAT = "sgrld-sample-results/1"
CHECKPOINT_FORMAT = "sgrld-sample-checkpoint/1"
SEED_STREAMS = ("init", "chain", "data_order", "curvature")
SPLITS = ("val", "test")
METRICS = ("lp", "accuracy", "ece", "confidence")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything that defines a run; two runs with equal configs give identical results.

    Attributes:
        dataset: ``"mnist"`` or ``"cifar10"``.
        model: ``"fc"`` (MNIST, 784-N-N-10) or ``"resnet20"`` (CIFAR-10).
        prior: ``"gaussian"``, ``"horseshoe"`` (fc) or ``"correlated"`` (resnet20 convolutions).
        sampler: ``identity``, ``wenzel``, ``rmsprop``, ``monge`` or ``shampoo``.
        lr: learning rate ℓ > 0 (h = ℓ/n, ``docs/conventions.md``).
        epochs: passes over the training set, ≥ 1 (400 in the paper).
        seed: master seed ≥ 0; the init, chain, data-order and curvature generators derive from it.
        width: hidden width N of ``fc`` (400, 800, 1200); ignored for ``resnet20``.
        alpha2: Monge's α² ≥ 0 (required for ``monge``, ``None`` otherwise).
        temperature: τ ≥ 0 (1 in the paper).
        batch_size: minibatch size (100).
        burnin: updates before the first sample can be taken (1,000).
        thinning: a sample every ``thinning`` updates by global step (100).
        curvature: measure C(θ) of every sample (spec §4.5; costly).
        curvature_points: leading test points used for C(θ) (1,000).
        num_val: validation size drawn from the official training set (10,000).
        max_train: use only the first ``max_train`` training points (smoke tests; ``None`` = all).
            n in the potential is then ``max_train``.
        max_eval: evaluate on the first ``max_eval`` validation and test points (``None`` = all).
        eval_batch_size: batch size of the (eval-mode) ensemble evaluation.
        noise: the sampler's noise source, ``"torch"`` (default) or ``"philox"``
            (:mod:`sgrld.core.noise`; faster on CPU, a different random stream).
        compile: compile each step's metric and move (:mod:`sgrld.core.compiled`; identity,
            wenzel and rmsprop only).
        alpha2_rule: Monge's ``"fixed"`` α² (the paper's) or ``"normalized"`` (α²_t = c/‖m_t‖²
            with c = ``alpha2`` > 0; :class:`~sgrld.metrics.MongeMetric`).
        schedule: ``"constant"`` ℓ (the paper's) or ``"cyclical"`` (:class:`~sgrld.CyclicalLR`
            over all ``epochs``: ``cycles`` cosine cycles, the leading ``explore_fraction`` of
            each noise-free and without samples).
        cycles: M ≥ 1 (cyclical only).
        explore_fraction: r in [0, 1) (cyclical only).
    """

    dataset: str
    model: str
    prior: str
    sampler: str
    lr: float
    epochs: int
    seed: int = 0
    width: int = 400
    alpha2: float | None = None
    temperature: float = 1.0
    batch_size: int = 100
    burnin: int = 1000
    thinning: int = 100
    curvature: bool = False
    curvature_points: int = 1000
    num_val: int = 10_000
    max_train: int | None = None
    max_eval: int | None = None
    eval_batch_size: int = 1000
    noise: str = "torch"
    compile: bool = False
    alpha2_rule: str = "fixed"
    schedule: str = "constant"
    cycles: int = 1
    explore_fraction: float = 0.0

    def __post_init__(self) -> None:
        def choice(name: str, valid: tuple[str, ...]) -> None:
            if getattr(self, name) not in valid:
                raise ValueError(
                    f"unknown {name} {getattr(self, name)!r}; valid names: {', '.join(valid)}"
                )

        choice("dataset", tuple(MODEL_FOR_DATASET))
        choice("model", tuple(MODEL_FOR_DATASET.values()))
        choice("prior", tuple(PRIOR_NAMES))
        choice("sampler", SAMPLER_NAMES)
        choice("noise", NOISE_SOURCES)
        if self.compile:
            check_compilable(get_metric(self.sampler)())
        if MODEL_FOR_DATASET[self.dataset] != self.model:
            raise ValueError(
                f"model {self.model!r} does not fit dataset {self.dataset!r}; "
                f"use --model {MODEL_FOR_DATASET[self.dataset]} with --dataset {self.dataset}"
            )
        if self.prior == "correlated" and self.model != "resnet20":
            raise ValueError("the correlated prior acts on convolutions: use it with resnet20")
        if self.prior == "horseshoe" and self.model != "fc":
            raise ValueError("the horseshoe prior is the paper's MNIST prior: use it with fc")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a finite number > 0, got {self.lr}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.sampler == "monge":
            if self.alpha2 is None or not (math.isfinite(self.alpha2) and self.alpha2 >= 0):
                raise ValueError(f"monge needs alpha2 >= 0, got {self.alpha2}")
        elif self.alpha2 is not None:
            raise ValueError(f"alpha2 is a Monge option; leave it unset for {self.sampler}")
        self._check_beyond()
        minimum = {"epochs": 1, "seed": 0, "width": 1, "batch_size": 1, "burnin": 0}
        minimum |= {"thinning": 1, "curvature_points": 1, "num_val": 1, "eval_batch_size": 1}
        for name, low in minimum.items():
            _check_int(name, getattr(self, name), low)
        for name in ("max_train", "max_eval"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 1)

    def _check_beyond(self) -> None:
        """The α² rule and the schedule (issue 14)."""
        choice = {"alpha2_rule": ("fixed", "normalized"), "schedule": ("constant", "cyclical")}
        for name, valid in choice.items():
            if getattr(self, name) not in valid:
                raise ValueError(f"unknown {name} {getattr(self, name)!r}; valid: {valid}")
        if self.alpha2_rule != "fixed":
            if self.sampler != "monge":
                raise ValueError(f"alpha2_rule is a Monge option; leave it for {self.sampler}")
            MongeMetric(alpha2=self.alpha2, alpha2_rule=self.alpha2_rule)  # type: ignore[arg-type]
        if self.schedule == "cyclical":
            check_cyclical(1, self.cycles, self.explore_fraction)
        elif (self.cycles, self.explore_fraction) != (1, 0.0):
            raise ValueError("cycles and explore_fraction need schedule 'cyclical'")

    def to_dict(self) -> dict[str, Any]:
        """The config as plain JSON values."""
        return asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> RunConfig:
        """Inverse of :meth:`to_dict` (unknown keys are an error)."""
        known = {f.name for f in fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"unknown config keys: {sorted(unknown)}")
        return cls(**values)

    def label(self) -> str:
        """Short human-readable name, e.g. ``monge ℓ=0.25 α²=1.25 seed 0``."""
        extra = f" α²={self.alpha2:g}" if self.alpha2 is not None else ""
        return f"{self.sampler} ℓ={self.lr:g}{extra} seed {self.seed}"


def _check_int(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def config_differences(saved: RunConfig, wanted: RunConfig) -> list[str]:
    """Fields (other than ``epochs``) in which two configs differ, as ``"name: a vs b"``.

    With a cyclical schedule ``epochs`` counts too: the cycles span the whole run.
    """
    free = "epochs" if wanted.schedule != "cyclical" else None
    return [
        f"{f.name}: {getattr(saved, f.name)!r} vs {getattr(wanted, f.name)!r}"
        for f in fields(RunConfig)
        if f.name != free and getattr(saved, f.name) != getattr(wanted, f.name)
    ]


def derive_seed(seed: int, stream: str) -> int:
    """An independent 63-bit seed for one of :data:`SEED_STREAMS`, derived from the master seed."""
    entropy = np.random.SeedSequence([seed, SEED_STREAMS.index(stream)])
    return int(entropy.generate_state(1, np.uint64)[0] >> np.uint64(1))


def is_sample_step(global_step: int, burnin: int = 1000, thinning: int = 100) -> bool:
    """Whether the state after update ``global_step`` (1-based) is a sample (spec §4.2).

    With the paper's values the first sample is taken after 1,100 updates, as in the reference
    (0-based step 1099 with ``(i + 1) % 100 == 0 and step > 1000``).
    """
    return global_step > burnin and global_step % thinning == 0


def num_samples_after(num_steps: int, burnin: int = 1000, thinning: int = 100) -> int:
    """Number of samples taken in the first ``num_steps`` updates (1,990 for 200,000 on MNIST)."""
    return max(0, num_steps // thinning - burnin // thinning)


def make_sampler(
    config: RunConfig, params: list[Tensor], num_data: int, generator: torch.Generator
) -> SGRLDOptimizer:
    """The config's sampler over ``params`` in one parameter group (spec §1.1)."""
    common: dict[str, Any] = {
        "lr": config.lr,
        "num_data": num_data,
        "temperature": config.temperature,
        "generator": generator,
        "noise": config.noise,
        "compile": config.compile,
    }
    if config.sampler == "monge":
        assert config.alpha2 is not None  # validated by RunConfig
        return MongeSGLD(params, alpha2=config.alpha2, alpha2_rule=config.alpha2_rule, **common)
    classes: dict[str, type[SGRLDOptimizer]] = {
        "identity": SGLD,
        "wenzel": WenzelSGLD,
        "rmsprop": RMSpropSGLD,
        "shampoo": ShampooSGLD,
    }
    return classes[config.sampler](params, **common)


class RunObserver:
    """Hooks called by :class:`SamplingRun`; the base class does nothing."""

    def on_start(self, run: SamplingRun) -> None:
        """Before the first epoch of this call (after a resume, the restored state is visible)."""

    def on_step(self, run: SamplingRun) -> None:
        """After every sampler step (and the sample's evaluation, if it was one)."""

    def on_epoch(self, run: SamplingRun) -> None:
        """After an epoch's curves are recorded and its checkpoint is written."""

    def on_finish(self, run: SamplingRun) -> None:
        """When the run ends, completed or broken down."""


class _BrokeDown(Exception):
    """The chain hit a non-finite potential or gradient (spec §4.8)."""


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


def _write_atomic(path: Path, write: Callable[[Any], None], binary: bool) -> None:
    """Write through ``write(handle)`` to a temporary file, fsync, then rename over ``path``."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb" if binary else "w", encoding=None if binary else "utf-8") as handle:
        write(handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a checkpoint written by :class:`SamplingRun` (tensors on CPU).

    Raises:
        ValueError: not a sgrld sampling checkpoint.
    """
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path} is not a sgrld sample checkpoint")
    return state


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
        self.epoch = 0  # epochs completed
        self.global_step = 0  # updates done
        self.status = "running"
        self.broken_down: dict[str, Any] | None = None
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
                "epoch": self.epoch,
                "global_step": self.global_step,
                "reason": str(exc),
            }
            self._save()
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
                raise _BrokeDown(f"potential is {loss.item()} at update {self.global_step + 1}")
            loss.backward()
            for p in params:
                if p.grad is not None:
                    p.grad.clamp_(-GRAD_MAX, GRAD_MAX)
            exploring = self.schedule is not None and self.schedule.exploring  # τ = 0, no sample
            try:
                self.optimizer.step()
            except NonFiniteGradientError as exc:
                raise _BrokeDown(f"{exc} at update {self.global_step + 1}") from exc
            if self.schedule is not None:
                self.schedule.step()
            self.global_step += 1
            self._record_step_time(self._clock() - started)
            sample = is_sample_step(self.global_step, self.config.burnin, self.config.thinning)
            if sample and not exploring:
                self._evaluate_sample()
            self.observer.on_step(self)
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
                        ensemble.add_batch(start, self.model(inputs[start:stop]))
                    ensemble.commit()
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
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`; its config must equal this run's except for ``epochs``.

        A larger ``config.epochs`` than the checkpoint's extends a completed run.
        """
        saved = RunConfig.from_dict(state["config"])
        differences = config_differences(saved, self.config)
        if differences:
            raise ValueError("checkpoint was made with another config: " + "; ".join(differences))
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
        _write_atomic(self.out_dir / CHECKPOINT_FILE, lambda f: torch.save(state, f), True)
        text = json.dumps(self.results(), indent=1, allow_nan=False)
        _write_atomic(self.out_dir / RESULTS_FILE, lambda f: f.write(text + "\n"), False)

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
                "environment": {
                    "torch": torch.__version__,
                    "python": platform.python_version(),
                    "platform": platform.platform(),
                },
            }
        )


class ProgressBar(RunObserver):
    """A one-line progress bar with the running ensemble metrics, on stderr.

    On a terminal the line is redrawn at most every ``interval`` seconds; elsewhere (logs) one
    line per epoch is printed.
    """

    def __init__(self, stream: TextIO | None = None, *, interval: float = 0.5) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.interval = interval
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last = 0.0

    def _line(self, run: SamplingRun, *, epoch_done: bool = False) -> str:
        epoch = run.epoch if epoch_done else run.epoch + 1
        filled = 20 if epoch_done else int(20 * run.step_in_epoch / run.steps_per_epoch)
        bar = "#" * filled + "-" * (20 - filled)
        parts = [f"epoch {epoch}/{run.config.epochs} [{bar}] step {run.global_step}"]
        parts.append(f"S={run.ensembles['val'].num_samples}")
        if run.curves["epoch"]:
            parts.append(
                f"val LP {run.curves['val_lp'][-1]:.4f} acc {run.curves['val_accuracy'][-1]:.4f}"
                f" | test LP {run.curves['test_lp'][-1]:.4f}"
                f" acc {run.curves['test_accuracy'][-1]:.4f}"
            )
        if run.timing["sampling_seconds"]:
            parts.append(f"{run.timing['sampling_seconds'][-1]:.1f} s/epoch")
        return " | ".join(parts)

    def on_start(self, run: SamplingRun) -> None:
        if run.epoch:
            print(f"resuming {run.config.label()} after epoch {run.epoch}", file=self.stream)

    def on_step(self, run: SamplingRun) -> None:
        now = time.monotonic()
        if self.live and now - self._last >= self.interval:
            self._last = now
            print("\r" + self._line(run), end="", file=self.stream, flush=True)

    def on_epoch(self, run: SamplingRun) -> None:
        line = self._line(run, epoch_done=True)
        print(("\r" if self.live else "") + line, file=self.stream, flush=True)

    def on_finish(self, run: SamplingRun) -> None:
        if run.status == "broken_down" and run.broken_down is not None:
            end = "\n" if self.live else ""
            print(f"{end}run broke down: {run.broken_down['reason']}", file=self.stream)


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
        run.load_state_dict(load_checkpoint(checkpoint))
        if run.status == "completed":  # nothing to do; refresh the results file
            run._save()
            return run.results()
    return run.run()
