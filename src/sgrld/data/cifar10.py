"""Reader for the official CIFAR-10 python version (Krizhevsky, 2009) and its preprocessing.

Reads ``cifar-10-python.tar.gz`` directly or the extracted ``cifar-10-batches-py/``; batches are
unpickled with an allow-list, so a hostile file cannot run code.
"""

from __future__ import annotations

import codecs
import io
import os
import pickle
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from sgrld.data.download import CIFAR10_ARCHIVE, missing_files_message, verify_file
from sgrld.data.idx import ImageArrays

BATCH_DIR = "cifar-10-batches-py"
TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_BATCH = "test_batch"
_RECONSTRUCT = np.zeros(1).__reduce__()[0]  # numpy's array-unpickling helper, wherever it lives
_ALLOWED = {
    ("numpy.core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("numpy._core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("_codecs", "encode"): codecs.encode,  # bytes in Python 3 protocol-2 pickles
}


class Cifar10FormatError(ValueError):
    """A CIFAR-10 batch is malformed; the message names the file."""


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed") from None


def parse_batch(raw: bytes, *, source: str) -> tuple[np.ndarray, np.ndarray]:
    """Decode one pickled batch into images ``(N, 3, 32, 32)`` uint8 and labels ``(N,)`` int64."""
    try:
        batch = _SafeUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except Exception as exc:  # pickle raises many types on corrupt input
        raise Cifar10FormatError(f"{source}: cannot unpickle CIFAR-10 batch ({exc!r})") from exc
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        raise Cifar10FormatError(f"{source}: not a CIFAR-10 batch (needs b'data' and b'labels')")
    data, labels = batch[b"data"], np.asarray(batch[b"labels"])
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2:
        raise Cifar10FormatError(f"{source}: b'data' must be a 2-d uint8 array")
    if data.shape[1] != 3072 or labels.shape != (data.shape[0],):
        raise Cifar10FormatError(
            f"{source}: data shape {data.shape} and labels shape {labels.shape} do not match "
            "(N, 3072) and (N,)"
        )
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise Cifar10FormatError(f"{source}: labels outside 0..9")
    return data.reshape(-1, 3, 32, 32).copy(), labels.astype(np.int64)


def _read_members(path: Path, verify: bool) -> dict[str, bytes]:
    names = (*TRAIN_BATCHES, TEST_BATCH)
    if path.is_dir():
        for member in (path / name for name in names):
            if not member.is_file():
                raise FileNotFoundError(f"CIFAR-10 batch {member} is missing")
        return {name: (path / name).read_bytes() for name in names}
    if verify:
        verify_file(path, CIFAR10_ARCHIVE)
    try:
        with tarfile.open(path, "r:gz") as archive:
            out = {}
            for name in names:
                try:
                    handle = archive.extractfile(f"{BATCH_DIR}/{name}")
                except KeyError:
                    handle = None
                if handle is None:
                    raise Cifar10FormatError(f"{path}: archive has no {BATCH_DIR}/{name}")
                out[name] = handle.read()
            return out
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise Cifar10FormatError(f"{path}: corrupt or truncated archive ({exc})") from exc


def locate_cifar10(path: str | os.PathLike[str]) -> Path:
    """The archive or batch directory at ``path`` (itself, or inside it if it is a directory).

    Raises:
        FileNotFoundError: nothing usable; the message says what to put where.
    """
    path = Path(path)
    for candidate in (path / CIFAR10_ARCHIVE.filename, path / BATCH_DIR, path):
        if candidate.is_file() or (candidate.is_dir() and (candidate / TEST_BATCH).is_file()):
            return candidate
    raise FileNotFoundError(
        f"no CIFAR-10 data at {os.fspath(path)}; " + missing_files_message("cifar10", path)
    )


def read_cifar10(path: str | os.PathLike[str], *, verify: bool = True) -> ImageArrays:
    """Read CIFAR-10 from the official archive or its extracted batch directory.

    Args:
        path: the archive, the ``cifar-10-batches-py`` directory, or a directory holding either.
        verify: check the archive's published SHA-256 (the extracted batches have none).

    Raises:
        FileNotFoundError: no data found.
        Cifar10FormatError, ChecksumError: malformed or unofficial data.
    """
    location = locate_cifar10(path)
    members = _read_members(location, verify)
    parsed = {name: parse_batch(raw, source=f"{location}/{name}") for name, raw in members.items()}
    train = [parsed[name] for name in TRAIN_BATCHES]
    return ImageArrays(
        train_images=np.concatenate([images for images, _ in train]),
        train_labels=np.concatenate([labels for _, labels in train]),
        test_images=parsed[TEST_BATCH][0],
        test_labels=parsed[TEST_BATCH][1],
    )


def standardise(train: Tensor, *others: Tensor) -> tuple[Tensor, ...]:
    """Per-channel standardisation with the train images' mean and unbiased std.

    Float64 statistics over the (N, H, W) axes of ``train`` (ddof = 1); float32 results.

    Returns:
        ``(train, *others)`` standardised.
    """
    train64 = train.to(torch.float64)
    mean = train64.mean(dim=(0, 2, 3), keepdim=True)
    std = train64.std(dim=(0, 2, 3), keepdim=True)
    return tuple(((x.to(torch.float64) - mean) / std).to(torch.float32) for x in (train, *others))
