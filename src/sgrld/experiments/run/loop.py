"""The sampling loop: one loop for every way of running chains (``docs/experiments.md``).

:class:`SamplingRun` owns the protocol and one :class:`~.run.record.RunRecord` per chain; how the
chains step is a :class:`Stepper` (:class:`~.run.single.OneChain` or
:class:`~.run.chains.VmappedChains`), as numpyro's ``chain_method``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from sgrld.chain_health import BROKEN_GROWTH_NO_NOISE
from sgrld.chains import chain_batches
from sgrld.core.warmup import Arrival
from sgrld.data import Splits
from sgrld.experiments.base import files
from sgrld.experiments.base.files import CheckpointError, OutputError
from sgrld.experiments.run.chains import VmappedChains, check_chain_configs
from sgrld.experiments.run.checkpoint import CHAINS_CHECKPOINT_FORMAT, load_checkpoint
from sgrld.experiments.run.config import (
    CHECKPOINT_FILE,
    CHECKPOINT_FORMAT,
    RunConfig,
    config_differences,
    is_sample_step,
)
from sgrld.experiments.run.naming import chain_label
from sgrld.experiments.run.parallel import DataParallel
from sgrld.experiments.run.record import RunRecord, restrict_splits
from sgrld.experiments.run.results import Results, write_results
from sgrld.experiments.run.single import OneChain
from sgrld.schedules import CyclicalLR

__all__ = ["RunObserver", "SamplingRun", "Stepper", "run_sampling"]

#: steps between two reads of every chain's ‖θ‖ against its start (:meth:`SamplingRun._grown`):
#: a chain that blows up stops within this many steps, not at the epoch's end
GROWTH_CHECK_EVERY = 32

#: ``add(chain, split, start, logits)``: fold a batch of a chain's predictions into its record.
Fold = Callable[[int, str, int, Tensor], None]


class Stepper(Protocol):
    """How the chains of a run take their steps: the loop's one variable part."""

    #: ``timing.step_mode``: ``"eager"`` reads finiteness every step; ``"deferred"`` and
    #: ``"graph"`` read device flags before a sample and at the epoch end
    step_mode: str
    state_bytes: int | None  # per chain
    schedule: CyclicalLR | None
    is_main: bool  # this process writes the outputs
    collective_state: bool  # building the checkpoint takes every rank
    watch: Any  # the optimizer whose watch judges a run without telemetry, or None

    def step(self, index: Tensor) -> bool:
        """Update every chain on rows ``index`` ``(K, B)``; ``False``: not a sample (τ = 0)."""

    def failures(self, last: int) -> dict[int, tuple[int, str]]:
        """New breakdowns, ``chain -> (failing update, reason)``, each set back before it."""

    def refresh(self) -> bool:
        """The metric's epoch-end refresh (Wenzel's); whether there was one."""

    def telemetry(self) -> list[Mapping[str, float]] | None: ...

    def train(self, mode: bool) -> None: ...

    def predict(
        self, inputs: Mapping[str, Tensor], batch: int, add: Fold
    ) -> list[dict[str, float]]:
        """Each chain's logits of ``inputs`` to ``add`` in batches; its scalars (horseshoe)."""

    def module(self, chain: int) -> nn.Module: ...

    def theta_norms(self) -> list[float] | None:
        """Each chain's ‖θ‖ (one host read), or ``None`` where a rank holds only a shard."""

    def state_dict(self) -> dict[str, Any]: ...

    def mismatches(self, state: Mapping[str, Any]) -> list[str]:
        """What in a checkpoint does not fit (checked before anything is restored)."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...

    def arrival(self, chain: int) -> tuple[Arrival | None, int]:
        """Chain ``chain``'s waiting warm-up as held now (a checkpoint loaded over it replaces
        the states): its sampler state's :class:`~sgrld.core.warmup.Arrival` (``None``: the
        warm-up does not wait) and the chain's index among that state's chains."""


class RunObserver:
    """Hooks called by the loop (:class:`SamplingRun`); the base does nothing."""

    def on_start(self, run: SamplingRun) -> None:
        """Before the first epoch of this call (after a resume, the restored state is visible)."""

    def on_step(self, run: SamplingRun) -> None:
        """After every sampler step (and the sample's evaluation, if it was one)."""

    def on_epoch(self, run: SamplingRun) -> None:
        """After an epoch's curves are recorded and its checkpoint is written."""

    def on_finish(self, run: SamplingRun) -> None:
        """When the run ends, completed or broken down."""


class SamplingRun:
    """One sampling run of one chain or of K chains.

    Args:
        configs: one run, or the K runs of ``--chains K`` (:func:`~.run.chains.
            check_chain_configs`).
        splits: the dataset (any device); restricted by ``max_train``/``max_eval`` and moved.
        device: where the models, the data, the noise and the accumulators live.
        out_dir: ``checkpoint.pt`` each epoch, with ``results.json`` beside it for one run and
            in ``OUT/<label>`` for each of K (``None``: nowhere).
        observer: progress hooks (:class:`~.run.observers.ProgressBar`).
        step_mode: one run's loop (:func:`~.run.single.resolve_step_mode`); K run deferred.
        parallel: one run's place in a data-parallel job (:mod:`~.run.parallel`).
        chain_batch: at most this many of K chains per vmapped call (``None``: all on a CPU,
            as many as fit on CUDA).
        folders: each of K runs' results folder instead of ``OUT/<label>`` (a sweep's).

    Raises:
        ValueError: what the chosen stepper cannot run, in one line.
    """

    def __init__(
        self,
        configs: RunConfig | Sequence[RunConfig],
        splits: Splits,
        *,
        device: torch.device | str = "cpu",
        out_dir: str | os.PathLike[str] | None = None,
        observer: RunObserver | None = None,
        step_mode: str = "auto",
        parallel: DataParallel | None = None,
        chain_batch: int | None = None,
        folders: Sequence[str | os.PathLike[str]] | None = None,
    ) -> None:
        self.one = isinstance(configs, RunConfig)  # one run: the single-run checkpoint format
        self.configs = [configs] if isinstance(configs, RunConfig) else list(configs)
        if not self.one:
            check_chain_configs(self.configs)
            if parallel is not None:
                raise ValueError(f"--parallel {parallel.mode} runs one chain: drop --chains")
            if step_mode not in ("auto", "deferred"):
                raise ValueError(f"K chains run the deferred loop, not step_mode {step_mode!r}")
        if folders is not None and len(folders) != len(self.configs):
            raise ValueError(f"{len(folders)} folders for {len(self.configs)} chains")
        self.config = self.configs[0]  # the fields the chains share
        self.device = torch.device(device)
        self.splits = restrict_splits(splits, self.config).to(self.device)
        k = len(self.configs)
        self.records = [
            RunRecord(c, self.splits, self.device, chains_in_process=k) for c in self.configs
        ]
        self.num_data = self.records[0].num_data
        self.steps_per_epoch = self.records[0].steps_per_epoch
        seeds = [r.seeds for r in self.records]
        self.stepper: Stepper = (
            OneChain(self.config, self.splits, seeds[0], self.device, step_mode, parallel)
            if self.one
            else VmappedChains(self.configs, self.splits, seeds, self.device, chain_batch)
        )
        for k, r in enumerate(self.records):
            r.stepper, r.chain = self.stepper, k
        self._note_theta_start()  # the seed's initialisation, fresh or resumed
        self.out_dir = None if out_dir is None else Path(out_dir)
        self.folders = None if folders is None else [Path(f) for f in folders]
        if folders is None and self.out_dir is not None:
            out = self.out_dir
            self.folders = [out] if self.one else [out / chain_label(c) for c in self.configs]
        self.observer = observer if observer is not None else RunObserver()
        self.epoch = 0  # epochs the loop completed
        self.global_step = 0  # updates the loop took (a frozen chain's record stops earlier)
        self._block: list[int] = []  # updates timed together, since :attr:`_block_started`
        self._block_started = 0.0

    @property
    def running(self) -> list[RunRecord]:
        """The records still running (not completed, broken down or failed)."""
        return [r for r in self.records if r.status == "running"]

    def _clock(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def run(self, epochs: int | None = None) -> list[Results]:
        """Run until ``epochs`` epochs (default ``config.epochs``) or no chain runs; return
        every chain's results (as written to its ``results.json``)."""
        if not self.running:  # a finished run resumed: refresh its results
            self._save()
            return self.results()
        target = self.config.epochs if epochs is None else epochs
        self.observer.on_start(self)
        try:
            while self.running and self.epoch < target:
                self._run_epoch()
        except OutputError as exc:  # e.g. disk full: the last good checkpoint is kept
            for r in self.running:
                r.status, r.failure = "failed", str(exc)
            with contextlib.suppress(OutputError):  # say so, if there is room for that
                for r in self.records:
                    self._save_results(r)
            raise
        self.observer.on_finish(self)
        return self.results()

    def results(self) -> list[Results]:
        return [r.results() for r in self.records]

    def _run_epoch(self) -> None:
        generators = [r.order_generator for r in self.records]
        batches = chain_batches(self.num_data, self.config.batch_size, generators, self.device)
        config, stepper = self.config, self.stepper
        self._block_started = self._clock()
        eager = stepper.step_mode == "eager"  # each step timed alone, its finiteness read at once
        for index in batches:
            if eager:
                self._block_started = self._clock()
            may_sample = stepper.step(index)
            self.global_step += 1
            self._block.append(self.global_step)
            if eager:
                self._credit()
            if may_sample and is_sample_step(self.global_step, config.burnin, config.thinning):
                self._credit()
                self._evaluate_sample()
                self._block_started = self._clock()
            if self.global_step % GROWTH_CHECK_EVERY == 0:
                if not eager:  # the breakdowns flagged so far first (eager: read each step)
                    self._credit()
                    self._block_started = self._clock()
                self._grown()
            if not self.running:  # every chain broke down: stop at once
                break
            self.observer.on_step(self)
        else:
            self._credit()
            self._grown()
        if self.running:
            self._finish_epoch()
        else:
            self._save()

    def _finish_epoch(self) -> None:
        """The metric's per-epoch refresh (Wenzel's), the epoch's telemetry, health and
        curves, the checkpoint, the observer."""
        started = self._clock()
        if self.stepper.refresh():
            seconds = (self._clock() - started) / len(self.records)
            for r in self.running:
                r.record_refresh_time(seconds)
        figures = self.stepper.telemetry()  # the epoch's sums, read once
        ended = False
        for k, r in enumerate(self.records):
            if r.status == "running":
                ended |= r.end_epoch(None if figures is None else figures[k])
        self.epoch += 1
        self._save()
        if ended or not self.one:  # K chains: a line per epoch, breakdowns included
            self.observer.on_epoch(self)

    def _note_theta_start(self) -> None:
        """Each chain's ‖θ‖ before its first step, the reference of :meth:`_grown`: measured as
        the stepper is built from the seed, before a checkpoint is loaded over it."""
        norms = self.stepper.theta_norms()
        for k, r in enumerate(self.records):
            r.theta_start = None if norms is None else norms[k]

    def _grown(self) -> None:
        """Stop every running chain whose ‖θ‖ grew :data:`~sgrld.chain_health.
        BROKEN_GROWTH_NO_NOISE` times beyond its start (or max(start, 1)): blown up while finite,
        at any τ, from the first step on (the telemetry's growth rule is relative to the first
        epoch, which may have blown up already)."""
        if not self.running:
            return
        norms = self.stepper.theta_norms()
        if norms is None:
            return
        for r, norm in zip(self.records, norms, strict=True):
            if r.status != "running" or r.theta_start is None:
                continue
            reference = max(r.theta_start, 1.0)
            growth = norm / reference
            if math.isfinite(growth) and growth < BROKEN_GROWTH_NO_NOISE:
                continue
            reason = (
                f"blown up while finite: |theta| {norm:.3g} is {growth:.3g} >= "
                f"{BROKEN_GROWTH_NO_NOISE:.0e} times its start {r.theta_start:.3g}, at update "
                f"{r.global_step}"
            )
            if not math.isfinite(norm):
                reason = f"|theta| is not finite at update {r.global_step}"
            self._break(r, reason, blown_up=True)

    def _credit(self) -> None:
        """Read the breakdowns (at most one host read) and credit the timed updates to every
        running chain up to its failing update; close the records of those that failed."""
        pending: list[tuple[int, float]] = []  # (update, seconds)
        if self._block:  # each chain is charged its share of the process's steps
            share = (self._clock() - self._block_started) / len(self._block) / len(self.records)
            pending = [(update, share) for update in self._block]
            self._block = []
        failed = self.stepper.failures(self.global_step)
        for k, r in enumerate(self.records):
            if r.status != "running":
                continue
            update, reason = failed.get(k, (None, ""))
            r.credit_updates(pending, update)
            if update is not None:
                self._break(r, reason)

    def _break(self, record: RunRecord, reason: str, *, blown_up: bool = False) -> None:
        """Record a chain's breakdown; while others go on, write its results now."""
        record.record_breakdown(reason, blown_up=blown_up)
        if self.running:
            self._save_results(record)

    def _evaluate_sample(self) -> None:
        """Fold each running chain's current state into its ensembles (eval mode)."""
        running = [(k, r) for k, r in enumerate(self.records) if r.status == "running"]
        if not running:
            return
        started = self._clock()

        def add(chain: int, split: str, start: int, logits: Tensor) -> None:
            if self.records[chain].status == "running":
                self.records[chain].add_logits(split, start, logits)

        self.stepper.train(False)
        try:
            inputs = {split: getattr(self.splits, f"x_{split}") for split in ("val", "test")}
            scalars = self.stepper.predict(inputs, self.config.eval_batch_size, add)
            for k, r in running:
                r.commit_sample(scalars[k], functools.partial(self.stepper.module, k))
        finally:
            self.stepper.train(True)
        seconds = (self._clock() - started) / len(running)
        for _, r in running:
            r.add_evaluation_time(seconds)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue every chain exactly (one run: the single-run format,
        older than K chains; K: one entry per chain)."""
        stepper = self.stepper.state_dict()
        if self.one:
            record = self.records[0].record_state()  # its epoch and global_step are the loop's
            return {"format": CHECKPOINT_FORMAT, "config": self.config.to_dict()} | stepper | record
        return {
            "format": CHAINS_CHECKPOINT_FORMAT,
            "configs": [c.to_dict() for c in self.configs],
            "epoch": self.epoch,
            "global_step": self.global_step,
            **stepper,
            "records": [r.record_state() for r in self.records],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` of the same runs (``epochs`` may grow).

        Raises:
            CheckpointError: other runs, or a misfit; nothing is restored.
        """
        saved = [state["config"]] if self.one else state["configs"]
        records = [state] if self.one else state["records"]
        try:
            if len(saved) != len(self.configs) or len(records) != len(self.records):
                raise CheckpointError(f"it holds {len(saved)} chains, not {len(self.configs)}")
            for old, new in zip(saved, self.configs, strict=True):
                differences = config_differences(RunConfig.from_dict(old), new)
                if differences:
                    raise CheckpointError(
                        f"{new.label()}: another config: {'; '.join(differences)}"
                    )
            pairs = list(zip(self.records, records, strict=True))
            wrong = self.stepper.mismatches(state)
            wrong += [w for r, s in pairs for w in r.ensemble_mismatches(s)]
            if wrong:  # refused before anything is restored
                raise CheckpointError("; ".join(wrong))
            self.stepper.load_state_dict(state)
            for r, s in pairs:
                r.restore_record(s)
        except CheckpointError:
            raise
        except (KeyError, IndexError, TypeError, ValueError, RuntimeError, AttributeError) as exc:
            raise CheckpointError(f"{type(exc).__name__}: {exc}") from exc
        self.epoch, self.global_step = int(state["epoch"]), int(state["global_step"])

    def _save(self) -> None:
        if self.out_dir is None:
            return
        if not self.stepper.is_main:
            if self.stepper.collective_state:  # rank 0 gathers the shards with every rank
                self.state_dict()
            return
        state = self.state_dict()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        files.save_checkpoint(self.out_dir / CHECKPOINT_FILE, state)
        for r in self.records:
            self._save_results(r)

    def _save_results(self, record: RunRecord) -> None:
        if self.folders is None or not self.stepper.is_main:
            return
        folder = self.folders[self.records.index(record)]
        if folder != self.out_dir:  # OUT/<run name> planted as a link
            files.refuse_links(folder.parent, folder.name)
        folder.mkdir(parents=True, exist_ok=True)
        write_results(folder, record.results())


def run_sampling(
    configs: RunConfig | Sequence[RunConfig],
    splits: Splits,
    out_dir: str | os.PathLike[str] | None = None,
    *,
    resume: bool = False,
    chain_batch: int | None = None,
    **options: Any,
) -> list[Results]:
    """Run (or, with ``resume``, continue from ``out_dir/checkpoint.pt``) a :class:`SamplingRun`
    and return every chain's results.

    Args:
        configs: one run or K; a resumed run's may have larger ``epochs`` (they extend it).
        splits: the dataset (see :func:`sgrld.data.load_dataset`).
        out_dir: where the checkpoint and the results are written every epoch.
        resume: continue from the checkpoint if there is one.
        chain_batch: K chains per vmapped call; a resumed run keeps its checkpoint's.
        options: the other arguments of :class:`SamplingRun`.

    Raises:
        CheckpointError: the checkpoint is damaged or does not fit these runs.
    """
    checkpoint = None if out_dir is None else Path(out_dir) / CHECKPOINT_FILE
    state = None
    if resume and checkpoint is not None and checkpoint.is_file():
        state = load_checkpoint(checkpoint, chains=not isinstance(configs, RunConfig))
        if not isinstance(configs, RunConfig):
            saved = state.get("chain_batch") or len(configs)  # None: all in one call
            if chain_batch is not None and min(chain_batch, len(configs)) != saved:
                raise CheckpointError(
                    f"checkpoint {checkpoint} was made with chain_batch {saved}, not "
                    f"{chain_batch}: resume it with the same (or no) --chain-batch"
                )
            chain_batch = saved  # the same call groups, whatever memory is free now
    run = SamplingRun(configs, splits, out_dir=out_dir, chain_batch=chain_batch, **options)
    if state is not None:
        try:
            run.load_state_dict(state)
        except CheckpointError as exc:
            raise CheckpointError(f"checkpoint {checkpoint} does not fit this run: {exc}") from None
    return run.run()
