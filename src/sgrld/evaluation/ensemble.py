"""Streaming cumulative-ensemble predictive for classification.

The reference stores float64 log-probabilities of every posterior sample (about 1.6 GB per split
on MNIST) and reduces them after the run. The ensemble metrics only need, per point and class,

    L[i, c] = logsumexp_s log p(c | x_i, θ_s)        and the sample count S,

because the averaged predictive is ``p̄(c | x_i) = exp(L[i, c] − log S)``. This module keeps
exactly that running log-sum-exp in float64, so memory is ``O(N·C)`` whatever the number of samples
and the per-epoch curves of the cumulative ensemble come for free (call :meth:`metrics` at the end
of every epoch).

Example:
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

from sgrld.evaluation.calibration import expected_calibration_error

__all__ = ["EnsemblePredictive"]


class EnsemblePredictive:
    """Running ensemble predictive ``p̄(y | x_i) = (1/S) Σ_s p(y | x_i, θ_s)`` over a fixed set.

    Feed each posterior sample either whole with :meth:`add`, or in consecutive minibatches with
    :meth:`add_batch` followed by :meth:`commit`. A sample only enters the ensemble at commit, and
    every point of the evaluation set must have been given exactly once.

    Args:
        num_points: Size ``N`` of the (fixed, unshuffled) evaluation set.
        num_classes: Number of classes ``C``.
        device: Where the float64 ``(N, C)`` accumulator lives (default CPU). Incoming logits are
            moved there.

    References:
        The paper's Tables 1-3 (LP, accuracy), 8-9 (ECE) and 10 (confidence); the ensemble is
        streamed instead of storing samples (``docs/experiments.md``, the protocol).
    """

    def __init__(
        self, num_points: int, num_classes: int, *, device: torch.device | str | None = None
    ) -> None:
        if num_points < 1 or num_classes < 2:
            raise ValueError(
                f"need num_points >= 1 and num_classes >= 2, got {num_points}, {num_classes}"
            )
        self.num_points = num_points
        self.num_classes = num_classes
        self.device = torch.device("cpu" if device is None else device)
        self._log_sum = torch.full(
            (num_points, num_classes), -math.inf, dtype=torch.float64, device=self.device
        )
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
        if logits.ndim != 2 or logits.shape[1] != self.num_classes:
            raise ValueError(f"expected logits (B, {self.num_classes}), got {tuple(logits.shape)}")
        stop = start + logits.shape[0]
        if start < 0 or stop > self.num_points:
            raise ValueError(f"batch [{start}, {stop}) is outside [0, {self.num_points})")
        if self._pending is None or self._covered is None:
            self._pending = torch.empty_like(self._log_sum)
            self._covered = torch.zeros(self.num_points, dtype=torch.bool, device=self.device)
        if bool(self._covered[start:stop].any()):
            raise ValueError(f"points in [{start}, {stop}) were already given for this sample")
        batch = logits.detach().to(device=self.device, dtype=torch.float64)
        self._pending[start:stop] = torch.log_softmax(batch, dim=1)
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
        self._log_sum = torch.logaddexp(self._log_sum, self._pending)
        self._num_samples += 1
        self._pending = None
        self._covered = None

    def log_predictive(self) -> torch.Tensor:
        """Log of the ensemble-averaged class probabilities, ``L − log S``, shape ``(N, C)``.

        Returns NaN everywhere while the ensemble is empty (epochs with ``S ≤ 0``).
        """
        if self._num_samples == 0:
            return torch.full_like(self._log_sum, math.nan)
        return self._log_sum - math.log(self._num_samples)

    def metrics(self, labels: torch.Tensor, *, num_bins: int = 30) -> dict[str, float]:
        """Ensemble metrics of the committed samples.

        Args:
            labels: Integer labels of the evaluation set, shape ``(N,)``.
            num_bins: ECE bins (30 in the paper).

        Returns:
            A dict with

            - ``lp``: ``(1/N) Σ_i [logsumexp_s log p(y_i | x_i, θ_s) − log S]``;
            - ``accuracy``: accuracy of the argmax of the averaged probabilities;
            - ``ece``: top-label 30-bin L1 ECE of the averaged probabilities
              (:func:`~sgrld.evaluation.calibration.expected_calibration_error`);
            - ``confidence``: mean over points of the max averaged probability (Table 10);
            - ``num_samples``: ``S``.

            All but ``num_samples`` are NaN while the ensemble is empty.
        """
        if labels.shape != (self.num_points,):
            raise ValueError(f"expected labels ({self.num_points},), got {tuple(labels.shape)}")
        if self._num_samples == 0:
            nan = math.nan
            return {"lp": nan, "accuracy": nan, "ece": nan, "confidence": nan, "num_samples": 0}
        log_mean = self.log_predictive()
        labels = labels.to(device=self.device, dtype=torch.long)
        true_class = log_mean.gather(1, labels[:, None]).squeeze(1)
        probs = log_mean.exp()
        return {
            "lp": float(true_class.mean()),
            "accuracy": float((log_mean.argmax(dim=1) == labels).double().mean()),
            "ece": expected_calibration_error(probs, labels, num_bins),
            "confidence": float(probs.max(dim=1).values.mean()),
            "num_samples": self._num_samples,
        }

    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state: the float64 accumulator and the sample count.

        Raises:
            RuntimeError: If a sample is half-assembled (call :meth:`commit` first).
        """
        if self._pending is not None:
            raise RuntimeError("cannot checkpoint while a sample is being assembled; commit first")
        return {
            "num_points": self.num_points,
            "num_classes": self.num_classes,
            "num_samples": self._num_samples,
            "log_sum_exp": self._log_sum.clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state from :meth:`state_dict` (onto this accumulator's device)."""
        shape = (int(state["num_points"]), int(state["num_classes"]))
        if shape != (self.num_points, self.num_classes):
            raise ValueError(f"state is for {shape}, this accumulator is for {self._log_sum.shape}")
        log_sum = state["log_sum_exp"]
        if tuple(log_sum.shape) != shape:
            raise ValueError(f"log_sum_exp has shape {tuple(log_sum.shape)}, expected {shape}")
        self._log_sum = log_sum.detach().to(device=self.device, dtype=torch.float64).clone()
        self._num_samples = int(state["num_samples"])
        self._pending = None
        self._covered = None
