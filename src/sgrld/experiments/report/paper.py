"""The paper's selected hyper-parameters and reference numbers (Tables 1-5).

Keys are ``(dataset, prior, width)`` with ``width=None`` for CIFAR-10's ResNet-20; values map a
sampler name to its entry. Monge is absent where the paper found α² = 0 (Identity) optimal.
"""

from __future__ import annotations

from typing import NamedTuple

Setting = tuple[str, str, int | None]


class PaperEntry(NamedTuple):
    """One sampler's row of Tables 1-5: the selected ℓ (and α²), test LP / accuracy, s/epoch."""

    lr: float
    alpha2: float | None
    lp: float
    accuracy: float
    seconds_per_epoch: float


_ROWS: dict[Setting, dict[str, tuple[float, float | None, float, float, float]]] = {
    # MNIST: Table 1 (LP, acc), Table 4 (ℓ), Table 2 (s/epoch on one Xeon Gold 6230 core).
    ("mnist", "gaussian", 400): {
        "identity": (0.05, None, -0.1310, 0.9685, 8.1),
        "wenzel": (0.075, None, -0.1315, 0.9686, 7.7),
        "rmsprop": (0.00025, None, -0.1307, 0.9689, 8.8),
        "shampoo": (0.0025, None, -0.1286, 0.9689, 18.8),
    },
    ("mnist", "horseshoe", 400): {
        "identity": (0.25, None, -0.0750, 0.9823, 8.3),
        "wenzel": (0.75, None, -0.0768, 0.9807, 9.5),
        "rmsprop": (0.0005, None, -0.0678, 0.9798, 10.7),
        "monge": (0.25, 1.25, -0.0629, 0.9831, 12.9),
        "shampoo": (0.005, None, -0.0641, 0.9820, 20.1),
    },
    ("mnist", "gaussian", 800): {
        "identity": (0.05, None, -0.1667, 0.9587, 19.9),
        "wenzel": (0.05, None, -0.1667, 0.9583, 20.3),
        "rmsprop": (0.0005, None, -0.1643, 0.9614, 24.2),
        "shampoo": (0.0075, None, -0.1620, 0.9605, 46.5),
    },
    ("mnist", "horseshoe", 800): {
        "identity": (0.5, None, -0.0798, 0.9818, 24.8),
        "wenzel": (0.5, None, -0.0839, 0.9789, 26.2),
        "rmsprop": (0.0005, None, -0.0656, 0.9800, 29.3),
        "monge": (0.25, 0.5, -0.0612, 0.9834, 32.1),
        "shampoo": (0.005, None, -0.0603, 0.9824, 53.3),
    },
    ("mnist", "gaussian", 1200): {
        "identity": (0.025, None, -0.1932, 0.9514, 43.5),
        "wenzel": (0.05, None, -0.1933, 0.9519, 49.1),
        "rmsprop": (0.0005, None, -0.1886, 0.9568, 56.9),
        "monge": (0.025, 0.75, -0.1780, 0.9560, 59.2),
        "shampoo": (0.0075, None, -0.1854, 0.9559, 92.9),
    },
    ("mnist", "horseshoe", 1200): {
        "identity": (0.25, None, -0.0809, 0.9814, 56.3),
        "wenzel": (0.25, None, -0.1006, 0.9746, 58.2),
        "rmsprop": (0.0005, None, -0.0631, 0.9808, 58.3),
        "monge": (0.25, 0.075, -0.0694, 0.9833, 60.1),
        "shampoo": (0.005, None, -0.0564, 0.9834, 89.1),
    },
    # CIFAR-10 ResNet-20: Table 3 (LP, acc, s/epoch on one V100), Table 5 (ℓ).
    ("cifar10", "gaussian", None): {
        "identity": (0.1, None, -0.4627, 0.8591, 7.6),
        "wenzel": (0.5, None, -0.4869, 0.8533, 7.5),
        "rmsprop": (0.0005, None, -0.4751, 0.8566, 8.8),
        "shampoo": (0.01, None, -0.4606, 0.8596, 11.4),
    },
    ("cifar10", "correlated", None): {
        "identity": (0.1, None, -0.4437, 0.8641, 11.6),
        "wenzel": (0.75, None, -0.4615, 0.8614, 11.8),
        "rmsprop": (0.0005, None, -0.4500, 0.8642, 14.1),
        "shampoo": (0.01, None, -0.4365, 0.8668, 15.4),
    },
}

PAPER: dict[Setting, dict[str, PaperEntry]] = {
    setting: {sampler: PaperEntry(*row) for sampler, row in rows.items()}
    for setting, rows in _ROWS.items()
}


def paper_entry(dataset: str, prior: str, width: int | None, sampler: str) -> PaperEntry | None:
    """The paper's row for a setting (``width`` is ignored for CIFAR-10), or ``None``."""
    key = (dataset, prior, width if dataset == "mnist" else None)
    return PAPER.get(key, {}).get(sampler)
