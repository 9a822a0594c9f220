"""Engines that execute a sweep's jobs: local processes, or submitit (SLURM or its local executor).

No scheduler is written here: :func:`run_local` hands jobs to a
:class:`concurrent.futures.ProcessPoolExecutor` (or runs them in this process with one job at a
time), :func:`run_submitit` to submitit's executors. Both report to one :class:`GridProgress`
(tqdm): runs done, running and failed over the whole grid, with tqdm's ETA.
"""

from __future__ import annotations

import multiprocessing
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sgrld.experiments.jobs import RunOutcome, SweepJob


@dataclass
class Tally:
    """How the runs of a sweep ended in this invocation."""

    completed: int = 0
    broken_down: int = 0
    skipped: int = 0
    busy: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)  # (run, error)


class GridProgress:
    """One progress bar over the whole grid (tqdm, on stderr): done / total, running, failed."""

    def __init__(self, total: int, done: int, *, enabled: bool = True) -> None:
        from tqdm import tqdm

        self.tally = Tally()
        self.running = 0
        self.bar = tqdm(
            total=total,
            initial=done,
            unit="run",
            desc="sweep",
            disable=not enabled,
            file=sys.stderr,
            dynamic_ncols=True,
        )
        self._show()

    def _show(self) -> None:
        t = self.tally
        self.bar.set_postfix_str(
            f"running {self.running}, failed {len(t.failed)}, broke down {t.broken_down}",
            refresh=True,
        )

    def started(self, count: int = 1) -> None:
        self.running += count
        self._show()

    def set_running(self, count: int) -> None:
        """The number of jobs actually running (a cluster's queued jobs are not)."""
        if count != self.running:
            self.running = count
            self._show()

    def finished(
        self, job: SweepJob, outcomes: Sequence[RunOutcome] | None, error: str = ""
    ) -> None:
        """Record a job's end: its outcomes, or the error that failed all its runs."""
        self.running -= 1
        t = self.tally
        if outcomes is None:
            t.failed += [(run.path, error) for run in job.runs]
            self.bar.write(f"failed: {job.name}: {error}", file=sys.stderr)
        else:
            for outcome in outcomes:
                if outcome.status == "busy":
                    t.busy.append(outcome.path)
                    continue
                t.completed += outcome.status == "completed"
                t.broken_down += outcome.status == "broken_down"
                t.skipped += outcome.status == "skipped"
                self.bar.update(1)
        self._show()

    def close(self) -> None:
        self.bar.close()


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM ends the sweep like Ctrl-C, so that worker processes are stopped too."""

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def run_local(jobs: Sequence[SweepJob], workers: int, progress: GridProgress) -> None:
    """Execute the jobs in ``workers`` processes (in this process when ``workers`` is 1).

    On Ctrl-C or SIGTERM the worker processes are terminated; each run keeps its last epoch's
    checkpoint, so the next sweep resumes it.
    """
    with _sigterm_as_interrupt():
        if workers == 1:
            for job in jobs:
                progress.started()
                try:
                    outcomes = job()
                except KeyboardInterrupt:
                    raise
                except Exception as exc:  # a failed run must not stop the others
                    progress.finished(job, None, _error(exc))
                else:
                    progress.finished(job, outcomes)
            return
        context = multiprocessing.get_context("spawn")  # no forked torch/CUDA state
        pool = ProcessPoolExecutor(max_workers=workers, mp_context=context)
        try:
            pending: dict[Future[list[RunOutcome]], SweepJob] = {}
            queue = list(jobs)
            while queue or pending:
                while queue and len(pending) < workers:  # keep the "running" count honest
                    job = queue.pop(0)
                    pending[pool.submit(job)] = job
                    progress.started()
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    job = pending.pop(future)
                    error = future.exception()
                    if error is None:
                        progress.finished(job, future.result())
                    else:
                        progress.finished(job, None, _error(error))
        except BaseException:
            for child in multiprocessing.active_children():
                child.terminate()
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown()


@dataclass(frozen=True)
class ClusterOptions:
    """submitit options: ``local`` uses submitit's LocalExecutor instead of SLURM."""

    local: bool = False
    partition: str | None = None
    gpus_per_job: int = 0
    cpus_per_job: int = 1
    timeout_min: int = 60
    parallel: int | None = None  # at most this many jobs at once (None: SLURM decides; local 1)
    wait: bool = True
    poll_seconds: float = 0.25


def _executor(folder: Path, options: ClusterOptions) -> Any:
    import submitit

    if options.local:
        local = submitit.LocalExecutor(folder=folder)
        local.update_parameters(timeout_min=options.timeout_min)
        return local
    executor = submitit.AutoExecutor(folder=folder, cluster="slurm")
    parameters: dict[str, Any] = {
        "name": "sgrld-sweep",
        "timeout_min": options.timeout_min,
        "gpus_per_node": options.gpus_per_job,
        "cpus_per_task": options.cpus_per_job,
        "tasks_per_node": 1,
        "nodes": 1,
    }
    if options.partition:
        parameters["slurm_partition"] = options.partition
    if options.parallel:
        parameters["slurm_array_parallelism"] = options.parallel
    executor.update_parameters(**parameters)
    return executor


def run_submitit(
    jobs: Sequence[SweepJob], out: Path, options: ClusterOptions, progress: GridProgress
) -> None:
    """Submit the jobs through submitit and, unless ``options.wait`` is off, follow them.

    SLURM jobs go out as one job array; submitit requeues a preempted or timed-out job, which
    then resumes its runs from their checkpoints (:meth:`SweepJob.checkpoint`). The local
    executor starts at most ``options.parallel`` jobs at a time. Logs: ``OUT/.submitit/``.
    """
    executor = _executor(out / ".submitit" / "%j", options)
    window = len(jobs) if not options.local else (options.parallel or 1)
    queue = list(jobs)
    pending: list[tuple[Any, SweepJob]] = []
    with _sigterm_as_interrupt():
        try:
            while queue or pending:
                if len(pending) < window and queue:
                    batch = queue[: window - len(pending)]
                    del queue[: len(batch)]
                    with executor.batch():
                        submitted = [executor.submit(job) for job in batch]
                    pending += zip(submitted, batch, strict=True)
                    progress.started(len(batch))
                    if not options.wait:
                        ids = ", ".join(job.job_id for job, _ in pending)
                        progress.bar.write(f"submitted {len(pending)} jobs: {ids}")
                        return
                for entry in [p for p in pending if p[0].done()]:
                    pending.remove(entry)
                    job, sweep_job = entry
                    try:
                        progress.finished(sweep_job, job.result())
                    except Exception as exc:  # the job's own error, with submitit's log path
                        progress.finished(sweep_job, None, _error(exc))
                if pending:
                    progress.set_running(sum(job.state == "RUNNING" for job, _ in pending))
                    time.sleep(options.poll_seconds)
        except KeyboardInterrupt:
            if options.local:
                for job, _ in pending:
                    job.cancel(check=False)
            else:
                progress.bar.write(
                    "interrupted: the submitted SLURM jobs keep running; run the sweep again "
                    "later to collect them (finished runs are skipped)"
                )
            raise
