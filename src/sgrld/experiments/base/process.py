"""Worker processes that never outlive the command that started them.

A pool worker (``sgrld funnel --jobs``, ``sgrld sweep --jobs``) calls :func:`die_with_parent`
first: when the parent ends, even by SIGKILL, which it cannot handle, the worker ends too
instead of running on unsupervised (and holding its runs' locks).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent: int) -> None:
    """End this worker when process ``parent`` ends.

    Linux delivers SIGKILL to the worker when its parent dies (``prctl(PR_SET_PDEATHSIG)``);
    elsewhere, and as a fallback, a daemon thread polls the parent's pid every 0.5 s. Ctrl-C is
    left to the parent, which terminates its workers itself.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it died before prctl took effect
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="sgrld-parent-watch", daemon=True).start()
