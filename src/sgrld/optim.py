"""``torch.optim`` facade: the samplers as optimizers, thin wrappers over :mod:`sgrld.core`.

``p.grad`` must hold the gradient of the per-datum potential (batch-mean negative log-likelihood
minus log-prior / num_data); every sampler then applies

    θ ← θ − lr · G⁻¹ · grad + √(2 · lr · temperature / num_data) · G^{-1/2} · ξ

(see ``docs/conventions.md``). Each parameter group is one metric: Monge's inner products and
Wenzel's normalisation run over all parameters of a group, as in the paper's code.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from sgrld.core.compiled import CompiledMove, check_compile
from sgrld.core.layout import FlatLayout
from sgrld.core.noise import NoiseSource, check_noise_source
from sgrld.core.sampler import sgrld_step, validate_hyperparameters
from sgrld.core.state import SamplerState, new_generator
from sgrld.metrics import (
    IdentityMetric,
    Metric,
    MongeMetric,
    RMSpropMetric,
    ShampooMetric,
    WenzelMetric,
)

ParamsT = Iterable[Tensor] | Iterable[dict[str, Any]]


class SGRLDOptimizer(torch.optim.Optimizer):
    """SGRLD with an arbitrary metric plug-in.

    Args:
        params: parameters or parameter groups (each group has its own metric statistics).
        lr: learning rate ℓ > 0 (the SDE step is h = ℓ / num_data).
        num_data: number of training data n > 0.
        temperature: τ ≥ 0; 0 gives deterministic preconditioned descent (no noise drawn).
        metric: the metric G (see :mod:`sgrld.metrics`).
        generator: drives the noise; a private one seeded from torch's global generator by
            default. Its state is saved in :meth:`state_dict`.
        check_finite: refuse a step whose gradient holds NaN/Inf, naming the parameter (costs
            one host sync per step; turn off on GPU for speed).
        noise: the source of ξ: ``"torch"`` (``normal_``, default) or ``"philox"`` (a compiled
            counter-based generator on all cores, 1.7x faster on one CPU core and scaling with
            cores; see :mod:`sgrld.core.noise`).
        compile: run each step's metric update, preconditioning and move as one
            ``torch.compile``d call (:mod:`sgrld.core.compiled`; identity, RMSprop and Wenzel).

    Each parameter group also carries ``adapt_metric`` (default True): set it to False, e.g.
    after burn-in, to freeze the metric's statistics (see :meth:`freeze_metric`).

    References: Yu et al., Scalable SGRLD in Non-Diagonal Metrics, TMLR 2023, eq. 4.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float,
        num_data: float,
        temperature: float = 1.0,
        *,
        metric: Metric,
        generator: torch.Generator | None = None,
        check_finite: bool = True,
        noise: NoiseSource = "torch",
        compile: bool = False,
    ) -> None:
        validate_hyperparameters(lr, num_data, temperature)
        check_noise_source(noise)
        check_compile(compile, metric)
        defaults = {
            "lr": lr,
            "num_data": num_data,
            "temperature": temperature,
            "adapt_metric": True,
        }
        super().__init__(params, defaults)
        self.metric = metric
        self.check_finite = check_finite
        self.noise: NoiseSource = noise
        self.compile = compile
        self._compiled: dict[int, CompiledMove] = {}  # per param group (compile=True)
        device = self.param_groups[0]["params"][0].device
        self.generator = generator if generator is not None else new_generator(device)
        self._group_states: list[SamplerState | None] = [None] * len(self.param_groups)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        if hasattr(self, "_group_states"):
            self._group_states.append(None)

    def _group_state(self, index: int) -> SamplerState:
        state = self._group_states[index]
        if state is None:
            group = self.param_groups[index]
            params: list[Tensor] = group["params"]
            validate_hyperparameters(group["lr"], group["num_data"], group["temperature"])
            names = [f"group{index}.param{i}" for i in range(len(params))]
            layout = FlatLayout.from_tensors(names, params)
            stats = self.metric.init(layout, params[0])
            state = SamplerState(
                dict(zip(names, params, strict=True)), stats, 0, self.generator, layout
            )
            self._group_states[index] = state
        return state

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One sampler step for every parameter group (grads of ``None`` are skipped)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            state = self._group_state(index)
            sgrld_step(
                self.metric,
                state,
                [p.grad for p in group["params"]],
                lr=group["lr"],
                num_data=group["num_data"],
                temperature=group["temperature"],
                check_finite=self.check_finite,
                adapt=group["adapt_metric"],
                noise_source=self.noise,
                compiled=self._compiled_move(index),
            )
        return loss

    def _compiled_move(self, index: int) -> CompiledMove | None:
        if not self.compile:
            return None
        if index not in self._compiled:
            self._compiled[index] = CompiledMove()
        return self._compiled[index]

    def freeze_metric(self, frozen: bool = True) -> None:
        """Stop (or resume) updating the metric's statistics in every group."""
        for group in self.param_groups:
            group["adapt_metric"] = not frozen

    @property
    def num_steps(self) -> int:
        """Steps taken by the first parameter group (the optimizer's own counter)."""
        state = self._group_states[0]
        return 0 if state is None else state.step

    def refresh_metric(self) -> None:
        """Recompute the explicitly scheduled part of the metric in every group."""
        for index in range(len(self.param_groups)):
            state = self._group_state(index)
            self.metric.refresh(state.stats, state.layout)

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        # Each group's entry is SamplerState.state_dict(): statistics, step and generator state
        # (all groups share one generator, so every entry carries the same generator state).
        sd["sgrld"] = {
            "generator": self.generator.get_state(),
            "groups": [None if s is None else s.state_dict() for s in self._group_states],
        }
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        extra = state_dict.pop("sgrld", None)
        if extra is None:  # refuse before anything is loaded
            raise ValueError("not an sgrld optimizer state dict (no 'sgrld' entry)")
        super().load_state_dict(state_dict)
        self.generator.set_state(extra["generator"])
        self._group_states = [None] * len(self.param_groups)
        for index, saved in enumerate(extra["groups"]):
            if saved is not None:
                self._group_state(index).load_state_dict(saved)


