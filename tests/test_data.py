"""Tests of sgrld.data: IDX and CIFAR-10 readers, the paper's splits, downloads."""

from __future__ import annotations

import gzip
import hashlib
import os
import pickle
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from sgrld.data.cifar10 import Cifar10FormatError, read_cifar10, standardise
from sgrld.data.datasets import load_dataset
from sgrld.data.download import (
    MNIST_FILES,
    ChecksumError,
    DownloadError,
    RemoteFile,
    download_dataset,
    fetch_file,
)
from sgrld.data.idx import IdxFormatError, read_idx, read_mnist
from sgrld.data.splits import split_indices, validation_indices

REPO_ROOT = Path(__file__).resolve().parents[1]
MNIST_DIR = Path(os.environ.get("SGRLD_MNIST_DIR", REPO_ROOT / ".." / "shared" / "data" / "mnist"))
MNIST_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
needs_mnist = pytest.mark.skipif(
    not (MNIST_DIR / "train-images-idx3-ubyte.gz").is_file(),
    reason=f"real MNIST not found in {MNIST_DIR} (set SGRLD_MNIST_DIR)",
)


# --- IDX --------------------------------------------------------------------------------------


def idx_bytes(array: np.ndarray, type_code: int = 0x08) -> bytes:
    """Encode ``array`` as IDX (big-endian), independently of the reader."""
    big = array.astype(array.dtype.newbyteorder(">"))
    header = bytes([0, 0, type_code, array.ndim])
    header += b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    return header + big.tobytes()


def write_mnist_like(directory: Path, num_train: int, num_test: int, compress: bool) -> None:
    """Synthetic MNIST-format files (random pixels, labels cycling 0..9)."""
    rng = np.random.default_rng(0)
    directory.mkdir(parents=True, exist_ok=True)
    for prefix, count in (("train", num_train), ("t10k", num_test)):
        images = rng.integers(0, 256, (count, 28, 28), dtype=np.uint8)
        labels = (np.arange(count) % 10).astype(np.uint8)
        for kind, array, dims in (("images", images, 3), ("labels", labels, 1)):
            raw = idx_bytes(array)
            name = f"{prefix}-{kind}-idx{dims}-ubyte"
            if compress:
                (directory / f"{name}.gz").write_bytes(gzip.compress(raw))
            else:
                (directory / name).write_bytes(raw)


@pytest.mark.parametrize("compress", [False, True])
def test_idx_roundtrip(tmp_path: Path, compress: bool) -> None:
    array = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    raw = idx_bytes(array)
    path = tmp_path / ("a.gz" if compress else "a")
    path.write_bytes(gzip.compress(raw) if compress else raw)
    out = read_idx(path, sha256=hashlib.sha256(raw).hexdigest(), shape=(None, 3, 4))
    np.testing.assert_array_equal(out, array)
    assert out.dtype == np.uint8


def test_idx_big_endian_int32(tmp_path: Path) -> None:
    array = np.array([[1, -2], [70000, 3]], dtype=np.int32)
    (tmp_path / "b").write_bytes(idx_bytes(array, type_code=0x0C))
    out = read_idx(tmp_path / "b")
    np.testing.assert_array_equal(out, array)
    assert out.dtype.isnative


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda raw: raw[:-1], "truncated"),
        (lambda raw: raw + b"\0", "trailing"),
        (lambda raw: b"\x01" + raw[1:], "magic"),
        (lambda raw: raw[:2] + b"\x42" + raw[3:], "data type"),
        (lambda raw: raw[:6], "header"),
    ],
)
def test_idx_malformed_raises_naming_file(tmp_path: Path, mutate: object, message: str) -> None:
    raw = idx_bytes(np.zeros((5, 28, 28), dtype=np.uint8))
    path = tmp_path / "bad-images-idx3-ubyte"
    path.write_bytes(mutate(raw))  # type: ignore[operator]
    with pytest.raises(IdxFormatError, match=message) as info:
        read_idx(path)
    assert str(path) in str(info.value)


