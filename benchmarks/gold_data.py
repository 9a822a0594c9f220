"""The gold-standard problem of ``benchmarks/gold.py``: Bayesian logistic regression on the
breast-cancer data shipped with scikit-learn (``docs/posterior.md``).

569 tumours × 30 features; a fixed 80 % split (``train_test_split(..., test_size=0.2,
random_state=0)``) leaves 455 training points; each feature is standardised on them. The model is
``nn.Linear(30, 1)`` (a (1, 30) weight and a bias), prior N(0, 1) on all 31 parameters, Bernoulli
likelihood. Its NUTS reference (``benchmarks/gold_reference.py``) is stored in
``benchmarks/gold_nuts.json``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

REFERENCE = Path(__file__).with_name("gold_nuts.json")
#: The ill-conditioned variant: raw features (posterior condition number ~1e7).
REFERENCE_RAW = Path(__file__).with_name("gold_nuts_raw.json")
NAMES = [f"w{i}" for i in range(30)] + ["b"]


def load(raw: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(X, y): the standardised (``raw``: unscaled) training features (455, 30) and labels in
    {0, 1} (float64)."""
    from sklearn.datasets import load_breast_cancer
    from sklearn.model_selection import train_test_split

    x, y = load_breast_cancer(return_X_y=True)
    x_train, _, y_train, _ = train_test_split(x, y, test_size=0.2, random_state=0)
    if not raw:
        x_train = (x_train - x_train.mean(0)) / x_train.std(0)
    return x_train.astype(np.float64), y_train.astype(np.float64)
