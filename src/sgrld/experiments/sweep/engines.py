"""Engines that execute a sweep's jobs: local processes (:func:`run_local`) or submitit, SLURM or
its local executor (:func:`run_submitit`), both reporting to one :class:`GridProgress`.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sgrld.experiments.base.files import sigterm_raises
from sgrld.experiments.base.process import die_with_parent, silence_resource_tracker
from sgrld.experiments.sweep.jobs import RunOutcome, SweepJob


@dataclass
class Tally:
    """How the runs of a sweep ended in this invocation."""

    completed: int = 0
    broken_down: int = 0
    skipped: int = 0
    busy: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)  # (run, error)
    retried: list[tuple[str, str]] = field(default_factory=list)  # (run, why)


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

    def retried(self, job: SweepJob, reason: str) -> None:
        """A job that ended without outcomes and goes back to the queue (``reason``)."""
        self.running -= 1
        self.tally.retried += [(run.path, reason) for run in job.runs]
        self.bar.write(f"retrying {job.name}: {reason}", file=sys.stderr)
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


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


#: How often a job whose worker died (OOM killer, a kill) is retried (from its checkpoints).
WORKER_RETRIES = 1
WORKER_DIED = "its worker process died (killed, e.g. by the out-of-memory killer)"


def run_local(jobs: Sequence[SweepJob], workers: int, progress: GridProgress) -> None:
    """Execute the jobs in ``workers`` processes (in this process when ``workers`` is 1).

    Each worker is a one-process pool of its own, so a worker that dies breaks only its job,
    which is retried (:data:`WORKER_RETRIES`); workers die with the sweep, even by SIGKILL.
    """
    with sigterm_raises():
        if workers == 1:
            for job in jobs:
                progress.started()
                try:
                    outcomes = job()
                except Exception as exc:  # a failed run must not stop the others (Ctrl-C does)
                    progress.finished(job, None, _error(exc))
                else:
                    progress.finished(job, outcomes)
            return
        context = multiprocessing.get_context("spawn")  # no forked torch/CUDA state

        def new_pool() -> ProcessPoolExecutor:
            return ProcessPoolExecutor(
                max_workers=1,
                mp_context=context,
                initializer=die_with_parent,
                initargs=(os.getpid(),),
            )

        pools: list[ProcessPoolExecutor] = []
        silence_resource_tracker()  # a killed tracker: no tracebacks
        try:
            pools += [new_pool() for _ in range(min(workers, len(jobs)))]
            free = list(range(len(pools)))
            pending: dict[Future[list[RunOutcome]], tuple[int, SweepJob]] = {}
            queue = deque(jobs)
            deaths: dict[int, int] = {}
            while queue or pending:
                while queue and free:  # keep the "running" count honest
                    slot, job = free.pop(), queue.popleft()
                    pending[pools[slot].submit(job)] = (slot, job)
                    progress.started()
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    slot, job = pending.pop(future)
                    free.append(slot)
                    error = future.exception()
                    if isinstance(error, BrokenProcessPool):
                        pools[slot].shutdown(wait=True)
                        pools[slot] = new_pool()
                        deaths[id(job)] = deaths.get(id(job), 0) + 1
                        if deaths[id(job)] <= WORKER_RETRIES:
                            progress.retried(job, WORKER_DIED)
                            queue.appendleft(job)
                        else:
                            progress.finished(job, None, WORKER_DIED)
                    elif error is not None:
                        progress.finished(job, None, _error(error))
                    else:
                        progress.finished(job, future.result())
        except BaseException:
            for child in multiprocessing.active_children():
                child.terminate()
            for pool in pools:
                pool.shutdown(wait=False, cancel_futures=True)
            raise
        for pool in pools:
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
    nodes: int = 1  # a job's nodes (the local executor has one)
    tasks_per_node: int = 1  # processes per node: > 1 only for runs spread over processes


def _executor(folder: Path, options: ClusterOptions) -> Any:
    import submitit

    parameters: dict[str, Any] = {
        "timeout_min": options.timeout_min,
        "tasks_per_node": options.tasks_per_node,
        "gpus_per_node": options.gpus_per_job,  # locally, 0 hides every GPU from the tasks
    }
    if options.local:
        executor: Any = submitit.LocalExecutor(folder=folder)
    else:
        executor = submitit.AutoExecutor(folder=folder, cluster="slurm")
        parameters.update(
            name="sgrld-sweep", cpus_per_task=options.cpus_per_job, nodes=options.nodes
        )
        if options.partition:
            parameters["slurm_partition"] = options.partition
        if options.parallel:
            parameters["slurm_array_parallelism"] = options.parallel
    executor.update_parameters(**parameters)
    return executor


class RankFailed(RuntimeError):
    """A task (rank) of a multi-process job failed: each failed rank's error, in one line."""


