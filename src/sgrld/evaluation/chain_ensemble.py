"""The streaming ensemble predictive of K chains at once.

:class:`~sgrld.evaluation.ensemble.EnsemblePredictive` with a leading chain dim, fed the
``(K, B, C)`` logits of :class:`sgrld.Chains`: every chain's metrics are exactly those of a
single run's ``EnsemblePredictive``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from sgrld.evaluation.ensemble import ensemble_likelihood
from sgrld.likelihoods.base import Likelihood

__all__ = ["ChainEnsemble", "evaluate_chains"]


class ChainEnsemble:
    """Running ensemble predictive of each of K chains over one fixed evaluation set.

    Feed each posterior sample (one state of every chain) in consecutive batches with
    :meth:`add_batch`, then :meth:`commit`. Memory: ``K·N·C`` float64 (categorical).

    Args:
        num_chains: K.
        num_points: N, size of the (unshuffled) evaluation set.
        num_classes: C of the default categorical likelihood.
        likelihood: the likelihood whose predictive is averaged (default
            ``Categorical(num_classes)``).
        device: where the accumulator lives (default CPU); logits are moved there.

    References:
        The single-chain version :class:`~sgrld.evaluation.ensemble.EnsemblePredictive`.
    """

    def __init__(
        self,
        num_chains: int,
        num_points: int,
        num_classes: int | None = None,
        *,
        likelihood: Likelihood | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        if num_chains < 1 or num_points < 1 or (num_classes is not None and num_classes < 2):
            raise ValueError(
                "need num_chains >= 1, num_points >= 1 and num_classes >= 2, got "
                f"{num_chains}, {num_points}, {num_classes}"
            )
        self.likelihood = ensemble_likelihood(num_classes, likelihood)
        #: (K, N, width of η): the shape of one sample's outputs over the whole set
        self.shape = (num_chains, num_points, self.likelihood.width)
        self.device = torch.device("cpu" if device is None else device)
        self._log_sum = self.likelihood.ensemble_init((num_chains,), num_points, self.device)
        self._num_samples = 0
        self._pending: Tensor | None = None
        self._covered: Tensor | None = None

    @property
    def num_samples(self) -> int:
        """Committed samples S (the same for every chain)."""
        return self._num_samples

    def add_batch(self, start: int, logits: Tensor) -> None:
        """Logits ``(K, B, C)`` of points ``start : start + B`` for the sample being assembled."""
        k, n, c = self.shape
        if logits.ndim != 3 or logits.shape[0] != k or logits.shape[2] != c:
            raise ValueError(f"expected logits ({k}, B, {c}), got {tuple(logits.shape)}")
        stop = start + logits.shape[1]
        if start < 0 or stop > n:
            raise ValueError(f"batch [{start}, {stop}) is outside [0, {n})")
        terms = self.likelihood.ensemble_terms(logits.detach().to(device=self.device))
        if self._pending is None or self._covered is None:
            self._pending = terms.new_empty((k, n, *terms.shape[2:]))
            self._covered = torch.zeros(n, dtype=torch.bool, device=self.device)
        if bool(self._covered[start:stop].any()):
            raise ValueError(f"points in [{start}, {stop}) were already given for this sample")
        self._pending[:, start:stop] = terms
        self._covered[start:stop] = True

    def commit(self) -> None:
        """Fold the assembled sample of every chain into its ensemble."""
        if self._pending is None or self._covered is None:
            raise RuntimeError("commit() without add_batch()")
        missing = int((~self._covered).sum())
        if missing:
            raise RuntimeError(f"{missing} of {self.shape[1]} points were not given")
        self._log_sum = self.likelihood.ensemble_fold(self._log_sum, self._pending)
        self._num_samples += 1
        self._pending = self._covered = None

    def log_predictive(self) -> Tensor:
        """``L − log S``, shape ``(K, N, C)`` (NaN while empty); the categorical likelihood's."""
        if self._num_samples == 0:
            return torch.full_like(self._log_sum, math.nan)
        return self._log_sum - math.log(self._num_samples)

    def metrics(self, labels: Tensor, *, num_bins: int = 30) -> list[dict[str, float]]:
        """Per chain, the dict of :meth:`EnsemblePredictive.metrics
        <sgrld.evaluation.ensemble.EnsemblePredictive.metrics>` (categorical: lp, accuracy,
        ece, confidence, num_samples); the scores batched over chains."""
        k, n, _ = self.shape
        if labels.shape != (n,):
            raise ValueError(f"expected labels ({n},), got {tuple(labels.shape)}")
        if self._num_samples == 0:
            empty = {**dict.fromkeys(self.likelihood.score_names, math.nan), "num_samples": 0}
            return [dict(empty) for _ in range(k)]
        scores = self.likelihood.scores(self._log_sum, self._num_samples, labels, num_bins=num_bins)
        columns = {name: value.tolist() for name, value in scores.items()}
        return [
            {
                **{name: column[i] for name, column in columns.items()},
                "num_samples": self._num_samples,
            }
            for i in range(k)
        ]

    def state_dict(self) -> dict[str, Any]:
        """The float64 accumulator and the sample count (commit a pending sample first)."""
        if self._pending is not None:
            raise RuntimeError("cannot checkpoint while a sample is being assembled; commit first")
        return {"num_samples": self._num_samples, "log_sum_exp": self._log_sum.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (onto this accumulator's device)."""
        log_sum = state["log_sum_exp"]
        k, n, _ = self.shape
        expected = self.likelihood.total_shape((k,), n, int(state["num_samples"]))
        if tuple(log_sum.shape) != expected:
            raise ValueError(f"log_sum_exp has shape {tuple(log_sum.shape)}, expected {expected}")
        self._log_sum = log_sum.detach().to(device=self.device, dtype=torch.float64).clone()
        self._num_samples = int(state["num_samples"])
        self._pending = self._covered = None


def evaluate_chains(
    forward: Callable[[Tensor], Tensor],
    ensemble: ChainEnsemble,
    inputs: Tensor,
    *,
    batch_size: int = 1000,
) -> None:
    """Add one sample of every chain: ``forward`` (e.g. ``lambda x: chains(x, shared=True)``)
    over ``inputs`` (``(N, ...)``, shared by all chains) in batches, then commit."""
    with torch.no_grad():
        for start in range(0, inputs.shape[0], batch_size):
            ensemble.add_batch(start, forward(inputs[start : start + batch_size]))
    ensemble.commit()