def test_idx_truncated_gzip_and_wrong_shape_and_digest(tmp_path: Path) -> None:
    raw = idx_bytes(np.ones((5, 28, 28), dtype=np.uint8))
    path = tmp_path / "x.gz"
    path.write_bytes(gzip.compress(raw)[:-10])
    with pytest.raises(IdxFormatError, match="gzip") as info:
        read_idx(path)
    assert str(path) in str(info.value)
    path.write_bytes(gzip.compress(raw))
    with pytest.raises(IdxFormatError, match="expected"):
        read_idx(path, shape=(None, 28, 29))
    with pytest.raises(ChecksumError) as info_sum:
        read_idx(path, sha256="0" * 64)
    assert str(path) in str(info_sum.value)


# --- splits -----------------------------------------------------------------------------------


def test_validation_indices_match_reference_recipe() -> None:
    mnist = validation_indices(60_000)
    assert mnist[:5].tolist() == [15281, 21435, 44536, 13518, 47529]
    assert validation_indices(50_000)[:5].tolist() == [26247, 35067, 34590, 16668, 12196]
    state = np.random.get_state()
    try:  # the reference's own recipe, on the global generator
        np.random.seed(1)
        expected = np.random.choice(np.arange(60_000), size=10_000, replace=False)
    finally:
        np.random.set_state(state)
    np.testing.assert_array_equal(mnist, expected)


def test_split_indices_partition() -> None:
    train, val = split_indices(50_000)
    assert len(train) == 40_000 and len(val) == 10_000
    assert np.all(np.diff(train) > 0)
    assert len(np.union1d(train, val)) == 50_000
    assert np.intersect1d(train, val).size == 0
    with pytest.raises(ValueError, match="num_val"):
        split_indices(100, 100)


# --- MNIST ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mnist_splits():  # type: ignore[no-untyped-def]
    return load_dataset("mnist", MNIST_DIR)


@needs_mnist
def test_real_mnist_files_and_label_counts() -> None:
    arrays = read_mnist(MNIST_DIR)
    assert arrays.train_images.shape == (60_000, 28, 28)
    assert arrays.test_images.shape == (10_000, 28, 28)
    assert np.bincount(arrays.train_labels, minlength=10).tolist() == MNIST_COUNTS


@needs_mnist
def test_real_mnist_paper_splits(mnist_splits) -> None:  # type: ignore[no-untyped-def]
    arrays = read_mnist(MNIST_DIR, verify=False)
    s = mnist_splits
    assert (s.x_train.shape, s.x_val.shape, s.x_test.shape) == ((50_000, 784),) + (
        (10_000, 784),
    ) * 2
    assert s.x_train.dtype == torch.float32 and s.y_train.dtype == torch.int64
    assert s.num_train == 50_000 and s.num_classes == 10
    # val keeps draw order (first index 15281), train is sorted, test keeps file order
    first_val = torch.from_numpy(arrays.train_images[15281].reshape(-1) / 255.0).float()
    torch.testing.assert_close(s.x_val[0], first_val)
    assert int(s.y_val[0]) == int(arrays.train_labels[15281])
    assert torch.equal(s.x_train[0], torch.from_numpy(arrays.train_images[0].reshape(-1)) / 255.0)
    assert torch.equal(s.y_test, torch.from_numpy(arrays.test_labels.astype(np.int64)))
    counts = torch.bincount(torch.cat([s.y_train, s.y_val]), minlength=10)
    assert counts.tolist() == MNIST_COUNTS
    assert float(s.x_train.min()) == 0.0 and float(s.x_train.max()) == 1.0


@needs_mnist
def test_real_mnist_truncated_copy_is_rejected(tmp_path: Path) -> None:
    for remote in MNIST_FILES.values():
        shutil.copy(MNIST_DIR / remote.filename, tmp_path)
    victim = tmp_path / "t10k-labels-idx1-ubyte.gz"
    victim.write_bytes(victim.read_bytes()[:2000])
    with pytest.raises(IdxFormatError) as info:
        read_mnist(tmp_path)
    assert "t10k-labels-idx1-ubyte.gz" in str(info.value)


