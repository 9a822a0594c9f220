"""The streaming ensemble predictive of K chains at once.

:class:`~sgrld.evaluation.ensemble.EnsemblePredictive` with a leading chain dim, fed the
``(K, B, C)`` logits of :class:`sgrld.Chains`: every chain's metrics are exactly those of a
single run's ``EnsemblePredictive``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from sgrld.evaluation.ensemble import EnsemblePredictive
from sgrld.likelihoods.base import Likelihood

__all__ = ["ChainEnsemble", "evaluate_chains"]


class ChainEnsemble(EnsemblePredictive):
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
        if num_chains < 1:  # the sizes of the set: EnsemblePredictive's check
            raise ValueError(f"need num_chains >= 1, got {num_chains}")
        self._lead = (num_chains,)
        super().__init__(num_points, num_classes, likelihood=likelihood, device=device)
        #: (K, N, width of η): the shape of one sample's outputs over the whole set
        self.shape = (num_chains, num_points, self.likelihood.width)

    def metrics(  # type: ignore[override]
        self, labels: Tensor, *, num_bins: int = 30
    ) -> list[dict[str, float]]:
        """Per chain, the dict of :meth:`EnsemblePredictive.metrics
        <sgrld.evaluation.ensemble.EnsemblePredictive.metrics>` (categorical: lp, accuracy,
        ece, confidence, num_samples); the scores batched over chains."""
        return self._per_chain(labels, num_bins)


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
