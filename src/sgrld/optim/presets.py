"""The paper's samplers: :class:`~sgrld.SGRLDOptimizer` with its metric fixed.

A preset takes the base's arguments (documented there) and its metric's options as keywords,
every field of the metric class: ``WenzelSGLD(params, lr=0.05, num_data=n, min_scale=0.1)``.
"""

from __future__ import annotations

import warnings

from sgrld.metrics import (
    IdentityMetric,
    MongeMetric,
    RMSpropMetric,
    ShampooMetric,
    TensorBlocks,
    WenzelMetric,
)
from sgrld.optim.optimizer import SGRLDOptimizer


class SGLD(SGRLDOptimizer):
    """SGLD: G = I, θ ← θ − ℓĝ + √(2ℓτ/n) ξ (:class:`~sgrld.metrics.IdentityMetric`).

    References: Welling & Teh, Bayesian Learning via Stochastic Gradient Langevin Dynamics,
    ICML 2011.
    """

    metric_class = IdentityMetric


class RMSpropSGLD(SGRLDOptimizer):
    """pSGLD: G = diag(√V + max(eps, floor·s)), V an EMA of ĝ² from zeros, s the statistics'
    scale (:class:`~sgrld.metrics.RMSpropMetric`: ``decay``, ``eps``, ``floor``,
    ``bias_correction``).

    References: Li et al., Preconditioned Stochastic Gradient Langevin Dynamics for Deep Neural
    Networks, AAAI 2016.
    """

    metric_class = RMSpropMetric


class WenzelSGLD(SGRLDOptimizer):
    """Layer-wise scalar metric: G⁻¹ = M_p·I per tensor, M_p = (s_p / min_q s_q)^(−1/2), s_p the
    mean of an EMA of ĝ² (:class:`~sgrld.metrics.WenzelMetric`: ``decay``, ``eps``,
    ``min_scale``).

    G = I until the first refresh; the paper refreshes at every epoch end. Give ``batch_size``
    or ``refresh_every`` and the optimizer refreshes itself; without either, call
    :meth:`update_preconditioner` (as the runner does at each epoch end): a warning says so
    once if more than ``num_data`` steps go by without it.

    References: Wenzel et al., How Good is the Bayes Posterior in Deep Neural Networks Really?,
    ICML 2020.
    """

    metric_class = WenzelMetric
    _config_attrs = (*SGRLDOptimizer._config_attrs, "_warned")
    _warned = False

    def update_preconditioner(self) -> None:
        """M_p = (s_p / min_q s_q)^(−1/2) with s_p = mean(V_p) + eps, over each group."""
        self.refresh_metric()

    def _after_step(self) -> None:
        super()._after_step()
        unrefreshed = self.num_steps - self._last_refresh
        if (
            self.refresh_every is None
            and not self._warned
            and unrefreshed > self.param_groups[0]["num_data"]
        ):
            self._warned = True
            warnings.warn(
                f"WenzelSGLD: {unrefreshed} steps without update_preconditioner(), so G is still "
                "what the last refresh (or I) made it; give batch_size= or refresh_every= to "
                "refresh on a schedule (the paper: once per epoch)",
                RuntimeWarning,
                stacklevel=3,
            )


class MongeSGLD(SGRLDOptimizer):
    """Monge metric G = I + α² m mᵀ, m an EMA of ĝ (:class:`~sgrld.metrics.MongeMetric`:
    ``alpha2``, ``decay``, ``scope``, ``alpha2_rule``, ``fallback_threshold``).

    References: Yu et al., Scalable SGRLD in Non-Diagonal Metrics, TMLR 2023, §4.1.
    """

    metric_class = MongeMetric


class ShampooSGLD(SGRLDOptimizer):
    """Kronecker-factored Shampoo metric per parameter tensor: statistics every step from eps·I,
    inverse roots refreshed every ``update_interval`` steps (G = I until the first)
    (:class:`~sgrld.metrics.ShampooMetric`: ``decay``, ``eps``, ``block_size``,
    ``update_interval``, ``root_method``, ``precondition_vectors``, ...).

    References: Yu et al., Scalable SGRLD in Non-Diagonal Metrics, TMLR 2023, §4.2.
    """

    metric_class = ShampooMetric

    def partition(self) -> dict[str, TensorBlocks]:
        """How Shampoo merges and blocks each parameter on this rank, by name: its whole shape,
        the rows this rank holds (all of them unsharded), the merged shape and every block's
        shape (:meth:`ShampooMetric.partition`). Under FSDP2 each rank reports its own shard's
        blocks; they differ with the number of ranks (``docs/distributed.md``)."""
        out: dict[str, TensorBlocks] = {}
        for metric, state in zip(self.group_metrics, self.sampler_states, strict=True):
            assert isinstance(metric, ShampooMetric)
            out.update((t.name, t) for t in metric.partition(state.layout))
        return out
