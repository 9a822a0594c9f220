"""What the experiment commands write, made safe against the faults of a real machine: whole
files or none (:func:`write_atomic`), one writer per directory (:class:`DirectoryLock`),
checkpoints that carry their SHA-256 (torch's loader does not check the zip's CRCs). The
guarantees per fault are listed in ``docs/experiments.md``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import math
import os
import signal
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from sgrld.experiments.base import exits
from sgrld.experiments.base.exits import Terminated, UsageError

try:
    import fcntl
except ImportError:  # Windows: no flock; runs there are not protected from each other
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "EXIT_IO_ERROR",
    "CheckpointError",
    "DirectoryLock",
    "DirectoryLockedError",
    "OutputError",
    "Terminated",
    "UnsafePathError",
    "check_out_dir",
    "error_reason",
    "find_nonfinite",
    "load_checkpoint",
    "locked_out_dir",
    "make_out_dir",
    "open_regular",
    "read_file",
    "read_json",
    "refuse_links",
    "remove_stale_temporaries",
    "save_checkpoint",
    "save_figure",
    "sha256_hex",
    "sigint_deferred",
    "sigterm_raises",
    "write_atomic",
]

#: Exit status when an output cannot be written (BSD sysexits ``EX_IOERR``).
EXIT_IO_ERROR = exits.IO_ERROR
LOCK_FILE = ".sgrld.lock"
_TEMP_SUFFIX = ".sgrld-tmp"
_MAGIC = b"sgrld-checkpoint\n"  # then one JSON header line, then the torch.save payload


class OutputError(OSError):
    """An output could not be written; ``str()`` is one line naming the file and the reason."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()  # without OSError's "[Errno 28] " prefix


class DirectoryLockedError(RuntimeError):
    """Another live process holds the output directory's lock."""


class CheckpointError(ValueError):
    """A checkpoint is damaged, truncated, empty, foreign or does not fit the run."""


class UnsafePathError(OSError):
    """A path the commands refuse to read or write through: a symbolic link, a special file
    (FIFO, device, socket), or a file too large to be what it claims."""


def error_reason(exc: OSError) -> str:
    """Why an I/O call failed, in words for an error message."""
    # "no space left on device", not a traceback ending in torch's "enforce fail"
    if isinstance(exc, UnsafePathError):
        return str(exc.strerror)
    return os.strerror(exc.errno).lower() if exc.errno else str(exc)


MAX_JSON_BYTES = 1 << 30  # the largest JSON file (results, manifests, configs) read


def open_regular(path: str | os.PathLike[str], flags: int, use: str) -> int:
    """Open a regular file, never through a link planted at its name, never blocking on a FIFO.

    Raises:
        UnsafePathError: a symbolic link, or not a regular file (refusing to ``use`` it).
    """
    flags |= getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP or Path(path).is_symlink():
            message = "it is a symbolic link; refusing to follow it"
            raise UnsafePathError(errno.ELOOP, message) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafePathError(errno.EINVAL, f"it is not a regular file; refusing to {use} it")
    return fd


def read_file(path: str | os.PathLike[str], limit: int | None = MAX_JSON_BYTES) -> bytes:
    """The bytes of a regular file (:func:`open_regular`), never reading a device.

    Args:
        limit: the most bytes such a file can sanely hold (``None``: the machine's memory).

    Raises:
        UnsafePathError: a symbolic link, not a regular file, or larger than ``limit``.
        OSError: it cannot be opened or read.
    """
    fd = open_regular(path, os.O_RDONLY, "read")
    try:
        info = os.fstat(fd)
        most = limit
        if most is None:
            try:
                most = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            except (ValueError, OSError, AttributeError):
                most = 1 << 40
        if info.st_size > most:
            raise UnsafePathError(
                errno.EFBIG, f"it holds {info.st_size} bytes, more than the {most} it can sanely be"
            )
        chunks = []
        while chunk := os.read(fd, 1 << 24):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_json(path: str | os.PathLike[str], what: str) -> Any:
    """The JSON value in the regular file ``path`` (:func:`read_file`: no link followed, no
    FIFO or device read, at most :data:`MAX_JSON_BYTES`).

    Args:
        what: what the file holds, for the message (e.g. ``"the tuned options"``).

    Raises:
        UsageError: one line naming ``path``, ``what`` and the reason (unreadable, a link or a
            special file, too large, not JSON).
    """
    try:
        return json.loads(read_file(path))
    except OSError as exc:
        raise UsageError(f"cannot read {what} in {path}: {error_reason(exc)}") from None
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError
        reason = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise UsageError(f"cannot read {what} in {path}: not JSON ({reason})") from None


