""":class:`SGRLDOptimizer`: every sampler as a ``torch.optim`` optimizer, a step being
:func:`sgrld.core.engine.advance` per parameter group."""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import math
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, Literal, overload

import torch
from torch import Tensor

from sgrld.chain_health import WATCH_EVERY, Health
from sgrld.core.compiled import CompiledMove
from sgrld.core.contract import check_bool, check_groups, check_options, option_names
from sgrld.core.engine import (
    CheckMode,
    NonFiniteGradientError,
    advance,
    check,
    check_finite_now,
    check_mode,
    in_graph,
    refresh_due,
    telemetry_figures,
    validate_grads,
)
from sgrld.core.layout import FlatLayout, check_one_buffer
from sgrld.core.noise import NoiseSource
from sgrld.core.param_state import GENERATOR
from sgrld.core.precision import LowPrecision, StandIns, check_low_precision, is_low_precision
from sgrld.core.replicas import check_same_noise
from sgrld.core.sampler import check_flags
from sgrld.core.shards import is_sharded, local
from sgrld.core.state import SamplerState, new_generator
from sgrld.core.warmup import (
    DEFAULT_WARMUP,
    adapting,
    after_step,
    closes_warmup,
    new_arrival,
    warmup_length,
)
from sgrld.integrations.huggingface import TrainerWatch
from sgrld.metrics import Metric, get_metric
from sgrld.optim import loading
from sgrld.optim.groups import (
    as_scalar,
    check_masks,
    check_sharded,
    follow_shards,
    masks_by_parameter,
    own,
    publish_group,
    refuse_duplicates,
    validate_group,
)
from sgrld.optim.watch import (
    WATCH_KEY,
    WINDOW_STEPS,
    HealthWatch,
    chain_sums,
    new_sums,
    over_the_mesh,
    settled,
)

ParamsT = Iterable[Tensor] | Iterable[tuple[str, Tensor]] | Iterable[dict[str, Any]]

#: metric fields that fix the layout of the statistics: not changeable after the first step
_STRUCTURAL = ("block_size", "tiling", "precondition_vectors", "row_shards", "scope")


def _metric_options(metric: Metric) -> dict[str, Any]:
    """The metric's public hyper-parameters and their values, e.g. ``alpha2``, ``decay``."""
    return {name: getattr(metric, name) for name in option_names(type(metric))}


def _check_schedule(refresh_every: int | None, batch_size: int | None, metric: Metric) -> None:
    """The host's refresh schedule: one of the two, for a metric refreshed per epoch."""
    for name, value in (("refresh_every", refresh_every), ("batch_size", batch_size)):
        if value is not None and (type(value) is not int or value < 1):
            raise ValueError(f"invalid {name}: {value!r} (expected an integer >= 1 or None)")
    if refresh_every is not None and batch_size is not None:
        raise ValueError("give refresh_every or batch_size, not both")
    if (refresh_every or batch_size) and not metric.refresh_per_epoch:
        raise ValueError(
            f"refresh_every/batch_size: the {metric.name} metric has no per-epoch refresh"
        )


