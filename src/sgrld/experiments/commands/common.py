"""What several commands share: ``--strict``, the warning lines of left-out runs, an error line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def add_strict_argument(parser: argparse.ArgumentParser) -> None:
    """``--strict`` (``table`` and ``report``): exit 1 when a run was left out or flagged."""
    parser.add_argument(
        "--strict",
        action="store_true",
        help="exit with status 1 when a run was left out (a duplicate, a config unlike its "
        "folder, impossible or non-finite values); the outputs are still written. For CI",
    )


def report_problems(command: str, problems: Sequence[str]) -> None:
    """Each left-out run as a warning line on stderr."""
    for problem in problems:
        print(f"sgrld {command}: warning: {problem}", file=sys.stderr)


def fail(command: str, message: str, status: int) -> int:
    """Say ``sgrld COMMAND: error: MESSAGE`` on stderr; return the exit ``status``."""
    print(f"sgrld {command}: error: {message}", file=sys.stderr)
    return status
