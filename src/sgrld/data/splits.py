"""The paper's train/validation/test splits and the container that holds them."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np
import torch
from torch import Tensor


def validation_indices(num_total: int, num_val: int = 10_000, seed: int = 1) -> np.ndarray:
    """The reference ``index_val.pkl``: ``np.random.seed(seed); np.random.choice(N, num_val)``.

    numpy's legacy :class:`~numpy.random.RandomState`: the reference's draw (MNIST: 15281,
    21435, 44536, ...), in its order.

    Raises:
        ValueError: unless ``0 < num_val < num_total``.
    """
    if not 0 < num_val < num_total:
        raise ValueError(
            f"num_val={num_val} is not a validation size for {num_total} training points: "
            f"it must be between 1 and {num_total - 1}"
        )
    rng = np.random.RandomState(seed)
    return rng.choice(np.arange(num_total), size=num_val, replace=False).astype(np.int64)


def split_indices(
    num_total: int, num_val: int = 10_000, seed: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """``(train, val)`` index arrays: val in draw order, train = the rest in sorted order."""
    val = validation_indices(num_total, num_val, seed)
    train = np.setdiff1d(np.arange(num_total, dtype=np.int64), val, assume_unique=True)
    return train, val


@dataclass(frozen=True)
class Splits:
    """Inputs and targets of the three splits, all on one device.

    ``num_train`` is the ``n`` of the per-datum potential and of the step size h = ℓ/n.

    Attributes:
        likelihood: the registry name of the data's likelihood (:mod:`sgrld.likelihoods`):
            ``"categorical"`` (int64 labels) or ``"gaussian"`` (float targets).
        target_mean, target_scale: the targets are (y − ``target_mean``)/``target_scale`` of
            the original ones (0 and 1: not scaled).
    """

    x_train: Tensor
    y_train: Tensor
    x_val: Tensor
    y_val: Tensor
    x_test: Tensor
    y_test: Tensor
    likelihood: str = "categorical"
    target_mean: float = 0.0
    target_scale: float = 1.0

    def __post_init__(self) -> None:
        for split in ("train", "val", "test"):
            x, y = getattr(self, f"x_{split}"), getattr(self, f"y_{split}")
            if len(x) != len(y):
                raise ValueError(f"{split}: {len(x)} inputs but {len(y)} labels")

    @property
    def num_train(self) -> int:
        """Number of training points n."""
        return len(self.y_train)

    @property
    def num_classes(self) -> int:
        """Number of classes, from the largest label of any split (classification only)."""
        if self.likelihood != "categorical":
            raise ValueError(f"a {self.likelihood!r} data set has targets, not classes")
        return 1 + max(int(getattr(self, f"y_{s}").max()) for s in ("train", "val", "test"))

    def to(self, device: torch.device | str) -> Splits:
        """A copy with every tensor on ``device``."""
        return replace(
            self,
            **{
                f.name: getattr(self, f.name).to(device)
                for f in fields(self)
                if isinstance(getattr(self, f.name), Tensor)
            },
        )