class SGRLDOptimizer(torch.optim.Optimizer):
    """SGRLD with an arbitrary metric plug-in: θ ← θ − ℓ G⁻¹ĝ + √(2ℓτ/n) G^{-1/2}ξ, ĝ the
    gradient of the per-datum potential in ``p.grad`` (``docs/conventions.md``).

    Each parameter group is one metric (Monge's inner products and Wenzel's normalisation run over
    a group's parameters, as in the paper's code); the presets (:class:`~sgrld.SGLD`, ...) are this
    class with the metric fixed.

    Args:
        params: parameters, ``(name, parameter)`` pairs (messages then use the names) or groups,
            which may override ``lr``, ``num_data``, ``temperature``, ``adapt_until``,
            ``adapt_metric`` (False freezes the metric) and any option of the metric.
        lr: ℓ ≥ 0 (h = ℓ / num_data): a float or a one-element tensor (a scheduler then changes it
            on the device, and a compiled step does not recompile).
        num_data: number of training data n > 0.
        temperature: τ ≥ 0; 0 gives deterministic preconditioned descent (no noise drawn).
        metric: the metric G, or its registry name or alias (``"rmsprop"``) built with
            ``metric_options``; a preset's is its :attr:`metric_class`.
        generator: drives the noise (default: a private one seeded from torch's global
            generator); saved in :meth:`state_dict`.
        check_finite: refuse a step whose gradient holds NaN/Inf, naming the parameter and step;
            nothing changes in any group (:mod:`sgrld.core.engine`).
        sync_checks: ``None``: read the check at once on CPU, defer it on CUDA and in traced steps
            to :meth:`check`, :meth:`state_dict` and refreshes; ``True``: always at once;
            ``False``: always deferred.
        noise: ``"torch"`` (``normal_`` with ``generator``) or ``"philox"`` (counter-based,
            :mod:`sgrld.core.noise`); ``None``: ``"philox"`` if ``capturable`` or sharded, else
            ``"torch"`` (a traced ``"torch"`` step draws Philox keyed by the generator's seed).
        compile: run each step's body as one ``torch.compile``d call (:mod:`sgrld.core.compiled`).
        capturable: steps free of host reads and Python randomness, as torch.optim's; checks are
            deferred and a traced step's Shampoo refresh is left to :meth:`refresh_if_due`.
        low_precision: parameters of fewer bits than ``master_dtype``: ``"master"`` (a copy in the
            state carries the chain), ``"stochastic"`` (unbiased rounding) or ``"nearest"``
            (warns: small moves are lost); :mod:`sgrld.core.precision`.
        master_dtype: the dtype of master copies and low-precision arithmetic (float32).
        telemetry: sum per-step figures on the device, read by :meth:`telemetry`.
        masks: ``{parameter: bool tensor of its shape}`` (global shape if sharded; a key may be
            the parameter's name where ``model.named_parameters()`` was given): only the
            ``True`` elements are sampled, the others stay fixed bit for bit.
        data_parallel: whether the ranks of a process group hold replicas of one chain (DDP): the
            first step then refuses ranks that would draw different noise. ``None``: whenever a
            group of several ranks exists; ``False``: independent chains per rank.
        adapt_until: the metric adapts during the first ``adapt_until`` steps, then G is
            frozen; the default ``Windows(1000, arrival=True)`` is Stan's windowed warm-up of
            1,000 steps (G frozen from step 950), extended while the chain is still travelling
            (:mod:`sgrld.core.warmup`); ``None`` always adapts (the paper's, biased:
            ``docs/posterior.md``).
        localization: c ≥ 0, the pull c·(θ − θ₀) towards the parameters at construction, added
            to the drift's gradient only (``docs/llc.md``).
        refresh_every: refresh a per-epoch metric (Wenzel's) every ``refresh_every`` steps;
            ``None``: the caller calls :meth:`refresh_metric`.
        batch_size: instead of ``refresh_every``: refresh every ⌈num_data / batch_size⌉ steps.
        **metric_options: the metric's options when ``metric`` is a name or the class a preset,
            e.g. ``WenzelSGLD(params, lr=0.05, num_data=n, min_scale=0.1)``.

    The state is torch.optim's ``optimizer.state[p]`` from construction on, every tensor a step
    depends on (:mod:`sgrld.core.param_state`), so :meth:`state_dict`, ``copy.deepcopy``,
    pickling and ``torch.distributed.checkpoint`` carry it.

    References:
        Yu et al., Scalable SGRLD in Non-Diagonal Metrics, TMLR 2023, eq. 4.
    """

    #: the metric of a preset (built from the keyword options); ``None``: ``metric=`` gives it
    metric_class: ClassVar[type[Metric] | None] = None
    #: attributes besides torch's (defaults, state, param_groups) that a copy carries
    _config_attrs: tuple[str, ...] = tuple(
        "metric _options check_finite noise compile capturable sync_checks "  # noqa: SIM905
        "low_precision master_dtype telemetry_enabled _masks data_parallel localization "
        "refresh_every _last_refresh".split()
    )
    refresh_every: int | None = None
    _last_refresh = 0  # the step of the last refresh_metric()

    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor,
        num_data: float,
        temperature: float = 1.0,
        *,
        metric: Metric | str | None = None,
        generator: torch.Generator | None = None,
        check_finite: bool = True,
        noise: NoiseSource | None = None,
        compile: bool = False,
        capturable: bool = False,
        sync_checks: bool | None = None,
        low_precision: LowPrecision = "master",
        master_dtype: torch.dtype = torch.float32,
        telemetry: bool = False,
        masks: Mapping[Any, Tensor] | None = None,
        data_parallel: bool | None = None,
        adapt_until: int | None = DEFAULT_WARMUP,
        localization: float = 0.0,
        refresh_every: int | None = None,
        batch_size: int | None = None,
        **metric_options: Any,
    ) -> None:
        validate_group(lr, num_data, temperature)
        if not (isinstance(localization, (int, float)) and 0.0 <= localization < math.inf):
            raise ValueError(f"invalid localization: {localization!r} (expected finite >= 0)")
        metric = self._make_metric(metric, metric_options)
        if data_parallel is not None and not isinstance(data_parallel, bool):
            raise ValueError(f"invalid data_parallel: {data_parallel!r} (expected None or a bool)")
        check_bool("telemetry", telemetry)
        _check_schedule(refresh_every, batch_size, metric)
        check_low_precision(low_precision, master_dtype)
        requested_noise = noise
        if noise is None:
            noise = "philox" if capturable is True else "torch"
        check_flags(metric, noise, compile, check_finite, capturable, sync_checks)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
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
        self._group_states: list[SamplerState] = []
        self._group_metrics: list[Metric] = []
        # the group options each group's metric was made from (a step compares, not rebuilds)
        self._group_options: list[dict[str, Any]] = []
        self._ready = False  # groups get their state once the generator exists
        self.low_precision: LowPrecision = low_precision
        self.master_dtype = master_dtype
        # per group with low-precision or masked parameters: the tensors stepped in their place
        self._standins: dict[int, StandIns] = {}
        self._warned_nearest = False
        self.telemetry_enabled = telemetry
        self._telemetry: dict[int, Tensor] = {}  # per group: float64 (4,) device sums
        self._watch = HealthWatch()
        self._masks: dict[Any, Tensor] = dict(masks or {})
        self.data_parallel = data_parallel
        self.localization = float(localization)
        self._replicas_checked = data_parallel is False
        if batch_size is not None:
            refresh_every = math.ceil(num_data / batch_size)
        self.refresh_every = refresh_every
        super().__init__(params, defaults)
        self.register_step_pre_hook(TrainerWatch())  # what transformers.Trainer changes, warned
        named = [
            pair
            for g in self.param_groups
            for pair in zip(g.get("param_names", ()), g["params"], strict=False)
        ]
        self._masks = masks_by_parameter(self._masks, named)  # keys: parameters or names
        check_masks(self._masks, [p for g in self.param_groups for p in g["params"]])
        self.check_finite = check_finite
        sharded = any(is_sharded(p) for g in self.param_groups for p in g["params"])
        if sharded and requested_noise is None:
            noise = "philox"  # drawn at each shard's global indices (sgrld.core.shards)
        self.noise: NoiseSource = noise
        self.compile = compile
        self.capturable = capturable
        self.sync_checks = sync_checks
        # per param group (compile=True)
        self._compiled: defaultdict[int, CompiledMove] = defaultdict(CompiledMove)
        device = self.param_groups[0]["params"][0].device
        self.generator = generator if generator is not None else new_generator(device)
        self._ready = True
        for index in range(len(self.param_groups)):
            self._build(index)

    def _make_metric(self, metric: Metric | str | None, options: dict[str, Any]) -> Metric:
        """The metric from ``metric`` (or the preset's class) and the keyword options left."""
        owner = type(self).__name__
        given: Metric | type[Metric] | str | None = metric
        if self.metric_class is not None:
            if metric is not None:
                raise TypeError(
                    f"{owner} takes no metric= (its metric is {self.metric_class.name})"
                )
            given = self.metric_class
        elif metric is None:
            raise TypeError(f"{owner} needs metric=: a Metric or a registry name")
        elif isinstance(metric, str):
            owner, given = f"{owner}({metric!r})", get_metric(metric)
        if isinstance(given, Metric):  # its options are set on the instance, not beside it
            check_options(type(given), options, owner, _FACADE_OPTIONS, instance=True)
            return given
        if not (isinstance(given, type) and issubclass(given, Metric)):
            raise TypeError(f"metric must be a Metric or a registry name, not {metric!r}")
        check_options(given, options, owner, _FACADE_OPTIONS)
        return given(**options)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        param_group = {**param_group, "params": refuse_duplicates(param_group["params"])}
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        index = len(self.param_groups) - 1
        params: list[Tensor] = group["params"]
        # stepped as one flat buffer: one dtype and device, floating
        check_one_buffer(self._names(index), params, " (put the others in a group of their own)")
        validate_group(group["lr"], group["num_data"], group["temperature"], group["adapt_until"])
        self._group_metric(group)  # validates the group's metric options now
        low = is_low_precision(params[0].dtype, self.master_dtype)
        if low and self.low_precision == "nearest" and not self._warned_nearest:
            self._warned_nearest = True
            warnings.warn(
                f"parameters in {params[0].dtype} with low_precision='nearest': every move is "
                "rounded to nearest in that dtype, so moves smaller than half a unit in the last "
                "place are lost (the chain freezes or samples the wrong variance); low_precision"
                "='master' (the default) keeps a float32 copy, 'stochastic' rounds without bias",
                RuntimeWarning,
                stacklevel=3,
            )
        for p in params:
            own(p, self)
        if self._ready:
            self._build(index)

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

    def _new_state(
        self, index: int, metric: Metric, group: dict[str, Any] | None = None
    ) -> tuple[SamplerState, StandIns | None]:
        """Fresh state of group ``index`` (or of ``group``, its future self on a load) over the
        parameters or their stand-ins; its noise key is set by :meth:`_build`."""
        group = self.param_groups[index] if group is None else group
        params: list[Tensor] = group["params"]
        masks = [self._masks.get(p) for p in params]
        standins = None
        names = self._names(index)
        if StandIns.needed(params, masks, self.low_precision, self.master_dtype):
            standins = StandIns(params, masks, self.low_precision, self.master_dtype)
            params = standins.work
            layout = standins.layout(names)
        else:
            layout = FlatLayout.from_tensors(names, params)
        if layout.shards is not None:
            check_sharded(names[0], self.noise, self.compile, self.capturable)
        shards = [local(p) for p in params]  # the rank's shards of sharded parameters
        stats = metric.checked_init(layout, shards[0])
        state = SamplerState(
            dict(zip(names, shards, strict=True)), stats, 0, self.generator, layout
        )
        if self.localization:  # θ₀: the chain's tensors (master copies) as they are now
            state.center = [t.detach().clone() for t in shards]
        # the warm-up waits for the chain with one host read per window: not in captured steps
        eligible = not self.capturable and layout.shards is None
        state.warmup = new_arrival(metric, group["adapt_until"], shards, (), eligible)
        return state, standins

    def _build(self, index: int, keys: Tensor | None = None) -> None:
        """Create group ``index``'s state (with ``keys``, or new ones) in ``self.state``."""
        metric = self._group_metric(self.param_groups[index])
        state, standins = self._new_state(index, metric)
        if keys is None:
            keys = loading.new_key(self.noise, self.generator, state.keys.device)
        state.keys.copy_(keys)
        self._install(index, state, metric, standins)

    def _install(
        self, index: int, state: SamplerState, metric: Metric, standins: StandIns | None
    ) -> None:
        """Make ``state`` group ``index``'s, published in ``self.state``."""
        group = self.param_groups[index]
        self._group_states[index : index + 1] = [state]  # replaced, or appended (a new group)
        self._group_metrics[index : index + 1] = [metric]
        self._group_options[index : index + 1] = [{k: group[k] for k in self._options}]
        entries = publish_group(metric, state, standins)
        self.state.update(zip(group["params"], entries, strict=True))
        if standins is None:
            self._standins.pop(index, None)
        else:
            self._standins[index] = standins
        if index == 0:
            self._snapshot_generator()
        self._compiled.pop(index, None)

    def _snapshot_generator(self) -> None:
        """Write the generator's state into the first parameter's state."""
        first = self.param_groups[0]["params"][0]
        self.state[first][GENERATOR] = self.generator.get_state()

    def _group_state(self, index: int) -> SamplerState:
        """Group ``index``'s state, after the group options changed since its last step."""
        state = self._group_states[index]
        group = self.param_groups[index]
        options = {k: group[k] for k in self._options}
        if options != self._group_options[index]:
            current = self._group_metrics[index]
            if state.step == 0:  # nothing to keep yet: a layout may still change
                self._build(index, state.keys.clone())
                state = self._group_states[index]
            else:
                self._group_metrics[index] = self._group_metric(group, current)
                self._group_options[index] = options
        return state

    # --- what the functional core sees (capture, the runner) ---------------------------------

    @property
    def sampler_states(self) -> list[SamplerState]:
        """Each parameter group's :class:`sgrld.SamplerState`: the live tensors the next
        :meth:`step` reads and writes."""
        return [self._group_state(i) for i in range(len(self.param_groups))]

    @property
    def group_metrics(self) -> list[Metric]:
        """Each parameter group's metric: :attr:`metric` with the group's own options."""
        for index in range(len(self.param_groups)):
            self._group_state(index)  # a group's options changed since: its metric follows
        return list(self._group_metrics)

    def refreshes_next(self) -> bool:
        """Whether the coming step refreshes G on the host (Shampoo's roots, the warm-up's end, a
        ``refresh_every`` refresh): a step a CUDA graph cannot replay.
        """
        groups = enumerate(zip(self.sampler_states, self.param_groups, strict=True))
        # a frozen metric (adapt_metric False) is not refreshed
        if any(g["adapt_metric"] and self._refresh_due(i, s.step + 1) for i, (s, g) in groups):
            return True
        every = self.refresh_every
        return every is not None and (self.num_steps + 1) % every == 0

    def _refresh_due(self, index: int, step: int) -> bool:
        """Whether step ``step`` of group ``index`` refreshes G (scheduled or the warm-up's last
        step).
        """
        metric, until = self._group_metrics[index], self.param_groups[index]["adapt_until"]
        arrival = self._group_states[index].warmup
        due = refresh_due(metric, step) or closes_warmup(metric, step, until, arrival)
        return due and adapting(step - 1, until, arrival)

    def after_replay(self) -> None:
        """The host's part of a step replayed from a CUDA graph: counters advance, the schedule
        runs.
        """
        for state in self._group_states:
            state.step += 1
        self._after_step()

    def _after_step(self) -> None:
        """The host's schedule after a step: the metric's refresh every ``refresh_every``."""
        if self.refresh_every is not None and self.num_steps % self.refresh_every == 0:
            self.refresh_metric()

    # --- the step ----------------------------------------------------------------------------

    def _checks(self, state: SamplerState) -> CheckMode:
        device = next(iter(state.params.values())).device
        mode = check_mode(self.check_finite, self.sync_checks, device, self.capturable)
        if mode == "sync" and self.sync_checks is None and in_graph():
            return "deferred"  # a traced step cannot read the host: checked at check()
        return mode

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One sampler step for every parameter group (grads of ``None`` are skipped); every group's
        gradients are validated before any group moves, so a refused step changes nothing.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        states = self.sampler_states
        if not self._replicas_checked and not in_graph():
            self._check_replicas()
        grads = [self._grads(i) for i in range(len(self.param_groups))]
        modes = [self._checks(state) for state in states]
        traced = in_graph()
        noise: NoiseSource = "philox" if traced else self.noise
        # the health watch (sgrld.health): this step's figures summed if it is a watched one
        watched = not traced and (states[0].step + 1) % WATCH_EVERY == 0
        check_groups(self.param_groups)  # ℓ, n, τ may have been set since (contract)
        try:
            if len(states) > 1:  # refuse before the first group moves
                for index, (state, gs) in enumerate(zip(states, grads, strict=True)):
                    validate_grads(state, gs)
                    if modes[index] == "sync":
                        check_finite_now(state, gs)
                        modes[index] = "off"  # checked just now: not again inside the step
            steps_before = [state.step for state in states]
            for index, (group, state) in enumerate(zip(self.param_groups, states, strict=True)):
                metric, standins = self._group_metrics[index], self._standins.get(index)
                if state.layout.shards is not None and standins is None:
                    follow_shards(state, group["params"])  # stand-ins stay where they are
                if standins is not None:  # step master copies, scratch or selected elements
                    standins.pull()
                telemetry = self._accumulator(index)
                # a watched step's sums go to the watch and the user's telemetry both
                device = group["params"][0].device
                sums = self._watch.step_sums(index, device) if watched else telemetry
                advance(
                    metric,
                    state,
                    grads[index],
                    lr=as_scalar(group["lr"]),
                    num_data=group["num_data"],
                    temperature=group["temperature"],
                    checks=modes[index],
                    adapt=self.adapts(index),
                    noise_source=noise,
                    compiled=self._compiled[index] if self.compile else None,
                    refresh=not (self.capturable and traced),
                    telemetry=sums,
                    localization=self.localization,
                    closes_warmup=closes_warmup(
                        metric, state.step + 1, group["adapt_until"], state.warmup
                    ),
                )
                if state.step != steps_before[index]:
                    after_step(metric, state)  # the warm-up's host schedule (core.warmup)
                if watched:
                    assert sums is not None
                    self._watch.add(index, sums, telemetry)
                if standins is not None:
                    standins.push(state.keys, state.device_step)
        except NonFiniteGradientError as exc:
            window = self._open_window()  # a read on the error path
            message = self._watch.nonfinite_message(str(exc), states[0].step + 1, window)
            raise NonFiniteGradientError(message) from None
        self._after_step()
        steps = states[0].step
        # after the step's bookkeeping: a warning raised as an error leaves it done
        if watched and steps % WINDOW_STEPS == 0:
            self._watch.end_window(self._open_window(), self._settled(steps))
        return loss

    def _grads(self, index: int) -> list[Tensor | None]:
        """Group ``index``'s gradients, in the dtype of the tensors stepped (master copies)."""
        params = self.param_groups[index]["params"]
        grads: list[Tensor | None] = [None if p.grad is None else local(p.grad) for p in params]
        standins = self._standins.get(index)
        if standins is None:
            return grads
        for name, p, g in zip(self._names(index), params, grads, strict=True):
            shard = local(p)  # a sharded gradient's shard against the parameter's
            if g is not None and (g.dtype != shard.dtype or g.shape != shard.shape):
                raise ValueError(
                    f"gradient of parameter {name!r} is {g.dtype} of shape {tuple(g.shape)}, "
                    f"the parameter {shard.dtype} of shape {tuple(shard.shape)}: a gradient must "
                    "have its parameter's dtype and shape"
                )
        return standins.grads(grads)

    def _check_replicas(self) -> None:
        """Before the first step, under a process group (DistributedDataParallel, or FSDP2's
        shards of one chain), every rank must draw the same noise (one all-gather)."""
        keys = [state.keys.reshape(-1).cpu() for state in self._group_states]
        generator = self.generator.get_state().to(torch.int64)
        device = self.param_groups[0]["params"][0].device
        check_same_noise(torch.cat([*keys, generator]).to(device))
        self._replicas_checked = True

    # --- health and telemetry ----------------------------------------------------------------

    def _open_window(self) -> dict[str, float] | None:
        shards = [state.layout.shards for state in self._group_states]
        return self._watch.open_window(shards, self.param_groups[0]["temperature"])

    def _settled(self, steps: int) -> bool:
        """Past the warm-up as it stands (extended while the chain travelled); a metric that
        adapts nothing (G = I, or frozen by the user) has none to wait for."""
        group = self.param_groups[0]
        if not (group["adapt_metric"] and self.group_metrics[0].preconditions):
            return settled(steps, 0)
        return settled(steps, warmup_length(group["adapt_until"], self.sampler_states[0].warmup))

    def health(self) -> Health:
        """The chain's health (:func:`sgrld.health`) from every step so far. Every optimizer watches
        one step in 16 on the device and reads the figures once per 512 steps, warning once per
        verdict (:class:`sgrld.HealthWarning`); this reads the open window too (under FSDP an
        all-reduce: call it on every rank)."""
        return self._watch.verdict(self._settled(self.num_steps), self._open_window())

    def _accumulator(self, index: int) -> Tensor | None:
        if not self.telemetry_enabled:
            return None
        if index not in self._telemetry:
            self._telemetry[index] = new_sums(self.param_groups[index]["params"][0].device)
        return self._telemetry[index]

    @overload
    def telemetry(
        self, reset: bool = True, *, per_group: Literal[False] = False
    ) -> dict[str, float]: ...

    @overload
    def telemetry(
        self, reset: bool = True, *, per_group: Literal[True]
    ) -> list[dict[str, float]]: ...

    def telemetry(
        self, reset: bool = True, *, per_group: bool = False
    ) -> dict[str, float] | list[dict[str, float]]:
        """Per-step figures of the chain since the last read (``telemetry=True``), summed on the
        device.

        ``steps``; ``drift_rms``, ``noise_rms`` and ``theta_norm``, the RMS over the steps of
        ‖ℓG⁻¹ĝ‖, ‖σG^{-½}ξ‖ and ‖θ‖; ``drift_to_noise`` (healthy chains 0.04–0.35; above 1 ℓ is too
        large: ``docs/health.md``); and the metric's own (:meth:`Metric.diagnostics`). Norms are of
        all groups together (a metric figure is its largest); ``per_group=True`` gives one mapping
        per group. Each read starts new sums unless ``reset=False``."""
        if not self.telemetry_enabled:
            raise RuntimeError("telemetry is off: build the optimizer with telemetry=True")
        sums_of, extras = [], []
        for index, (metric, state) in enumerate(
            zip(self._group_metrics, self._group_states, strict=True)
        ):
            acc = self._accumulator(index)
            assert acc is not None
            diagnostics = metric.diagnostics(state.stats, state.layout)
            sums = acc.clone()
            if state.layout.shards is not None:
                sums, diagnostics = over_the_mesh(state.layout.shards, sums, diagnostics)
            sums_of.append(sums.tolist())
            extras.append({key: float(value) for key, value in diagnostics.items()})
            if reset:
                acc.zero_()
        if per_group:
            return [telemetry_figures(s, e) for s, e in zip(sums_of, extras, strict=True)]
        extra: dict[str, float] = {}
        for e in extras:
            for key, value in e.items():
                extra[key] = max(value, extra.get(key, -math.inf))
        return telemetry_figures(chain_sums(sums_of), extra)

    # --- checks, refreshes, the metric's adaptation ------------------------------------------

    def check(self) -> None:
        """Raise :class:`~sgrld.core.NonFiniteGradientError` if a deferred check recorded a NaN/Inf
        gradient, naming the first bad step and parameter.
        """
        for index, state in enumerate(self._group_states):
            check(state, f"param group {index}: " if len(self._group_states) > 1 else "")

    def refresh_if_due(self) -> bool:
        """Run a due scheduled refresh (Shampoo's roots) in every group, for ``capturable``
        optimizers; returns whether one ran."""
        due = [i for i, s in enumerate(self._group_states) if self._refresh_due(i, s.step)]
        for index in due:
            state = self._group_states[index]
            self._group_metrics[index].refresh(state.stats, state.layout)
        return bool(due)

    def refresh_metric(self) -> None:
        """Recompute the explicitly scheduled part of the metric in every group (Wenzel's
        scales).
        """
        for metric, state in zip(self.group_metrics, self._group_states, strict=True):
            metric.refresh(state.stats, state.layout)
        self._last_refresh = self.num_steps

    def adapts(self, index: int = 0) -> bool:
        """Whether group ``index``'s next step updates its metric."""
        group, state = self.param_groups[index], self._group_states[index]
        until = group["adapt_until"]
        return bool(group["adapt_metric"]) and adapting(state.step, until, state.warmup)

    def freeze_metric(self, frozen: bool = True) -> None:
        """Stop (or resume) updating the metric's statistics in every group."""
        for group in self.param_groups:
            group["adapt_metric"] = not frozen

    def state_bytes(self) -> dict[str, int]:
        """Bytes of optimizer state per parameter name (statistics, master copies, step, keys,
        generator), to size block sizes and precision before a run."""
        out: dict[str, int] = {}
        for index, group in enumerate(self.param_groups):
            for name, p in zip(self._names(index), group["params"], strict=True):
                out[name] = sum(  # a sharded statistic's bytes on this rank: its shard's
                    local(v).numel() * v.element_size()
                    for v in self.state[p].values()
                    if isinstance(v, Tensor)
                )
        return out

    @property
    def num_steps(self) -> int:
        """Steps taken by the first parameter group (the optimizer's own counter)."""
        return self._group_states[0].step

    # --- state dicts and copies --------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's state dict, holding every tensor a step depends on; deferred checks are
        read first (a chain with a non-finite gradient is not checkpointed). As in torch, the
        tensors are the optimizer's own."""
        self.check()
        self._snapshot_generator()
        state_dict = super().state_dict()
        if self._watch.first is not None:  # the health watch's reference: ‖θ‖, drift at start
            state_dict[WATCH_KEY] = dict(self._watch.first)
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` (or one of sgrld's first format, converted).

        After the pre-hooks everything is validated before anything is applied, so a refused dict
        leaves the optimizer as it was; missing group options take their defaults; floating-point
        state is cast to the parameters' dtype and device. The post-hooks run last.
        """
        if not isinstance(state_dict, dict):
            raise ValueError(f"not an optimizer state dict: a {type(state_dict).__name__}")
        state_dict = dict(state_dict)
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        self._load(state_dict)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _load(self, state_dict: dict[str, Any]) -> None:
        """Validate ``state_dict`` completely (:func:`~sgrld.optim.loading.plan`), then apply it."""
        target = loading.Target(self.param_groups, self.metric, self.noise, self.generator,
                                self._group_metric, self._names, self._new_state)  # fmt: skip
        load = loading.plan(target, state_dict)
        self.param_groups = load.groups
        self.state = defaultdict(dict)
        self._compiled = defaultdict(CompiledMove)
        self._standins = {}
        self._watch = HealthWatch(load.watch_first)
        load.copy()
        self.generator.set_state(load.generator_state.to("cpu", torch.uint8))
        for index, ((state, standins), metric) in enumerate(
            zip(load.fresh, load.metrics, strict=True)
        ):
            self._install(index, state, metric, standins)

    def __getstate__(self) -> dict[str, Any]:
        self._snapshot_generator()
        state = super().__getstate__()
        state["_sgrld"] = {name: getattr(self, name) for name in self._config_attrs}
        state["_sgrld"]["generator_device"] = str(self.generator.device)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A copy (deepcopy, pickle, ``torch.save``): the configuration restored, the per-parameter
        state loaded into fresh flat buffers."""
        config = dict(state.pop("_sgrld"))
        super().__setstate__(state)
        self.generator = torch.Generator(device=config.pop("generator_device"))
        for name, value in config.items():
            setattr(self, name, value)
        self._telemetry = {}
        self._replicas_checked = self.data_parallel is False
        self._warned_nearest = self._ready = True
        self._group_states, self._group_metrics, self._group_options = [], [], []
        ids = itertools.count()  # as state_dict packs them: parameters by index
        groups = [{**g, "params": [next(ids) for _ in g["params"]]} for g in self.param_groups]
        params = [p for g in self.param_groups for p in g["params"]]
        saved = {i: self.state[p] for i, p in enumerate(params)}
        self._load({"state": saved, "param_groups": groups})


#: the optimizer's own keyword arguments, suggested for a misspelt metric option too
_FACADE_OPTIONS = [
    name
    for name, p in inspect.signature(SGRLDOptimizer.__init__).parameters.items()
    if p.kind is p.KEYWORD_ONLY
]
