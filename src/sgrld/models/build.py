"""``build_model``: the paper's architectures with their priors, by name."""

from __future__ import annotations

import torch

from sgrld.models.bayesian import BayesianModel
from sgrld.models.fc import FullyConnected
from sgrld.models.resnet20 import ResNet20
from sgrld.priors import PriorConfig, get_prior

MODEL_NAMES = ("fc", "resnet20")


def build_model(
    arch: str,
    *,
    prior: str = "gaussian",
    width: int = 400,
    num_classes: int = 10,
    config: PriorConfig | None = None,
    generator: torch.Generator | None = None,
) -> BayesianModel:
    """A He-initialised :class:`BayesianModel` for one of the paper's settings.

    Args:
        arch: ``"fc"`` (MNIST 784-N-N-10) or ``"resnet20"`` (CIFAR-10).
        prior: ``gaussian``, ``horseshoe`` or ``convcorrnormal``; the paper uses G/HS for
            ``fc`` and G/``convcorrnormal`` for ``resnet20``.
        width: hidden width N of ``fc`` (400, 800 or 1200 in the paper); ignored for resnet20.
        num_classes: number of logits.
        config: prior scales and variants (reference defaults).
        generator: random generator of the initialisation.

    Raises:
        ValueError: unknown ``arch`` or ``prior`` (listing the valid names) or bad sizes.
    """
    get_prior(prior)  # validate before building the net
    if arch == "fc":
        net: torch.nn.Module = FullyConnected(width, num_classes=num_classes)
    elif arch == "resnet20":
        net = ResNet20(num_classes)
    else:
        raise ValueError(f"unknown arch {arch!r}; valid names: {list(MODEL_NAMES)}")
    return BayesianModel(net, prior, config, generator=generator)
