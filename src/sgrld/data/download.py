"""Official download locations, checksums and a verifying downloader.

Without internet access :func:`download_dataset` fails with a :class:`DownloadError` that names
the files to place and where.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import tempfile
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal


class ChecksumError(ValueError):
    """A file's SHA-256 digest differs from the published one."""


class DownloadError(RuntimeError):
    """A dataset could not be fetched; the message says which files to place where."""


@dataclass(frozen=True, kw_only=True)
class RemoteFile:
    """One file of a dataset at its official location.

    Attributes:
        filename: name of the file, both remotely (appended to each base URL) and on disk.
        base_urls: locations to try in order, each ending in ``/``; the first is the official one.
        sha256: hex digest that the file must have, or ``None`` when none is known.
        digest_of: ``"file"`` if ``sha256`` is of the file as stored, ``"gunzipped"`` if it is of
            its gzip-decompressed content (the published MNIST digests are of the raw IDX files).
    """

    filename: str
    base_urls: tuple[str, ...]
    sha256: str | None
    digest_of: Literal["file", "gunzipped"] = "file"


_MNIST_URLS = (
    "http://yann.lecun.com/exdb/mnist/",
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
)
_CIFAR10_URLS = ("https://www.cs.toronto.edu/~kriz/",)

#: The digests of the four MNIST IDX files *uncompressed* (shared/data/README.md).
_MNIST_DIGESTS = {
    "train-images-idx3-ubyte": "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db",
    "train-labels-idx1-ubyte": "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5",
    "t10k-images-idx3-ubyte": "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
    "t10k-labels-idx1-ubyte": "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2",
}
#: The four MNIST IDX files by key (``train_images``, ..., ``test_labels``), gzipped.
MNIST_FILES: dict[str, RemoteFile] = {
    key: RemoteFile(
        filename=f"{stem}.gz", base_urls=_MNIST_URLS, sha256=digest, digest_of="gunzipped"
    )
    for key, (stem, digest) in zip(
        ("train_images", "train_labels", "test_images", "test_labels"),
        _MNIST_DIGESTS.items(),
        strict=True,
    )
}

#: The official CIFAR-10 python archive (170,498,071 bytes; md5 c58f30108f718f92721af3b95e74349a).
CIFAR10_ARCHIVE = RemoteFile(
    filename="cifar-10-python.tar.gz",
    base_urls=_CIFAR10_URLS,
    sha256="6d958be074577803d12ecdefd02955f39262c83c16fe9348329d7fe0b5c001ce",
)

DATASET_FILES: dict[str, tuple[RemoteFile, ...]] = {
    "mnist": tuple(MNIST_FILES.values()),
    "cifar10": (CIFAR10_ARCHIVE,),
}


def sha256_hex(data: bytes) -> str:
    """Hex SHA-256 digest of ``data``."""
    return hashlib.sha256(data).hexdigest()


def verify_sha256(data: bytes, expected: str, *, source: str | os.PathLike[str]) -> None:
    """Raise :class:`ChecksumError` naming ``source`` unless ``data`` hashes to ``expected``."""
    actual = sha256_hex(data)
    if actual != expected.lower():
        raise ChecksumError(
            f"{os.fspath(source)}: sha256 {actual} does not match the expected {expected}; "
            "the file is corrupt, truncated or not the official one"
        )


def verify_file(path: str | os.PathLike[str], remote: RemoteFile) -> None:
    """Check a local copy of ``remote`` against its published digest (no-op if none is known)."""
    if remote.sha256 is None:
        return
    raw = Path(path).read_bytes()
    if remote.digest_of == "gunzipped":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as exc:
            raise ChecksumError(f"{os.fspath(path)}: not a valid gzip file ({exc})") from exc
    verify_sha256(raw, remote.sha256, source=path)


