"""The likelihood plug-in contract and the registry.

A :class:`Likelihood` is the observation model p(y | x, θ) of a
:class:`~sgrld.models.BayesianModel`, an ``nn.Module`` attached as ``model.likelihood`` so that
a sampled likelihood parameter is stepped by the same chain as the weights. It maps the net's
outputs to η, gives the potential's data term (:meth:`~Likelihood.nll`), builds the
posterior-predictive ensemble and scores it (``docs/likelihoods.md``).
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import Tensor, nn


class Likelihood(nn.Module, abc.ABC):
    """Base class of the observation models p(y | x, θ)."""

    #: registry name, e.g. ``"gaussian"``
    name: ClassVar[str]
    #: the keys of :meth:`scores`, in order (also those reported NaN while an ensemble is empty)
    score_names: ClassVar[tuple[str, ...]]
    #: what the experiments read (``docs/likelihoods.md``): the headline scores shown beside LP,
    #: short label → score (the first in one-line summaries and plots, the first and last in a
    #: run's summary, all in the tables' Markdown layouts)
    headline: ClassVar[dict[str, str]]
    #: the scores the CSV tables aggregate besides LP, per split
    table_scores: ClassVar[dict[str, tuple[str, ...]]]
    #: scores that are fractions in [0, 1], and other scores that are never negative
    fractions: ClassVar[tuple[str, ...]] = ()
    nonnegative: ClassVar[tuple[str, ...]] = ()
    #: whether the log-probability is at most 0 (a discrete observation's)
    discrete: ClassVar[bool] = False
    #: the paper's likelihood: its runs fill the paper's tables (1-10), its table scores stand
    #: beside LP in the CSV tables; another's runs get a table of their headline scores
    paper: ClassVar[bool] = False

    @classmethod
    def second(cls) -> str:
        """The score shown beside LP where there is room for one."""
        return next(iter(cls.headline.values()))

    @property
    @abc.abstractmethod
    def num_outputs(self) -> int:
        """How many outputs the network must have (the classes; 1 for a scalar regression)."""

    @property
    @abc.abstractmethod
    def width(self) -> int:
        """Size of the last dimension of η (the classes' logits; mean and log σ)."""

    def forward(self, outputs: Tensor) -> Tensor:
        """η, the per-point parameters of p(y | η), from the network's outputs (default: as is)."""
        return outputs

    @abc.abstractmethod
    def nll(self, eta: Tensor, targets: Tensor) -> Tensor:
        """Minibatch mean of −log p(y_i | η_i): η ``(B, width)``, targets ``(B,)``; a 0-d tensor."""

    @abc.abstractmethod
    def log_prob(self, eta: Tensor, targets: Tensor) -> Tensor:
        """log p(y_i | η_i) of every point, ``(…, B)`` for η ``(…, B, width)``."""

    def log_prior_terms(self) -> list[Tensor]:
        """log p of the likelihood's own sampled parameters (none by default)."""
        return []

    def reset_parameters(self) -> None:
        """Put the likelihood's sampled parameters back at their initial values."""

    def total_shape(
        self, lead: tuple[int, ...], num_points: int, num_samples: int
    ) -> tuple[int, ...]:
        """Shape of the running total after ``num_samples`` samples."""
        return (*lead, num_points, self.width)

    @abc.abstractmethod
    def ensemble_init(self, lead: tuple[int, ...], num_points: int, device: torch.device) -> Tensor:
        """The empty float64 running total of ``lead`` ensembles (e.g. ``(K,)`` chains)."""

    @abc.abstractmethod
    def ensemble_terms(self, eta: Tensor) -> Tensor:
        """One sample's float64 contribution for a batch of points: η ``(…, B, width)``."""

    @abc.abstractmethod
    def ensemble_fold(self, total: Tensor, terms: Tensor) -> Tensor:
        """The total with one more sample whose terms cover all points."""

    @abc.abstractmethod
    def scores(
        self, total: Tensor, num_samples: int, targets: Tensor, *, num_bins: int = 30
    ) -> dict[str, Tensor]:
        """The ensemble's scores (keys :attr:`score_names`), each of shape ``lead``; ``num_bins``
        calibration bins where a score uses them (ECE).
        """


_REGISTRY: dict[str, type[Likelihood]] = {}


def register(cls: type[Likelihood]) -> type[Likelihood]:
    """Class decorator adding a likelihood to the registry under ``cls.name``."""
    _REGISTRY[cls.name] = cls
    return cls


def likelihood_names() -> list[str]:
    """Registered likelihood names."""
    return sorted(_REGISTRY)


def scored_by(keys: Iterable[str]) -> type[Likelihood]:
    """The likelihood whose scores ``keys`` are (a results file's ``final`` scores, or its
    curves' ``<split>_<score>`` names): the one with the most of its score names among them,
    the first registered on a tie."""
    names = {k.split("_", 1)[1] if k.startswith(("test_", "val_")) else k for k in keys}
    ranked = [_REGISTRY[n] for n in likelihood_names()]
    return max(ranked, key=lambda cls: len(names & set(cls.score_names)))


def get_likelihood(name: str) -> type[Likelihood]:
    """Look a likelihood class up by name (``categorical``, ``gaussian``).

    Raises:
        ValueError: unknown name; the message lists the valid ones.
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown likelihood {name!r}; valid names: {likelihood_names()}"
        ) from None
