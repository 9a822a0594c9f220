"""The paper's networks and the Bayesian wrapper with priors and potential."""

from sgrld.models.bayesian import BayesianModel, log_likelihood, parameter_scales, potential
from sgrld.models.build import MODEL_NAMES, build_model
from sgrld.models.fc import FullyConnected
from sgrld.models.resnet20 import BasicBlock, ResNet20

__all__ = [
    "MODEL_NAMES",
    "BasicBlock",
    "BayesianModel",
    "FullyConnected",
    "ResNet20",
    "build_model",
    "log_likelihood",
    "parameter_scales",
    "potential",
]