def missing_files_message(
    name: str, directory: str | os.PathLike[str], missing: Sequence[str] | None = None
) -> str:
    """Human instructions listing where each (or each ``missing``) file of ``name`` goes."""
    files = [f for f in DATASET_FILES[name] if missing is None or f.filename in missing]
    listing = "\n".join(f"  {f.filename}  (from {f.base_urls[0]}{f.filename})" for f in files)
    extra = " (or its extracted cifar-10-batches-py/ directory)" if name == "cifar10" else ""
    these = "this file" if len(files) == 1 else "these files"
    return (
        f"put {these} of {name}{extra} into {os.fspath(directory)}:\n{listing}\n"
        "or set SGRLD_DATA_DIR to a directory that holds them (optionally in a "
        f"'{name}/' subdirectory)"
    )


def fetch_file(
    remote: RemoteFile,
    directory: str | os.PathLike[str],
    *,
    base_urls: Sequence[str] | None = None,
    timeout: float = 60.0,
) -> Path:
    """Download ``remote`` into ``directory`` and verify it, unless a verified copy is there.

    Written to a temporary name, renamed into place once its digest matches.

    Args:
        remote: the file to fetch.
        directory: destination directory (created if needed).
        base_urls: locations to try instead of ``remote.base_urls`` (each ending in ``/``;
            ``file://`` URLs work too).
        timeout: socket timeout in seconds for each attempt.

    Returns:
        The path of the verified file.

    Raises:
        DownloadError: no location gave a file with the right digest.
    """
    target = Path(directory) / remote.filename
    if target.exists():
        verify_file(target, remote)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    errors: list[str] = []
    for base in base_urls if base_urls is not None else remote.base_urls:
        url = base + remote.filename
        fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{remote.filename}.")
        tmp = Path(tmp_name)
        try:
            with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout) as src:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
            verify_file(tmp, remote)
            tmp.replace(target)
            return target
        except (OSError, ValueError) as exc:  # URLError is an OSError, ChecksumError a ValueError
            errors.append(f"{url}: {exc}")
        finally:
            tmp.unlink(missing_ok=True)
    raise DownloadError(
        f"could not download {remote.filename}:\n  " + "\n  ".join(errors) + "\n"
        f"Without network access, put {remote.filename} into {target.parent} by hand."
    )


def find_copy(directory: str | os.PathLike[str], filename: str) -> Path | None:
    """The file ``filename`` in ``directory`` or its uncompressed twin, whichever exists first."""
    for name in (filename, filename.removesuffix(".gz")):
        candidate = Path(directory) / name
        if candidate.is_file():
            return candidate
    return None


def download_dataset(
    name: str,
    directory: str | os.PathLike[str],
    *,
    timeout: float = 60.0,
    base_urls: Sequence[str] | None = None,
) -> Path:
    """Complete dataset ``name`` (``"mnist"`` or ``"cifar10"``) in ``directory``.

    Files already there (also MNIST's uncompressed twins, or CIFAR-10's extracted batches) are
    verified and kept; only the missing ones are fetched, each verified before it is in place.

    Args:
        name: the dataset.
        directory: where its files go (created if needed).
        timeout: socket timeout per attempt, seconds.
        base_urls: locations to try instead of the official ones (mirrors; ``file://`` works).

    Raises:
        ValueError: unknown dataset name.
        ChecksumError: a file already present is corrupt or not the official one.
        DownloadError: a file could not be fetched; the message lists the files to place by hand.
    """
    if name not in DATASET_FILES:
        raise ValueError(f"unknown dataset {name!r}; valid names: {sorted(DATASET_FILES)}")
    directory = Path(directory)
    if name == "cifar10" and _has_cifar_batches(directory):
        return directory  # extracted batches carry no published digest: nothing to fetch
    for remote in DATASET_FILES[name]:
        local = find_copy(directory, remote.filename)
        if local is None:
            try:
                fetch_file(remote, directory, timeout=timeout, base_urls=base_urls)
            except DownloadError as exc:
                hint = missing_files_message(name, directory, [remote.filename])
                raise DownloadError(f"{exc}\n{hint}") from exc
        elif local.name == remote.filename:
            verify_file(local, remote)
        elif remote.sha256 is not None:  # the gunzipped twin: the published digest is of it
            verify_sha256(local.read_bytes(), remote.sha256, source=local)
    return directory


def _has_cifar_batches(directory: Path) -> bool:
    batches = directory / "cifar-10-batches-py"
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    return all((batches / n).is_file() for n in names)
