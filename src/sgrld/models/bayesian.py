"""A network whose parameters carry priors, its likelihood, He initialisation and the potential.

Every ``nn.Linear`` and ``nn.Conv*`` parameter gets a prior as ``<param>_prior`` (a horseshoe's
scale is ``....weight_prior.raw_scale``); σ = ``weight_scale``/sqrt(fan) (C_in for convs, or
C_in·k² with ``conv_scale="fan_in"``), ``bias_scale`` for biases. Other parameters (BatchNorm)
have an improper flat prior but are sampled too. ``named_parameters()`` order: each layer's
weight and bias, its priors' hyper-parameters, then the likelihood's (``docs/likelihoods.md``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.conv import _ConvNd

from sgrld.likelihoods import Categorical, Likelihood
from sgrld.priors import Prior, PriorConfig, get_prior

PRIOR_SUFFIX = "_prior"


def parameter_scales(module: nn.Module, config: PriorConfig) -> dict[str, float]:
    """Base prior scale σ of each prior-carrying parameter of a Linear or conv layer."""
    scales: dict[str, float] = {}
    if isinstance(module, nn.Linear):
        scales["weight"] = config.weight_scale / math.sqrt(module.in_features)
    elif isinstance(module, _ConvNd):
        fan = module.weight.shape[1]  # C_in per group
        if config.conv_scale == "fan_in":
            fan *= math.prod(module.weight.shape[2:])
        scales["weight"] = config.weight_scale / math.sqrt(fan)
    else:
        return scales
    if getattr(module, "bias", None) is not None:
        scales["bias"] = config.bias_scale
    return scales


class BayesianModel(nn.Module):
    """``net`` with a prior on every Linear/conv parameter, a likelihood and ``log_prior()``.

    The forward pass returns η, the likelihood's per-point parameters (logits by default). Sample in
    ``train()`` mode and evaluate in ``eval()`` mode (BatchNorm).

    Args:
        net: the network; its layers get ``<param>_prior`` submodules attached.
        prior: prior family name (``gaussian``, ``horseshoe``, ``convcorrnormal``).
        config: scales and variants; the default reproduces the reference.
        init: apply He initialisation now; otherwise keep the net's own values.
        generator: random generator for the initialisation.
        likelihood: p(y | x, θ) (default: :class:`~sgrld.likelihoods.Categorical`).

    Raises:
        ValueError: unknown ``prior``; the message lists the valid names.

    Examples:
        >>> from sgrld.models.fc import FullyConnected
        >>> model = BayesianModel(FullyConnected(400), "horseshoe")
        >>> sum(p.numel() for p in model.parameters())
        478416
    """

    def __init__(
        self,
        net: nn.Module,
        prior: str = "gaussian",
        config: PriorConfig | None = None,
        *,
        init: bool = True,
        generator: torch.Generator | None = None,
        likelihood: Likelihood | None = None,
    ) -> None:
        super().__init__()
        family = get_prior(prior)
        self.prior_name = prior
        self.config = config if config is not None else PriorConfig()
        self.net = net
        self.likelihood = likelihood if likelihood is not None else Categorical()
        # (owning layer, parameter name, prior); parameters are looked up at call time so that
        # torch.func.functional_call substitutes them.
        self._sites: list[tuple[str, nn.Module, str, Prior]] = []
        for layer_name, layer in net.named_modules():
            for param_name, scale in parameter_scales(layer, self.config).items():
                shape = getattr(layer, param_name).shape
                site_prior = family.for_parameter(shape, scale, self.config)
                layer.add_module(param_name + PRIOR_SUFFIX, site_prior)
                full = ".".join(filter(None, ("net", layer_name, param_name)))
                self._sites.append((full, layer, param_name, site_prior))
        if init:
            self.reset_parameters(generator)

    def forward(self, x: Tensor) -> Tensor:
        """η(x): the likelihood's parameters from the net's outputs (categorical: the logits)."""
        return self.likelihood(self.net(x))

    def named_priors(self) -> Iterator[tuple[str, Prior]]:
        """``(parameter name, prior)`` for every parameter that has a prior."""
        for full, _, _, site_prior in self._sites:
            yield full, site_prior

    def log_prior(self) -> Tensor:
        """log p(θ): the sum of every prior's ``log_prob``, hyper-priors and the likelihood's
        sampled parameters included."""
        terms = [p.log_prob(getattr(layer, name)) for _, layer, name, p in self._sites]
        terms += self.likelihood.log_prior_terms()
        if not terms:
            return torch.zeros(())
        return torch.stack(terms).sum()

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """He initialisation: prior-carrying weights Kaiming normal (fan_in, ReLU gain), their
        biases U(±1/sqrt(out_features)); BatchNorm, prior and likelihood parameters at their initial
        values."""
        for _, layer, name, site_prior in self._sites:
            param = getattr(layer, name)
            if name == "weight":
                nn.init.kaiming_normal_(
                    param, mode="fan_in", nonlinearity="relu", generator=generator
                )
            else:
                bound = 1.0 / math.sqrt(param.numel())
                nn.init.uniform_(param, -bound, bound, generator=generator)
            site_prior.reset_parameters()
        for module in self.net.modules():
            if isinstance(module, _BatchNorm):
                module.reset_parameters()
        self.likelihood.reset_parameters()

    def extra_repr(self) -> str:
        return f"prior={self.prior_name!r}"


def potential(model: BayesianModel, x: Tensor, y: Tensor, num_data: int) -> Tensor:
    """Per-datum potential u_B(θ) = −mean_B log p(y|x, θ) − log p(θ)/n, whose gradient is the
    paper's ĝ (``docs/conventions.md``); for the categorical likelihood the data term is exactly
    ``F.cross_entropy(model(x), y)``.

    Args:
        model: the Bayesian model (its mode decides how BatchNorm behaves).
        x: a minibatch of inputs.
        y: the minibatch's targets: int64 class labels (categorical), floats (Gaussian).
        num_data: n, the number of training points.

    Returns:
        A 0-d tensor.
    """
    if num_data < 1:
        raise ValueError(f"num_data must be >= 1, got {num_data}")
    return model.likelihood.nll(model(x), y) - model.log_prior() / num_data


def log_likelihood(model: BayesianModel, batch: Any) -> Tensor:
    """Each datum's log-likelihood log p(yᵢ|xᵢ, θ), ``(B,)``, on an ``(x, y)`` batch: what
    :func:`sgrld.tune` scores a :class:`BayesianModel`'s chains by when it is given no
    log-likelihood (the model declares its likelihood)."""
    x, y = batch
    return model.likelihood.log_prob(model(x), y)
