"""``torch.optim`` facade: the samplers as optimizers, thin wrappers over :mod:`sgrld.core`.

``p.grad`` must hold the gradient of the per-datum potential (batch-mean negative log-likelihood
minus log-prior / num_data); every sampler then applies

    θ ← θ − lr · G⁻¹ · grad + √(2 · lr · temperature / num_data) · G^{-1/2} · ξ

(see ``docs/conventions.md``). Each parameter group is one metric: Monge's inner products and
Wenzel's normalisation run over all parameters of a group, as in the paper's code.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from sgrld.core.compiled import CompiledMove, check_compile
from sgrld.core.engine import (
    CheckMode,
    advance,
    check,
    check_finite_now,
    check_mode,
    in_graph,
    refresh_due,
    validate_grads,
)
from sgrld.core.layout import FlatLayout
from sgrld.core.noise import NoiseSource, check_noise_source, keys_from_generator
from sgrld.core.sampler import check_flags, validate_hyperparameters
from sgrld.core.state import SamplerState, check_generator_state, new_generator
from sgrld.core.warmup import DEFAULT_WARMUP, adapting, check_adapt_until
from sgrld.metrics import (
    IdentityMetric,
    Metric,
    MongeMetric,
    RMSpropMetric,
    ShampooMetric,
    WenzelMetric,
)

ParamsT = Iterable[Tensor] | Iterable[tuple[str, Tensor]] | Iterable[dict[str, Any]]

#: metric fields that fix the layout of the statistics: not changeable after the first step
_STRUCTURAL = ("block_size", "tiling", "precondition_vectors", "scope")


def _metric_options(metric: Metric) -> dict[str, Any]:
    """The metric's public hyper-parameters (its dataclass fields), e.g. ``alpha2``, ``decay``."""
    return {
        f.name: getattr(metric, f.name)
        for f in dataclasses.fields(metric)  # type: ignore[arg-type]
        if f.init and not f.name.startswith("_")
    }


