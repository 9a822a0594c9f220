"""What every ``torch.compile`` user in sgrld shares: quiet tracing, a one-line failure reason."""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from collections.abc import Iterator


@contextlib.contextmanager
def quiet_compile() -> Iterator[None]:
    """Silence torch's own warnings while it imports inductor, traces or compiles (under ``-W
    error`` they would abort the compilation, and no user can act on them)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\._dynamo")
        yield


def failure_reason(exc: BaseException) -> str:
    """``"Type: first line of the message"``, for a warning that compiling failed."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def announce(what: str) -> None:
    """Say that a slow compilation starts: on the ``sgrld`` logger (INFO), or on stderr where
    logging is not configured (a pause of seconds is not a hang)."""
    logger = logging.getLogger("sgrld")
    if logger.hasHandlers():
        logger.info("sgrld: %s", what)
    else:
        print(f"sgrld: {what}", file=sys.stderr, flush=True)