def refuse_links(root: str | os.PathLike[str], *paths: str) -> None:
    """Refuse a symbolic link planted at a folder or file the commands write under ``root`` (the
    user's ``--out``, which may itself be a link).

    Raises:
        OutputError: naming the link.
    """
    for path in paths:
        parts = Path(path).parts
        for depth in range(1, len(parts) + 1):
            folder = Path(root).joinpath(*parts[:depth])
            if folder.is_symlink():
                raise OutputError(
                    errno.ELOOP,
                    f"cannot write in {folder}: it is a symbolic link; refusing to follow it",
                )


def write_atomic(path: str | os.PathLike[str], data: bytes | str) -> None:
    """Write ``data`` to ``path`` whole or not at all.

    Raises:
        OutputError: the write failed (the temporary is removed, an older ``path`` is kept).
    """
    path = Path(path)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=_TEMP_SUFFIX, dir=path.parent)
    except OSError as exc:
        raise OutputError(exc.errno, f"cannot write {path}: {error_reason(exc)}") from exc
    try:
        try:
            _write_all(fd, payload)
            os.fsync(fd)
        finally:
            os.close(fd)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600 files; outputs get the usual mode
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise OutputError(exc.errno, f"cannot write {path}: {error_reason(exc)}") from exc
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def make_out_dir(out: Path) -> None:
    """Refuse an ``--out`` that cannot be written (a read-only one: exit 74, as every command).

    Raises:
        OutputError: naming ``--out`` and the reason.
    """
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=out)  # O_EXCL: never a link
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise OutputError(exc.errno, f"cannot write to --out {out}: {reason}") from exc


def check_out_dir(out: str | os.PathLike[str]) -> Path:
    """``--out`` as a path, refused where a file (or a link to one) is there: every command's
    first check of its output folder (exit 2, before any work).

    Raises:
        UsageError: ``--out ... exists and is not a directory``.
    """
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise UsageError(f"--out {path} exists and is not a directory")
    return path


@contextlib.contextmanager
def locked_out_dir(out: str | os.PathLike[str], command: str) -> Iterator[Path]:
    """Hold a command's output folder for the block: :func:`check_out_dir`, then create and
    lock it (:class:`DirectoryLock`, recording ``command``), then remove the temporaries that
    killed writers left there (:func:`remove_stale_temporaries`). Every command's folder goes
    through here; write in it with :func:`write_atomic` or :func:`save_figure`.

    Raises:
        UsageError: ``--out`` is a file (exit 2).
        DirectoryLockedError: another live process holds it (exit 2).
        OutputError: it cannot be created or locked (exit 74).
    """
    path = check_out_dir(out)
    with DirectoryLock(path, command):
        remove_stale_temporaries(path)
        yield path


