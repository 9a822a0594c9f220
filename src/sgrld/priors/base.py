"""The prior contract, its configuration and the registry: a :class:`Prior` is an ``nn.Module``
attached to one parameter tensor, owning its hyper-parameters; log p(θ) sums over them.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import Tensor, nn


@dataclass(frozen=True, kw_only=True)
class PriorConfig:
    """How priors are scaled and which variants are used (defaults reproduce the reference).

    Attributes:
        weight_scale: σ_w = ``weight_scale`` / sqrt(dim) (1.41 in every experiment).
        bias_scale: σ of every bias prior, not width-scaled.
        conv_scale: ``"c_in"`` scales conv priors by the input channels only (the reference);
            ``"fan_in"`` uses C_in·k².
        horseshoe_jacobian: ``False`` = reference horseshoe (no Jacobian); ``True`` = textbook
            λ = softplus(p) ~ HC(0, 1) with its Jacobian.
        lengthscale: ℓ of the correlated conv prior's exponential kernel.
    """

    weight_scale: float = 1.41
    bias_scale: float = 1.0
    conv_scale: Literal["c_in", "fan_in"] = "c_in"
    horseshoe_jacobian: bool = False
    lengthscale: float = 1.0

    def __post_init__(self) -> None:
        for field in ("weight_scale", "bias_scale", "lengthscale"):
            if not getattr(self, field) > 0:
                raise ValueError(f"{field} must be > 0, got {getattr(self, field)}")
        if self.conv_scale not in ("c_in", "fan_in"):
            raise ValueError(f"conv_scale must be 'c_in' or 'fan_in', got {self.conv_scale!r}")


class Prior(nn.Module, abc.ABC):
    """Base class of priors over one parameter tensor."""

    #: registry name, e.g. ``"horseshoe"``
    name: ClassVar[str]

    @abc.abstractmethod
    def log_prob(self, value: Tensor) -> Tensor:
        """log p(value) summed over all elements, plus the log hyper-prior (a 0-d tensor)."""

    @abc.abstractmethod
    def sample(self, shape: torch.Size, generator: torch.Generator | None = None) -> Tensor:
        """A draw of the given shape, conditional on the current hyper-parameters."""

    @classmethod
    @abc.abstractmethod
    def for_parameter(cls, shape: torch.Size, scale: float, config: PriorConfig) -> Prior:
        """The prior of this family for a parameter of ``shape`` with base scale ``scale`` (or
        another family's where this one does not apply)."""

    def reset_parameters(self) -> None:
        """Put sampled hyper-parameters back at their initial values."""


def standard_normal(
    shape: torch.Size, generator: torch.Generator | None, device: torch.device
) -> Tensor:
    """N(0, 1) draws made on ``generator``'s device (if given) and returned on ``device``."""
    where = generator.device if generator is not None else device
    return torch.randn(shape, generator=generator, device=where).to(device)


_REGISTRY: dict[str, type[Prior]] = {}


def register(cls: type[Prior]) -> type[Prior]:
    """Class decorator adding a prior family to the registry under ``cls.name``."""
    _REGISTRY[cls.name] = cls
    return cls


def prior_names() -> list[str]:
    """Registered prior family names."""
    return sorted(_REGISTRY)


def get_prior(name: str) -> type[Prior]:
    """Look a prior family up by name (``gaussian``, ``horseshoe``, ``convcorrnormal``).

    Raises:
        ValueError: unknown name; the message lists the valid ones.
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown prior {name!r}; valid names: {prior_names()}") from None