class SGRLDOptimizer(torch.optim.Optimizer):
    """SGRLD with an arbitrary metric plug-in.

    Args:
        params: parameters, ``(name, parameter)`` pairs (e.g. ``model.named_parameters()``:
            error messages then use the names) or parameter groups. A group may override ``lr``,
            ``num_data``, ``temperature`` and any option of the metric (``alpha2``, ``decay``,
            ...), as torch.optim groups override ``lr``; each group has its own statistics.
        lr: learning rate ℓ > 0 (the SDE step is h = ℓ / num_data): a float or a 0-d tensor
            (``capturable=True``: a scheduler then changes it on the device).
        num_data: number of training data n > 0.
        temperature: τ ≥ 0; 0 gives deterministic preconditioned descent (no noise drawn).
        metric: the metric G (see :mod:`sgrld.metrics`).
        generator: drives the noise; a private one seeded from torch's global generator by
            default. Its state is saved in :meth:`state_dict`.
        check_finite: refuse a step whose gradient holds NaN/Inf, naming the parameter and step;
            nothing changes in any group (see :mod:`sgrld.core.engine` for the modes).
        sync_checks: ``None`` (default): read the check at once on CPU, defer it on CUDA to
            :meth:`check`, :meth:`state_dict` and refreshes (no host sync per step); ``True``
            read at once everywhere; ``False`` always defer.
        noise: the source of ξ: ``"torch"`` (``normal_``, default) or ``"philox"`` (a compiled
            counter-based generator; see :mod:`sgrld.core.noise`).
        compile: run each step's metric update, preconditioning and move as one
            ``torch.compile``d call (:mod:`sgrld.core.compiled`; identity, RMSprop and Wenzel).
        capturable: make :meth:`step` free of host reads and Python randomness, as torch.optim's
            ``capturable``: it can be captured in a CUDA graph or traced by ``torch.compile``
            (``opt.step(); sched.step()`` in one compiled function). Needs ``noise="philox"``;
            checks are deferred; while a step is traced or captured, Shampoo's root refresh is
            left to :meth:`refresh_if_due` on the host (:class:`sgrld.capture.GraphedStep` calls
            it; eager steps refresh themselves as usual).

        adapt_until: the warm-up (:mod:`sgrld.core.warmup`): the metric adapts during the
            first ``adapt_until`` steps (default 1,000), then G is frozen, so that the chain
            samples the posterior; ``None`` adapts at every step (the paper's protocol, whose
            stationary law is biased: ``docs/posterior.md``). A group option.

    Each parameter group also carries ``adapt_metric`` (default True): set it to False to
    freeze the metric's statistics at once (see :meth:`freeze_metric`).

    References: Yu et al., Scalable SGRLD in Non-Diagonal Metrics, TMLR 2023, eq. 4.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor,
        num_data: float,
        temperature: float = 1.0,
        *,
        metric: Metric,
        generator: torch.Generator | None = None,
        check_finite: bool = True,
        noise: NoiseSource = "torch",
        compile: bool = False,
        capturable: bool = False,
        sync_checks: bool | None = None,
        adapt_until: int | None = DEFAULT_WARMUP,
    ) -> None:
        validate_hyperparameters(lr, num_data, temperature)
        check_noise_source(noise)
        check_compile(compile, metric)
        check_flags(check_finite, capturable, sync_checks, noise)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        if isinstance(lr, Tensor) and lr.dim() != 0:
            raise ValueError(f"invalid lr: a tensor of shape {tuple(lr.shape)} (expected 0-d)")
        self.metric = metric
        self._options = _metric_options(metric)
        defaults = {
            "lr": lr,
            "num_data": num_data,
            "temperature": temperature,
            "adapt_metric": True,
            "adapt_until": adapt_until,
            **self._options,
        }
        self._group_states: list[SamplerState | None] = []
        self._group_metrics: list[Metric | None] = []
        # the group options each group's metric was made from (a step compares, not rebuilds)
        self._group_options: list[dict[str, Any] | None] = []
        super().__init__(params, defaults)
        self.check_finite = check_finite
        self.noise: NoiseSource = noise
        self.compile = compile
        self.capturable = capturable
        self.sync_checks = sync_checks
        self._compiled: dict[int, CompiledMove] = {}  # per param group (compile=True)
        device = self.param_groups[0]["params"][0].device
        self.generator = generator if generator is not None else new_generator(device)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        index = len(self.param_groups) - 1
        params: list[Tensor] = group["params"]
        names = self._names(index)
        first = params[0]
        for name, p in zip(names, params, strict=True):
            if p.dtype != first.dtype or p.device != first.device:
                raise ValueError(
                    f"parameter {name!r} is {p.dtype} on {p.device}, {names[0]!r} {first.dtype} "
                    f"on {first.device}: the parameters of one group are stepped as one flat "
                    "buffer, so they must share dtype and device (put the others in a group of "
                    "their own)"
                )
            if not p.is_floating_point():
                raise ValueError(f"parameter {name!r} is {p.dtype}: expected floating point")
        validate_hyperparameters(group["lr"], group["num_data"], group["temperature"])
        check_adapt_until(group["adapt_until"])
        self._group_metric(group)  # validates the group's metric options now
        self._group_states.append(None)
        self._group_metrics.append(None)
        self._group_options.append(None)

    def _names(self, index: int) -> list[str]:
        group = self.param_groups[index]
        if "param_names" in group:
            return list(group["param_names"])
        return [f"group{index}.param{i}" for i in range(len(group["params"]))]

    def _group_metric(self, group: dict[str, Any], current: Metric | None = None) -> Metric:
        """The metric of a group: this optimizer's, with the group's own options (validated)."""
        options = {k: group[k] for k in self._options}
        if current is not None and _metric_options(current) == options:
            return current
        if options == self._options:
            return self.metric
        if current is not None:
            for k in _STRUCTURAL:
                if k in options and options[k] != getattr(current, k):
                    raise ValueError(
                        f"{k} of a parameter group cannot change after its first step "
                        f"({getattr(current, k)!r} → {options[k]!r}): it fixes the statistics' "
                        "layout"
                    )
        return dataclasses.replace(self.metric, **options)  # type: ignore[type-var]

    def _new_state(self, index: int, metric: Metric) -> SamplerState:
        group = self.param_groups[index]
        params: list[Tensor] = group["params"]
        names = self._names(index)
        layout = FlatLayout.from_tensors(names, params)
        stats = metric.init(layout, params[0])
        return SamplerState(dict(zip(names, params, strict=True)), stats, 0, self.generator, layout)

    def _group_state(self, index: int) -> SamplerState:
        state = self._group_states[index]
        group = self.param_groups[index]
        options = {k: group[k] for k in self._options}
        metric = self._group_metrics[index]
        if metric is None or options != self._group_options[index]:
            metric = self._group_metric(group, metric)
            self._group_metrics[index], self._group_options[index] = metric, options
        if state is None:
            validate_hyperparameters(group["lr"], group["num_data"], group["temperature"])
            state = self._new_state(index, metric)
            if self.noise == "philox":
                state.keys.copy_(keys_from_generator((), self.generator, state.keys.device))
            self._group_states[index] = state
        return state

    def _checks(self, state: SamplerState) -> CheckMode:
        device = next(iter(state.params.values())).device
        return check_mode(self.check_finite, self.sync_checks, device, self.capturable)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One sampler step for every parameter group (grads of ``None`` are skipped).

        Every group's gradients are validated (shape, dtype; NaN/Inf in ``"sync"`` check mode)
        before any group moves, so a refused step changes nothing anywhere.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        states = [self._group_state(i) for i in range(len(self.param_groups))]
        grads = [[p.grad for p in g["params"]] for g in self.param_groups]
        modes = [self._checks(state) for state in states]
        if len(states) > 1:  # refuse before the first group moves
            for index, (state, gs) in enumerate(zip(states, grads, strict=True)):
                validate_grads(state, gs)
                if modes[index] == "sync":
                    check_finite_now(state, gs)
                    modes[index] = "off"  # checked just now: not again inside the step
        for index, group in enumerate(self.param_groups):
            state = states[index]
            advance(
                self._group_metrics[index] or self.metric,
                state,
                grads[index],
                lr=group["lr"],
                num_data=group["num_data"],
                temperature=group["temperature"],
                checks=modes[index],
                adapt=self.adapts(index),
                noise_source=self.noise,
                compiled=self._compiled_move(index),
                refresh=not (self.capturable and in_graph()),
            )
        self._after_step()
        return loss

    def _after_step(self) -> None:
        """Hook for facades with a host-side schedule (Wenzel's refresh)."""

    def _compiled_move(self, index: int) -> CompiledMove | None:
        if not self.compile:
            return None
        if index not in self._compiled:
            self._compiled[index] = CompiledMove()
        return self._compiled[index]

    def check(self) -> None:
        """Raise :class:`~sgrld.core.NonFiniteGradientError` if a deferred check (CUDA,
        ``capturable=True`` or ``sync_checks=False``) recorded a NaN/Inf gradient: the one host
        read of the flags, naming the first bad step and parameter."""
        for index, state in enumerate(self._group_states):
            if state is not None:
                check(state, f"param group {index}: " if len(self._group_states) > 1 else "")

    def refresh_if_due(self) -> bool:
        """Run a due scheduled refresh (Shampoo's roots) in every group; for ``capturable``
        optimizers, whose steps leave it to the host. Returns whether one ran."""
        ran = False
        for index, state in enumerate(self._group_states):
            metric = self._group_metrics[index]
            if state is None or metric is None or not refresh_due(metric, state.step):
                continue
            if not adapting(state.step - 1, self.param_groups[index]["adapt_until"]):
                continue  # that step was after the warm-up: G is frozen
            metric.refresh(state.stats, state.layout)
            ran = True
        return ran

    def adapts(self, index: int = 0) -> bool:
        """Whether group ``index``'s next step updates its metric (``adapt_metric`` and still
        in the warm-up of ``adapt_until`` steps)."""
        group, state = self.param_groups[index], self._group_states[index]
        steps = 0 if state is None else state.step
        return bool(group["adapt_metric"]) and adapting(steps, group["adapt_until"])

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
            (self._group_metrics[index] or self.metric).refresh(state.stats, state.layout)

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's state dict plus ``"sgrld"``: the generator state and every group's
        :meth:`SamplerState.state_dict` with its parameters' names and shapes. Deferred checks
        are read first: a chain with a non-finite gradient is not checkpointed."""
        self.check()
        sd = super().state_dict()
        groups: list[dict[str, Any] | None] = []
        for state in self._group_states:
            if state is None:
                groups.append(None)
                continue
            entry = state.state_dict()
            entry["shapes"] = [list(s) for s in state.layout.shapes]
            groups.append(entry)
        sd["sgrld"] = {"generator": self.generator.get_state(), "groups": groups}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict`: everything is validated first (groups, parameter shapes,
        statistics' keys, shapes, dtypes and finiteness, step, generator state), then applied;
        a refused dict leaves the optimizer exactly as it was."""
        if not isinstance(state_dict, dict):
            raise ValueError(f"not an optimizer state dict: a {type(state_dict).__name__}")
        state_dict = dict(state_dict)
        extra = state_dict.pop("sgrld", None)
        if not isinstance(extra, dict) or not {"generator", "groups"} <= set(extra):
            raise ValueError("not an sgrld optimizer state dict (no valid 'sgrld' entry)")
        saved_groups = state_dict.get("param_groups")
        if not isinstance(saved_groups, list) or len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"the state dict has {len(saved_groups) if isinstance(saved_groups, list) else 0}"
                f" parameter groups, this optimizer {len(self.param_groups)}"
            )
        if not isinstance(extra["groups"], list) or len(extra["groups"]) != len(saved_groups):
            raise ValueError("the state dict's sgrld entry does not match its parameter groups")
        check_generator_state(self.generator, extra["generator"], "the state dict")
        metrics: list[Metric] = []
        for index, (group, saved) in enumerate(zip(saved_groups, extra["groups"], strict=True)):
            label = f"param group {index}"
            if len(group.get("params", [])) != len(self.param_groups[index]["params"]):
                raise ValueError(f"{label}: the state dict has a different number of parameters")
            merged = {
                **self.param_groups[index],
                **{k: v for k, v in group.items() if k != "params"},
            }
            try:
                metric = self._group_metric(merged)
                validate_hyperparameters(merged["lr"], merged["num_data"], merged["temperature"])
                check_adapt_until(group.get("adapt_until"))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{label}: {exc}") from None
            metrics.append(metric)
            if saved is None:
                continue
            fresh = self._new_state(index, metric)
            shapes = saved.get("shapes") if isinstance(saved, dict) else None
            mine = [list(s) for s in fresh.layout.shapes]
            if shapes is not None and shapes != mine:
                raise ValueError(
                    f"{label}: the state dict is for parameters of shapes {shapes}, these are "
                    f"{mine}"
                )
            fresh.validate_state_dict(saved, label)
        # everything fits: apply
        super().load_state_dict(state_dict)
        for group in self.param_groups:  # a dict saved before warm-ups: it adapted throughout
            group.setdefault("adapt_until", None)
        self.generator.set_state(extra["generator"])
        self._group_states = [None] * len(self.param_groups)
        self._group_metrics = list(metrics)
        self._group_options = [None] * len(self.param_groups)
        for index, saved in enumerate(extra["groups"]):
            if saved is not None:
                self._group_state(index).apply_state_dict(saved)