def save_figure(fig: Any, path: str | os.PathLike[str], **options: Any) -> None:
    """A matplotlib figure rendered as PNG in memory, then written with :func:`write_atomic`
    (never through a file or link already at ``path``)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", **options)
    write_atomic(path, buffer.getvalue())


def remove_stale_temporaries(directory: str | os.PathLike[str]) -> list[Path]:
    """Remove the temporaries that killed writers left in ``directory`` (hold its lock first;
    a folder that is not there, or is a link, has none of ours)."""
    removed: list[Path] = []
    folder = Path(directory)
    if folder.is_symlink() or not folder.is_dir():
        return removed
    for entry in folder.glob(f".*{_TEMP_SUFFIX}"):
        with contextlib.suppress(OSError):
            entry.unlink()
            removed.append(entry)
    return removed


def sha256_hex(data: bytes) -> str:
    """The SHA-256 of ``data`` in hex."""
    return hashlib.sha256(data).hexdigest()


class DirectoryLock:
    """An exclusive ``flock`` on ``directory/.sgrld.lock``, which records the holder; the kernel
    releases it when the holder dies. A context manager; the directory is created if needed
    (and removed on release if still empty); the lock file is removed on release.

    Raises:
        DirectoryLockedError: on entry, when another process holds the lock (the message names
            its pid, host and command).
        OutputError: the directory or the lock file cannot be created.
    """

    def __init__(self, directory: str | os.PathLike[str], command: str) -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK_FILE
        self.command = command
        self._fd: int | None = None
        self._created = False

    def __enter__(self) -> DirectoryLock:
        if fcntl is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            return self
        try:
            self._created = not self.directory.exists()
            self.directory.mkdir(parents=True, exist_ok=True)
            while True:
                fd = open_regular(self.path, os.O_RDWR | os.O_CREAT, "use")
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
                    os.close(fd)
                    raise DirectoryLockedError(
                        f"{self.directory} is in use by another run "
                        f"({holder or 'holder not yet recorded'}; lock {self.path})"
                    ) from None
                # A holder that released between our open and flock unlinked the file we
                # locked: only a lock on the file now at the path counts.
                with contextlib.suppress(FileNotFoundError):
                    if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                        if os.fstat(fd).st_nlink == 1:
                            break
                        # a hard link (a folder snapshotted with cp -al or rsync --link-dest):
                        # never write through it to the other name; a file of our own replaces
                        # it (unlinked under the lock, so a racing run retries as above)
                        os.unlink(self.path)
                os.close(fd)
            host = socket.gethostname()
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            os.ftruncate(fd, 0)
            os.write(fd, f"pid {os.getpid()} on {host}, {self.command}, since {stamp}\n".encode())
        except OSError as exc:
            raise OutputError(exc.errno, f"cannot lock {self.path}: {error_reason(exc)}") from exc
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)  # while still holding it (see the inode check on entry)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None
        if self._created:
            with contextlib.suppress(OSError):  # only succeeds when nothing was written
                self.directory.rmdir()


def save_checkpoint(path: str | os.PathLike[str], state: Any) -> None:
    """``torch.save(state)`` behind a header holding the payload's size and SHA-256, atomically.

    Raises:
        OutputError: the file could not be written (the previous checkpoint is kept).
    """
    import torch

    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    header = json.dumps({"bytes": len(payload), "sha256": sha256_hex(payload)})
    write_atomic(path, _MAGIC + header.encode() + b"\n" + payload)


def load_checkpoint(path: str | os.PathLike[str]) -> Any:
    """Read a :func:`save_checkpoint` file onto the CPU after checking its SHA-256.

    Raises:
        CheckpointError: the file is unreadable, empty, truncated, damaged or not a sgrld
            checkpoint; the message names the file and what is wrong.
    """
    import torch

    try:
        data = read_file(path, limit=None)
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {error_reason(exc)}") from None
    if not data:
        raise CheckpointError(f"checkpoint {path} is empty (0 bytes)")
    if not data.startswith(_MAGIC):
        what = "a bare torch file" if data[:2] == b"PK" else "not a sgrld checkpoint"
        raise CheckpointError(
            f"checkpoint {path} has no sgrld integrity header ({what}); refusing to trust it"
        )
    end = data.find(b"\n", len(_MAGIC))
    try:
        header = json.loads(data[len(_MAGIC) : end])
        size, digest = int(header["bytes"]), str(header["sha256"])
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f"checkpoint {path} is damaged (unreadable header)") from None
    payload = data[end + 1 :] if end >= 0 else b""
    if len(payload) != size:
        raise CheckpointError(
            f"checkpoint {path} is truncated or padded: {len(payload)} payload bytes, "
            f"{size} written"
        )
    if sha256_hex(payload) != digest:
        raise CheckpointError(
            f"checkpoint {path} is damaged: its SHA-256 does not match the one written with it"
        )
    try:
        return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as exc:  # the checksum matched: written by something else than sgrld
        raise CheckpointError(
            f"checkpoint {path} holds a payload sgrld cannot load safely ({type(exc).__name__})"
        ) from None


def find_nonfinite(value: Any, name: str = "", *, allow_minus_inf: bool = False) -> list[str]:
    """Dotted names of the floating tensors (and floats) in ``value`` holding NaN or ±Inf.

    Args:
        value: nested dicts, lists and tuples of tensors and numbers.
        name: prefix of the reported names.
        allow_minus_inf: accept −Inf (e.g. a log-sum-exp accumulator before its first term).
    """
    import torch

    found: list[str] = []
    if isinstance(value, dict):
        for key, item in value.items():
            key_name = f"{name}.{key}" if name else str(key)
            found += find_nonfinite(item, key_name, allow_minus_inf=allow_minus_inf)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            found += find_nonfinite(item, f"{name}[{index}]", allow_minus_inf=allow_minus_inf)
    elif isinstance(value, torch.Tensor) and value.is_floating_point():
        bad = value.isnan() | (value == math.inf)
        if not allow_minus_inf:
            bad |= value == -math.inf
        if bool(bad.any()):
            found.append(name)
    elif isinstance(value, float) and (
        math.isnan(value) or value == math.inf or (value == -math.inf and not allow_minus_inf)
    ):
        found.append(name)
    return found


@contextlib.contextmanager
def _handling(signum: int, handler: Callable[[int, FrameType | None], None]) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield  # signals reach the main thread only
        return
    previous = signal.signal(signum, handler)
    try:
        yield
    finally:
        signal.signal(signum, previous)


@contextlib.contextmanager
def sigint_deferred() -> Iterator[None]:
    """Hold Ctrl-C until the block ends, then raise :class:`KeyboardInterrupt` (for ``import
    torch``: one raised inside its C++ start-up aborts the process instead of unwinding)."""
    received: list[int] = []
    with _handling(signal.SIGINT, lambda signum, frame: received.append(signum)):
        yield
    if received:
        raise KeyboardInterrupt


def sigterm_raises() -> contextlib.AbstractContextManager[None]:
    """Within the block, SIGTERM raises :class:`Terminated` (clean-up runs as for Ctrl-C)."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise Terminated

    return _handling(signal.SIGTERM, handler)
