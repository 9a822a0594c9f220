"""Reader for the IDX format of the MNIST files (LeCun et al.), gzip-compressed or raw.

An IDX file is a 4-byte magic number ``00 00 <type> <ndim>``, then ``ndim`` big-endian uint32
dimension sizes, then the data in C order. Every malformed input raises an error naming the file.
"""

from __future__ import annotations

import gzip
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sgrld.data.download import MNIST_FILES, find_copy, missing_files_message, verify_sha256

_IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_GZIP_MAGIC = b"\x1f\x8b"


class IdxFormatError(ValueError):
    """A file is not a well-formed IDX file (or not the one expected)."""


def read_raw(path: str | os.PathLike[str]) -> bytes:
    """Bytes of ``path``, gunzipped if it starts with the gzip magic number."""
    raw = Path(path).read_bytes()
    if not raw.startswith(_GZIP_MAGIC):
        return raw
    try:
        return gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as exc:
        raise IdxFormatError(f"{os.fspath(path)}: corrupt or truncated gzip data ({exc})") from exc


def parse_idx(raw: bytes, *, source: str = "<bytes>") -> np.ndarray:
    """Decode IDX bytes into a native-endian array; ``source`` names the data in errors."""
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise IdxFormatError(f"{source}: bad IDX magic number {raw[:4].hex() or '(empty)'}")
    type_code, ndim = raw[2], raw[3]
    if type_code not in _IDX_DTYPES:
        raise IdxFormatError(f"{source}: unknown IDX data type 0x{type_code:02x}")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise IdxFormatError(f"{source}: truncated IDX header ({len(raw)} bytes)")
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    dtype = _IDX_DTYPES[type_code]
    expected = header + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) != expected:
        what = "truncated" if len(raw) < expected else "has trailing bytes"
        raise IdxFormatError(
            f"{source}: IDX data {what}: {len(raw)} bytes for shape {shape}, expected {expected}"
        )
    data = np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape)
    return data.astype(dtype.newbyteorder("="), copy=True)


def read_idx(
    path: str | os.PathLike[str],
    *,
    sha256: str | None = None,
    shape: tuple[int | None, ...] | None = None,
) -> np.ndarray:
    """Read one IDX file (``.gz`` or uncompressed).

    Args:
        path: the file.
        sha256: expected digest of the *uncompressed* bytes; checked once while reading.
        shape: expected shape; ``None`` entries match any size.

    Returns:
        A writable native-endian array (uint8 for the MNIST files).

    Raises:
        IdxFormatError: malformed file or unexpected shape.
        ChecksumError: digest mismatch.
    """
    raw = read_raw(path)
    if sha256 is not None:
        verify_sha256(raw, sha256, source=path)
    data = parse_idx(raw, source=os.fspath(path))
    if shape is not None and (
        len(shape) != data.ndim
        or any(e is not None and e != s for e, s in zip(shape, data.shape, strict=True))
    ):
        raise IdxFormatError(f"{os.fspath(path)}: shape {data.shape}, expected {shape}")
    return data


@dataclass(frozen=True)
class ImageArrays:
    """Official images and labels: MNIST ``(N, 28, 28)`` uint8 and ``(N,)`` uint8; CIFAR-10
    ``(N, 3, 32, 32)`` uint8 and ``(N,)`` int64."""

    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray


def read_mnist(directory: str | os.PathLike[str], *, verify: bool = True) -> ImageArrays:
    """Read the four MNIST files from ``directory``.

    Args:
        directory: holds ``train-images-idx3-ubyte.gz`` etc. (uncompressed copies also work).
        verify: check the published SHA-256 digests (off only for MNIST-format look-alikes).

    Raises:
        FileNotFoundError: a file is missing; the message lists what to put where.
        IdxFormatError, ChecksumError: a file is malformed or not the official one.
    """
    missing = [r.filename for r in MNIST_FILES.values() if not find_copy(directory, r.filename)]
    if missing:
        what = "file " + missing[0] if len(missing) == 1 else "files " + ", ".join(missing)
        raise FileNotFoundError(
            f"MNIST {what} not found in {os.fspath(directory)}; "
            + missing_files_message("mnist", directory, missing)
        )
    arrays: dict[str, np.ndarray] = {}
    for key, remote in MNIST_FILES.items():
        path = find_copy(directory, remote.filename)
        assert path is not None  # checked above
        spec: tuple[int | None, ...] = (None, 28, 28) if key.endswith("images") else (None,)
        arrays[key] = read_idx(path, sha256=remote.sha256 if verify else None, shape=spec)
    for split in ("train", "test"):
        images, labels = arrays[f"{split}_images"], arrays[f"{split}_labels"]
        if len(images) != len(labels):
            raise IdxFormatError(
                f"{os.fspath(directory)}: {len(images)} {split} images but {len(labels)} labels"
            )
        if labels.size and int(labels.max()) > 9:
            raise IdxFormatError(f"{os.fspath(directory)}: {split} labels outside 0..9")
    return ImageArrays(**arrays)
