"""The categorical likelihood of classification: p(y = c | x, θ) = softmax(f(x; θ))_c."""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from sgrld.likelihoods.base import Likelihood, register
from sgrld.likelihoods.calibration import expected_calibration_error


@register
class Categorical(Likelihood):
    """Softmax cross-entropy over ``num_classes`` logits (temperature 1); η are the logits.

    The ensemble is the mean of the samples' softmax as a float64 running log-sum-exp (memory
    ``N·C``); scores ``lp``, ``accuracy``, ``ece`` and ``confidence`` (``docs/likelihoods.md``).

    Args:
        num_classes: C ≥ 1; ``None`` (a model's default) takes as many as the net has outputs,
            and then :attr:`num_outputs` cannot size a net.
    """

    name = "categorical"
    score_names = ("lp", "accuracy", "ece", "confidence")
    headline: ClassVar[dict[str, str]] = {"acc": "accuracy", "ECE": "ece"}
    table_scores: ClassVar[dict[str, tuple[str, ...]]] = {
        "test": ("accuracy", "ece", "confidence"),
        "val": ("accuracy", "ece"),
    }
    fractions = ("accuracy", "ece", "confidence")
    discrete = True
    paper = True

    def __init__(self, num_classes: int | None = None) -> None:
        super().__init__()
        if num_classes is not None and (isinstance(num_classes, bool) or num_classes < 1):
            raise ValueError(f"num_classes must be an integer >= 1, got {num_classes!r}")
        self.num_classes = num_classes

    @property
    def num_outputs(self) -> int:
        if self.num_classes is None:
            raise ValueError("this Categorical was built without num_classes")
        return self.num_classes

    @property
    def width(self) -> int:
        return self.num_outputs

    def nll(self, eta: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(eta, targets)

    def log_prob(self, eta: Tensor, targets: Tensor) -> Tensor:
        return torch.log_softmax(eta, dim=-1).gather(-1, targets[..., None]).squeeze(-1)

    def ensemble_init(self, lead: tuple[int, ...], num_points: int, device: torch.device) -> Tensor:
        shape = self.total_shape(lead, num_points, 0)
        return torch.full(shape, -math.inf, dtype=torch.float64, device=device)

    def ensemble_terms(self, eta: Tensor) -> Tensor:
        return torch.log_softmax(eta.detach().to(torch.float64), dim=-1)

    def ensemble_fold(self, total: Tensor, terms: Tensor) -> Tensor:
        return torch.logaddexp(total, terms)

    def scores(
        self, total: Tensor, num_samples: int, targets: Tensor, *, num_bins: int = 30
    ) -> dict[str, Tensor]:
        log_mean = total - math.log(num_samples)
        labels = targets.to(device=total.device, dtype=torch.long)
        lead, (n, c) = log_mean.shape[:-2], log_mean.shape[-2:]
        true_class = log_mean.gather(-1, labels.expand(*lead, n)[..., None]).squeeze(-1)
        probs = log_mean.exp()
        ece = [expected_calibration_error(p, labels, num_bins) for p in probs.reshape(-1, n, c)]
        return {
            "lp": true_class.mean(dim=-1),
            "accuracy": (log_mean.argmax(dim=-1) == labels).double().mean(dim=-1),
            "ece": torch.tensor(ece, dtype=torch.float64).reshape(lead),
            "confidence": probs.max(dim=-1).values.mean(dim=-1),
        }
