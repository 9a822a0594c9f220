"""Datasets: the paper's MNIST (IDX files) and CIFAR-10 (python batches), scikit-learn's
diabetes regression data, splits and downloads.

Entry point: :func:`load_dataset`.
"""

from sgrld.data.cifar10 import Cifar10FormatError, read_cifar10, standardise
from sgrld.data.datasets import (
    DATA_DIR_ENV,
    DATASET_NAMES,
    DATASETS,
    DatasetInfo,
    dataset_info,
    load_dataset,
)
from sgrld.data.diabetes import load_diabetes_splits
from sgrld.data.download import ChecksumError, DownloadError, download_dataset
from sgrld.data.idx import IdxFormatError, read_idx, read_mnist
from sgrld.data.splits import Splits, split_indices, validation_indices

__all__ = [
    "DATASETS",
    "DATASET_NAMES",
    "DATA_DIR_ENV",
    "ChecksumError",
    "Cifar10FormatError",
    "DatasetInfo",
    "DownloadError",
    "IdxFormatError",
    "Splits",
    "dataset_info",
    "download_dataset",
    "load_dataset",
    "load_diabetes_splits",
    "read_cifar10",
    "read_idx",
    "read_mnist",
    "split_indices",
    "standardise",
    "validation_indices",
]
