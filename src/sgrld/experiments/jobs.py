"""The unit of work of a sweep: a job runs (or resumes, or skips) a few runs of a grid.

A :class:`SweepJob` is what every engine executes: a local process pool calls it, submitit
pickles it to a SLURM node. It is idempotent: a run whose ``results.json`` says it is finished
is skipped, a run with a checkpoint is resumed (``sgrld sample --resume``: the runner checkpoints
every epoch and continues bit-identically), so a job that is preempted, timed out or killed and
run again loses at most one epoch per run. submitit calls :meth:`SweepJob.checkpoint` on
preemption or timeout and requeues the same job.

Today a job holds the runs of one process, run one after the other; packing the chains of one
setting and sampler into one multi-chain process changes :meth:`SweepJob.__call__` only.
"""

from __future__ import annotations

import fcntl
import functools
import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sgrld.experiments.grid import PlannedRun

RESULTS_FILE = "results.json"  # == runner.RESULTS_FILE, without importing torch
CHECKPOINT_FILE = "checkpoint.pt"
LOCK_FILE = ".lock"
FINISHED = ("completed", "broken_down")


def run_state(folder: Path, config: dict[str, Any]) -> str:
    """``"done"`` (completed or broken down), ``"partial"`` (a checkpoint to resume) or ``"todo"``.

    A run counts as done when its ``results.json`` has this config and a final status; a
    broken-down run is a result of the protocol (spec §4.8), so it is not run again.
    """
    try:
        results = json.loads((folder / RESULTS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        results = None
    if (
        isinstance(results, dict)
        and results.get("config") == config
        and results.get("status") in FINISHED
    ):
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


@contextmanager
def _locked(folder: Path) -> Iterator[bool]:
    """Hold ``folder/.lock`` (non-blocking); yields whether this process got it.

    Two jobs of the same run (a rerun sweep while a cluster job still runs it) never write the
    same folder at once: the second one skips the run.
    """
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / LOCK_FILE, "a+", encoding="utf-8") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def execute_run(run: PlannedRun, out: Path, machine: Machine) -> RunOutcome:
    """Run, resume or skip one run of the grid in this process."""
    folder = out / run.path
    if run_state(folder, run.config) == "done":
        return RunOutcome(run.path, "skipped")
    with _locked(folder) as mine:
        if not mine:
            return RunOutcome(run.path, "busy")
        import torch

        from sgrld.experiments.runner import RunConfig, run_sampling

        if machine.threads is not None:
            torch.set_num_threads(machine.threads)
        config = RunConfig.from_dict(run.config)
        splits = _splits(
            config.dataset, machine.data_dir, config.num_val, machine.verify, machine.download
        )
        results = run_sampling(config, splits, folder, device=machine.device, resume=True)
        if machine.plot:
            from sgrld.experiments.plots import plot_run_curves

            plot_run_curves(results, folder / "curves.png")
        return RunOutcome(run.path, results["status"], results["epochs_completed"])


@dataclass
class SweepJob:
    """Runs of one process, executed in order; callable by any engine, checkpointable by submitit.

    Attributes:
        runs: the runs (one today; several chains of one setting and sampler later).
        out: the sweep folder.
        machine: data, device and threads.
    """

    runs: Sequence[PlannedRun]
    out: str
    machine: Machine

    @property
    def name(self) -> str:
        return self.runs[0].path if len(self.runs) == 1 else f"{len(self.runs)} runs"

    def __call__(self) -> list[RunOutcome]:
        """Run every run that is not finished; an exception fails the job (and is reported)."""
        return [execute_run(run, Path(self.out), self.machine) for run in self.runs]

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """submitit's preemption/timeout hook: requeue this job; it resumes from the checkpoints.

        The runs' state is on disk (``checkpoint.pt`` every epoch), so the job itself carries
        none and is resubmitted as it is.
        """
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(self, *args, **kwargs)


def make_jobs(runs: Sequence[PlannedRun], out: Path, machine: Machine) -> list[SweepJob]:
    """One job per run (one process per run until multi-chain processes exist)."""
    return [SweepJob([run], str(out), machine) for run in runs]
