"""Streaming cumulative-ensemble predictive (classification by default, any likelihood).

Instead of every sample's log-probabilities, keep per point and class the float64 running
``L[i, c] = logsumexp_s log p(c | x_i, θ_s)`` and S: ``p̄(c | x_i) = exp(L[i, c] − log S)``, so
memory is ``O(N·C)`` whatever S. Another likelihood brings its own running total and scores.
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

    Feed each sample whole with :meth:`add`, or in minibatches with :meth:`add_batch` then
    :meth:`commit`, giving every point exactly once.

    Args:
        num_points: Size ``N`` of the (fixed, unshuffled) evaluation set.
        num_classes: Number of classes ``C`` of the default categorical likelihood.
        likelihood: The likelihood whose predictive is averaged (default:
            ``Categorical(num_classes)``); its ``scores`` are the :meth:`metrics`.
        device: Where the float64 accumulator lives (default CPU).

    References:
        The paper's Tables 1-3 (LP, accuracy), 8-9 (ECE) and 10 (confidence).
    """

    _lead: tuple[int, ...] = ()  # leading dims of the outputs before the points' (chains)

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
        self._log_sum = self.likelihood.ensemble_init(self._lead, num_points, self.device)
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
            logits: Shape ``(N, C)``: logits (normalised with a float64 ``log_softmax``), or
                another likelihood's η, ``(N, width)``.
        """
        self.add_batch(0, logits)
        self.commit()

    def add_batch(self, start: int, logits: torch.Tensor) -> None:
        """Give the logits of points ``start : start + B`` for the sample being assembled.

        Args:
            start: Index of the first point of the batch in the evaluation set.
            logits: Shape ``(B, C)``, as in :meth:`add` (chains: ``(K, B, C)``).

        Raises:
            ValueError: If the batch is out of range or overlaps points already given.
        """
        lead, n = self._lead, self.num_points
        dims = (*lead, "B", self.likelihood.width)
        if logits.ndim != len(dims) or (*logits.shape[: len(lead)], "B", logits.shape[-1]) != dims:
            expected = ", ".join(map(str, dims))
            raise ValueError(f"expected logits ({expected}), got {tuple(logits.shape)}")
        stop = start + logits.shape[len(lead)]
        if start < 0 or stop > n:
            raise ValueError(f"batch [{start}, {stop}) is outside [0, {n})")
        terms = self.likelihood.ensemble_terms(logits.detach().to(device=self.device))
        if self._pending is None or self._covered is None:
            self._pending = terms.new_empty((*lead, n, *terms.shape[len(lead) + 1 :]))
            self._covered = torch.zeros(n, dtype=torch.bool, device=self.device)
        if bool(self._covered[start:stop].any()):
            raise ValueError(f"points in [{start}, {stop}) were already given for this sample")
        self._pending[(*[slice(None)] * len(lead), slice(start, stop))] = terms
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
        """Log of the ensemble-averaged class probabilities, ``L − log S``, ``(N, C)`` (chains:
        ``(K, N, C)``).

        NaN while the ensemble is empty; categorical only (others: :attr:`total`).
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
            Categorical: ``lp`` (mean log of the averaged probability of the label),
            ``accuracy``, ``ece`` (top-label L1) and ``confidence`` (mean max probability) of
            the averaged probabilities; Gaussian: ``lp``, ``rmse``, ``coverage_50``,
            ``coverage_90``; and ``num_samples``. NaN while the ensemble is empty.
        """
        return self._per_chain(labels, num_bins)[0]

    def _per_chain(self, labels: torch.Tensor, num_bins: int) -> list[dict[str, float]]:
        """:meth:`metrics` of each ensemble of the leading dims (one without them)."""
        if labels.shape != (self.num_points,):
            raise ValueError(f"expected labels ({self.num_points},), got {tuple(labels.shape)}")
        count = math.prod(self._lead)
        if self._num_samples == 0:
            empty = {**dict.fromkeys(self.likelihood.score_names, math.nan), "num_samples": 0}
            return [dict(empty) for _ in range(count)]
        scores = self.likelihood.scores(self._log_sum, self._num_samples, labels, num_bins=num_bins)
        columns = {name: value.reshape(-1).tolist() for name, value in scores.items()}
        return [
            {
                **{name: column[i] for name, column in columns.items()},
                "num_samples": self._num_samples,
            }
            for i in range(count)
        ]

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
        shape: dict[str, int] = {}
        if not self._lead:  # a single chain's state records its set's shape
            shape = {"num_points": self.num_points, "num_classes": self.likelihood.width}
        # "log_sum_exp": the name of the categorical total
        return {**shape, "num_samples": self._num_samples, "log_sum_exp": self._log_sum.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state from :meth:`state_dict` (onto this accumulator's device)."""
        if not self._lead:
            shape = (int(state["num_points"]), int(state["num_classes"]))
            if shape != (self.num_points, self.likelihood.width):
                raise ValueError(
                    f"state is for {shape}, this accumulator is for {self._log_sum.shape}"
                )
        log_sum = state["log_sum_exp"]
        samples = int(state["num_samples"])
        expected = self.likelihood.total_shape(self._lead, self.num_points, samples)
        if tuple(log_sum.shape) != expected:
            raise ValueError(f"log_sum_exp has shape {tuple(log_sum.shape)}, expected {expected}")
        self._log_sum = log_sum.detach().to(device=self.device, dtype=torch.float64).clone()
        self._num_samples = samples
        self._pending = self._covered = None
