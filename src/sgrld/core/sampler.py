"""Functional core: ``build(metric, ...)`` → ``init(params) -> state``, ``step(state, grads)``,
each step :func:`sgrld.core.engine.advance` (``docs/conventions.md``).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from sgrld.core import engine, runner, warmup
from sgrld.core.compiled import CompiledMove, check_compilable
from sgrld.core.contract import (
    Metric,
    check_bool,
    check_choice,
    check_hyperparameters,
    check_int,
    check_localization,
)
from sgrld.core.engine import CheckMode, NonFiniteGradientError, in_graph
from sgrld.core.layout import FlatLayout, check_one_buffer
from sgrld.core.noise import NOISE_SOURCES, NoiseSource, keys_from_generator, keys_from_seeds
from sgrld.core.state import SamplerState, new_generator

__all__ = ["NonFiniteGradientError", "Sampler", "clone_state", "validate_hyperparameters"]

#: the loader of :meth:`Sampler.run`: one batch, which its gradient function does not read
ONE_BATCH = (None,)


def validate_hyperparameters(lr: float | Tensor, num_data: float, temperature: float) -> None:
    if isinstance(lr, Tensor):
        check_lr_tensor(lr)
    check_hyperparameters(lr, num_data, temperature)  # finite, ≤ float32's largest (contract)


def check_lr_tensor(lr: Tensor, num_chains: int | bool | None = True) -> None:
    """A tensor ℓ: floating point, 0-d or one per chain (``num_chains``; ``None``: one chain, 0-d
    only; ``True``: not known yet), every entry >= 0 (ℓ = 0 moves nothing, as in torch.optim).
    """
    if not lr.is_floating_point():
        raise ValueError(f"invalid lr: a {lr.dtype} tensor (expected a floating-point tensor)")
    if num_chains is None:
        fits, want = lr.dim() == 0, "0-d"
    elif num_chains is True:
        fits, want = lr.dim() <= 1, "0-d, or 1-d with one entry per chain"
    else:
        fits = lr.dim() == 0 or lr.shape == (num_chains,)
        want = f"0-d or shape ({num_chains},), one per chain"
    if not fits:
        raise ValueError(f"invalid lr: a tensor of shape {tuple(lr.shape)} (expected {want})")
    if not bool((lr >= 0).all()):
        raise ValueError("invalid lr: every entry must be >= 0")


@dataclass(frozen=True)
class Sampler:
    """A configured SGRLD sampler: the functional API (blackjax / posteriors style).

    ``lr`` is a float, a 0-d tensor or a ``(K,)`` tensor of per-chain step sizes;
    ``check_finite``/``sync_checks`` choose how NaN/Inf gradients are caught
    (:mod:`sgrld.core.engine`); ``capturable=True`` (needs ``noise="philox"``) makes every step
    free of host reads for CUDA graphs and ``torch.compile``, leaving a due Shampoo refresh of a
    traced step to :meth:`refresh_if_due`; the metric adapts for the first ``adapt_until`` steps,
    then G is frozen (:mod:`sgrld.core.warmup`; ``None``: always, the paper's biased protocol).

    Examples:
        >>> import torch, sgrld
        >>> sampler = sgrld.build("monge", lr=1e-2, num_data=100, alpha2=1.0)
        >>> state = sampler.init({"w": torch.zeros(3)}, generator=torch.Generator().manual_seed(0))
        >>> state = sampler.step(state, {"w": state.params["w"] - 1.0})
        >>> state.step
        1
    """

    metric: Metric
    lr: float | Tensor
    num_data: float
    temperature: float = 1.0
    check_finite: bool = True
    noise: NoiseSource = "torch"
    compile: bool = False
    capturable: bool = False
    sync_checks: bool | None = None
    adapt_until: int | None = warmup.DEFAULT_WARMUP
    localization: float = 0.0
    # the compiled step (compile=True), shared by the states this sampler steps; not state
    _compiled: CompiledMove = field(
        default_factory=CompiledMove, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        """Refuse bad ℓ, n, τ, warm-up or localisation, an unknown noise source, non-bool flags,
        ``compile=True`` for a metric that is not compilable (:mod:`sgrld.core.compiled`) and the
        combinations a captured step cannot honour."""
        validate_hyperparameters(self.lr, self.num_data, self.temperature)
        check_choice("noise", self.noise, NOISE_SOURCES)
        check_bool("compile", self.compile)
        if self.compile:
            check_compilable(self.metric)
        check_bool("check_finite", self.check_finite)
        check_bool("capturable", self.capturable)
        if self.sync_checks is not None and not isinstance(self.sync_checks, bool):
            raise ValueError(
                f"invalid sync_checks: {self.sync_checks!r} (expected None, True or False)"
            )
        if self.capturable and self.noise != "philox":
            raise ValueError(
                "capturable=True needs noise='philox': torch's generator-driven normal_ cannot be "
                "replayed by a CUDA graph or traced by torch.compile without a graph break"
            )
        if self.capturable and self.sync_checks:
            raise ValueError(
                "sync_checks=True reads a flag on the host every step, which a captured step "
                "cannot do; read it with check() instead"
            )
        warmup.check_adapt_until(self.adapt_until)
        check_localization(self.localization)

    def init(
        self,
        params: Mapping[str, Tensor],
        *,
        num_chains: int | None = None,
        generator: torch.Generator | None = None,
        seeds: Sequence[int] | None = None,
    ) -> SamplerState:
        """Initial state, using the parameters in place. With ``num_chains=K`` every tensor carries
        K chains in a leading dim; ``seeds`` (one per chain) set the chains' Philox keys, so that
        chain k's noise depends on its seed alone."""
        if not params:
            raise ValueError("params is empty")
        if num_chains is not None:
            check_int("num_chains", num_chains, 1)
        names, tensors = list(params), list(params.values())
        for name, t in zip(names, tensors, strict=True):
            if not isinstance(t, Tensor):
                raise TypeError(f"parameter {name!r} is a {type(t).__name__}, not a tensor")
        layout = FlatLayout.from_tensors(names, tensors, num_chains)
        check_one_buffer(names, tensors)
        first = tensors[0]
        if isinstance(self.lr, Tensor):
            check_lr_tensor(self.lr, num_chains)
        check_generator(generator)
        gen = generator if generator is not None else new_generator(first.device)
        state = self.new_state(params, layout, gen)
        if seeds is not None:
            if len(seeds) != max(1, math.prod(layout.batch_shape)):
                raise ValueError(
                    f"seeds: {len(seeds)} given for {math.prod(layout.batch_shape)} chains"
                )
            state.keys.copy_(keys_from_seeds(list(seeds), first.device).view_as(state.keys))
        elif self.noise == "philox":
            state.keys.copy_(keys_from_generator(layout.batch_shape, gen, first.device))
        return state

    def new_state(
        self, params: Mapping[str, Tensor], layout: FlatLayout, generator: torch.Generator
    ) -> SamplerState:
        """A state over ``params`` (in place) of ``layout``: fresh statistics, step 0, the warm-up's
        arrival and the localisation's centre; its noise keys are the caller's to set."""
        tensors = list(params.values())
        stats = self.metric.checked_init(layout, tensors[0])
        state = SamplerState(dict(params), stats, 0, generator, layout)
        # the warm-up waits for the chain with one host read per window: not in captured steps,
        # not for shards (core.warmup)
        eligible = not self.capturable and layout.shards is None
        batch = layout.batch_shape
        state.warmup = warmup.new_arrival(self.metric, self.adapt_until, tensors, batch, eligible)
        if self.localization:  # θ₀: the chain's tensors as they are now
            state.center = [t.detach().clone() for t in tensors]
        return state

    def step(
        self,
        state: SamplerState,
        grads: Mapping[str, Tensor | None],
        *,
        inplace: bool = True,
        adapt: bool = True,
        telemetry: Tensor | None = None,
    ) -> SamplerState:
        """Advance ``state`` by one step given ĝ = ∇u_B by parameter name (missing or ``None``:
        skipped).

        ``inplace=False`` returns a new state; ``adapt=False`` freezes the metric for this step;
        ``telemetry``: a :func:`sgrld.core.engine.record_telemetry` accumulator.
        """
        if not isinstance(grads, Mapping):
            raise TypeError(
                f"grads must be a mapping from parameter names to tensors, got "
                f"{type(grads).__name__}"
            )
        unknown = set(grads) - set(state.params)
        if unknown:
            raise KeyError(f"gradients for unknown parameters {sorted(unknown)}")
        if not inplace:
            state = clone_state(state)
        self.move(state, [grads.get(n) for n in state.params], adapt=adapt, telemetry=telemetry)
        return state

    def move(
        self,
        state: SamplerState,
        grads: Sequence[Tensor | None],
        *,
        adapt: bool = True,
        telemetry: Tensor | None = None,
        checks: CheckMode | None = None,
        noise: NoiseSource | None = None,
    ) -> None:
        """The one step of every path (this API and each of
        :class:`~sgrld.SGRLDOptimizer`'s groups): :func:`sgrld.core.engine.advance` with this
        sampler's configuration over ``grads`` in ``state.params``' order, then the warm-up's host
        schedule (:mod:`sgrld.core.warmup`). ``checks`` and ``noise`` override the sampler's (a
        facade's pre-checked group, its traced steps)."""
        traced = in_graph()
        checks = self.checks(state) if checks is None else checks
        before = state.step
        engine.advance(
            self.metric,
            state,
            grads,
            lr=self.lr,
            num_data=self.num_data,
            temperature=self.temperature,
            checks=checks,
            adapt=adapt and warmup.adapting(state.step, self.adapt_until, state.warmup),
            noise_source=self.noise if noise is None else noise,
            compiled=self._compiled if self.compile else None,
            refresh=not (self.capturable and traced),
            telemetry=telemetry,
            closes_warmup=warmup.closes_warmup(
                self.metric, state.step + 1, self.adapt_until, state.warmup
            ),
            localization=self.localization,
            restarts=warmup.restart_steps(self.metric, self.adapt_until, state.warmup),
        )
        if state.step != before:
            warmup.after_step(self.metric, state)

    def run(
        self,
        state: SamplerState,
        grad_fn: Callable[[dict[str, Tensor]], Mapping[str, Tensor | None]],
        num_steps: int,
        *,
        adapt: bool = True,
        callback: Callable[[SamplerState], None] | None = None,
        account: runner.Account | None = None,
    ) -> SamplerState:
        """``num_steps`` steps in place, ĝ = ``grad_fn(state.params)``, through the chain runner
        (:func:`sgrld.core.runner.run`): a chain whose gradient is not finite is frozen there,
        the others go on, and :class:`NonFiniteGradientError` names them at the end;
        ``callback(state)`` after each step; ``account`` charged one gradient evaluation per
        chain and step. Tiny single-tensor problems: :class:`sgrld.core.multistep.BlockRunner`."""
        check_int("num_steps", num_steps, 0)
        each = None if callback is None else lambda _, __: callback(state)
        done = runner.run(
            [runner.StateChains(self, state, grad_fn, adapt=adapt)],
            ONE_BATCH,
            num_steps,
            account=account,
            each=each,
        )
        if done.failures:
            raise runner.stopped(done.failures)
        return state

    def checks(self, state: SamplerState, defer_traced: bool = False) -> CheckMode:
        """The check mode of ``state``'s steps (:mod:`sgrld.core.engine`): ``sync_checks=None``
        reads at once on CPU unless capturable, else defers to the device; ``defer_traced``: a
        step traced or captured defers such a check too (read at :meth:`check`), as the
        optimizer's do."""
        if not self.check_finite:
            return "off"
        sync = self.sync_checks
        if sync is None:
            device = next(iter(state.params.values())).device
            sync = device.type == "cpu" and not self.capturable
            sync = sync and not (defer_traced and in_graph())
        return "sync" if sync else "deferred"

    def deferred(self) -> Sampler:
        """This sampler with deferred checks (a bad step freezes its chain), its compiled step
        shared."""
        return self if self.sync_checks is False else self.retuned(sync_checks=False)

    def retuned(self, **changes: object) -> Sampler:
        """This sampler with ``changes`` (validated), its compiled step shared."""
        other = replace(self, **changes)  # type: ignore[arg-type]
        object.__setattr__(other, "_compiled", self._compiled)
        return other

    def check(self, state: SamplerState) -> None:
        """Raise :class:`NonFiniteGradientError` if a deferred check recorded a bad gradient."""
        engine.check(state)

    def refresh_due(self, state: SamplerState, step: int) -> bool:
        """Whether step ``step`` of ``state`` refreshes G: a scheduled refresh (Shampoo's roots)
        or the warm-up's last step, while G adapts (a frozen G's refresh would change nothing)."""
        metric, until, arrival = self.metric, self.adapt_until, state.warmup
        due = engine.refresh_due(metric, step) or warmup.closes_warmup(metric, step, until, arrival)
        return due and warmup.adapting(step - 1, until, arrival)

    def refresh_if_due(self, state: SamplerState) -> bool:
        """Run the metric's scheduled refresh if due at ``state.step`` (capturable samplers)."""
        if not self.refresh_due(state, state.step):
            return False
        self.metric.refresh(state.stats, state.layout)
        return True

    def refresh(self, state: SamplerState) -> SamplerState:
        """Recompute the explicitly scheduled part of the metric (Wenzel's preconditioner)."""
        self.metric.refresh(state.stats, state.layout)
        return state


def check_generator(generator: object) -> None:
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")


def clone_state(state: SamplerState) -> SamplerState:
    gen = torch.Generator(device=state.generator.device)
    gen.set_state(state.generator.get_state())
    arrival = state.warmup
    if arrival is not None:
        arrival = replace(arrival, sums=arrival.sums.clone(), count=arrival.count.clone())
    return SamplerState(
        {k: v.clone() for k, v in state.params.items()},
        {k: v.clone() for k, v in state.stats.items()},
        state.step,
        gen,
        copy.copy(state.layout),
        keys=state.keys.clone(),
        device_step=state.device_step.clone(),
        flags=state.flags.clone(),
        center=None if state.center is None else [c.clone() for c in state.center],
        warmup=arrival,
    )
