"""``build_model``: the paper's architectures with their priors and likelihood, by name."""

from __future__ import annotations

import torch

from sgrld.likelihoods import Categorical, Likelihood
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
    in_features: int = 784,
    likelihood: Likelihood | None = None,
) -> BayesianModel:
    """A He-initialised :class:`BayesianModel` for one of the paper's settings, or a regression;
    the net has as many outputs as the likelihood reads.

    Args:
        arch: ``"fc"`` (MNIST 784-N-N-10; diabetes 10-N-N-1) or ``"resnet20"`` (CIFAR-10).
        prior: ``gaussian``, ``horseshoe`` or ``convcorrnormal`` (the paper: G/HS for ``fc``,
            G/``convcorrnormal`` for ``resnet20``).
        width: hidden width N of ``fc`` (400, 800 or 1200 in the paper).
        num_classes: number of logits of the default likelihood, ``Categorical(num_classes)``.
        config: prior scales and variants (reference defaults).
        generator: random generator of the initialisation.
        in_features: inputs of ``fc`` (784 for MNIST, 10 for diabetes).
        likelihood: p(y | x, θ), e.g. :class:`~sgrld.likelihoods.Gaussian`; overrides
            ``num_classes``.

    Raises:
        ValueError: unknown ``arch`` or ``prior`` (listing the valid names) or bad sizes.

    Examples:
        >>> from sgrld.likelihoods import Gaussian
        >>> model = build_model("fc", width=50, in_features=10, likelihood=Gaussian(scale=None))
        >>> model(torch.zeros(3, 10)).shape  # per point: mean and log σ
        torch.Size([3, 2])
    """
    get_prior(prior)  # validate before building the net
    if likelihood is None:
        likelihood = Categorical(num_classes)
    outputs = likelihood.num_outputs
    if arch == "fc":
        net: torch.nn.Module = FullyConnected(width, in_features, num_classes=outputs)
    elif arch == "resnet20":
        net = ResNet20(outputs)
    else:
        raise ValueError(f"unknown arch {arch!r}; valid names: {list(MODEL_NAMES)}")
    return BayesianModel(net, prior, config, generator=generator, likelihood=likelihood)
