"""Streaming cumulative-ensemble predictive (classification by default, any likelihood).

The reference stores float64 log-probabilities of every posterior sample (about 1.6 GB per split
on MNIST) and reduces them after the run. The ensemble metrics only need, per point and class,

    L[i, c] = logsumexp_s log p(c | x_i, θ_s)        and the sample count S,

because the averaged predictive is ``p̄(c | x_i) = exp(L[i, c] − log S)``. This module keeps
exactly that running log-sum-exp in float64, so memory is ``O(N·C)`` whatever the number of samples
and the per-epoch curves of the cumulative ensemble come for free (call :meth:`metrics` at the end
of every epoch). Another likelihood (:mod:`sgrld.likelihoods`) brings its own running total
and scores: a Gaussian keeps the mixture's components and scores LP, RMSE and coverage.

Examples:
    >>> import torch
    >>> ensemble = EnsemblePredictive(num_points=3, num_classes=2)
    >>> ensemble.add(torch.tensor([[2.0, 0.0], [0.0, 1.0], [0.5, 0.5]]))
    >>> ensemble.add_batch(0, torch.tensor([[1.0, 0.0], [0.0, 3.0]]))  # a sample in two batches
    >>> ensemble.add_batch(2, torch.tensor([[0.0, 2.0]]))
    >>> ensemble.commit()
    >>> ensemble.num_samples
    2
    >>> sorted(ensemble.metrics(torch.tensor([0, 1, 1])))
    ['accuracy', 'confidence', 'ece', 'lp', 'num_samples']
"""

from __future__ import annotations

import math
from typing import Any

import torch

from sgrld.likelihoods.base import Likelihood, get_likelihood

__all__ = ["EnsemblePredictive", "ensemble_likelihood"]


def ensemble_likelihood(num_classes: int | None, likelihood: Likelihood | None) -> Likelihood:
    """The likelihood an ensemble averages: ``likelihood``, else ``Categorical(num_classes)``.

    Raises:
        ValueError: neither is given, or both and they disagree on the number of classes.
    """
    if likelihood is None:
        if num_classes is None:
            raise ValueError("give num_classes (classification) or a likelihood")
        return get_likelihood("categorical")(num_classes)
    if num_classes is not None and likelihood.width != num_classes:
        raise ValueError(f"num_classes={num_classes} but the likelihood has {likelihood.width}")
    return likelihood


