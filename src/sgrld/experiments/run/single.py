"""One Bayesian-neural-network sampling run: burn-in, thinning, streaming evaluation, checkpoints.

The protocol (schedule, streaming evaluation, curvature, timing, failure, checkpoints and
resume) is tabulated in ``docs/experiments.md`` ("One run"); the step modes there too. In short:
``"eager"`` reads the potential's finiteness every step; ``"deferred"`` never syncs inside a step
(static minibatch buffers, a ``capturable`` optimizer whose flags are read before a sample and at
the epoch end, the potential poisoning its own gradient so the flags freeze the chain at the
failing update); ``"graph"`` (CUDA) captures the deferred step (:class:`sgrld.capture.GraphedStep`).
The gradient handed to the sampler is that of the per-datum potential (``docs/conventions.md``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from sgrld.capture import GraphedStep
from sgrld.core import NonFiniteGradientError
from sgrld.data import Splits
from sgrld.evaluation import measure_curvature
from sgrld.evaluation.trace import scalar_hyperparameters
from sgrld.experiments.base import files
from sgrld.experiments.base.files import CheckpointError, OutputError
from sgrld.experiments.run.build import build_run_model, make_sampler, poisoned_potential
from sgrld.experiments.run.checkpoint import (
    check_checkpoint_fits,
    load_checkpoint,
    tensor_mismatches,
)
from sgrld.experiments.run.config import (
    CHECKPOINT_FILE,
    CHECKPOINT_FORMAT,
    GRAD_MAX,
    RunConfig,
    check_collects_samples,
    config_differences,
    derive_seed,
    is_sample_step,
    num_samples_after,
)
from sgrld.experiments.run.observers import (
    ProgressBar,
    RunObserver,
    breakdown_message,
)
from sgrld.experiments.run.parallel import DataParallel, factor_mismatch
from sgrld.experiments.run.record import (
    RunRecord,
    blown_up_reason,
    deferred_breakdown_reason,
    restrict_splits,
    run_health,
)
from sgrld.experiments.run.results import Results, write_results
from sgrld.models import potential
from sgrld.optim import SGRLDOptimizer
from sgrld.schedules import CyclicalLR

__all__ = [
    "CHECKPOINT_FILE",
    "STEP_MODES",
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
    "num_samples_after",
    "resolve_step_mode",
    "run_sampling",
]

#: ``SamplingRun``'s step modes (module docstring); ``"auto"`` resolves to one of the others.
STEP_MODES = ("auto", "eager", "deferred", "graph")


class _BrokeDown(Exception):
    """The chain hit a non-finite potential or gradient."""


def deferred_refusal(config: RunConfig) -> str | None:
    """Why the deferred loop cannot honour ``config`` (``None``: it can)."""
    if config.noise != "philox":
        return "noise 'torch' draws from a generator on the host; use noise 'philox'"
    if config.schedule != "constant":
        return "the cyclical schedule sets ℓ and τ on the host every step"
    if config.compile:
        return "compile fuses a step of its own; drop it"
    return None


def resolve_step_mode(step_mode: str, config: RunConfig, device: torch.device) -> str:
    """The loop a run uses: ``"auto"`` is ``"graph"`` on CUDA when the config allows, else
    ``"eager"``; an explicit mode is checked.

    Raises:
        ValueError: an unknown mode, a deferred mode for a config it cannot honour
            (:func:`deferred_refusal`), or ``"graph"`` off CUDA.
    """
    if step_mode not in STEP_MODES:
        raise ValueError(f"unknown step_mode {step_mode!r}; valid: {', '.join(STEP_MODES)}")
    refusal = deferred_refusal(config)
    if step_mode == "auto":
        return "graph" if device.type == "cuda" and refusal is None else "eager"
    if step_mode != "eager" and refusal is not None:
        raise ValueError(f"step_mode {step_mode!r} cannot run this config: {refusal}")
    if step_mode == "graph" and device.type != "cuda":
        raise ValueError(
            f"step_mode 'graph' needs a CUDA device, not {device}; 'deferred' runs the same "
            "loop without capture"
        )
    return step_mode


def _first_failure(optimizer: SGRLDOptimizer) -> tuple[int, int] | None:
    """The first failing update and the index of its first non-finite tensor, from the
    optimizer's deferred device flags (one host read), or ``None``."""
    for state in optimizer.sampler_states:  # one group (make_sampler)
        if state is not None:
            step, tensor = (int(v) for v in state.flags.tolist())
            if step:
                return step, tensor
    return None