#: How much of a failed rank's error the summary shows; of an echo (a rank that lost its peers).
RANK_ERROR_CHARS = 300
ECHO_CHARS = 100
#: Words of errors that only echo another rank's failure (a broken collective, rank 0's refusal).
ECHO_WORDS = (
    "connection closed",
    "connection reset",
    "gloo",
    "nccl",
    "broken pipe",
    "timed out",
    "rank 0 could not start",
)


def _cut(line: str, limit: int) -> str:
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _last_line(error: BaseException) -> str:
    """The gist of a submitit task error: its traceback's last line, or that it died."""
    text = str(error)
    parts = text.split("\n----------------------\n")
    if len(parts) >= 2 and parts[1].strip():  # FailedJobError: the task's traceback
        return parts[1].strip().splitlines()[-1]
    if "has not produced any output" in text:  # UncompletedJobError: no result pickle
        return "its process died without a result (killed, e.g. by the out-of-memory killer)"
    return text.strip().splitlines()[0] if text.strip() else type(error).__name__


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def rank_failures(lines: dict[int, str], world: int) -> str:
    """One line for a job's failed ranks (rank → error): causes first, then the echoes, e.g.
    ``1 of 2 ranks failed (rank 1: ValueError: …; rank 0 stopped with it: RuntimeError: …)``."""
    causes: dict[str, list[int]] = {}
    echoes: dict[str, list[int]] = {}
    for rank, line in sorted(lines.items()):
        echo = any(word in line.lower() for word in ECHO_WORDS)
        (echoes if echo else causes).setdefault(line, []).append(rank)
    full = causes or echoes  # no cause among them: each echo in full
    parts = [f"{_ranks(r)}: {_cut(line, RANK_ERROR_CHARS)}" for line, r in full.items()]
    if causes:
        parts += [
            f"{_ranks(r)} stopped with it: {_cut(line, ECHO_CHARS)}" for line, r in echoes.items()
        ]
    return f"{len(lines)} of {world} ranks failed ({'; '.join(parts)})"


def job_outcomes(job: Any) -> Any:
    """A finished submitit job's outcomes (rank 0's for a multi-process job).

    Raises:
        Exception: a one-task job's own error.
        RankFailed: a multi-process job's failed ranks (:func:`rank_failures`) and their logs.
    """
    if job.num_tasks == 1:
        return job.result()
    errors = {k: job.task(k).exception() for k in range(job.num_tasks)}
    lines = {k: _last_line(e) for k, e in errors.items() if e is not None}
    if lines:
        raise RankFailed(
            f"{rank_failures(lines, job.num_tasks)}; logs: {Path(job.paths.stderr).parent}"
        )
    return job.results()[0]


@contextmanager
def _output_to(log: Path, redirect: bool) -> Iterator[None]:
    """With ``redirect``, processes started in the block write stdout and stderr to ``log`` (a
    cancelled submitit local controller would print a traceback on the terminal)."""
    if not redirect:
        yield
        return
    from sgrld.experiments.base.files import OutputError, error_reason, open_regular

    sys.stdout.flush()
    sys.stderr.flush()
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        handle = open_regular(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, "use")
    except OSError as exc:
        raise OutputError(exc.errno, f"cannot write {log}: {error_reason(exc)}") from None
    saved = [os.dup(1), os.dup(2)]
    try:
        os.dup2(handle, 1)
        os.dup2(handle, 2)
        yield
    finally:
        for fd, copy in zip((1, 2), saved, strict=True):
            os.dup2(copy, fd)
            os.close(copy)
        os.close(handle)


def run_submitit(
    jobs: Sequence[SweepJob], out: Path, options: ClusterOptions, progress: GridProgress
) -> None:
    """Submit the jobs through submitit (one SLURM job array; the local executor at most
    ``options.parallel`` at a time) and, unless ``options.wait`` is off, follow them."""
    from sgrld.experiments.base.files import refuse_links

    # submitit writes its pickles and logs there and the sweep unpickles results from there
    refuse_links(out, ".submitit")
    executor = _executor(out / ".submitit" / "%j", options)
    window = len(jobs) if not options.local else (options.parallel or 1)
    queue = list(jobs)
    pending: list[tuple[Any, SweepJob]] = []
    with sigterm_raises():
        try:
            while queue or pending:
                if len(pending) < window and queue:
                    batch = queue[: window - len(pending)]
                    del queue[: len(batch)]
                    log = out / ".submitit" / "controllers.log"
                    with _output_to(log, options.local), executor.batch():
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
                        progress.finished(sweep_job, job_outcomes(job))
                    except Exception as exc:  # the job's own error, with submitit's log path
                        progress.finished(sweep_job, None, _error(exc))
                if pending:
                    progress.set_running(sum(job.state == "RUNNING" for job, _ in pending))
                    time.sleep(options.poll_seconds)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM (Terminated)
            if options.local:
                for job, _ in pending:
                    job.cancel(check=False)
            else:
                progress.bar.write(
                    "interrupted: the submitted SLURM jobs keep running; run the sweep again "
                    "later to collect them (finished runs are skipped)"
                )
            raise
