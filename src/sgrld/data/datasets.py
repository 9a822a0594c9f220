"""``load_dataset``: the paper's MNIST and CIFAR-10 splits as tensors on a device."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from sgrld.data.cifar10 import locate_cifar10, read_cifar10, standardise
from sgrld.data.download import MNIST_FILES, download_dataset, missing_files_message
from sgrld.data.idx import find_mnist_file, read_mnist
from sgrld.data.splits import Splits, split_indices

DATA_DIR_ENV = "SGRLD_DATA_DIR"
DATASET_NAMES = ("mnist", "cifar10")


def resolve_data_dir(data_dir: str | os.PathLike[str] | None) -> Path:
    """``data_dir``, else the directory in the ``SGRLD_DATA_DIR`` environment variable.

    Raises:
        ValueError: neither is set.
    """
    if data_dir is None:
        data_dir = os.environ.get(DATA_DIR_ENV)
        if not data_dir:
            raise ValueError(
                f"no data_dir given and the {DATA_DIR_ENV} environment variable is unset"
            )
    return Path(data_dir)


def _dataset_dir(name: str, root: Path) -> Path | None:
    """``root/name`` or ``root`` itself, whichever holds (any of) the dataset's files."""
    for candidate in (root / name, root):
        if name == "mnist" and any(
            find_mnist_file(candidate, f.filename) for f in MNIST_FILES.values()
        ):
            return candidate  # read_mnist names any file still missing
        if name == "cifar10":
            try:
                locate_cifar10(candidate)
            except FileNotFoundError:
                continue
            return candidate
    return None


def _mnist(directory: Path, num_val: int, seed: int, verify: bool) -> Splits:
    arrays = read_mnist(directory, verify=verify)
    train_idx, val_idx = split_indices(len(arrays.train_labels), num_val, seed)

    def inputs(images: np.ndarray) -> torch.Tensor:  # pixels / 255, flattened to 784
        return torch.from_numpy(images.reshape(len(images), -1)).to(torch.float32) / 255.0

    def labels(values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(values.astype(np.int64))

    return Splits(
        x_train=inputs(arrays.train_images[train_idx]),
        y_train=labels(arrays.train_labels[train_idx]),
        x_val=inputs(arrays.train_images[val_idx]),
        y_val=labels(arrays.train_labels[val_idx]),
        x_test=inputs(arrays.test_images),
        y_test=labels(arrays.test_labels),
    )


def _cifar10(directory: Path, num_val: int, seed: int, verify: bool) -> Splits:
    arrays = read_cifar10(directory, verify=verify)
    train_idx, val_idx = split_indices(len(arrays.train_labels), num_val, seed)
    x_train, x_val, x_test = standardise(
        *(
            torch.from_numpy(a)
            for a in (
                arrays.train_images[train_idx],
                arrays.train_images[val_idx],
                arrays.test_images,
            )
        )
    )
    return Splits(
        x_train=x_train,
        y_train=torch.from_numpy(arrays.train_labels[train_idx]),
        x_val=x_val,
        y_val=torch.from_numpy(arrays.train_labels[val_idx]),
        x_test=x_test,
        y_test=torch.from_numpy(arrays.test_labels),
    )


def load_dataset(
    name: str,
    data_dir: str | os.PathLike[str] | None = None,
    *,
    device: torch.device | str = "cpu",
    num_val: int = 10_000,
    seed: int = 1,
    verify: bool = True,
    download: bool = False,
) -> Splits:
    """Load ``"mnist"`` or ``"cifar10"`` with the paper's splits and preprocessing.

    * MNIST: 50,000 / 10,000 / 10,000; pixels/255 flattened to 784, float32.
    * CIFAR-10: 40,000 / 10,000 / 10,000; NCHW float32 standardised per channel with the train
      split's mean and unbiased std.

    Validation indices come from ``np.random.RandomState(seed).choice`` (draw order kept); the
    remaining training indices are sorted; the official test set keeps its file order.

    Args:
        name: ``"mnist"`` or ``"cifar10"``.
        data_dir: directory holding the files, directly or in a ``name/`` subdirectory;
            defaults to ``$SGRLD_DATA_DIR``.
        device: where the tensors go.
        num_val: validation size (10,000 in the paper).
        seed: seed of the validation draw (1 in the paper).
        verify: check published SHA-256 digests.
        download: complete a partial copy (or fetch the whole dataset into ``data_dir/name``)
            from the official locations, verifying every file, present or fetched.

    Returns:
        The :class:`Splits`, labels as int64.

    Raises:
        ValueError: unknown ``name`` or no directory given.
        NotADirectoryError: ``data_dir`` is a regular file.
        FileNotFoundError: files missing; the message names each missing file and where it goes.
    """
    if name not in DATASET_NAMES:
        raise ValueError(f"unknown dataset {name!r}; valid names: {list(DATASET_NAMES)}")
    root = resolve_data_dir(data_dir)
    if root.exists() and not root.is_dir():
        raise NotADirectoryError(f"data_dir {root} is a file, not a directory")
    directory = _dataset_dir(name, root)
    if download:  # fetch what is missing, verify what is there
        directory = download_dataset(name, directory or root / name)
    if directory is None:
        raise FileNotFoundError(
            f"{name} not found under {root}; " + missing_files_message(name, root / name)
        )
    loader = _mnist if name == "mnist" else _cifar10
    return loader(directory, num_val, seed, verify).to(device)