def _rewind(optimizer: SGRLDOptimizer, update: int) -> None:
    """After a breakdown at ``update`` found in the flags: the engine froze the chain there
    (parameters and statistics untouched), only the step counters ran on. Set them back to the
    last good update and clear the flags, so that the checkpoint holds the state after update
    ``update - 1`` as the eager loop's does (and ``state_dict`` does not refuse it)."""
    for state in optimizer.sampler_states:
        if state is not None:
            state.flags.zero_()
            state.step = update - 1
            state.device_step.fill_(update - 1)


class SamplingRun(RunRecord):
    """The state of one run and its loop; see the module docstring for the protocol.

    Args:
        config: what to run.
        splits: the dataset (any device); restricted by ``max_train``/``max_eval`` and moved to
            ``device``.
        device: where the model, the data, the chain's noise and the accumulators live.
        out_dir: where ``checkpoint.pt`` and ``results.json`` go each epoch (``None``: nowhere).
        observer: progress hooks (e.g. :class:`ProgressBar`).
        step_mode: ``"auto"`` (default: ``"graph"`` on CUDA when the config allows it, else
            ``"eager"``), ``"eager"``, ``"deferred"`` (no host read in a step; on CPU the
            tests' way to run the loop that CUDA captures) or ``"graph"`` (CUDA); see the
            module docstring. Configs with ``noise="torch"``, the cyclical schedule or
            ``compile`` run the eager loop (an explicit deferred mode is refused for them).
    """

    def __init__(
        self,
        config: RunConfig,
        splits: Splits,
        *,
        device: torch.device | str = "cpu",
        out_dir: str | os.PathLike[str] | None = None,
        observer: RunObserver | None = None,
        step_mode: str = "auto",
        parallel: DataParallel | None = None,
    ) -> None:
        device = torch.device(device)
        self.parallel = parallel
        if parallel is not None:  # the data-parallel step is the eager loop's
            if step_mode not in ("auto", "eager"):
                raise ValueError(
                    f"--parallel {parallel.mode} runs the eager loop, not step_mode {step_mode!r}"
                )
            step_mode = "eager"
            if parallel.mode == "fsdp" and config.curvature:
                raise ValueError(
                    "--curvature differentiates through the model outside the potential's "
                    "forward, which the sharded parameters (--parallel fsdp) do not allow; "
                    "use --parallel ddp or measure it in one process"
                )
        self.step_mode = resolve_step_mode(step_mode, config, device)
        super().__init__(config, restrict_splits(splits, config).to(device), device)
        self.out_dir = None if out_dir is None else Path(out_dir)
        self.observer = observer if observer is not None else RunObserver()
        init_generator = torch.Generator().manual_seed(self.seeds["init"])
        self.model = build_run_model(config, splits, init_generator).to(self.device)
        if parallel is not None:
            self.model = parallel.prepare(self.model)
        self.model.train()
        chain_generator = torch.Generator(self.device).manual_seed(self.seeds["chain"])
        deferred = self.step_mode != "eager"
        self.optimizer = make_sampler(
            config,
            list(self.model.parameters()) if parallel is None else parallel.parameters(self.model),
            self.num_data,
            chain_generator,
            capturable=deferred,
        )
        self.state_bytes = sum(self.optimizer.state_bytes().values())
        # the deferred loop's state: the potential that poisons its own gradient, the static
        # minibatch buffers (by batch size), the captured step and the updates not yet credited
        self._lr = self.optimizer.param_groups[0]["lr"]
        self._loss = poisoned_potential(self.num_data)
        self._batches: dict[int, tuple[Tensor, Tensor]] = {}
        self._graphed: GraphedStep | None = None
        self._pending: list[int] = []
        self._block_started = 0.0
        if config.schedule == "cyclical":
            total = config.epochs * self.steps_per_epoch
            self.schedule = CyclicalLR(
                self.optimizer, total, config.cycles, config.explore_fraction
            )

    def _clock(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    # --- the loop ---------------------------------------------------------------------------

    def run(self, epochs: int | None = None) -> Results:
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
            self.record_breakdown(str(exc.args[0]), blown_up=len(exc.args) > 1)
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
        if self.step_mode != "eager":
            self._run_epoch_deferred()
            return
        x_train, y_train = self.splits.x_train, self.splits.y_train
        order = torch.randperm(self.num_data, generator=self.order_generator).to(self.device)
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        self.start_epoch()
        batch = self.config.batch_size
        for step, start in enumerate(range(0, self.num_data, batch), 1):
            self.step_in_epoch = step
            index = order[start : start + batch]
            x, y = x_train[index], y_train[index]
            started = self._clock()
            for p in params:
                p.grad = None
            if self.parallel is None:
                loss = potential(self.model, x, y, self.num_data)
                total = loss
            else:  # this rank's share; every rank checks the same total
                loss = self.parallel.potential(self.model, x, y, self.num_data)
                total = self.parallel.sum(loss)
            if not bool(torch.isfinite(total)):
                raise _BrokeDown(f"potential is {total.item()}")
            loss.backward()
            if self.parallel is not None:
                self.parallel.sum_gradients(params)
            for p in params:
                if p.grad is not None:
                    p.grad.clamp_(-GRAD_MAX, GRAD_MAX)
            exploring = self.schedule is not None and self.schedule.exploring  # τ = 0, no sample
            try:  # sync_checks: a NaN/Inf gradient is refused at once, on every device
                self.optimizer.step()
            except NonFiniteGradientError as exc:
                raise _BrokeDown(str(exc)) from exc
            if self.schedule is not None:
                self.schedule.step()
            self.global_step += 1
            self.record_step_time(self._clock() - started)
            sample = is_sample_step(self.global_step, self.config.burnin, self.config.thinning)
            if sample and not exploring:
                self._evaluate_sample()
            self.observer.on_step(self)
        self._finish_epoch()

    def _finish_epoch(self) -> None:
        """The metric's per-epoch refresh (Wenzel's) (in place, so later replays of a
        captured step see it), the epoch's curves, the checkpoint, the observer."""
        if self.optimizer.metric.refresh_per_epoch:
            started = self._clock()
            self.optimizer.refresh_metric()
            self.record_refresh_time(self._clock() - started)
        if self.optimizer.telemetry_enabled:  # the epoch's sums, read once
            self.record_telemetry(self.optimizer.telemetry())
        verdict = run_health(self.telemetry, self.config.temperature, self.optimizer)
        if verdict.broken_down:  # blown up while finite (sgrld.health)
            raise _BrokeDown(blown_up_reason(verdict), True)
        self.end_epoch()
        self._save()
        self.observer.on_epoch(self)

    def _run_epoch_deferred(self) -> None:
        """One epoch without a host read per step: the flags are read (and the steps timed)
        only before a sample is evaluated and at the epoch end (:meth:`_credit`)."""
        order = torch.randperm(self.num_data, generator=self.order_generator).to(self.device)
        self.start_epoch()
        batch = self.config.batch_size
        self._pending = []
        self._block_started = self._clock()
        for step, start in enumerate(range(0, self.num_data, batch), 1):
            self.step_in_epoch = step
            self._deferred_step(order[start : start + batch])
            self.global_step += 1
            self._pending.append(self.global_step)
            if is_sample_step(self.global_step, self.config.burnin, self.config.thinning):
                self._credit()
                self._evaluate_sample()
                self._block_started = self._clock()
            self.observer.on_step(self)
        self._credit()
        self._finish_epoch()

    def _deferred_step(self, index: Tensor) -> None:
        """Gather the minibatch into its static buffers and take the step (replayed in
        ``"graph"`` mode, except for a batch of another size: the short last one)."""
        size = len(index)
        if size not in self._batches:
            x, y = self.splits.x_train, self.splits.y_train
            self._batches[size] = (x.new_empty((size, *x.shape[1:])), y.new_empty((size,)))
        x, y = self._batches[size]
        torch.index_select(self.splits.x_train, 0, index, out=x)
        torch.index_select(self.splits.y_train, 0, index, out=y)
        if self.step_mode != "graph" or size != min(self.config.batch_size, self.num_data):
            self._train_step(x, y)
            return
        if self._graphed is None:
            self._graphed = GraphedStep(functools.partial(self._train_step, x, y), self.optimizer)
        self._graphed()

    def _train_step(self, x: Tensor, y: Tensor) -> None:
        """Forward, backward, clamp, sampler step: no host read. The gradients persist
        (zeroed, not freed) so that a captured step writes the same tensors every replay."""
        self.optimizer.zero_grad(set_to_none=False)
        self._loss(self.model, x, y).backward()
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.clamp_(-GRAD_MAX, GRAD_MAX)
        self.optimizer.step()

    def _credit(self) -> None:
        """Read the flags (one host read) and credit the pending updates' time up to the
        failing one; on a breakdown, close the record as the eager loop does (its state is
        the last good update's).

        Raises:
            _BrokeDown: a non-finite potential or gradient at one of the pending updates.
        """
        seconds = self._clock() - self._block_started
        failure = _first_failure(self.optimizer)
        share = seconds / max(len(self._pending), 1)
        pending = [(update, share) for update in self._pending]
        self._pending = []
        self.credit_updates(pending, None if failure is None else failure[0])
        if failure is None:
            return
        update, tensor = failure
        name = [n for n, _ in self.model.named_parameters()][tensor]
        _rewind(self.optimizer, update)
        raise _BrokeDown(deferred_breakdown_reason(update, name))

    def _evaluate_sample(self) -> None:
        """Fold the current state into the ensembles (eval mode), then back to train mode."""
        started = self._clock()
        self.model.eval()
        try:
            with torch.no_grad():
                if self.parallel is None:
                    scalars = self._fold_sample(self.model)
                else:  # under fsdp with the parameters gathered
                    scalars = self.parallel.within(self._fold_sample)
            curvature = None
            if self.config.curvature:
                curvature = measure_curvature(
                    self.model,
                    self.splits.x_test,
                    self.splits.y_test,
                    generator=self.curvature_generator,
                    num_points=min(self.config.curvature_points, len(self.splits.y_test)),
                ).mean
            self.commit_sample(scalars, curvature)
        finally:
            self.model.train()
        self.add_evaluation_time(self._clock() - started)

    def _fold_sample(self, model: nn.Module) -> dict[str, float]:
        """Add ``model``'s predictions to the ensembles; its recorded scales. Under
        ``--parallel`` each rank predicts its slice of the points, then all have them all."""
        batch = self.config.eval_batch_size
        for split in self.ensembles:
            inputs = getattr(self.splits, f"x_{split}")
            if self.parallel is None:
                for start in range(0, len(inputs), batch):
                    self.add_logits(split, start, model(inputs[start : start + batch]))
                continue
            rows = self.parallel.rows(len(inputs))
            parts = [  # at least one call: an empty slice gives the predictions' shape
                model(inputs[start : min(start + batch, rows.stop)])
                for start in range(rows.start, max(rows.stop, rows.start + 1), batch)
            ]
            logits = self.parallel.gather_rows(torch.cat(parts), len(inputs))
            self.add_logits(split, 0, logits)
        return scalar_hyperparameters(model)

    # --- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the run exactly (in any step mode: ℓ is saved as a
        float)."""
        optimizer = self.optimizer.state_dict()
        if self.parallel is not None:
            optimizer = self.parallel.optimizer_state(optimizer)
        for group in optimizer["param_groups"]:
            if isinstance(group["lr"], Tensor):
                group["lr"] = float(group["lr"])
        return {
            "format": CHECKPOINT_FORMAT,
            "config": self.config.to_dict(),
            "model": self._model_state(),
            "optimizer": optimizer,
            "schedule": None if self.schedule is None else self.schedule.state_dict(),
            **self.record_state(),
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

    def _model_state(self) -> dict[str, Tensor]:
        """The model's state dict in the single run's names and shapes (under fsdp gathered:
        every rank takes part)."""
        if self.parallel is None:
            return self.model.state_dict()
        return self.parallel.model_state(self.model)

    def _mismatches(self, state: Mapping[str, Any]) -> list[str]:
        wrong = tensor_mismatches(state["model"], self._model_state(), "model")
        factors = factor_mismatch(state["optimizer"], self.optimizer.state_dict())
        if factors is not None:
            wrong.append(factors)
        return wrong + self.ensemble_mismatches(state)

    def _restore(self, state: Mapping[str, Any]) -> None:
        if self.parallel is None:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        else:
            self.parallel.load_model_state(self.model, state["model"])
            self.parallel.load_optimizer_state(self.optimizer, state["optimizer"])
        if self.step_mode != "eager":  # ℓ is the config's (constant), as a device tensor
            for group in self.optimizer.param_groups:
                group["lr"] = self._lr
        self._graphed = None  # the optimizer's state tensors are new: capture again
        if self.schedule is not None:  # same epochs (config_differences), same cycles
            self.schedule.load_state_dict(state["schedule"])
        self.restore_record(state)

    def _save(self) -> None:
        if self.out_dir is None:
            return
        if self.parallel is not None and not self.parallel.is_main:
            if self.parallel.collective_state:  # rank 0 gathers the shards with every rank
                self.state_dict()
            return
        state = self.state_dict()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        files.save_checkpoint(self.out_dir / CHECKPOINT_FILE, state)
        self._save_results()

    def _save_results(self) -> None:
        assert self.out_dir is not None
        write_results(self.out_dir, self.results())


def run_sampling(
    config: RunConfig,
    splits: Splits,
    out_dir: str | os.PathLike[str] | None = None,
    *,
    device: torch.device | str = "cpu",
    resume: bool = False,
    observer: RunObserver | None = None,
    step_mode: str = "auto",
    parallel: DataParallel | None = None,
) -> Results:
    """Run (or, with ``resume``, continue) a sampling run and return its results.

    Args:
        config: the run.
        splits: the dataset (see :func:`sgrld.data.load_dataset`).
        out_dir: where ``checkpoint.pt`` and ``results.json`` are written every epoch.
        device: compute device.
        resume: continue from ``out_dir/checkpoint.pt`` if it exists (its config must equal
            ``config`` except for ``epochs``, which may grow).
        observer: progress hooks.
        step_mode: the loop (:class:`SamplingRun`); ``"auto"`` captures the step on CUDA.
        parallel: this process's place in a data-parallel job (:mod:`~.run.parallel`): the
            rank's share of every minibatch, gradients summed over the ranks; rank 0 writes.

    Returns:
        The results dict, also in ``out_dir/results.json``.
    """
    run = SamplingRun(
        config,
        splits,
        device=device,
        out_dir=out_dir,
        observer=observer,
        step_mode=step_mode,
        parallel=parallel,
    )
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
