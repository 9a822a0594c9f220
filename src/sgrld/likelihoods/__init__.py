"""Likelihood plug-ins p(y | x, θ) and their registry (see :mod:`sgrld.likelihoods.base`)."""

from sgrld.likelihoods.base import (
    Likelihood,
    get_likelihood,
    likelihood_names,
    register,
    scored_by,
)
from sgrld.likelihoods.categorical import Categorical
from sgrld.likelihoods.gaussian import COVERAGE_LEVELS, Gaussian
from sgrld.likelihoods.mixture import mixture_cdf, mixture_quantile

__all__ = [
    "COVERAGE_LEVELS",
    "Categorical",
    "Gaussian",
    "Likelihood",
    "get_likelihood",
    "likelihood_names",
    "mixture_cdf",
    "mixture_quantile",
    "register",
    "scored_by",
]
