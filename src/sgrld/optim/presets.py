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

    References:
        Welling & Teh, Bayesian Learning via Stochastic Gradient Langevin Dynamics, ICML 2011.
    """

    metric_class = IdentityMetric


class RMSpropSGLD(SGRLDOptimizer):
    """pSGLD: G = diag(√V + max(eps, floor·s)), V an EMA of ĝ²
    (:class:`~sgrld.metrics.RMSpropMetric`).

    References:
        Li et al., Preconditioned Stochastic Gradient Langevin Dynamics for Deep Neural Networks,
        AAAI 2016.
    """

    metric_class = RMSpropMetric


class WenzelSGLD(SGRLDOptimizer):
    """Layer-wise scalar metric G⁻¹ = M_p·I per tensor (:class:`~sgrld.metrics.WenzelMetric`).

    G = I until the first refresh. Give ``batch_size`` or ``refresh_every`` and the optimizer
    refreshes itself; else call :meth:`update_preconditioner` each epoch (a warning says so once if
    more than ``num_data`` steps go by without it).

    References:
        Wenzel et al., How Good is the Bayes Posterior in Deep Neural Networks Really?, ICML 2020.
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
    """Monge metric G = I + α² m mᵀ, m an EMA of ĝ (:class:`~sgrld.metrics.MongeMetric`).

    References:
        Yu et al., Scalable SGRLD in Non-Diagonal Metrics, TMLR 2023, §4.1.
    """

    metric_class = MongeMetric


class ShampooSGLD(SGRLDOptimizer):
    """Kronecker-factored Shampoo metric per tensor, roots refreshed every ``update_interval`` steps
    (G = I until the first) (:class:`~sgrld.metrics.ShampooMetric`).

    References:
        Yu et al., Scalable SGRLD in Non-Diagonal Metrics, TMLR 2023, §4.2.
    """

    metric_class = ShampooMetric

    def partition(self) -> dict[str, TensorBlocks]:
        """How Shampoo merges and blocks each parameter on this rank, by name
        (:meth:`ShampooMetric.partition`); under FSDP2 each rank reports its own shard's blocks.
        """
        out: dict[str, TensorBlocks] = {}
        for metric, state in zip(self.group_metrics, self.sampler_states, strict=True):
            assert isinstance(metric, ShampooMetric)
            out.update((t.name, t) for t in metric.partition(state.layout))
        return out