def test_mnist_like_uncompressed_via_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_mnist_like(tmp_path / "mnist", num_train=30, num_test=7, compress=False)
    monkeypatch.setenv("SGRLD_DATA_DIR", str(tmp_path))
    with pytest.raises(ChecksumError):  # look-alikes fail the official digests
        load_dataset("mnist", num_val=10)
    s = load_dataset("mnist", num_val=10, verify=False)
    train_idx, val_idx = split_indices(30, 10)
    raw = read_mnist(tmp_path / "mnist", verify=False)
    expected = raw.train_images[val_idx].reshape(10, -1) / 255.0
    torch.testing.assert_close(s.x_val, torch.from_numpy(expected).float())
    assert s.y_train.tolist() == (train_idx % 10).tolist()
    assert len(s.x_test) == 7


def test_missing_data_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(FileNotFoundError, match=r"train-images-idx3-ubyte\.gz"):
        load_dataset("mnist", tmp_path)
    with pytest.raises(FileNotFoundError, match=r"cifar-10-python\.tar\.gz"):
        load_dataset("cifar10", tmp_path)
    with pytest.raises(ValueError, match="valid names"):
        load_dataset("svhn", tmp_path)
    monkeypatch.delenv("SGRLD_DATA_DIR", raising=False)
    with pytest.raises(ValueError, match="SGRLD_DATA_DIR"):
        load_dataset("mnist")


# --- CIFAR-10 ---------------------------------------------------------------------------------


def cifar_batch(count: int, offset: int, rng: np.random.Generator) -> dict[bytes, object]:
    """A batch dict with the official keys; label i is (offset + i) % 10."""
    return {
        b"batch_label": b"synthetic batch",
        b"labels": [(offset + i) % 10 for i in range(count)],
        b"data": rng.integers(0, 256, (count, 3072), dtype=np.uint8),
        b"filenames": [f"img_{offset + i}.png".encode() for i in range(count)],
    }


def write_cifar(root: Path, per_batch: int = 6, archive: bool = True) -> dict[str, dict]:
    """Write the official layout (protocol-2 pickles, optionally in a tar.gz) under ``root``."""
    rng = np.random.default_rng(1)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    batches = {n: cifar_batch(per_batch, k * per_batch, rng) for k, n in enumerate(names)}
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for name, batch in batches.items():
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))
    (folder / "batches.meta").write_bytes(pickle.dumps({b"num_cases_per_batch": per_batch}, 2))
    if archive:
        with tarfile.open(root / "cifar-10-python.tar.gz", "w:gz") as tar:
            tar.add(folder, arcname="cifar-10-batches-py")
        shutil.rmtree(folder)
    return batches


@pytest.mark.parametrize("archive", [True, False])
def test_cifar_reader_layout(tmp_path: Path, archive: bool) -> None:
    batches = write_cifar(tmp_path, archive=archive)
    arrays = read_cifar10(tmp_path, verify=False)
    assert arrays.train_images.shape == (30, 3, 32, 32)
    assert arrays.test_images.shape == (6, 3, 32, 32)
    raw = batches["data_batch_2"][b"data"]
    # image 7 = 2nd of batch 2; channel c, pixel (h, w) sits at c*1024 + h*32 + w
    assert arrays.train_images[7, 1, 4, 5] == raw[1, 1024 + 4 * 32 + 5]  # type: ignore[index]
    assert arrays.train_labels.tolist() == [i % 10 for i in range(30)]
    assert arrays.test_labels.dtype == np.int64


def test_cifar_official_digest_checked(tmp_path: Path) -> None:
    write_cifar(tmp_path)
    with pytest.raises(ChecksumError, match=r"cifar-10-python\.tar\.gz"):
        read_cifar10(tmp_path)


