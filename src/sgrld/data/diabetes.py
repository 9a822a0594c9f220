"""scikit-learn's diabetes regression data (bundled in its wheel: no download).

442 patients, 10 features, a disease-progression target. Test (88) then validation (``num_val``,
44) points are drawn with :func:`~sgrld.data.splits.split_indices`, the other 310 train in file
order; features and targets are standardised with the train split's mean and unbiased std
(:attr:`Splits.target_scale` keeps the targets' std for scores in the original units).
"""

from __future__ import annotations

import torch

from sgrld.data.splits import Splits, split_indices

NUM_TEST = 88
NUM_VAL = 44


def load_diabetes_splits(num_val: int = NUM_VAL, seed: int = 1) -> Splits:
    """The standardised diabetes splits, float32 features ``(N, 10)`` and targets ``(N,)``.

    Raises:
        ModuleNotFoundError: scikit-learn is not installed (``pip install 'sgrld[regression]'``).
        ValueError: ``num_val`` leaves no training point.
    """
    try:
        from sklearn.datasets import load_diabetes  # optional: the ``regression`` extra
    except ImportError as error:
        raise ModuleNotFoundError(
            "the diabetes data set ships with scikit-learn: pip install 'sgrld[regression]'"
        ) from error
    x, y = load_diabetes(return_X_y=True)
    rest, test = split_indices(len(y), NUM_TEST, seed)
    train_of_rest, val_of_rest = split_indices(len(rest), num_val, seed)
    train, val = rest[train_of_rest], rest[val_of_rest]
    y_mean, y_std = y[train].mean(), y[train].std(ddof=1)
    inputs = torch.from_numpy((x - x[train].mean(0)) / x[train].std(0, ddof=1)).to(torch.float32)
    targets = torch.from_numpy((y - y_mean) / y_std).to(torch.float32)
    return Splits(
        x_train=inputs[train],
        y_train=targets[train],
        x_val=inputs[val],
        y_val=targets[val],
        x_test=inputs[test],
        y_test=targets[test],
        likelihood="gaussian",
        target_mean=float(y_mean),
        target_scale=float(y_std),
    )
