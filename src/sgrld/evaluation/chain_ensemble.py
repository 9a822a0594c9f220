"""The streaming ensemble predictive of K chains at once.

:class:`~sgrld.evaluation.ensemble.EnsemblePredictive` for a leading chain dimension: one float64
running log-sum-exp ``L[k, i, c] = logsumexp_s log p(c | x_i, θ_s^k)`` per chain, fed with the
``(K, B, C)`` logits of :class:`sgrld.Chains` in one call per batch, so that no per-sample logits
are kept and every chain's metrics (LP, accuracy, ECE, confidence) are exactly those a single
run's ``EnsemblePredictive`` reports.

Example:
    >>> import torch
    >>> ensemble = ChainEnsemble(num_chains=2, num_points=3, num_classes=2)
    >>> ensemble.add_batch(0, torch.zeros(2, 3, 2))
    >>> ensemble.commit()
    >>> [m["accuracy"] for m in ensemble.metrics(torch.tensor([0, 1, 0]))]
    [0.6666666666666666, 0.6666666666666666]
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from sgrld.evaluation.calibration import expected_calibration_error

__all__ = ["ChainEnsemble", "evaluate_chains"]


class ChainEnsemble:
    """Running ensemble predictive of each of K chains over one fixed evaluation set.

    Feed each posterior sample (one state of every chain) in consecutive batches with
    :meth:`add_batch`, then :meth:`commit`. Memory: ``K·N·C`` float64.

    Args:
        num_chains: K.
        num_points: N, size of the (unshuffled) evaluation set.
        num_classes: C.
        device: where the accumulator lives (default CPU); logits are moved there.

    References:
        The single-chain version
        :class:`~sgrld.evaluation.ensemble.EnsemblePredictive`.
    """

    def __init__(
        self,
        num_chains: int,
        num_points: int,
        num_classes: int,
        *,
        device: torch.device | str | None = None,
    ) -> None:
        if num_chains < 1 or num_points < 1 or num_classes < 2:
            raise ValueError(
                "need num_chains >= 1, num_points >= 1 and num_classes >= 2, got "
                f"{num_chains}, {num_points}, {num_classes}"
            )
        self.shape = (num_chains, num_points, num_classes)
        self.device = torch.device("cpu" if device is None else device)
        self._log_sum = torch.full(self.shape, -math.inf, dtype=torch.float64, device=self.device)
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
        if self._pending is None or self._covered is None:
            self._pending = torch.empty_like(self._log_sum)
            self._covered = torch.zeros(n, dtype=torch.bool, device=self.device)
        if bool(self._covered[start:stop].any()):
            raise ValueError(f"points in [{start}, {stop}) were already given for this sample")
        batch = logits.detach().to(device=self.device, dtype=torch.float64)
        self._pending[:, start:stop] = torch.log_softmax(batch, dim=-1)
        self._covered[start:stop] = True

    def commit(self) -> None:
        """Fold the assembled sample of every chain into its ensemble."""
        if self._pending is None or self._covered is None:
            raise RuntimeError("commit() without add_batch()")
        missing = int((~self._covered).sum())
        if missing:
            raise RuntimeError(f"{missing} of {self.shape[1]} points were not given")
        self._log_sum = torch.logaddexp(self._log_sum, self._pending)
        self._num_samples += 1
        self._pending = self._covered = None

    def log_predictive(self) -> Tensor:
        """``L − log S``, shape ``(K, N, C)`` (NaN while empty)."""
        if self._num_samples == 0:
            return torch.full_like(self._log_sum, math.nan)
        return self._log_sum - math.log(self._num_samples)

    def metrics(self, labels: Tensor, *, num_bins: int = 30) -> list[dict[str, float]]:
        """Per chain, the dict of :meth:`EnsemblePredictive.metrics
        <sgrld.evaluation.ensemble.EnsemblePredictive.metrics>` (lp, accuracy, ece,
        confidence, num_samples); LP, accuracy and confidence batched over chains."""
        k, n, _ = self.shape
        if labels.shape != (n,):
            raise ValueError(f"expected labels ({n},), got {tuple(labels.shape)}")
        if self._num_samples == 0:
            nan = math.nan
            empty = {"lp": nan, "accuracy": nan, "ece": nan, "confidence": nan, "num_samples": 0}
            return [dict(empty) for _ in range(k)]
        log_mean = self.log_predictive()
        labels = labels.to(device=self.device, dtype=torch.long)
        true_class = log_mean.gather(2, labels.expand(k, n)[..., None]).squeeze(2)
        probs = log_mean.exp()
        lp = true_class.mean(dim=1).tolist()
        accuracy = (log_mean.argmax(dim=2) == labels).double().mean(dim=1).tolist()
        confidence = probs.max(dim=2).values.mean(dim=1).tolist()
        return [
            {
                "lp": lp[i],
                "accuracy": accuracy[i],
                "ece": expected_calibration_error(probs[i], labels, num_bins),
                "confidence": confidence[i],
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
        if tuple(log_sum.shape) != self.shape:
            raise ValueError(f"log_sum_exp has shape {tuple(log_sum.shape)}, expected {self.shape}")
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
