"""``load_dataset``: the data registry (MNIST, CIFAR-10, diabetes) as splits on a device."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from sgrld.data import diabetes
from sgrld.data.cifar10 import locate_cifar10, read_cifar10, standardise
from sgrld.data.download import MNIST_FILES, download_dataset, find_copy, missing_files_message
from sgrld.data.idx import ImageArrays, read_mnist
from sgrld.data.splits import Splits, split_indices

DATA_DIR_ENV = "SGRLD_DATA_DIR"


@dataclass(frozen=True, kw_only=True)
class DatasetInfo:
    """What a data set declares: its likelihood, one input's shape, the net's outputs.

    Attributes:
        likelihood: registry name in :mod:`sgrld.likelihoods`.
        input_shape: the shape of one input.
        num_outputs: how many outputs the network needs (the classes; 1 for a scalar target).
        num_val: the default validation size.
        train_pool: the points the training and validation splits are drawn from.
        bundled: shipped with an installed package (no data directory, no download).
    """

    likelihood: str
    input_shape: tuple[int, ...]
    num_outputs: int
    num_val: int
    train_pool: int
    bundled: bool = False


DATASETS: dict[str, DatasetInfo] = {
    "mnist": DatasetInfo(
        likelihood="categorical",
        input_shape=(784,),
        num_outputs=10,
        num_val=10_000,
        train_pool=60_000,
    ),
    "cifar10": DatasetInfo(
        likelihood="categorical",
        input_shape=(3, 32, 32),
        num_outputs=10,
        num_val=10_000,
        train_pool=50_000,
    ),
    "diabetes": DatasetInfo(
        likelihood="gaussian",
        input_shape=(10,),
        num_outputs=1,
        num_val=diabetes.NUM_VAL,
        train_pool=442 - diabetes.NUM_TEST,  # the patients less the test split
        bundled=True,
    ),
}
DATASET_NAMES = tuple(DATASETS)


def dataset_info(name: str) -> DatasetInfo:
    """The declaration of data set ``name``.

    Raises:
        ValueError: unknown ``name``; the message lists the valid ones.
    """
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; valid names: {list(DATASET_NAMES)}")
    return DATASETS[name]


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
        if name == "mnist" and any(find_copy(candidate, f.filename) for f in MNIST_FILES.values()):
            return candidate  # read_mnist names any file still missing
        if name == "cifar10":
            try:
                locate_cifar10(candidate)
            except FileNotFoundError:
                continue
            return candidate
    return None


def _mnist_inputs(*images: np.ndarray) -> tuple[torch.Tensor, ...]:
    """Pixels / 255, flattened to 784, float32."""
    return tuple(torch.from_numpy(a.reshape(len(a), -1)).to(torch.float32) / 255.0 for a in images)


def _cifar10_inputs(*images: np.ndarray) -> tuple[torch.Tensor, ...]:
    """NCHW float32, standardised per channel with the train split's statistics."""
    return standardise(*(torch.from_numpy(a) for a in images))


def _splits(
    arrays: ImageArrays, num_val: int, seed: int, inputs: Callable[..., tuple[torch.Tensor, ...]]
) -> Splits:
    train, val = split_indices(len(arrays.train_labels), num_val, seed)
    x_train, x_val, x_test = inputs(
        arrays.train_images[train], arrays.train_images[val], arrays.test_images
    )
    y_train, y_val, y_test = (
        torch.from_numpy(y.astype(np.int64))
        for y in (arrays.train_labels[train], arrays.train_labels[val], arrays.test_labels)
    )
    return Splits(
        x_train=x_train, y_train=y_train, x_val=x_val, y_val=y_val, x_test=x_test, y_test=y_test
    )


def load_dataset(
    name: str,
    data_dir: str | os.PathLike[str] | None = None,
    *,
    device: torch.device | str = "cpu",
    num_val: int | None = None,
    seed: int = 1,
    verify: bool = True,
    download: bool = False,
) -> Splits:
    """Load ``"mnist"`` or ``"cifar10"`` with the paper's splits and preprocessing, or the
    ``"diabetes"`` regression data.

    * MNIST: 50,000 / 10,000 / 10,000; pixels/255 flattened to 784, float32.
    * CIFAR-10: 40,000 / 10,000 / 10,000; NCHW float32 standardised per channel with the train
      split's mean and unbiased std.
    * diabetes: 310 / 44 / 88, from scikit-learn (no ``data_dir``), standardised likewise.

    Validation indices: :func:`~sgrld.data.splits.validation_indices`; the rest sorted.

    Args:
        name: ``"mnist"``, ``"cifar10"`` or ``"diabetes"`` (:data:`DATASET_NAMES`).
        data_dir: directory holding the files, directly or in a ``name/`` subdirectory;
            defaults to ``$SGRLD_DATA_DIR`` (not used by diabetes).
        device: where the tensors go.
        num_val: validation size (default: the data set's, 10,000 in the paper; 44).
        seed: seed of the validation draw (1 in the paper).
        verify: check published SHA-256 digests.
        download: fetch what is missing (into ``data_dir/name``), verifying every file.

    Returns:
        The :class:`Splits`, labels as int64 (classification) or float32 targets (regression).

    Raises:
        ValueError: unknown ``name`` or no directory given.
        ModuleNotFoundError: diabetes without scikit-learn (``pip install 'sgrld[regression]'``).
        NotADirectoryError: ``data_dir`` is a regular file.
        FileNotFoundError: files missing; the message names each missing file and where it goes.
    """
    num_val = dataset_info(name).num_val if num_val is None else num_val
    if name == "diabetes":  # bundled with scikit-learn: no directory to look in
        return diabetes.load_diabetes_splits(num_val, seed).to(device)
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
    read, inputs = (
        (read_mnist, _mnist_inputs) if name == "mnist" else (read_cifar10, _cifar10_inputs)
    )
    return _splits(read(directory, verify=verify), num_val, seed, inputs).to(device)
