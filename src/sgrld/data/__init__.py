"""Datasets of the paper: MNIST (IDX files), CIFAR-10 (python batches), splits and downloads.

Entry point: :func:`load_dataset`.
"""

from sgrld.data.cifar10 import Cifar10FormatError, read_cifar10, standardise
from sgrld.data.datasets import DATA_DIR_ENV, DATASET_NAMES, load_dataset
from sgrld.data.download import ChecksumError, DownloadError, download_dataset
from sgrld.data.idx import IdxFormatError, read_idx, read_mnist
from sgrld.data.splits import Splits, split_indices, validation_indices

__all__ = [
    "DATASET_NAMES",
    "DATA_DIR_ENV",
    "ChecksumError",
    "Cifar10FormatError",
    "DownloadError",
    "IdxFormatError",
    "Splits",
    "download_dataset",
    "load_dataset",
    "read_cifar10",
    "read_idx",
    "read_mnist",
    "split_indices",
    "standardise",
    "validation_indices",
]