class EnsemblePredictive:
    """Running ensemble predictive ``p̄(y | x_i) = (1/S) Σ_s p(y | x_i, θ_s)`` over a fixed set.

    Feed each posterior sample either whole with :meth:`add`, or in consecutive minibatches with
    :meth:`add_batch` followed by :meth:`commit`. A sample only enters the ensemble at commit, and
    every point of the evaluation set must have been given exactly once.

    Args:
        num_points: Size ``N`` of the (fixed, unshuffled) evaluation set.
        num_classes: Number of classes ``C`` of the default categorical likelihood.
        likelihood: The likelihood whose predictive is averaged (default:
            ``Categorical(num_classes)``); its :meth:`~sgrld.likelihoods.Likelihood.scores` are
            the :meth:`metrics`.
        device: Where the float64 accumulator lives (default CPU). Incoming outputs (logits, or
            the likelihood's η) are moved there.

    References:
        The paper's Tables 1-3 (LP, accuracy), 8-9 (ECE) and 10 (confidence); the ensemble is
        streamed instead of storing samples (``docs/experiments.md``, the protocol).
    """

    def __init__(
        self,
        num_points: int,
        num_classes: int | None = None,
        *,
        likelihood: Likelihood | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        if num_points < 1 or (num_classes is not None and num_classes < 2):
            raise ValueError(
                f"need num_points >= 1 and num_classes >= 2, got {num_points}, {num_classes}"
            )
        self.likelihood = ensemble_likelihood(num_classes, likelihood)
        self.num_points = num_points
        self.num_classes = num_classes
        self.device = torch.device("cpu" if device is None else device)
        self._log_sum = self.likelihood.ensemble_init((), num_points, self.device)
        self._num_samples = 0
        self._pending: torch.Tensor | None = None
        self._covered: torch.Tensor | None = None

    @property
    def num_samples(self) -> int:
        """Number of committed posterior samples ``S``."""
        return self._num_samples

    def add(self, logits: torch.Tensor) -> None:
        """Add one posterior sample given its logits for the whole set.

        Args:
            logits: Shape ``(N, C)``: logits or (unnormalised) log-probabilities; they are
                normalised with a float64 ``log_softmax``, so a per-row shift does not matter.
                For another likelihood: its η, ``(N, width)``.
        """
        self.add_batch(0, logits)
        self.commit()

    def add_batch(self, start: int, logits: torch.Tensor) -> None:
        """Give the logits of points ``start : start + B`` for the sample being assembled.

        Args:
            start: Index of the first point of the batch in the evaluation set.
            logits: Shape ``(B, C)``, as in :meth:`add`.

        Raises:
            ValueError: If the batch is out of range or overlaps points already given.
        """
        width = self.likelihood.width
        if logits.ndim != 2 or logits.shape[1] != width:
            raise ValueError(f"expected logits (B, {width}), got {tuple(logits.shape)}")
        stop = start + logits.shape[0]
        if start < 0 or stop > self.num_points:
            raise ValueError(f"batch [{start}, {stop}) is outside [0, {self.num_points})")
        terms = self.likelihood.ensemble_terms(logits.detach().to(device=self.device))
        if self._pending is None or self._covered is None:
            self._pending = terms.new_empty((self.num_points, *terms.shape[1:]))
            self._covered = torch.zeros(self.num_points, dtype=torch.bool, device=self.device)
        if bool(self._covered[start:stop].any()):
            raise ValueError(f"points in [{start}, {stop}) were already given for this sample")
        self._pending[start:stop] = terms
        self._covered[start:stop] = True

    def commit(self) -> None:
        """Fold the sample assembled by :meth:`add_batch` into the ensemble.

        Raises:
            RuntimeError: If no batch was given or some points are missing.
        """
        if self._pending is None or self._covered is None:
            raise RuntimeError("commit() without add_batch()")
        missing = int((~self._covered).sum())
        if missing:
            raise RuntimeError(f"{missing} of {self.num_points} points were not given")
        self._log_sum = self.likelihood.ensemble_fold(self._log_sum, self._pending)
        self._num_samples += 1
        self._pending = None
        self._covered = None

    def log_predictive(self) -> torch.Tensor:
        """Log of the ensemble-averaged class probabilities, ``L − log S``, shape ``(N, C)``.

        Returns NaN everywhere while the ensemble is empty (epochs with ``S ≤ 0``). The
        categorical likelihood's; for the others the predictive is the running total itself (a
        Gaussian's mixture components, :attr:`total`).
        """
        if self._num_samples == 0:
            return torch.full_like(self._log_sum, math.nan)
        return self._log_sum - math.log(self._num_samples)

    def metrics(self, labels: torch.Tensor, *, num_bins: int = 30) -> dict[str, float]:
        """Ensemble metrics of the committed samples: the likelihood's scores and ``num_samples``.

        Args:
            labels: Targets of the evaluation set, shape ``(N,)``: integer labels, or floats
                for a Gaussian likelihood.
            num_bins: ECE bins (30 in the paper).

        Returns:
            For the categorical likelihood a dict with

            - ``lp``: ``(1/N) Σ_i [logsumexp_s log p(y_i | x_i, θ_s) − log S]``;
            - ``accuracy``: accuracy of the argmax of the averaged probabilities;
            - ``ece``: top-label 30-bin L1 ECE of the averaged probabilities
              (:func:`~sgrld.likelihoods.calibration.expected_calibration_error`);
            - ``confidence``: mean over points of the max averaged probability (Table 10);
            - ``num_samples``: ``S``.

            For a Gaussian: ``lp``, ``rmse``, ``coverage_50``, ``coverage_90``
            (:class:`~sgrld.likelihoods.Gaussian`) and ``num_samples``.
            All but ``num_samples`` are NaN while the ensemble is empty.
        """
        if labels.shape != (self.num_points,):
            raise ValueError(f"expected labels ({self.num_points},), got {tuple(labels.shape)}")
        if self._num_samples == 0:
            return {**dict.fromkeys(self.likelihood.score_names, math.nan), "num_samples": 0}
        scores = self.likelihood.scores(self._log_sum, self._num_samples, labels, num_bins=num_bins)
        return {**{k: float(v) for k, v in scores.items()}, "num_samples": self._num_samples}

    @property
    def total(self) -> torch.Tensor:
        """The likelihood's running total (categorical: ``L``, ``(N, C)``; Gaussian: the
        mixture's components, ``(N, S, 2)`` of mean and log σ)."""
        return self._log_sum

    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state: the float64 accumulator and the sample count.

        Raises:
            RuntimeError: If a sample is half-assembled (call :meth:`commit` first).
        """
        if self._pending is not None:
            raise RuntimeError("cannot checkpoint while a sample is being assembled; commit first")
        return {
            "num_points": self.num_points,
            "num_classes": self.likelihood.width,
            "num_samples": self._num_samples,
            "log_sum_exp": self._log_sum.clone(),  # the name of the categorical total
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state from :meth:`state_dict` (onto this accumulator's device)."""
        shape = (int(state["num_points"]), int(state["num_classes"]))
        if shape != (self.num_points, self.likelihood.width):
            raise ValueError(f"state is for {shape}, this accumulator is for {self._log_sum.shape}")
        log_sum = state["log_sum_exp"]
        expected = self.likelihood.total_shape((), self.num_points, int(state["num_samples"]))
        if tuple(log_sum.shape) != expected:
            raise ValueError(f"log_sum_exp has shape {tuple(log_sum.shape)}, expected {expected}")
        self._log_sum = log_sum.detach().to(device=self.device, dtype=torch.float64).clone()
        self._num_samples = int(state["num_samples"])
        self._pending = None
        self._covered = None