class SGLD(SGRLDOptimizer):
    """SGLD (Welling & Teh 2011): G = I."""

    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor,
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
        lr: float | Tensor,
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

    G = I until the first :meth:`update_preconditioner`; the paper refreshes at every epoch end.
    Give the schedule with ``batch_size`` (refresh every ⌈num_data / batch_size⌉ steps, i.e.
    once per epoch) or ``refresh_every`` (steps), and the optimizer refreshes itself after those
    steps; without either, call :meth:`update_preconditioner` yourself (as the runner does at each
    epoch end) — a warning says so once if more than ``num_data`` steps go by without it.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor,
        num_data: float,
        temperature: float = 1.0,
        decay: float = 0.99,
        eps: float = 1e-8,
        generator: torch.Generator | None = None,
        *,
        refresh_every: int | None = None,
        batch_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        metric = WenzelMetric(decay=decay, eps=eps)
        super().__init__(
            params, lr, num_data, temperature, metric=metric, generator=generator, **kwargs
        )
        for name, value in (("refresh_every", refresh_every), ("batch_size", batch_size)):
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value < 1
            ):
                raise ValueError(f"invalid {name}: {value!r} (expected an integer >= 1 or None)")
        if refresh_every is not None and batch_size is not None:
            raise ValueError("give refresh_every or batch_size, not both")
        if batch_size is not None:
            refresh_every = math.ceil(num_data / batch_size)
        self.refresh_every = refresh_every
        self._last_refresh = 0
        self._warned = False

    def update_preconditioner(self) -> None:
        """M_p = (s_p / min_q s_q)^(−1/2) with s_p = mean(V_p) + eps, over each group."""
        self.refresh_metric()
        self._last_refresh = self.num_steps

    def _after_step(self) -> None:
        steps = self.num_steps
        if self.refresh_every is not None:
            if steps % self.refresh_every == 0:
                self.update_preconditioner()
            return
        if not self._warned and steps - self._last_refresh > self.param_groups[0]["num_data"]:
            self._warned = True
            warnings.warn(
                f"WenzelSGLD: {steps - self._last_refresh} steps without update_preconditioner()"
                ", so G is still what the last refresh (or I) made it; give batch_size= or "
                "refresh_every= to refresh on a schedule (the paper: once per epoch)",
                RuntimeWarning,
                stacklevel=3,
            )


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
        lr: float | Tensor,
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
        lr: float | Tensor,
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
        capturable: bool = False,
        sync_checks: bool | None = None,
        adapt_until: int | None = DEFAULT_WARMUP,
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
            capturable=capturable,
            sync_checks=sync_checks,
            adapt_until=adapt_until,
        )