def test_cifar_load_dataset_split_and_standardisation(tmp_path: Path) -> None:
    write_cifar(tmp_path / "cifar10", per_batch=8)
    s = load_dataset("cifar10", tmp_path, num_val=10, verify=False)
    raw = read_cifar10(tmp_path / "cifar10", verify=False)
    train_idx, val_idx = split_indices(40, 10)
    x = raw.train_images.astype(np.float64)
    mean = x[train_idx].mean(axis=(0, 2, 3), keepdims=True)
    std = x[train_idx].std(axis=(0, 2, 3), ddof=1, keepdims=True)
    for got, images in ((s.x_train, x[train_idx]), (s.x_val, x[val_idx])):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, torch.from_numpy((images - mean) / std).float())
    assert s.y_val.tolist() == raw.train_labels[val_idx].tolist()
    assert s.x_test.shape == (8, 3, 32, 32) and s.num_train == 30


def test_standardise_unbiased_per_channel() -> None:
    g = torch.Generator().manual_seed(0)
    train = torch.rand(20, 3, 4, 4, generator=g) * torch.tensor([1.0, 5.0, 50.0]).view(1, 3, 1, 1)
    out, test = standardise(train, train[:2])
    torch.testing.assert_close(out.mean(dim=(0, 2, 3)), torch.zeros(3), atol=1e-5, rtol=0)
    torch.testing.assert_close(out.std(dim=(0, 2, 3)), torch.ones(3))
    torch.testing.assert_close(test, out[:2])


def test_cifar_corrupt_inputs_name_the_file(tmp_path: Path) -> None:
    write_cifar(tmp_path / "a")
    archive = tmp_path / "a" / "cifar-10-python.tar.gz"
    archive.write_bytes(archive.read_bytes()[:3000])
    with pytest.raises(Cifar10FormatError, match=r"cifar-10-python\.tar\.gz"):
        read_cifar10(archive, verify=False)

    batches = write_cifar(tmp_path / "b", archive=False)
    folder = tmp_path / "b" / "cifar-10-batches-py"
    bad = {**batches["test_batch"], b"labels": [10] * 6}
    (folder / "test_batch").write_bytes(pickle.dumps(bad, protocol=2))
    with pytest.raises(Cifar10FormatError, match="test_batch"):
        read_cifar10(folder)

    class Exploit:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.getcwd, ())  # any global outside the allow-list

    (folder / "test_batch").write_bytes(pickle.dumps({b"data": Exploit()}, protocol=2))
    with pytest.raises(Cifar10FormatError, match="not allowed"):
        read_cifar10(folder)


# --- downloads --------------------------------------------------------------------------------


def test_fetch_file_verifies_and_never_leaves_bad_files(tmp_path: Path) -> None:
    mirror, dest = tmp_path / "mirror", tmp_path / "dest"
    mirror.mkdir()
    payload = b"hello sgrld" * 100
    (mirror / "f.gz").write_bytes(gzip.compress(payload))
    good = RemoteFile(
        filename="f.gz",
        base_urls=(mirror.as_uri() + "/",),
        sha256=hashlib.sha256(payload).hexdigest(),
        digest_of="gunzipped",
    )
    bad = RemoteFile(filename="f.gz", base_urls=good.base_urls, sha256="0" * 64)
    with pytest.raises(DownloadError, match="sha256"):
        fetch_file(bad, dest)
    assert list(dest.iterdir()) == []
    missing = (tmp_path.as_uri() + "/nowhere/",)
    with pytest.raises(DownloadError, match=f"put f.gz into {dest}"):
        fetch_file(good, dest, base_urls=missing)
    path = fetch_file(good, dest, base_urls=(*missing, *good.base_urls))  # falls through
    assert gzip.decompress(path.read_bytes()) == payload
    assert fetch_file(good, dest, base_urls=missing) == path  # present and verified: no fetch


@needs_mnist
def test_fetch_real_mnist_from_file_mirror(tmp_path: Path) -> None:
    remote = MNIST_FILES["test_labels"]
    path = fetch_file(remote, tmp_path, base_urls=(MNIST_DIR.resolve().as_uri() + "/",))
    assert read_idx(path).shape == (10_000,)


def test_download_dataset_rejects_unknown_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="valid names"):
        download_dataset("imagenet", tmp_path)
