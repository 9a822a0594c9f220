"""Worker processes (``--jobs``) that never outlive the command that started them, even when
it is killed (SIGKILL), running on unsupervised and holding their runs' locks."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
import warnings
from typing import Any

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent: int) -> None:
    """End this worker when process ``parent`` ends: ``prctl(PR_SET_PDEATHSIG)`` on Linux, and
    a daemon thread polling the parent's pid. Ctrl-C is left to the parent."""
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


def silence_resource_tracker() -> None:
    """From now on in this process, a killed multiprocessing resource tracker is relaunched
    without a word (idempotent).

    The worker pools' semaphores are registered with the tracker, a process of its own. If it is
    killed, the pools' clean-up (which may run as late as the interpreter's exit) relaunched it
    and unregistered there the semaphores it never saw: each printed a ``KeyError`` traceback,
    though nothing was wrong with the sweep. Here a name is unregistered only with the tracker
    it was registered with.
    """
    from multiprocessing import resource_tracker

    tracker: Any = resource_tracker._resource_tracker  # the module's one instance
    if getattr(resource_tracker.unregister, "sgrld", False):
        return
    register, unregister, launch = tracker.register, tracker.unregister, tracker.ensure_running
    owners: dict[tuple[str, str], int | None] = {}

    def ensure_running() -> None:
        with warnings.catch_warnings():  # "process died unexpectedly, relaunching"
            warnings.simplefilter("ignore")
            launch()

    def register_here(name: str, rtype: str) -> None:
        register(name, rtype)
        owners[(name, rtype)] = tracker._pid

    def unregister_here(name: str, rtype: str) -> None:
        owner = owners.pop((name, rtype), None)
        tracker.ensure_running()
        if owner is None or owner == tracker._pid:
            unregister(name, rtype)

    unregister_here.sgrld = True  # type: ignore[attr-defined]
    tracker.ensure_running = ensure_running
    tracker.register, tracker.unregister = register_here, unregister_here
    module: Any = resource_tracker  # its functions are the instance's bound methods
    module.register, module.unregister = register_here, unregister_here
