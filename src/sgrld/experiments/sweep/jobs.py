"""The unit of work of a sweep: a :class:`SweepJob` runs, resumes or skips a few runs of a grid.

Every engine executes it (a local pool calls it, submitit pickles it to a node). It is
idempotent: finished runs are skipped, others resume from their checkpoint, so a job run again
loses at most one epoch per run. With ``--chains K`` a job is a *pack* of up to K runs run as
the chains of one process, its one checkpoint in ``OUT/.packs/<id>/`` (``docs/experiments.md``).
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sgrld.experiments.base.files import read_file, refuse_links
from sgrld.experiments.run.config import TUNED_FIELDS
from sgrld.experiments.run.results import FINISHED, RESULTS_FILE, impossible_values
from sgrld.experiments.sweep.grid import PlannedRun

CHECKPOINT_FILE = "checkpoint.pt"
LOCKS_DIR = ".locks"  # OUT/.locks/<digest>/: a run's lock that outlives its folder
PACKS_DIR = ".packs"  # a pack's checkpoint: OUT/.packs/<id>/checkpoint.pt


def run_state(folder: Path, config: dict[str, Any]) -> str:
    """``"done"``, ``"partial"`` (a checkpoint to resume) or ``"todo"``.

    Done: ``results.json`` has this config, a final status and possible values. A broken-down
    run is a result of the protocol: not rerun even when ``epochs`` grew (a completed one is).
    """
    try:
        results = json.loads(read_file(folder / RESULTS_FILE).decode("utf-8"))
    except (OSError, ValueError):
        results = None
    if isinstance(results, dict) and results.get("status") in FINISHED:
        saved = results.get("config")
        same = saved == config
        if not same and results["status"] == "broken_down" and isinstance(saved, dict):
            same = {**saved, "epochs": config.get("epochs")} == config
        if same and not impossible_values(results):
            return "done"
    return "partial" if (folder / CHECKPOINT_FILE).is_file() else "todo"


@dataclass(frozen=True)
class Machine:
    """Where and how runs execute (not part of a run's config)."""

    data_dir: str
    device: str = "cpu"
    threads: int | None = None
    verify: bool = True
    download: bool = False
    plot: bool = False
    chain_batch: int | None = None  # chains per vectorised call in a pack
    graph: bool = True  # CUDA: replay a single run's captured step (sgrld sample --no-graph)
    parallel: str = "none"  # sgrld sample --parallel: each task of the job is one rank of a run


@dataclass(frozen=True)
class RunOutcome:
    """What happened to one run in one job."""

    path: str
    status: str  # completed, broken_down, skipped (already done), busy (another job holds it)
    epochs: int = 0


@functools.lru_cache(maxsize=2)
def _splits(dataset: str, data_dir: str, num_val: int, verify: bool, download: bool) -> Any:
    """The dataset, loaded once per process (a pool worker runs many runs)."""
    from sgrld.data import load_dataset

    return load_dataset(dataset, data_dir, num_val=num_val, verify=verify, download=download)


def _use_threads(machine: Machine) -> None:
    import torch

    if machine.threads is not None:
        torch.set_num_threads(machine.threads)


def _plot(results: Sequence[Any], folders: Sequence[Path]) -> None:
    from sgrld.experiments.run.plots import plot_run_curves

    for result, folder in zip(results, folders, strict=True):
        plot_run_curves(result, folder / "curves.png")


def _sample(run: Any, machine: Any, out: Path, device: Any, parallel: Any = None) -> RunOutcome:
    """Run (or resume) ``run`` and draw its curves (rank 0): the sample run of one job or one
    rank of it."""
    from sgrld.experiments.run.config import RunConfig
    from sgrld.experiments.run.loop import run_sampling

    folder = out / run.path
    config = RunConfig.from_dict(run.config)
    splits = _splits(
        config.dataset, machine.data_dir, config.num_val, machine.verify, machine.download
    )
    (results,) = run_sampling(
        config,
        splits,
        folder,
        device=device,
        resume=True,
        step_mode="auto" if machine.graph else "eager",
        parallel=parallel,
    )
    if machine.plot and (parallel is None or parallel.is_main):
        _plot([results], [folder])
    return RunOutcome(run.path, results["status"], results["epochs_completed"])


@contextmanager
def _locked(out: Path, run_path: str) -> Iterator[bool]:
    """Hold the run's locks (non-blocking); yields whether this process got them.

    The folder's lock is ``sgrld sample``'s own; a second one, ``OUT/.locks/<digest>``, survives
    the folder's deletion. Killed writers' temporaries are removed once both are held.

    Raises:
        OutputError: a folder on the way is a symbolic link (never written through).
    """
    from sgrld.experiments.base.files import (
        DirectoryLock,
        DirectoryLockedError,
        remove_stale_temporaries,
    )

    digest = hashlib.sha256(run_path.encode()).hexdigest()[:16]
    refuse_links(out, run_path, f"{LOCKS_DIR}/{digest}")  # never written through a link
    with ExitStack() as stack:
        try:
            stack.enter_context(DirectoryLock(out / LOCKS_DIR / digest, f"sgrld sweep {run_path}"))
            stack.enter_context(DirectoryLock(out / run_path, "sgrld sweep"))
        except DirectoryLockedError:
            yield False
            return
        remove_stale_temporaries(out / run_path)
        yield True


def execute_run(run: PlannedRun, out: Path, machine: Machine) -> RunOutcome:
    """Run, resume or skip one run of the grid in this process."""
    with ExitStack() as stack:
        decision = _decide(run, out, stack)
        if decision != "run":
            return RunOutcome(run.path, decision)
        _use_threads(machine)
        return _sample(run, machine, out, machine.device)


def _decide(run: PlannedRun, out: Path, stack: ExitStack) -> str:
    """Rank 0's decision for the whole job: ``skipped``, ``busy`` or ``run`` (then it holds the
    run's locks in ``stack`` until the job ends)."""
    if run_state(out / run.path, run.config) == "done":
        return "skipped"
    return "run" if stack.enter_context(_locked(out, run.path)) else "busy"


def execute_parallel_run(run: PlannedRun, out: Path, machine: Machine) -> RunOutcome:
    """Run, resume or skip one run as a rank of a multi-process job (``sgrld sweep --parallel``).

    Every task calls this: it joins the job's process group (submitit's
    ``TorchDistributedEnvironment``) as ``sample --parallel`` does under torchrun. Rank 0
    decides for all whether to run, holds the locks and alone writes the run's folder.

    Raises:
        Exception: rank 0's error when it could not decide (e.g. a linked run folder), and on
            the other ranks a RuntimeError naming it; any rank's own error fails its task, and
            its peers then fail at their next collective.
    """
    import torch
    import torch.distributed as dist
    from submitit.helpers import TorchDistributedEnvironment

    from sgrld.experiments.run.parallel import DataParallel, rank_device

    env = TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
    device = rank_device(torch.device(machine.device), env.local_rank)
    _use_threads(machine)
    parallel = DataParallel.join(device, machine.parallel)
    with ExitStack() as stack:
        decision, error, refusal = "run", "", None
        if parallel.is_main:
            try:
                decision = _decide(run, out, stack)
            except Exception as exc:  # every rank stops, none is left waiting
                decision, error, refusal = "error", f"{type(exc).__name__}: {exc}", exc
        message = [decision, error]
        dist.broadcast_object_list(message, src=0)
        decision, error = message
        if refusal is not None:
            raise refusal
        if decision == "error":
            raise RuntimeError(f"rank 0 could not start {run.path}: {error}")
        if decision != "run":
            dist.destroy_process_group()
            return RunOutcome(run.path, decision)
        outcome = _sample(run, machine, out, device, parallel)
    dist.destroy_process_group()
    return outcome


def pack_id(runs: Sequence[PlannedRun]) -> str:
    """A pack's folder name under ``OUT/.packs``: a digest of its runs' folders."""
    return hashlib.sha256("\n".join(r.path for r in runs).encode()).hexdigest()[:16]


def execute_pack(runs: Sequence[PlannedRun], out: Path, machine: Machine) -> list[RunOutcome]:
    """Run, resume or skip a pack of runs as the chains of one process (without the pack's
    checkpoint, only its open runs run: a finished run is never written again).

    Returns:
        The outcomes of the runs that were not finished when the pack started.
    """
    open_runs = [r for r in runs if run_state(out / r.path, r.config) != "done"]
    if not open_runs:
        return []
    with ExitStack() as stack:
        if not all([stack.enter_context(_locked(out, r.path)) for r in runs]):
            return [RunOutcome(r.path, "busy") for r in open_runs]
        from sgrld.experiments.base.files import remove_stale_temporaries

        refuse_links(out, f"{PACKS_DIR}/{pack_id(runs)}")
        remove_stale_temporaries(out / PACKS_DIR / pack_id(runs))  # of a killed pack process
        if not (out / PACKS_DIR / pack_id(runs) / CHECKPOINT_FILE).is_file():
            runs = [r for r in runs if run_state(out / r.path, r.config) != "done"]
        if not runs:  # finished by another job meanwhile
            return [RunOutcome(r.path, "skipped") for r in open_runs]
        from sgrld.experiments.run import loop
        from sgrld.experiments.run.config import RunConfig

        _use_threads(machine)
        configs = [RunConfig.from_dict(r.config) for r in runs]
        first = configs[0]
        splits = _splits(
            first.dataset, machine.data_dir, first.num_val, machine.verify, machine.download
        )
        results = loop.run_sampling(
            configs,
            splits,
            out / PACKS_DIR / pack_id(runs),
            device=machine.device,
            resume=True,
            chain_batch=machine.chain_batch,
            folders=[out / r.path for r in runs],
        )
        if machine.plot:
            _plot(results, [out / r.path for r in runs])
        status = {r.path: res for r, res in zip(runs, results, strict=True)}
        return [
            RunOutcome(r.path, status[r.path]["status"], status[r.path]["epochs_completed"])
            if r.path in status
            else RunOutcome(r.path, "skipped")
            for r in open_runs
        ]


@dataclass
class SweepJob:
    """Runs of one process (the sweep folder ``out``; with ``pack`` as the chains of one
    process, :func:`execute_pack`); callable by any engine, checkpointable by submitit."""

    runs: Sequence[PlannedRun]
    out: str
    machine: Machine
    pack: bool = False

    @property
    def name(self) -> str:
        return self.runs[0].path if len(self.runs) == 1 else f"{len(self.runs)} runs"

    def __call__(self) -> list[RunOutcome]:
        """Run every run that is not finished; an exception fails the job (and is reported)."""
        if self.pack:
            return execute_pack(self.runs, Path(self.out), self.machine)
        if self.machine.parallel != "none":  # this process is one rank of the job's run
            return [execute_parallel_run(run, Path(self.out), self.machine) for run in self.runs]
        return [execute_run(run, Path(self.out), self.machine) for run in self.runs]

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """submitit's preemption/timeout hook: requeue this job as it is (its state is on disk)."""
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(self, *args, **kwargs)


def _pack_key(config: dict[str, Any]) -> str:
    """What the runs of one pack share: everything but seed, ℓ and the tuned options (α²)."""
    return repr(sorted((k, v) for k, v in config.items() if k not in ("seed", "lr", *TUNED_FIELDS)))


def _tuned(config: dict[str, Any]) -> list[float]:
    return [config.get(n) or 0.0 for n in TUNED_FIELDS]


def make_jobs(
    runs: Sequence[PlannedRun], out: Path, machine: Machine, chains: int = 1
) -> list[SweepJob]:
    """The jobs of the unfinished runs: one per run, or packs of up to ``chains`` runs of one
    setting and sampler, formed over all of ``runs`` (by α², ℓ, seed).

    Raises:
        ValueError: runs that cannot be chains of one process (e.g. torch noise).
    """
    todo = {r.path for r in runs if run_state(out / r.path, r.config) != "done"}
    if chains == 1:
        return [SweepJob([r], str(out), machine) for r in runs if r.path in todo]
    from sgrld.experiments.run.chains import check_chain_configs
    from sgrld.experiments.run.config import RunConfig

    groups: dict[str, list[PlannedRun]] = {}
    for r in runs:
        groups.setdefault(_pack_key(r.config), []).append(r)
    jobs = []
    for group in groups.values():
        group.sort(key=lambda r: (*_tuned(r.config), r.config["lr"], r.config["seed"]))
        for start in range(0, len(group), chains):
            pack = group[start : start + chains]
            if not any(r.path in todo for r in pack):
                continue
            if len(pack) > 1:
                check_chain_configs([RunConfig.from_dict(r.config) for r in pack])
            jobs.append(SweepJob(pack, str(out), machine, pack=len(pack) > 1))
    return jobs
