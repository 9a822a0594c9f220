"""The MNIST fully connected net 784-N-N-10 with ReLU (`classificationdensenet`), any sizes."""

from __future__ import annotations

from collections import OrderedDict

from torch import nn


def check_positive(name: str, value: int) -> None:
    """Raise ``ValueError`` naming the argument unless ``value`` is an int ≥ 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


class FullyConnected(nn.Sequential):
    """Flatten → fc1 → ReLU → fc2 → ReLU → fc3: Linear (in, N), (N, N), (N, classes), with biases.

    No BatchNorm (the reference's dense net ignores ``batchnorm=True``); 478,410 / 1,276,810 /
    2,395,210 parameters for N = 400 / 800 / 1200.

    Args:
        width: hidden width N ≥ 1.
        in_features: input size (784 for flattened MNIST, 10 for diabetes; inputs are flattened).
        num_classes: number of outputs (the logits; 1 for a Gaussian regression).
    """

    def __init__(self, width: int = 400, in_features: int = 784, num_classes: int = 10) -> None:
        check_positive("width", width)
        check_positive("in_features", in_features)
        check_positive("num_classes", num_classes)
        super().__init__(
            OrderedDict(
                flatten=nn.Flatten(),
                fc1=nn.Linear(in_features, width),
                relu1=nn.ReLU(),
                fc2=nn.Linear(width, width),
                relu2=nn.ReLU(),
                fc3=nn.Linear(width, num_classes),
            )
        )