class SGLD(SGRLDOptimizer):
    """SGLD (Welling & Teh 2011): G = I."""

    def __init__(
        self,
        params: ParamsT,
        lr: float,
        num_data: float,
        temperature: float = 1.0,
        generator: torch.Generator | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            params,
            lr,
            num_data,
            temperature,
            metric=IdentityMetric(),
            generator=generator,
            **kwargs,
        )


class RMSpropSGLD(SGRLDOptimizer):
    """pSGLD (Li et al. 2016): G = diag(√V + eps), V an EMA of g² from zeros (reference §2.3).

    Extra keyword options: ``bias_correction`` (default False, as the paper's code).
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float,
        num_data: float,
        temperature: float = 1.0,
        decay: float = 0.99,
        eps: float = 1e-8,
        generator: torch.Generator | None = None,
        *,
        bias_correction: bool = False,
        **kwargs: Any,
    ) -> None:
        metric = RMSpropMetric(decay=decay, eps=eps, bias_correction=bias_correction)
        super().__init__(
            params, lr, num_data, temperature, metric=metric, generator=generator, **kwargs
        )


class WenzelSGLD(SGRLDOptimizer):
    """Layer-wise scalar metric (Wenzel et al. 2020, reference §2.2).

    The metric changes only when :meth:`update_preconditioner` is called (at each epoch end in
    the paper's runs); until then G = I.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float,
        num_data: float,
        temperature: float = 1.0,
        decay: float = 0.99,
        eps: float = 1e-8,
        generator: torch.Generator | None = None,
        **kwargs: Any,
    ) -> None:
        metric = WenzelMetric(decay=decay, eps=eps)
        super().__init__(
            params, lr, num_data, temperature, metric=metric, generator=generator, **kwargs
        )

    def update_preconditioner(self) -> None:
        """M_p = (s_p / min_q s_q)^(−1/2) with s_p = mean(V_p) + eps, over each group."""
        self.refresh_metric()


class MongeSGLD(SGRLDOptimizer):
    """Monge metric G = I + α² m mᵀ, m an EMA of gradients (paper §4.1, reference §2.4).

    Extra keyword options: ``scope`` (``"global"``, the paper's metric over the whole group, or
    ``"tensor"``), ``fallback_threshold`` (the funnel's explosion fallback, off by default) and
    ``alpha2_rule`` (``"fixed"``, the paper's; ``"normalized"``: α²_t = alpha2/‖m_t‖², so the
    stretch along m is always 1 + alpha2; see :class:`sgrld.metrics.MongeMetric`).
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float,
        num_data: float,
        temperature: float = 1.0,
        alpha2: float = 1.0,
        decay: float = 0.9,
        generator: torch.Generator | None = None,
        *,
        scope: str = "global",
        fallback_threshold: float | None = None,
        alpha2_rule: str = "fixed",
        **kwargs: Any,
    ) -> None:
        metric = MongeMetric(
            alpha2=alpha2,
            alpha2_rule=alpha2_rule,  # type: ignore[arg-type]  # validated by MongeMetric
            decay=decay,
            scope=scope,  # type: ignore[arg-type]  # validated by MongeMetric
            fallback_threshold=fallback_threshold,
        )
        super().__init__(
            params, lr, num_data, temperature, metric=metric, generator=generator, **kwargs
        )


class ShampooSGLD(SGRLDOptimizer):
    """Kronecker-factored Shampoo metric per parameter tensor (paper §4.2, reference §2.5).

    Statistics every step from eps·I; inverse roots refreshed every ``update_interval`` steps
    counted by the optimizer itself (identity until the first refresh). Extra keyword options
    are passed to :class:`sgrld.metrics.ShampooMetric` (e.g. ``root_method``,
    ``precondition_vectors``).
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float,
        num_data: float,
        temperature: float = 1.0,
        decay: float = 0.99,
        eps: float = 1e-8,
        block_size: int = 128,
        update_interval: int = 100,
        generator: torch.Generator | None = None,
        *,
        check_finite: bool = True,
        noise: NoiseSource = "torch",
        compile: bool = False,
        **metric_options: Any,
    ) -> None:
        metric = ShampooMetric(
            decay=decay,
            eps=eps,
            block_size=block_size,
            update_interval=update_interval,
            **metric_options,
        )
        super().__init__(
            params,
            lr,
            num_data,
            temperature,
            metric=metric,
            generator=generator,
            check_finite=check_finite,
            noise=noise,
            compile=compile,
        )
