"""The exit statuses of every ``sgrld`` command: one table, which each command's ``--help`` prints
and ``docs/experiments.md`` reproduces. Nothing here imports torch."""

from __future__ import annotations

OK = 0
FAILED = 1
USAGE = 2
BROKEN_DOWN = 3
IO_ERROR = 74  # BSD sysexits EX_IOERR
BUSY = 75  # BSD sysexits EX_TEMPFAIL: try again later
INTERRUPTED = 130  # 128 + SIGINT
TERMINATED = 143  # 128 + SIGTERM

EVERY = ("sample", "sweep", "funnel", "demo", "geodesics", "report", "table", "llc", "tune")
#: status → (meaning, the commands that use it).
STATUSES: dict[int, tuple[str, tuple[str, ...]]] = {
    OK: ("done: every run finished (in a sweep: completed or broken down), outputs written", EVERY),
    FAILED: (
        "sweep: a run failed (its error is listed, the others went on); sample under torchrun: "
        "another rank died (the last good checkpoint is kept); report and table with --strict: "
        "a run was left out (the outputs are still written)",
        ("sample", "sweep", "report", "table"),
    ),
    USAGE: (
        "bad input, refused before any work: invalid options or config, a damaged or "
        "misfitting checkpoint, an --out held by another run or grid, unreadable results",
        EVERY,
    ),
    BROKEN_DOWN: (
        "a chain broke down (a non-finite value, or blown up while finite: sgrld.health): "
        "sample writes its results (status broken_down), funnel, demo and llc write nothing",
        ("sample", "funnel", "demo", "llc"),
    ),
    IO_ERROR: (
        "an output could not be written (a read-only --out, disk full); the last good "
        "checkpoint is kept",
        EVERY,
    ),
    BUSY: (
        "sweep: runs are still held by another sweep or job; run the sweep again when they end",
        ("sweep",),
    ),
    INTERRUPTED: ("interrupted (Ctrl-C), workers stopped, checkpoints intact", EVERY),
    TERMINATED: ("terminated (SIGTERM), workers stopped, checkpoints intact", EVERY),
}


class UsageError(ValueError):
    """Bad command-line input, refused before any work (exit status 2)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so that the same clean-up runs; the command exits with 143."""


def statuses(command: str) -> list[int]:
    """The exit statuses ``command`` may return, in increasing order."""
    return [code for code, (_, commands) in STATUSES.items() if command in commands]


def epilog(command: str) -> str:
    """The ``--help`` epilog of ``command``: its exit statuses and their meaning."""
    lines = "; ".join(f"{code} {STATUSES[code][0]}" for code in statuses(command))
    return f"Exit status: {lines}. docs/experiments.md lists what survives which fault."
