"""K sampling runs in one process: the runner's protocol for a stacked model (``--chains K``).

:class:`ChainsRun` runs the configs of K single runs that differ only in seed, ℓ and α² as one
:class:`sgrld.Chains` (stacked parameters, one vmapped forward/backward and one sampler call per
step), and keeps one :class:`~sgrld.experiments.run.record.RunRecord` per chain, so that each chain
writes ``OUT/<label>/results.json`` in exactly the single-run format. What makes chain k *the*
single run of its config (``sgrld sample --seed s``), whatever K and its position:

* initialisation from the chain's ``init`` seed, minibatch order from its ``data_order``
  generator (:func:`sgrld.chain_batches`), curvature points from its ``curvature`` generator;
* noise: Philox keys drawn from its ``chain`` generator exactly as the single run's optimizer
  draws them (so the runs need ``noise="philox"``, the runner's default);
* evaluation at the same updates, each sample folded into the chain's own ensembles.

A chain that breaks down (non-finite potential or gradient) is frozen by the engine's device
flags at that update — the potential is made to poison its own gradient, so a non-finite loss
freezes it too — and its record is closed as a single run's would be; the others go on. The flags
are read on the host only before a sample is evaluated and at the epoch end (on CUDA a step has
no host sync), and the step times are credited to each chain up to its failing update.

One checkpoint (``OUT/checkpoint.pt``, written atomically with its SHA-256 at every epoch end)
holds every chain; :func:`run_chains` with ``resume=True`` continues bit-identically.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

import sgrld
from sgrld.chains import Chains, chain_batches
from sgrld.data import Splits
from sgrld.evaluation import measure_curvature
from sgrld.evaluation.trace import scalar_hyperparameter_tensors
from sgrld.experiments.base import files
from sgrld.experiments.base.files import CheckpointError, OutputError
from sgrld.experiments.run.build import build_metric, build_run_model, poisoned_potential
from sgrld.experiments.run.config import (
    CHECKPOINT_FILE,
    GRAD_MAX,
    TUNED_FIELDS,
    RunConfig,
    config_differences,
    is_sample_step,
)
from sgrld.experiments.run.naming import chain_label
from sgrld.experiments.run.observers import RunObserver
from sgrld.experiments.run.record import (
    RunRecord,
    blown_up_reason,
    deferred_breakdown_reason,
    restrict_splits,
    run_health,
)
from sgrld.experiments.run.results import Results, write_results

__all__ = [
    "CHAINS_CHECKPOINT_FORMAT",
    "ChainsRun",
    "check_chain_configs",
    "load_chains_checkpoint",
    "plan_chain_batch",
    "run_chains",
]

CHAINS_CHECKPOINT_FORMAT = "sgrld-chains-checkpoint/1"
#: The fields in which the chains of one process may differ.
PER_CHAIN_FIELDS = ("seed", "lr", *TUNED_FIELDS)


def check_chain_configs(configs: Sequence[RunConfig]) -> None:
    """Refuse configs that cannot share one stacked model.

    Raises:
        ValueError: no config, duplicates, configs that differ in more than seed, ℓ and α², or
            options the multi-chain runner does not support (torch noise, cyclical schedule,
            compile).
    """
    if not configs:
        raise ValueError("no chain to run")
    base = configs[0]
    for c in configs[1:]:
        other = dataclasses.replace(c, **{f: getattr(base, f) for f in PER_CHAIN_FIELDS})
        differences = [d for d in config_differences(other, base) if not d.startswith("epochs")] + (
            ["epochs"] if c.epochs != base.epochs else []
        )
        if differences:
            raise ValueError(
                f"the chains of one process may differ only in {', '.join(PER_CHAIN_FIELDS[:-1])} "
                f"and {PER_CHAIN_FIELDS[-1]}; "
                f"{c.label()} differs from {base.label()} in {', '.join(differences)}"
            )
    labels = [chain_label(c) for c in configs]
    twice = sorted({x for x in labels if labels.count(x) > 1})
    if twice:
        raise ValueError(f"the same run twice: {', '.join(twice)}")
    if base.noise != "philox":
        raise ValueError(
            "chains need noise='philox' (the default): with torch's generator the chains would "
            "share one stream and no chain would be its single run"
        )
    if base.schedule != "constant":
        raise ValueError("the cyclical schedule is not supported with chains; run it singly")
    if base.compile:
        raise ValueError("compile is not supported with chains; drop it")


def _philox_seed(generator: torch.Generator) -> int:
    """The Philox key the single run's optimizer draws from its chain generator, as a seed of
    :func:`sgrld.core.noise.keys_from_seeds` (whose key words are the seed's halves)."""
    from sgrld.core.noise import keys_from_generator

    low, high = keys_from_generator((), generator, torch.device("cpu")).tolist()
    return int(low) | (int(high) << 32)


def plan_chain_batch(
    num_chains: int, free_bytes: int, state_bytes: int, step_bytes: int, headroom: float = 0.7
) -> int:
    """Chains per vectorised call so that K chains fit in ``free_bytes`` of device memory.

    Every chain's state (parameters, buffers, sampler statistics: ``state_bytes`` per chain)
    lives for the whole run; a step's transient memory (gradients, activations, workspace:
    ``step_bytes`` per chain) only for the chains of one call. ``headroom`` of what is left
    after the state may go to one call (the allocator fragments the rest).

    Raises:
        MemoryError: the K chains' state alone does not fit, or not even one chain's step.
    """
    left = free_bytes - num_chains * state_bytes
    mib = 2**20
    if left <= 0:
        raise MemoryError(
            f"{num_chains} chains need {num_chains * state_bytes / mib:.0f} MiB of state, "
            f"{free_bytes / mib:.0f} MiB are free: run fewer chains per process"
        )
    batch = int(left * headroom // max(step_bytes, 1))
    if batch < 1:
        raise MemoryError(
            f"one chain's step needs {step_bytes / mib:.0f} MiB, {left / mib:.0f} MiB are left "
            "beside the chains' state: run fewer chains per process"
        )
    return min(batch, num_chains)


def _probe_chain_memory(
    make: Any, sampler: sgrld.Sampler, seed: int, loss: Any, x: Tensor, y: Tensor
) -> tuple[int, int]:
    """``(state_bytes, step_bytes)`` of one chain on a CUDA device, measured: the allocation of
    a one-chain :class:`Chains` and the peak of one of its gradient passes above it."""
    device = x.device
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    probe = Chains(make, sampler, seeds=[seed], device=device)
    state = torch.cuda.memory_allocated(device) - base
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    probe.grads(loss, x[None], y[None], grad_clip=GRAD_MAX)  # BatchNorm buffers: the probe's
    step = torch.cuda.max_memory_allocated(device) - before
    del probe
    torch.cuda.empty_cache()
    return state, step


class ChainsRun:
    """K runs of one setting as one stacked model; see the module docstring.

    Args:
        configs: the chains' runs (:func:`check_chain_configs`). Chains with equal α² share a
            sampler call when they are next to each other.
        splits: the dataset (any device); restricted by ``max_train``/``max_eval``.
        device: where the stacked model, the data and the accumulators live.
        out_dir: ``OUT``: ``OUT/checkpoint.pt`` and ``OUT/<label>/results.json`` each epoch
            (``None``: nowhere).
        folders: where each chain's ``results.json`` goes instead of ``OUT/<label>`` (a sweep's
            run folders); the checkpoint stays in ``OUT``.
        observer: progress hooks; they see this object (``records``, ``epoch``, ...).
        chain_batch: at most this many chains per vmapped call (:class:`sgrld.Chains`);
            ``None``: all on a CPU, and on CUDA as many as fit beside every chain's state
            (:func:`plan_chain_batch`, from one chain's memory measured before the run).
    """

    def __init__(
        self,
        configs: Sequence[RunConfig],
        splits: Splits,
        *,
        device: torch.device | str = "cpu",
        out_dir: str | os.PathLike[str] | None = None,
        observer: RunObserver | None = None,
        chain_batch: int | None = None,
        folders: Sequence[str | os.PathLike[str]] | None = None,
    ) -> None:
        check_chain_configs(configs)
        if folders is not None and len(folders) != len(configs):
            raise ValueError(f"{len(folders)} folders for {len(configs)} chains")
        self.configs = list(configs)
        self.config = base = self.configs[0]  # the shared fields (observers read config.epochs)
        self.device = torch.device(device)
        self.out_dir = None if out_dir is None else Path(out_dir)
        self.folders: list[Path] | None = None
        if folders is not None:
            self.folders = [Path(f) for f in folders]
        elif self.out_dir is not None:
            self.folders = [self.out_dir / chain_label(c) for c in configs]
        self.observer = observer if observer is not None else RunObserver()
        self.splits = restrict_splits(splits, base).to(self.device)
        k = len(self.configs)
        self.records = [
            RunRecord(c, self.splits, self.device, chains_in_process=k) for c in self.configs
        ]
        self.num_data = self.records[0].num_data
        self.steps_per_epoch = self.records[0].steps_per_epoch
        self.epoch = 0
        self.global_step = 0

        def model(seed: int) -> torch.nn.Module:
            generator = torch.Generator().manual_seed(seed)
            return build_run_model(base, self.splits, generator)

        noise_seeds = [
            _philox_seed(torch.Generator(self.device).manual_seed(r.seeds["chain"]))
            for r in self.records
        ]
        sampler = sgrld.build(
            build_metric(base.sampler, base.metric_options, paper=base.adapt == "always"),
            lr=base.lr,
            num_data=self.num_data,
            temperature=base.temperature,
            noise="philox",
            adapt_until=base.adapt_until,
        )
        self._loss = poisoned_potential(self.num_data)
        if chain_batch is None and self.device.type == "cuda":
            batch = min(base.batch_size, self.num_data)
            state_bytes, step_bytes = _probe_chain_memory(
                model,
                sampler,
                self.records[0].seeds["init"],
                self._loss,
                self.splits.x_train[:batch],
                self.splits.y_train[:batch],
            )
            free, _ = torch.cuda.mem_get_info(self.device)
            chain_batch = plan_chain_batch(k, free, state_bytes, step_bytes)
        self.chain_batch = chain_batch
        tuned: dict[str, Any] = {
            n: [getattr(c, n) for c in self.configs] for n in sampler.metric.tuned
        }
        self.chains = Chains(
            model,
            sampler,
            seeds=[r.seeds["init"] for r in self.records],
            lr=[c.lr for c in self.configs],
            **tuned,
            noise_seeds=noise_seeds,
            chain_batch=chain_batch,
            device=self.device,
            telemetry=True,
        )
        self.chains.train()
        for r in self.records:
            r.state_bytes = self.chains.state_bytes()
        self._pending: list[tuple[int, float]] = []  # (update, seconds) not yet credited
        self._scalar_names = list(scalar_hyperparameter_tensors(self.chains.model))
        self._refreshes = sampler.metric.refresh_per_epoch  # as the single run refreshes

    # --- the loop ---------------------------------------------------------------------------

    @property
    def running(self) -> list[RunRecord]:
        """The records still running (not completed, broken down or failed)."""
        return [r for r in self.records if r.status == "running"]

    def _clock(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def run(self, epochs: int | None = None) -> list[Results]:
        """Run until ``epochs`` epochs (default ``config.epochs``) or every chain broke down.

        Returns:
            Every chain's results (as written to its ``results.json``).
        """
        target = self.config.epochs if epochs is None else epochs
        self.observer.on_start(self)  # type: ignore[arg-type]
        try:
            while self.running and self.epoch < target:
                self._run_epoch()
        except OutputError as exc:  # e.g. disk full: the last good checkpoint is kept
            for r in self.running:
                r.status, r.failure = "failed", str(exc)
            for r in self.records:
                try:
                    self._save_results(r)
                except OutputError:
                    break
            raise
        self.observer.on_finish(self)  # type: ignore[arg-type]
        return [r.results() for r in self.records]

    def _run_epoch(self) -> None:
        generators = [r.order_generator for r in self.records]
        for r in self.running:
            r.start_epoch()
        x_train, y_train = self.splits.x_train, self.splits.y_train
        batches = chain_batches(self.num_data, self.config.batch_size, generators, self.device)
        k = len(self.records)
        for step, index in enumerate(batches, 1):
            started = self._clock()
            self.chains.step(self._loss, x_train[index], y_train[index], grad_clip=GRAD_MAX)
            self.global_step += 1
            # each chain is charged its share of the process's step
            self._pending.append((self.global_step, (self._clock() - started) / k))
            for r in self.running:
                r.step_in_epoch = step
            if is_sample_step(self.global_step, self.config.burnin, self.config.thinning):
                self._credit()
                self._evaluate_sample()
            self.observer.on_step(self)  # type: ignore[arg-type]
        self._credit()
        if self._refreshes:  # Wenzel: refresh at each epoch end
            started = self._clock()
            self.chains.refresh()
            seconds = (self._clock() - started) / k
            for r in self.running:
                r.record_refresh_time(seconds)
        figures = self.chains.telemetry()  # the epoch's sums, read once
        for r in self.running:
            r.record_telemetry(figures[self.records.index(r)])
            verdict = run_health(r.telemetry, r.config.temperature)
            if verdict.broken_down:  # blown up while finite (sgrld.health)
                r.record_breakdown(blown_up_reason(verdict), blown_up=True)
                continue
            r.end_epoch()
        self.epoch += 1
        self._save()
        self.observer.on_epoch(self)  # type: ignore[arg-type]

    def _credit(self) -> None:
        """Read the breakdown flags (one host read) and credit the pending updates to every
        chain up to its failing one; a chain that failed is closed as its single run would be."""
        failed = self.chains.failure_details()
        for i, r in enumerate(self.records):
            if r.status != "running":
                continue
            bad = failed.get(i)
            r.credit_updates(self._pending, None if bad is None else bad[0])
            if bad is not None:
                r.record_breakdown(deferred_breakdown_reason(*bad))
                self._save_results(r)
        self._pending = []

    @torch.no_grad()
    def _evaluate_sample(self) -> None:
        """Fold every running chain's current state into its ensembles (eval mode)."""
        running = [(i, r) for i, r in enumerate(self.records) if r.status == "running"]
        if not running:
            return
        started = self._clock()
        self.chains.eval()
        try:
            for split in ("val", "test"):
                inputs = getattr(self.splits, f"x_{split}")
                for start in range(0, len(inputs), self.config.eval_batch_size):
                    stop = start + self.config.eval_batch_size
                    logits = self.chains(inputs[start:stop], shared=True)  # (K, B, C)
                    for i, r in running:
                        r.add_logits(split, start, logits[i])
            scalars = self._scalars()
            for i, r in running:
                curvature = None
                if self.config.curvature:
                    test = self.splits
                    curvature = measure_curvature(
                        self.chains.module(i),
                        test.x_test,
                        test.y_test,
                        generator=r.curvature_generator,
                        num_points=min(self.config.curvature_points, len(test.y_test)),
                    ).mean
                r.commit_sample({n: float(v[i]) for n, v in scalars.items()}, curvature)
        finally:
            self.chains.train()
        seconds = self._clock() - started
        for _, r in running:
            r.add_evaluation_time(seconds / len(running))

    def _scalars(self) -> dict[str, Tensor]:
        """Each chain's prior scales (horseshoe), ``name -> (K,)``, on the host."""
        if not self._scalar_names:
            return {}

        def scales(model: torch.nn.Module) -> Tensor:
            return torch.stack(list(scalar_hyperparameter_tensors(model).values()))

        values = self.chains.map(scales, shared=True).cpu()  # (K, S)
        return {n: values[:, j] for j, n in enumerate(self._scalar_names)}

    # --- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue every chain exactly."""
        return {
            "format": CHAINS_CHECKPOINT_FORMAT,
            "configs": [c.to_dict() for c in self.configs],
            "epoch": self.epoch,
            "global_step": self.global_step,
            "chain_batch": self.chain_batch,  # the sampler states are per call group
            "chains": self.chains.state_dict(),
            "records": [r.record_state() for r in self.records],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` of the same chains (``epochs`` may grow).

        Raises:
            CheckpointError: a checkpoint of another run or of other chains; nothing restored.
        """
        saved = [RunConfig.from_dict(c) for c in state["configs"]]
        if len(saved) != len(self.configs):
            raise CheckpointError(f"it holds {len(saved)} chains, not {len(self.configs)}")
        for old, new in zip(saved, self.configs, strict=True):
            differences = config_differences(old, new)
            if differences:
                raise CheckpointError(f"chain {new.label()}: " + "; ".join(differences))
        try:
            if len(state["records"]) != len(self.records):
                raise CheckpointError(f"it holds {len(state['records'])} records")
            pairs = zip(self.records, state["records"], strict=True)
            wrong = [w for r, s in pairs for w in r.ensemble_mismatches(s)]
            if wrong:
                raise CheckpointError("; ".join(wrong))
            self.chains.load_state_dict(state["chains"])
            for r, s in zip(self.records, state["records"], strict=True):
                r.restore_record(s)
        except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as exc:
            raise CheckpointError(f"{type(exc).__name__}: {exc}") from exc
        self.epoch = int(state["epoch"])
        self.global_step = int(state["global_step"])

    def _save(self) -> None:
        if self.out_dir is None:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        files.save_checkpoint(self.out_dir / CHECKPOINT_FILE, self.state_dict())
        for r in self.records:
            self._save_results(r)

    def _save_results(self, record: RunRecord) -> None:
        if self.folders is None:
            return
        folder = self.folders[self.records.index(record)]
        files.refuse_links(folder.parent, folder.name)  # OUT/<run name> planted as a link
        folder.mkdir(parents=True, exist_ok=True)
        write_results(folder, record.results())


def load_chains_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a multi-chain checkpoint (tensors on CPU), checking it first.

    Raises:
        CheckpointError: damaged (its SHA-256), foreign, incomplete, or NaN/Inf in an
            accumulator.
    """
    state = files.load_checkpoint(path)
    if not isinstance(state, dict) or state.get("format") != CHAINS_CHECKPOINT_FORMAT:
        found = state.get("format") if isinstance(state, dict) else None
        hint = "; it was made by a single run: resume it without --chains" if found else ""
        raise CheckpointError(f"checkpoint {path} is not a sgrld multi-chain checkpoint{hint}")
    missing = [
        k for k in ("configs", "epoch", "global_step", "chains", "records") if k not in state
    ]
    if missing:
        raise CheckpointError(f"checkpoint {path} is incomplete: no {', '.join(missing)}")
    bad = [
        b
        for i, record in enumerate(state["records"])
        for b in files.find_nonfinite(record["ensembles"], f"records.{i}", allow_minus_inf=True)
    ]
    if bad:
        raise CheckpointError(f"checkpoint {path} is damaged: NaN or Inf in {', '.join(bad)}")
    return state


def run_chains(
    configs: Sequence[RunConfig],
    splits: Splits,
    out_dir: str | os.PathLike[str] | None = None,
    *,
    device: torch.device | str = "cpu",
    resume: bool = False,
    observer: RunObserver | None = None,
    chain_batch: int | None = None,
    folders: Sequence[str | os.PathLike[str]] | None = None,
) -> list[Results]:
    """Run (or, with ``resume``, continue) K chains in one process and return their results.

    Args:
        configs: the chains (:func:`check_chain_configs`).
        splits: the dataset (see :func:`sgrld.data.load_dataset`).
        out_dir: ``OUT``; ``OUT/checkpoint.pt`` and ``OUT/<label>/results.json`` every epoch.
        device: compute device.
        resume: continue from ``OUT/checkpoint.pt`` if it exists.
        observer: progress hooks.
        chain_batch: at most this many chains per vmapped call.
        folders: each chain's results folder instead of ``OUT/<label>``.

    Returns:
        Every chain's results, in the order of ``configs``.
    """
    checkpoint = None if out_dir is None else Path(out_dir) / CHECKPOINT_FILE
    state = None
    if resume and checkpoint is not None and checkpoint.is_file():
        state = load_chains_checkpoint(checkpoint)
        saved = state.get("chain_batch") or len(configs)  # None: all in one call
        if chain_batch is not None and min(chain_batch, len(configs)) != saved:
            raise CheckpointError(
                f"checkpoint {checkpoint} was made with chain_batch {saved}, not {chain_batch}: "
                "resume it with the same (or no) --chain-batch"
            )
        chain_batch = saved  # the same call groups, whatever memory is free now
    run = ChainsRun(
        configs,
        splits,
        device=device,
        out_dir=out_dir,
        observer=observer,
        chain_batch=chain_batch,
        folders=folders,
    )
    if state is not None:
        try:
            run.load_state_dict(state)
        except CheckpointError as exc:
            raise CheckpointError(
                f"checkpoint {checkpoint} does not fit these chains: {exc}"
            ) from None
    return run.run()
