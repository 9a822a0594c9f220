"""The ``sgrld`` command: one sub-command per module of :mod:`sgrld.experiments.commands`.

Each module in :data:`COMMANDS` exposes ``add_arguments(parser)`` and ``run(args) -> int``; the
modules are imported only when their command runs, so ``sgrld --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Sequence

from sgrld.experiments.base import exits
from sgrld.experiments.base.exits import Terminated

#: sub-command → its one-line help; each is the module ``sgrld.experiments.commands.<name>``.
HELP = {
    "demo": "the paper's funnel (Figure 2) shortened to 20,000 steps (about 25 s of CPU "
    "time): identity, rmsprop, monge, shampoo, 32 chains each",
    "funnel": "the paper's funnel experiment (Figure 2)",
    "geodesics": "Monge-metric geodesics on the funnel (Figure 1)",
    "sample": "sample a Bayesian neural network (Tables 1-3)",
    "sweep": "a grid of sample runs, resumable, local or SLURM",
    "report": "the paper's selection rule, every table and figure",
    "table": "aggregate runs into the paper's table format",
    "llc": "the local learning coefficient with every metric",
    "tune": "choose each sampler's ℓ for a run from its own chains (sgrld.tune)",
}
COMMANDS: dict[str, tuple[str, str]] = {
    name: (f"sgrld.experiments.commands.{name}", text) for name, text in HELP.items()
}


def _available() -> dict[str, tuple[str, str]]:
    return {k: v for k, v in COMMANDS.items() if importlib.util.find_spec(v[0]) is not None}


def main(argv: Sequence[str] | None = None) -> int:
    try:  # Ctrl-C at any point, start-up (imports, data loading) included: no traceback
        return _main(argv)
    except Terminated:  # a command that turns SIGTERM into an exception (sweep, funnel)
        print("terminated", file=sys.stderr)
        return exits.TERMINATED
    except KeyboardInterrupt:
        words = list(sys.argv[1:] if argv is None else argv)
        hint = RESUME_HINTS.get(next((w for w in words if not w.startswith("-")), ""))
        print("interrupted" + (f"; {hint}" if hint else ""), file=sys.stderr)
        return exits.INTERRUPTED


#: What to do after Ctrl-C, per command whose checkpoints let it continue.
RESUME_HINTS = {
    "sweep": "rerun the same command to resume: finished runs are skipped, the others continue "
    "from their last epoch",
    "sample": "sgrld sample --resume --out OUT continues the run from its last epoch",
}


def version() -> str:
    """``sgrld X (torch Y)`` from the installed distributions' metadata (no torch import)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        torch = installed("torch")
    except PackageNotFoundError:
        torch = "not installed"
    try:
        own = installed("sgrld")
    except PackageNotFoundError:  # run from a source tree that is not installed
        own = "unknown"
    return f"sgrld {own} (torch {torch}, Python {sys.version.split()[0]})"


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``sgrld`` parser with every available sub-command; each command's options are added
    (its module imported) for ``command`` only, or for all where it is ``None``."""
    parser = argparse.ArgumentParser(
        prog="sgrld", description="Scalable SGRLD samplers and the paper's experiments."
    )
    parser.add_argument("--version", action="version", version=version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in _available().items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        if command is None or name == command:
            importlib.import_module(module).add_arguments(p)
    return parser


def _command(argv: list[str]) -> str:
    """The sub-command named in ``argv`` (``""`` for none: ``sgrld --help`` imports none of
    them, nor torch). The top-level options take no value, so it is the first word."""
    return next((w for w in argv if not w.startswith("-")), "")


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(_command(argv))
    args = parser.parse_args(argv)
    from sgrld.experiments.commands.options import given_options  # `import sgrld.cli`: no torch

    args._given = given_options(argv)
    return int(importlib.import_module(args._module).run(args))


if __name__ == "__main__":
    sys.exit(main())
