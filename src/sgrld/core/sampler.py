"""Functional core: ``build(metric, ...)`` → ``init(params) -> state``, ``step(state, grads)``.

The maths lives here once; :mod:`sgrld.optim` is a thin ``torch.optim`` facade over
:func:`sgrld_step`. Conventions (ℓ, n, τ, h, signs) are in ``docs/conventions.md``.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from sgrld.core.compiled import CompiledMove, check_compile
from sgrld.core.integrator import euler_maruyama, noise_scale
from sgrld.core.layout import FlatLayout
from sgrld.core.noise import NoiseSource, check_noise_source
from sgrld.core.state import SamplerState, Workspace, new_generator
from sgrld.metrics.base import Metric, Stats, check_range


class NonFiniteGradientError(FloatingPointError):
    """A gradient holds NaN or ±Inf; the step was refused and nothing was changed."""


def validate_hyperparameters(lr: float, num_data: float, temperature: float) -> None:
    check_range("lr", lr, lambda v: v > 0.0, "lr > 0")
    check_range("num_data", num_data, lambda v: v > 0.0, "num_data > 0")
    check_range("temperature", temperature, lambda v: v >= 0.0, "temperature >= 0")


def _check_finite(names: Sequence[str], layout: FlatLayout, flat: Tensor) -> None:
    # One reduction and one host sync: NaN/Inf anywhere makes the sum non-finite.
    if bool(torch.isfinite(flat.sum())):
        return
    for name, seg in zip(names, layout.segments(flat), strict=True):
        if not bool(torch.isfinite(seg).all()):
            raise NonFiniteGradientError(f"gradient of parameter {name!r} contains NaN or Inf")
    # The sum overflowed although every element is finite: nothing to refuse.


def _restrict(
    metric: Metric, stats: Stats, layout: FlatLayout, active: list[int]
) -> tuple[Stats, FlatLayout]:
    """Statistics of the parameters in ``active`` only (copies, written back by ``_merge``)."""
    sub_layout = FlatLayout(
        tuple(layout.names[i] for i in active),
        tuple(layout.shapes[i] for i in active),
        layout.batch_shape,
    )
    kinds = metric.stat_kinds(stats)
    index = {i: j for j, i in enumerate(active)}
    idx = torch.tensor(active)
    sub: Stats = {}
    for key, value in stats.items():
        if "@" in key:
            stat, i = key.rsplit("@", 1)
            if int(i) in index:
                sub[f"{stat}@{index[int(i)]}"] = value
        elif kinds[key] == "element":
            segs = layout.segments(value)
            sub[key] = torch.cat([segs[i] for i in active], dim=-1)
        elif kinds[key] == "tensor":
            sub[key] = value.index_select(-1, idx.to(value.device))
        else:
            sub[key] = value
    return sub, sub_layout


def _merge(metric: Metric, stats: Stats, sub: Stats, layout: FlatLayout, active: list[int]) -> None:
    kinds = metric.stat_kinds(stats)
    idx = torch.tensor(active)
    for key, value in stats.items():
        if "@" in key:
            stat, i = key.rsplit("@", 1)
            if int(i) in active:
                stats[key] = sub[f"{stat}@{active.index(int(i))}"]
        elif kinds[key] == "element":
            segs = layout.segments(value)
            for seg, src in zip(
                (segs[i] for i in active),
                sub[key].split([layout.numels[i] for i in active], -1),
                strict=True,
            ):
                seg.copy_(src)
        elif kinds[key] == "tensor":
            value.index_copy_(-1, idx.to(value.device), sub[key])
        else:
            stats[key] = sub[key]


@torch.no_grad()
def sgrld_step(
    metric: Metric,
    state: SamplerState,
    grads: Sequence[Tensor | None],
    *,
    lr: float,
    num_data: float,
    temperature: float,
    check_finite: bool = True,
    adapt: bool = True,
    noise_source: NoiseSource = "torch",
    compiled: CompiledMove | None = None,
) -> None:
    """One SGRLD step of ``state`` in place; parameters whose gradient is ``None`` are skipped.

    θ ← θ − ℓ·G⁻¹ĝ + √(2ℓτ/n)·G^{-1/2}ξ (paper eq. 4 with h = ℓ/n, Γ dropped). With
    ``adapt=False`` the metric's statistics are not updated: G stays as it is (a frozen metric
    makes the chain a fixed-preconditioner SGLD, e.g. after burn-in). ``noise_source`` picks
    the generator of ξ (:mod:`sgrld.core.noise`); with ``compiled`` the metric and the move run
    as one compiled call (:mod:`sgrld.core.compiled`).
    """
    layout = state.layout
    params = list(state.params.values())
    active = [i for i, g in enumerate(grads) if g is not None]
    if not active:
        return
    present = [g for g in grads if g is not None]
    if len(active) == len(params):
        if state.workspace is None:
            state.workspace = Workspace.for_layout(layout, params[0])
        work, stats, sub_layout = state.workspace, state.stats, layout
    else:  # rare: a subset of the group has gradients this step
        stats, sub_layout = _restrict(metric, state.stats, layout, active)
        work = Workspace.for_layout(sub_layout, params[0])
        params = [params[i] for i in active]
    grad = sub_layout.gather(present, work.grad)
    if check_finite:
        _check_finite(sub_layout.names, sub_layout, grad)

    step = state.step + 1
    sigma = noise_scale(lr, num_data, temperature)
    # ξ first: the generator drives nothing else, so the order does not change the chain.
    xi = work.noise.draw(state.generator, noise_source) if sigma > 0.0 else None
    fused = False
    if compiled is not None and stats is state.stats:  # a grad subset runs eagerly (rare)
        fused = compiled(metric, stats, sub_layout, grad, xi, params, step, lr, sigma, adapt)
    if not fused:
        if adapt:
            metric.update(stats, sub_layout, grad, step)
        drift = metric.inverse(stats, sub_layout, grad)
        noise = None
        if xi is not None:
            noise = sub_layout.views(metric.inverse_sqrt(stats, sub_layout, xi))
        euler_maruyama(params, sub_layout.views(drift), noise, lr, sigma)
    state.step = step
    if stats is not state.stats:
        _merge(metric, state.stats, stats, layout, active)


@dataclass(frozen=True)
class Sampler:
    """A configured SGRLD sampler: the functional API (blackjax / posteriors style).

    Example:
        >>> import torch, sgrld
        >>> sampler = sgrld.build("monge", lr=1e-2, num_data=100, alpha2=1.0)
        >>> state = sampler.init({"w": torch.zeros(3)}, generator=torch.Generator().manual_seed(0))
        >>> state = sampler.step(state, {"w": state.params["w"] - 1.0})
        >>> state.step
        1
    """

    metric: Metric
    lr: float
    num_data: float
    temperature: float = 1.0
    check_finite: bool = True
    noise: NoiseSource = "torch"
    compile: bool = False
    # the compiled step (compile=True), shared by the states this sampler steps; not state
    _compiled: list[CompiledMove] = field(
        default_factory=list, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        validate_hyperparameters(self.lr, self.num_data, self.temperature)
        check_noise_source(self.noise)
        check_compile(self.compile, self.metric)

    def init(
        self,
        params: Mapping[str, Tensor],
        *,
        num_chains: int | None = None,
        generator: torch.Generator | None = None,
    ) -> SamplerState:
        """Initial state. With ``num_chains=K`` every tensor carries K chains in a leading dim.

        The parameters are used (and later updated) in place, not copied.
        """
        if not params:
            raise ValueError("params is empty")
        if num_chains is not None and (not isinstance(num_chains, int) or num_chains < 1):
            raise ValueError(f"invalid num_chains: {num_chains!r} (expected an int >= 1)")
        names, tensors = list(params), list(params.values())
        layout = FlatLayout.from_tensors(names, tensors, num_chains)
        first = tensors[0]
        if not all(t.dtype == first.dtype and t.device == first.device for t in tensors):
            raise ValueError("all parameters of a sampler must share one dtype and device")
        if not first.is_floating_point():
            raise ValueError(f"parameters must be floating point, got {first.dtype}")
        gen = generator if generator is not None else new_generator(first.device)
        stats = self.metric.init(layout, first)
        return SamplerState(dict(params), stats, 0, gen, layout)

    def step(
        self,
        state: SamplerState,
        grads: Mapping[str, Tensor | None],
        *,
        inplace: bool = True,
        adapt: bool = True,
    ) -> SamplerState:
        """Advance ``state`` by one step given the gradients of the per-datum potential.

        ``grads`` maps parameter names to ĝ = ∇u_B (see ``docs/conventions.md``); a missing name
        or ``None`` skips that parameter. With ``inplace=False`` the input state is left
        untouched and a new one is returned; ``adapt=False`` freezes the metric for this step.
        """
        unknown = set(grads) - set(state.params)
        if unknown:
            raise KeyError(f"gradients for unknown parameters {sorted(unknown)}")
        if not inplace:
            state = clone_state(state)
        sgrld_step(
            self.metric,
            state,
            [grads.get(n) for n in state.params],
            lr=self.lr,
            num_data=self.num_data,
            temperature=self.temperature,
            check_finite=self.check_finite,
            adapt=adapt,
            noise_source=self.noise,
            compiled=self._compiled_move(),
        )
        return state

    def _compiled_move(self) -> CompiledMove | None:
        if not self.compile:
            return None
        if not self._compiled:
            self._compiled.append(CompiledMove())
        return self._compiled[0]

    def refresh(self, state: SamplerState) -> SamplerState:
        """Recompute the explicitly scheduled part of the metric (Wenzel's preconditioner)."""
        self.metric.refresh(state.stats, state.layout)
        return state


def clone_state(state: SamplerState) -> SamplerState:
    gen = torch.Generator(device=state.generator.device)
    gen.set_state(state.generator.get_state())
    return SamplerState(
        {k: v.clone() for k, v in state.params.items()},
        {k: v.clone() for k, v in state.stats.items()},
        state.step,
        gen,
        copy.copy(state.layout),
    )
