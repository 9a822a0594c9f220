"""Priors over network parameters: Gaussian, horseshoe, correlated conv normal.

Look a family up with :func:`get_prior`; each family builds the prior for one parameter tensor
with :meth:`Prior.for_parameter`.
"""

from sgrld.priors.base import Prior, PriorConfig, get_prior, prior_names, register
from sgrld.priors.correlated import ConvCorrelatedNormal, exponential_correlation
from sgrld.priors.gaussian import GaussianPrior
from sgrld.priors.horseshoe import HorseshoePrior, half_cauchy_log_prob

__all__ = [
    "ConvCorrelatedNormal",
    "GaussianPrior",
    "HorseshoePrior",
    "Prior",
    "PriorConfig",
    "exponential_correlation",
    "get_prior",
    "half_cauchy_log_prob",
    "prior_names",
    "register",
]
