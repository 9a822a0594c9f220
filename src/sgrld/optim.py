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
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, overload

import torch
from torch import Tensor

from sgrld.chain_health import WATCH_EVERY, WATCH_WINDOW, Health, Watch
from sgrld.core.compiled import CompiledMove, check_compile
from sgrld.core.contract import check_options, option_names
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
from sgrld.core.layout import FlatLayout
from sgrld.core.noise import (
    NoiseSource,
    check_noise_source,
    keys_from_generator,
    keys_from_seeds,
)
from sgrld.core.param_state import (
    GENERATOR,
    MASTER,
    apply_load,
    plan_load,
    publish,
    shard_key,
)
from sgrld.core.precision import (
    LowPrecision,
    StandIns,
    check_low_precision,
    is_low_precision,
)
from sgrld.core.replicas import check_same_noise
from sgrld.core.sampler import check_flags, validate_hyperparameters
from sgrld.core.shards import ShardSpec, is_sharded, local
from sgrld.core.state import SamplerState, check_generator_state, new_generator
from sgrld.core.warmup import (
    DEFAULT_WARMUP,
    adapting,
    check_adapt_until,
    closes_warmup,
    drawn_while_adapting,
)
from sgrld.metrics import (
    IdentityMetric,
    Metric,
    MongeMetric,
    RMSpropMetric,
    ShampooMetric,
    TensorBlocks,
    WenzelMetric,
    get_metric,
)

ParamsT = Iterable[Tensor] | Iterable[tuple[str, Tensor]] | Iterable[dict[str, Any]]

#: the optimizer stepping each parameter (weakly held on both sides), so that a
#: :class:`~sgrld.SampleStore` given only the model can tell whether a sample was drawn while
#: the metric was still adapting (:func:`drawn_adapting`)
_OWNERS: dict[int, tuple[weakref.ref[Tensor], weakref.ref[SGRLDOptimizer]]] = {}


def _own(p: Tensor, opt: SGRLDOptimizer) -> None:
    """Record ``opt`` as the optimizer of ``p`` (by id: a tensor's ``==`` is elementwise, so
    no mapping can key on tensors; the entry goes when ``p`` does)."""
    key = id(p)
    _OWNERS[key] = (weakref.ref(p, lambda _: _OWNERS.pop(key, None)), weakref.ref(opt))


def drawn_adapting(params: Iterable[Tensor]) -> tuple[bool, int, int | None] | None:
    """Whether the state of ``params`` was produced by a step that adapted the metric (the
    warm-up, :mod:`sgrld.core.warmup`), as ``(adapting, steps taken, adapt_until)`` of the
    optimizer that steps them; ``None`` when no sgrld optimizer steps them."""
    for p in params:
        refs = _OWNERS.get(id(p))
        opt = None if refs is None or refs[0]() is not p else refs[1]()
        if opt is None:
            continue
        found = [i for i, g in enumerate(opt.param_groups) if any(q is p for q in g["params"])]
        if not found:
            continue
        index = found[0]
        group, steps = opt.param_groups[index], opt.num_steps
        until = group["adapt_until"]
        metric, adapt = opt._group_metrics[index], bool(group["adapt_metric"])
        return drawn_while_adapting(metric, steps, until, adapt), steps, until
    return None


#: metric fields that fix the layout of the statistics: not changeable after the first step
_STRUCTURAL = ("block_size", "tiling", "precondition_vectors", "row_shards", "scope")

#: group options of the facade itself (beside ℓ, n, τ, the metric's options and adapt_until)
_FACADE_DEFAULTS: dict[str, Any] = {"adapt_metric": True}
#: a localised chain's centre θ₀ in a parameter's state
CENTER = "center"
#: the value each facade option had before it existed (what an older state dict ran with)
_BEFORE_IT_EXISTED: dict[str, Any] = {"adapt_metric": True, "adapt_until": None, "floor": 0.0}


def _facade_arguments() -> list[str]:
    """The optimizer's own keyword arguments (suggested for a misspelt option too)."""
    import inspect

    parameters = inspect.signature(SGRLDOptimizer.__init__).parameters
    return [n for n, p in parameters.items() if n != "self" and p.kind is p.KEYWORD_ONLY]


def _metric_options(metric: Metric) -> dict[str, Any]:
    """The metric's public hyper-parameters and their values, e.g. ``alpha2``, ``decay``."""
    return {name: getattr(metric, name) for name in option_names(type(metric))}


class SGRLDOptimizer(torch.optim.Optimizer):
    """SGRLD with an arbitrary metric plug-in.

    Args:
        params: parameters, ``(name, parameter)`` pairs (e.g. ``model.named_parameters()``:
            error messages then use the names) or parameter groups. A group may override ``lr``,
            ``num_data``, ``temperature`` and any option of the metric (``alpha2``, ``decay``,
            ...), as torch.optim groups override ``lr``; each group has its own statistics.
        lr: learning rate ℓ ≥ 0 (the SDE step is h = ℓ / num_data; ℓ = 0 is a step that moves
            nothing, e.g. the first of a warm-up schedule): a float or a one-element tensor (a
            scheduler then changes it on the device, and a compiled step does not recompile).
        num_data: number of training data n > 0.
        temperature: τ ≥ 0; 0 gives deterministic preconditioned descent (no noise drawn).
        metric: the metric G (see :mod:`sgrld.metrics`), or its registry name or alias
            (``"rmsprop"``), built with ``metric_options``.
        generator: drives the noise; a private one seeded from torch's global generator by
            default. Its state is saved in :meth:`state_dict`.
        check_finite: refuse a step whose gradient holds NaN/Inf, naming the parameter and step;
            nothing changes in any group (see :mod:`sgrld.core.engine` for the modes).
        sync_checks: ``None`` (default): read the check at once on CPU, defer it on CUDA and
            while a step is traced by ``torch.compile`` to :meth:`check`, :meth:`state_dict` and
            refreshes (no host sync per step); ``True`` read at once everywhere (eager steps);
            ``False`` always defer.
        noise: the source of ξ: ``"torch"`` (``normal_`` with ``generator``) or ``"philox"`` (a
            compiled counter-based generator; see :mod:`sgrld.core.noise`). ``None`` (default):
            ``"philox"`` with ``capturable=True``, else ``"torch"``. A ``"torch"`` step traced by
            ``torch.compile`` draws from the counter-based generator keyed by ``generator``'s
            seed, since ``normal_`` with a generator would break the graph.
        compile: run each step's metric update, preconditioning and move as one
            ``torch.compile``d call (:mod:`sgrld.core.compiled`; identity, RMSprop and Wenzel).
        capturable: make :meth:`step` free of host reads and Python randomness, as torch.optim's
            ``capturable``: it can be captured in a CUDA graph or traced by ``torch.compile``
            (``opt.step(); sched.step()`` in one compiled function). Needs counter-based noise
            (chosen unless ``noise`` says otherwise); checks are deferred; while a step is traced
            or captured, Shampoo's root refresh is left to :meth:`refresh_if_due` on the host
            (:class:`sgrld.capture.GraphedStep` calls it; eager steps refresh themselves).

        low_precision: how parameters of fewer bits than ``master_dtype`` (bfloat16, float16)
            are stepped: ``"master"`` (default: a ``master_dtype`` copy in the state carries the
            chain), ``"stochastic"`` (unbiased rounding of each move) or ``"nearest"`` (plain,
            warns: small moves are lost). See :mod:`sgrld.core.precision`.
        master_dtype: the dtype of master copies and of low-precision arithmetic (float32).
        telemetry: sum per-step figures on the device, read by :meth:`telemetry`.
        masks: ``{parameter: bool tensor of its shape}``: only the ``True`` elements are
            sampled (the metric acts on them alone), the others stay fixed bit for bit. A
            sharded (FSDP2) parameter's mask has its global shape, the same on every rank.
        data_parallel: whether the ranks of a ``torch.distributed`` process group hold replicas
            of one chain (``DistributedDataParallel``): the first step then refuses ranks that
            would draw different noise. ``None`` (default): whenever a group of several ranks
            exists (every rank must then step); ``False`` for independent chains per rank.

        adapt_until: the warm-up (:mod:`sgrld.core.warmup`): the metric adapts during the
            first ``adapt_until`` steps (default 1,000), then G is frozen, so that the chain
            samples the posterior; ``None`` adapts at every step (the paper's protocol, whose
            stationary law is biased: ``docs/posterior.md``). A group option.
        localization: c ≥ 0, the pull c·(θ − θ₀) towards the parameters θ₀ at construction
            (held in the state as ``center``), added to the drift's gradient after the metric
            has seen the loss's gradient alone: the local posterior of the learning
            coefficient (``docs/llc.md``; :func:`sgrld.build`'s option). 0 (default): none.
        **metric_options: the metric's options (``decay``, ``alpha2``, ...) when ``metric`` is a
            name, e.g. ``SGRLDOptimizer(params, lr=1e-3, num_data=n, metric="rmsprop", decay=0.9)``.

    Each parameter group also carries ``adapt_metric`` (default True): set it to False to
    freeze the metric's statistics at once (see :meth:`freeze_metric`).

    State: as every ``torch.optim`` optimizer, in ``optimizer.state[p]`` — every tensor a step
    depends on (the statistics, the step count, the group's noise key and deferred-check flags
    on its first parameter, the generator's state on the first parameter of the first group;
    layout in :mod:`sgrld.core.param_state`), so that :meth:`state_dict`, ``copy.deepcopy``,
    pickling and ``torch.distributed.checkpoint`` carry it all. It exists from construction
    (statistics at their initial values), so no tool needs a step to create it.

    References: Yu et al., Scalable SGRLD in Non-Diagonal Metrics, TMLR 2023, eq. 4.
    """

    #: attributes besides torch's (defaults, state, param_groups) that a copy carries
    _config_attrs: tuple[str, ...] = (
        "metric",
        "_options",
        "check_finite",
        "noise",
        "compile",
        "capturable",
        "sync_checks",
        "low_precision",
        "master_dtype",
        "telemetry_enabled",
        "_masks",
        "data_parallel",
        "localization",
    )

    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor,
        num_data: float,
        temperature: float = 1.0,
        *,
        metric: Metric | str,
        generator: torch.Generator | None = None,
        check_finite: bool = True,
        noise: NoiseSource | None = None,
        compile: bool = False,
        capturable: bool = False,
        sync_checks: bool | None = None,
        low_precision: LowPrecision = "master",
        master_dtype: torch.dtype = torch.float32,
        telemetry: bool = False,
        masks: Mapping[Tensor, Tensor] | None = None,
        data_parallel: bool | None = None,
        adapt_until: int | None = DEFAULT_WARMUP,
        localization: float = 0.0,
        **metric_options: Any,
    ) -> None:
        _validate_group(lr, num_data, temperature)
        if not (isinstance(localization, (int, float)) and 0.0 <= localization < math.inf):
            raise ValueError(f"invalid localization: {localization!r} (expected finite >= 0)")
        own = _facade_arguments()
        if isinstance(metric, str):
            cls = get_metric(metric)
            check_options(cls, metric_options, f"{type(self).__name__}({metric!r})", own)
            metric = cls(**metric_options)
        elif metric_options:  # a facade class built the metric, or the user gave an instance
            given_instance = type(self) is SGRLDOptimizer
            check_options(type(metric), metric_options, type(self).__name__, own, given_instance)
        if data_parallel is not None and not isinstance(data_parallel, bool):
            raise ValueError(f"invalid data_parallel: {data_parallel!r} (expected None or a bool)")
        if not isinstance(telemetry, bool):
            raise ValueError(f"invalid telemetry: {telemetry!r} (expected True or False)")
        check_low_precision(low_precision, master_dtype)
        requested_noise = noise
        if noise is None:
            noise = "philox" if capturable is True else "torch"
        check_noise_source(noise)
        check_compile(compile, metric)
        check_flags(check_finite, capturable, sync_checks, noise)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        self.metric = metric
        self._options = _metric_options(metric)
        defaults = {
            "lr": lr,
            "num_data": num_data,
            "temperature": temperature,
            **_FACADE_DEFAULTS,
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
        # per group with low-precision parameters: the tensors stepped in their place (master
        # copies, or scratch for stochastic rounding) and the rounding's uniforms
        self._standins: dict[int, StandIns] = {}
        self._warned_nearest = False
        self.telemetry_enabled = telemetry
        self._telemetry: dict[int, Tensor] = {}  # per group: float64 (4,) device sums
        self._reset_watch()
        self._masks: dict[Tensor, Tensor] = dict(masks or {})
        self.data_parallel = data_parallel
        self.localization = float(localization)
        self._replicas_checked = data_parallel is False
        super().__init__(params, defaults)
        _check_masks(self._masks, [p for g in self.param_groups for p in g["params"]])
        self.check_finite = check_finite
        sharded = any(is_sharded(p) for g in self.param_groups for p in g["params"])
        if sharded and requested_noise is None:
            noise = "philox"  # drawn at each shard's global indices (sgrld.core.shards)
        self.noise: NoiseSource = noise
        self.compile = compile
        self.capturable = capturable
        self.sync_checks = sync_checks
        self._compiled: dict[int, CompiledMove] = {}  # per param group (compile=True)
        device = self.param_groups[0]["params"][0].device
        self.generator = generator if generator is not None else new_generator(device)
        self._ready = True
        for index in range(len(self.param_groups)):
            self._build(index)

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
        _validate_group(group["lr"], group["num_data"], group["temperature"])
        check_adapt_until(group["adapt_until"])
        self._group_metric(group)  # validates the group's metric options now
        low = is_low_precision(first.dtype, self.master_dtype)
        if low and self.low_precision == "nearest" and not self._warned_nearest:
            self._warned_nearest = True
            warnings.warn(
                f"parameters in {first.dtype} with low_precision='nearest': every move is rounded "
                "to nearest in that dtype, so moves smaller than half a unit in the last place "
                "are lost (the chain freezes or samples the wrong variance); low_precision="
                "'master' (the default) keeps a float32 copy, 'stochastic' rounds without bias",
                RuntimeWarning,
                stacklevel=3,
            )
        for p in params:
            _own(p, self)
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
        """Fresh state of group ``index`` (or of ``group``, its future self on a load): its
        statistics at their initial values, over the parameters or their stand-ins (master
        copies of low-precision parameters, masked parameters' selected elements); the group's
        noise key is a function of the generator's seed (for traced ``"torch"`` steps) until
        :meth:`_build` draws a Philox key."""
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
            self._check_sharded(names[0])
        shards = [local(p) for p in params]  # the rank's shards of sharded parameters
        stats = metric.init(layout, shards[0])
        state = SamplerState(
            dict(zip(names, shards, strict=True)), stats, 0, self.generator, layout
        )
        if self.localization:  # θ₀: the chain's tensors (master copies) as they are now
            state.center = [t.detach().clone() for t in shards]
        return state, standins

    def _check_sharded(self, name: str) -> None:
        """Refuse, with the reason, the options that sharded parameters (FSDP2) do not have."""
        refused = {
            "noise='torch'": self.noise == "torch",
            "compile=True": self.compile,
            "capturable=True": self.capturable,
        }
        for option, given in refused.items():
            if given:
                reason = (
                    "a generator's stream cannot be drawn at a shard's global indices, so the "
                    "ranks would not form one chain (use noise='philox', the default for "
                    "sharded parameters)"
                    if option == "noise='torch'"
                    else "not implemented for sharded parameters"
                )
                raise NotImplementedError(
                    f"parameter {name!r} is sharded (DTensor, FSDP2) and the optimizer has "
                    f"{option}: {reason}"
                )

    @staticmethod
    def _publish(
        metric: Metric, state: SamplerState, standins: StandIns | None
    ) -> list[dict[str, Tensor]]:
        """:func:`publish` plus the master copies of low-precision parameters (a masked
        sharded parameter's: the rank's own, under its shard's key)."""
        entries = publish(metric, state)
        masters = None if standins is None else standins.masters
        shards = state.layout.shards
        if masters is not None:
            for j, (entry, master) in enumerate(zip(entries, masters, strict=True)):
                own = shards is not None and j in shards.uneven
                entry[shard_key(MASTER, shards) if own else MASTER] = master  # type: ignore[arg-type]
        for j, (entry, center) in enumerate(zip(entries, state.center or [], strict=False)):
            if shards is None:
                entry[CENTER] = center
            elif j in shards.uneven:  # a masked shard's: the rank's own
                entry[shard_key(CENTER, shards)] = center
            else:
                entry[CENTER] = shards.global_view(center, j)
        return entries

    def _seed_key(self, device: torch.device) -> Tensor:
        return keys_from_seeds([self.generator.initial_seed() % 2**64], device)[0]

    def _build(self, index: int) -> None:
        """Create group ``index``'s state and publish it in ``self.state``."""
        group = self.param_groups[index]
        metric = self._group_metric(group)
        state, standins = self._new_state(index, metric)
        if self.noise == "philox":
            state.keys.copy_(keys_from_generator((), self.generator, state.keys.device))
        else:
            state.keys.copy_(self._seed_key(state.keys.device))
        self._install(index, state, metric, self._publish(metric, state, standins), standins)

    def _install(
        self,
        index: int,
        state: SamplerState,
        metric: Metric,
        entries: list[dict[str, Tensor]],
        standins: StandIns | None,
    ) -> None:
        group = self.param_groups[index]
        options = {k: group[k] for k in self._options}
        if index < len(self._group_states):
            self._group_states[index] = state
            self._group_metrics[index] = metric
            self._group_options[index] = options
        else:
            self._group_states.append(state)
            self._group_metrics.append(metric)
            self._group_options.append(options)
        for p, entry in zip(group["params"], entries, strict=True):
            self.state[p] = entry
        if standins is None:
            self._standins.pop(index, None)
        else:
            self._standins[index] = standins
        if index == 0:
            self._snapshot_generator()
        self._compiled.pop(index, None)

    def _snapshot_generator(self) -> None:
        """Write the generator's state into the first parameter's state (read by state_dict)."""
        first = self.param_groups[0]["params"][0]
        self.state[first][GENERATOR] = self.generator.get_state()

    def _group_state(self, index: int) -> SamplerState:
        state = self._group_states[index]
        group = self.param_groups[index]
        options = {k: group[k] for k in self._options}
        if options != self._group_options[index]:
            current = self._group_metrics[index]
            if state.step == 0:  # nothing to keep yet: a layout may still change
                metric = self._group_metric(group)
                keys = state.keys.clone()
                state, standins = self._new_state(index, metric)
                state.keys.copy_(keys)
                entries = self._publish(metric, state, standins)
                self._install(index, state, metric, entries, standins)
            else:
                self._group_metrics[index] = self._group_metric(group, current)
                self._group_options[index] = options
        return state

    def _checks(self, state: SamplerState) -> CheckMode:
        device = next(iter(state.params.values())).device
        mode = check_mode(self.check_finite, self.sync_checks, device, self.capturable)
        if mode == "sync" and self.sync_checks is None and in_graph():
            return "deferred"  # a traced step cannot read the host: checked at check()
        return mode

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
        if not self._replicas_checked and not in_graph():
            self._check_replicas()
        grads = [self._grads(i) for i in range(len(self.param_groups))]
        modes = [self._checks(state) for state in states]
        traced = in_graph()
        noise: NoiseSource = "philox" if traced else self.noise
        # the health watch (sgrld.health): this step's figures summed if it is a watched one
        watched = not traced and (states[0].step + 1) % WATCH_EVERY == 0
        try:
            if len(states) > 1:  # refuse before the first group moves
                for index, (state, gs) in enumerate(zip(states, grads, strict=True)):
                    validate_grads(state, gs)
                    if modes[index] == "sync":
                        check_finite_now(state, gs)
                        modes[index] = "off"  # checked just now: not again inside the step
            self._advance_groups(states, grads, modes, noise, traced, watched)
        except NonFiniteGradientError as exc:
            raise NonFiniteGradientError(self._nonfinite_message(str(exc), states)) from None
        self._after_step()
        if watched:  # after the step's bookkeeping: a warning raised as an error leaves it done
            self._watch_step(states[0].step)
        return loss

    def _advance_groups(
        self,
        states: list[SamplerState],
        grads: list[list[Tensor | None]],
        modes: list[CheckMode],
        noise: NoiseSource,
        traced: bool,
        watched: bool,
    ) -> None:
        for index, group in enumerate(self.param_groups):
            standins = self._standins.get(index)
            if states[index].layout.shards is not None and standins is None:
                _follow_shards(states[index], group["params"])  # stand-ins stay where they are
            if standins is not None:  # step master copies, scratch or selected elements
                standins.pull()
            adapt = self.adapts(index)
            telemetry = self._accumulator(index)
            if watched:  # the watch's sums and the user's telemetry both get this step's
                telemetry = self._watch_sums(index, telemetry)
            advance(
                self._group_metrics[index],
                states[index],
                grads[index],
                lr=_as_scalar(group["lr"]),
                num_data=group["num_data"],
                temperature=group["temperature"],
                checks=modes[index],
                adapt=adapt,
                noise_source=noise,
                compiled=self._compiled_move(index),
                refresh=not (self.capturable and traced),
                telemetry=telemetry,
                localization=self.localization,
                closes_warmup=closes_warmup(
                    self._group_metrics[index], states[index].step + 1, group["adapt_until"]
                ),
            )
            if watched:
                self._watch_add(index)
            if standins is not None:
                standins.push(states[index].keys, states[index].device_step)

    # --- the health watch (sgrld.health) ----------------------------------------------------

    def _reset_watch(self, first: dict[str, float] | None = None) -> None:
        self._watch = Watch(first=first)
        self._watch_acc: dict[int, Tensor] = {}  # per group: the window's float64 (4,) sums
        self._watch_step_sums: dict[int, Tensor] = {}  # per group: this step's, while it runs

    def _watch_sums(self, index: int, telemetry: Tensor | None) -> Tensor:
        device = self.param_groups[index]["params"][0].device
        if index not in self._watch_acc:
            self._watch_acc[index] = torch.zeros(4, dtype=torch.float64, device=device)
        step = self._watch_acc[index].new_zeros(4)
        self._watch_step_sums[index] = step
        return step

    def _watch_add(self, index: int) -> None:
        step = self._watch_step_sums.pop(index)
        self._watch_acc[index].add_(step)
        user = self._accumulator(index)
        if user is not None:
            user.add_(step)

    def _watch_step(self, steps: int) -> None:
        """After watched step ``steps``: close the window at every multiple of its length
        (counted from step 0, so a resumed chain closes the same windows; one host read)."""
        if steps % (WATCH_EVERY * WATCH_WINDOW):
            return
        window = self._open_window()
        for acc in self._watch_acc.values():
            acc.zero_()
        if window is not None:
            self._watch.warn(self._watch.close(window, self._settled(steps)))

    def _open_window(self) -> dict[str, float] | None:
        """The open window's sums as a window (one host read; the groups' sums over the mesh
        under FSDP, so that every rank reaches the same verdict); ``None`` when empty."""
        sums_of = []
        for index, acc in self._watch_acc.items():
            shards = self._group_states[index].layout.shards
            sums_of.append((_over_the_mesh(shards, acc.clone(), {})[0] if shards else acc).tolist())
        if not sums_of or not sums_of[0][3]:
            return None
        return Watch.window(_chain_sums(sums_of), self.param_groups[0]["temperature"])

    def _settled(self, steps: int) -> bool:
        """Past the warm-up (while the metric adapts G changes under the chain): only then is
        ℓ judged; a chain still descending towards the posterior is told apart by its falling
        drift (:func:`sgrld.chain_health.judge`)."""
        until = self.param_groups[0]["adapt_until"]
        return steps > max(DEFAULT_WARMUP if until is None else until, WATCH_EVERY * WATCH_WINDOW)

    def health(self) -> Health:
        """The chain's health (:func:`sgrld.health`) from every step so far: whether it broke
        down while staying finite, or its ℓ is too large or too small, with the figure that
        crossed which bound. Every optimizer watches one step in 16 on the device (three
        reductions) and reads the figures once per 512 steps, warning once per verdict
        (:class:`sgrld.HealthWarning`); this reads the open window too (one host read; under
        FSDP one all-reduce, so call it on every rank)."""
        return self._watch.verdict(self._settled(self.num_steps), self._open_window())

    def _nonfinite_message(self, message: str, states: list[SamplerState]) -> str:
        """The non-finite error with the step, ‖θ‖ over the last watched windows and the fix."""
        text = f"{message} at step {states[0].step + 1}"
        open_window = self._open_window()  # a read on the error path
        windows = self._watch.windows[-3:] + ([open_window] if open_window else [])
        if windows:
            norms = ", ".join(f"{w['theta_norm']:.3g}" for w in windows)
            text += f" (|theta| over the last {WATCH_EVERY * WATCH_WINDOW}-step windows: {norms})"
        return text + "; a smaller lr usually avoids this"

    def _accumulator(self, index: int) -> Tensor | None:
        if not self.telemetry_enabled:
            return None
        if index not in self._telemetry:
            device = self.param_groups[index]["params"][0].device
            self._telemetry[index] = torch.zeros(4, dtype=torch.float64, device=device)
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
        """Per-step health figures of the chain since the last read (``telemetry=True``).

        Summed on the device in each step (no host read there) and read here, once: ``steps``;
        ``drift_rms`` and ``noise_rms``, the root-mean-square over the steps of the norms
        ‖ℓG⁻¹ĝ‖ and ‖σG^{-½}ξ‖; ``theta_norm``, that of ‖θ‖ before each move; their ratio
        ``drift_to_noise`` (healthy chains read 0.04–0.35; above 1, ℓ is too large:
        ``docs/health.md``, :func:`sgrld.health`); and the metric's own figures of the current G
        (:meth:`Metric.diagnostics`: Monge's ``stretch`` α²‖m‖², Shampoo's
        ``factor_condition``). The norms are of every parameter group together (their squares
        add; a metric figure is its largest over the groups); ``per_group=True`` gives one
        mapping per group instead. Each read starts new sums unless ``reset=False``.
        """
        if not self.telemetry_enabled:
            raise RuntimeError("telemetry is off: build the optimizer with telemetry=True")
        sums_of, extras = [], []
        for index in range(len(self.param_groups)):
            acc = self._accumulator(index)
            assert acc is not None
            state = self._group_states[index]
            diagnostics = self._group_metrics[index].diagnostics(state.stats, state.layout)
            sums = acc.clone()
            if state.layout.shards is not None:
                sums, diagnostics = _over_the_mesh(state.layout.shards, sums, diagnostics)
            sums_of.append(sums.tolist())
            extras.append({key: float(value) for key, value in diagnostics.items()})
            if reset:
                acc.zero_()
        if per_group:
            return [telemetry_figures(s, e) for s, e in zip(sums_of, extras, strict=True)]
        total = _chain_sums(sums_of)
        extra: dict[str, float] = {}
        for e in extras:
            for key, value in e.items():
                extra[key] = max(value, extra.get(key, -math.inf))
        return telemetry_figures(total, extra)

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
        out = standins.grads(grads)
        return out

    def _check_replicas(self) -> None:
        """Before the first step, under a process group (DistributedDataParallel, or FSDP2's
        shards of one chain), every rank must draw the same noise (one all-gather)."""
        keys = [state.keys.reshape(-1).cpu() for state in self._group_states]
        generator = self.generator.get_state().to(torch.int64)
        device = self.param_groups[0]["params"][0].device
        check_same_noise(torch.cat([*keys, generator]).to(device))
        self._replicas_checked = True

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
        ``capturable=True``, a traced step or ``sync_checks=False``) recorded a NaN/Inf
        gradient: the one host read of the flags, naming the first bad step and parameter."""
        for index, state in enumerate(self._group_states):
            check(state, f"param group {index}: " if len(self._group_states) > 1 else "")

    def refresh_if_due(self) -> bool:
        """Run a due scheduled refresh (Shampoo's roots) in every group; for ``capturable``
        optimizers, whose steps leave it to the host. Returns whether one ran."""
        ran = False
        for index, state in enumerate(self._group_states):
            metric = self._group_metrics[index]
            until = self.param_groups[index]["adapt_until"]
            if not (refresh_due(metric, state.step) or closes_warmup(metric, state.step, until)):
                continue
            if not adapting(state.step - 1, until):
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

    def state_bytes(self) -> dict[str, int]:
        """Bytes of optimizer state per parameter (by name; statistics, master copies, step and
        keys; the generator's state on the first parameter), to size block sizes and precision
        before a run rather than after it fails. ``sum(opt.state_bytes().values())`` is the
        total."""
        out: dict[str, int] = {}
        for index, group in enumerate(self.param_groups):
            for name, p in zip(self._names(index), group["params"], strict=True):
                entry = self.state[p]
                out[name] = sum(  # a sharded statistic's bytes on this rank: its shard's
                    local(v).numel() * v.element_size()
                    for v in entry.values()
                    if isinstance(v, Tensor)
                )
        return out

    @property
    def num_steps(self) -> int:
        """Steps taken by the first parameter group (the optimizer's own counter)."""
        return self._group_states[0].step

    def refresh_metric(self) -> None:
        """Recompute the explicitly scheduled part of the metric in every group."""
        for index in range(len(self.param_groups)):
            state = self._group_state(index)
            self._group_metrics[index].refresh(state.stats, state.layout)

    # --- state dicts and copies -------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's state dict (``state`` by parameter index, ``param_groups``), holding
        every tensor a step depends on (see the class docstring). Deferred checks are read
        first: a chain with a non-finite gradient is not checkpointed. As in torch, the tensors
        are the optimizer's own (not copies) and the state-dict hooks see the whole dict."""
        self.check()
        self._snapshot_generator()
        state_dict = super().state_dict()
        if self._watch.first is not None:  # the health watch's reference: ‖θ‖, drift at start
            state_dict[_WATCH_KEY] = dict(self._watch.first)
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` (or one of sgrld's first format, converted).

        The load pre-hooks run first and may replace the dict; then everything is validated
        (groups, options, every parameter's state: keys, shapes, finiteness, step, generator
        state) before anything is applied, so a refused dict leaves the optimizer exactly as it
        was. Group options missing from an older dict take their defaults; floating-point state
        is cast to the parameters' dtype and device, as torch.optim does. The post-hooks run
        after everything, step counts and noise state included, is restored.
        """
        if not isinstance(state_dict, dict):
            raise ValueError(f"not an optimizer state dict: a {type(state_dict).__name__}")
        state_dict = dict(state_dict)
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        apply = self._plan_load(state_dict)
        apply()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _plan_load(self, state_dict: dict[str, Any]) -> Callable[[], None]:
        """Validate ``state_dict`` completely; return the function that applies it."""
        saved_groups = state_dict.get("param_groups")
        if not isinstance(saved_groups, list) or len(saved_groups) != len(self.param_groups):
            have = len(saved_groups) if isinstance(saved_groups, list) else 0
            raise ValueError(
                f"the state dict has {have} parameter groups, this optimizer "
                f"{len(self.param_groups)}"
            )
        saved_state = state_dict.get("state")
        if not isinstance(saved_state, dict):
            raise ValueError("not an optimizer state dict (no 'state' entry)")
        groups, metrics = [], []
        for index, saved in enumerate(saved_groups):
            group, metric = self._load_group(index, saved)
            groups.append(group)
            metrics.append(metric)
        if "sgrld" in state_dict:  # the first format: the sampler state beside torch's
            return self._plan_legacy(state_dict["sgrld"], groups, metrics)
        watch_first = _watch_first(state_dict.get(_WATCH_KEY))
        fresh, copies = [], []
        generator_state: Tensor | None = None
        for index, (saved, metric) in enumerate(zip(saved_groups, metrics, strict=True)):
            label = f"param group {index}"
            state, standins = self._new_state(index, metric, groups[index])
            mine = self._publish(metric, state, standins)
            entries = [saved_state.get(pid) for pid in saved["params"]]
            extra = (GENERATOR,) if index == 0 else ()
            copies += plan_load(mine, entries, self._names(index), label, extra, (MASTER,))
            if index == 0:
                first = entries[0] if entries else None
                generator_state = first.get(GENERATOR) if isinstance(first, dict) else None
                if generator_state is None:
                    raise ValueError(f"{label}: the state dict has no generator state")
                check_generator_state(self.generator, generator_state, "the state dict")
            fresh.append((state, mine, standins))

        def apply() -> None:
            self._apply_groups(groups)
            apply_load(copies)
            assert generator_state is not None
            self.generator.set_state(generator_state.to("cpu", torch.uint8))
            for index, ((state, mine, standins), metric) in enumerate(
                zip(fresh, metrics, strict=True)
            ):
                state.step = int(state.device_step.item())
                self._install(index, state, metric, mine, standins)
            self._reset_watch(watch_first)

        return apply

    def _load_group(self, index: int, saved: Any) -> tuple[dict[str, Any], Metric]:
        """The group as it will be after loading ``saved`` (validated, missing options filled
        with their defaults) and its metric."""
        label = f"param group {index}"
        mine = self.param_groups[index]
        if not isinstance(saved, dict) or not isinstance(saved.get("params"), list):
            raise ValueError(f"{label}: not a parameter group")
        if len(saved["params"]) != len(mine["params"]):
            raise ValueError(
                f"{label}: the state dict has {len(saved['params'])} parameters, this optimizer "
                f"{len(mine['params'])}"
            )
        group = {k: v for k, v in saved.items() if k != "params"}
        for key in mine:
            if key not in group and key != "params":
                group[key] = self._default_of(key, mine[key])
        group["params"] = mine["params"]
        if "param_names" in mine:
            group["param_names"] = mine["param_names"]
        try:
            _validate_group(group["lr"], group["num_data"], group["temperature"])
            check_adapt_until(group["adapt_until"])
            metric = self._group_metric(group)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{label}: {exc}") from None
        return group, metric

    def _default_of(self, key: str, current: Any) -> Any:
        """The value an option missing from an older state dict had before it existed."""
        if key in _BEFORE_IT_EXISTED:  # e.g. no adapt_until: it adapted throughout; no
            return _BEFORE_IT_EXISTED[key]  # floor (RMSprop's, Adam's): the absolute ε alone
        for f in dataclasses.fields(self.metric):  # type: ignore[arg-type]
            if f.name == key and f.default is not dataclasses.MISSING:
                return f.default
        return current

    def _apply_groups(self, groups: list[dict[str, Any]]) -> None:
        self.param_groups = groups
        self.state = defaultdict(dict)
        self._compiled = {}
        self._standins = {}

    def _plan_legacy(
        self, extra: Any, groups: list[dict[str, Any]], metrics: list[Metric]
    ) -> Callable[[], None]:
        """The first format: ``{"sgrld": {"generator", "groups": [flat state or None]}}``."""
        if not isinstance(extra, dict) or not {"generator", "groups"} <= set(extra):
            raise ValueError("not an sgrld optimizer state dict (no valid 'sgrld' entry)")
        if not isinstance(extra["groups"], list) or len(extra["groups"]) != len(groups):
            raise ValueError("the state dict's sgrld entry does not match its parameter groups")
        check_generator_state(self.generator, extra["generator"], "the state dict")
        fresh = []
        for index, (saved, metric) in enumerate(zip(extra["groups"], metrics, strict=True)):
            label = f"param group {index}"
            state, standins = self._new_state(index, metric, groups[index])
            if saved is not None:
                shapes = saved.get("shapes") if isinstance(saved, dict) else None
                mine = [list(s) for s in state.layout.shapes]
                if shapes is not None and shapes != mine:
                    raise ValueError(
                        f"{label}: the state dict is for parameters of shapes {shapes}, these "
                        f"are {mine}"
                    )
                state.validate_state_dict(saved, label)
            fresh.append((state, standins))

        def apply() -> None:
            self._apply_groups(groups)
            self.generator.set_state(extra["generator"])
            for index, ((state, standins), saved) in enumerate(
                zip(fresh, extra["groups"], strict=True)
            ):
                if saved is not None:
                    state.apply_state_dict(saved)
                    state.step = int(saved["step"])
                elif self.noise == "philox":  # the first format drew it at the first step
                    state.keys.copy_(keys_from_generator((), self.generator, state.keys.device))
                if self.noise != "philox":
                    state.keys.copy_(self._seed_key(state.keys.device))
                entries = self._publish(metrics[index], state, standins)
                self._install(index, state, metrics[index], entries, standins)

        return apply

    def __getstate__(self) -> dict[str, Any]:
        self._snapshot_generator()
        state = super().__getstate__()
        state["_sgrld"] = {name: getattr(self, name) for name in self._config_attrs}
        state["_sgrld"]["generator_device"] = str(self.generator.device)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A copy (``copy.deepcopy``, pickle, ``torch.save(optimizer)``): the configuration is
        restored, and the per-parameter state is loaded into fresh flat buffers."""
        config = dict(state.pop("_sgrld"))
        super().__setstate__(state)
        device = config.pop("generator_device")
        for name, value in config.items():
            setattr(self, name, value)
        self._compiled = {}
        self._standins = {}
        self._telemetry = {}
        self._reset_watch()
        self._replicas_checked = self.data_parallel is False
        self._warned_nearest = True
        self._ready = True
        self.generator = torch.Generator(device=device)
        self._group_states, self._group_metrics, self._group_options = [], [], []
        saved = {i: self.state[p] for i, p in enumerate(self._all_params())}
        sd = {"state": saved, "param_groups": self._packed_groups()}
        self._plan_load(sd)()

    def _all_params(self) -> list[Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _packed_groups(self) -> list[dict[str, Any]]:
        out, start = [], 0
        for g in self.param_groups:
            n = len(g["params"])
            out.append(
                {
                    **{k: v for k, v in g.items() if k != "params"},
                    "params": list(range(start, start + n)),
                }
            )
            start += n
        return out


#: the state dict's entry of the health watch's first window (:class:`sgrld.chain_health.Watch`)
_WATCH_KEY = "health_watch"


def _watch_first(saved: Any) -> dict[str, float] | None:
    """The watch's first window from a state dict (``None``: none, or a dict from before)."""
    if saved is None:
        return None
    if not isinstance(saved, Mapping) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in saved.values()
    ):
        raise ValueError(f"{_WATCH_KEY!r}: not a mapping of figures to floats")
    return {str(k): float(v) for k, v in saved.items()}


def _chain_sums(sums_of: Sequence[Sequence[float]]) -> list[float]:
    """The chain's telemetry sums from its groups': the squares add; the step count is each
    group's (the groups step together)."""
    total = [sum(column) for column in zip(*sums_of, strict=True)]
    total[3] = sums_of[0][3]
    return total


def _over_the_mesh(
    shards: ShardSpec, sums: Tensor, diagnostics: dict[str, Tensor]
) -> tuple[Tensor, dict[str, Tensor]]:
    """A sharded group's telemetry for the whole chain: the rank's sums of squares (of its
    shard) summed over the ranks, the metric's figures (largest over the rank's own blocks or
    segments) their largest over the ranks; two collectives, at the read only."""
    import torch.distributed as dist

    shards.sum_(sums[:3])  # the step count is every rank's
    if diagnostics:
        names = sorted(diagnostics)
        peaks = torch.stack([diagnostics[n].to(sums.device, torch.float64) for n in names])
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX, group=shards.mesh.get_group())
        diagnostics = dict(zip(names, peaks.unbind(), strict=True))
    return sums, diagnostics


def _follow_shards(state: SamplerState, params: list[Tensor]) -> None:
    """Point the state at the parameters' current shards: FSDP2 moves a shard into its own
    padded storage at its first forward (lazy initialisation), after the optimizer was built."""
    for name, p in zip(state.params, params, strict=True):
        shard = local(p)
        if shard.data_ptr() != state.params[name].data_ptr():
            state.params[name] = shard


def _check_masks(masks: Mapping[Tensor, Tensor], params: list[Tensor]) -> None:
    """Masks: boolean, of their parameter's shape and device, for parameters of this optimizer."""
    mine = {id(p) for p in params}
    for p, mask in masks.items():
        if not isinstance(p, Tensor) or id(p) not in mine:
            raise ValueError("masks: every key must be a parameter of this optimizer")
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.shape != p.shape:
            got = f"{mask.dtype} {tuple(mask.shape)}" if isinstance(mask, Tensor) else mask
            raise ValueError(
                f"masks: a mask must be a bool tensor of its parameter's shape {tuple(p.shape)}, "
                f"got {got}"
            )
        if mask.device != p.device:
            raise ValueError(f"masks: a mask on {mask.device} for a parameter on {p.device}")


def _validate_group(lr: float | Tensor, num_data: float, temperature: float) -> None:
    """ℓ, n and τ of a group, as torch.optim takes ℓ: a float or any one-element tensor."""
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError(
                f"invalid lr: a tensor of shape {tuple(lr.shape)} (expected a float or a "
                "one-element tensor)"
            )
        lr = lr.reshape(())
    validate_hyperparameters(lr, num_data, temperature)


def _as_scalar(lr: float | Tensor) -> float | Tensor:
    """ℓ as the engine takes it: a float, or a 0-d view of any one-element tensor."""
    if isinstance(lr, Tensor) and lr.dim() > 0:
        return lr.view(())
    return lr


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
    """pSGLD (Li et al. 2016): G = diag(√V + max(eps, floor·s)), V an EMA of g² from zeros, s
    the statistics' scale (:class:`~sgrld.metrics.RMSpropMetric`).

    Extra keyword options: ``bias_correction`` (default False, as the paper's code) and
    ``floor`` (default 0.1; 0 is the paper's absolute ε alone).
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
        floor: float = 0.1,
        **kwargs: Any,
    ) -> None:
        metric = RMSpropMetric(decay=decay, eps=eps, bias_correction=bias_correction, floor=floor)
        super().__init__(
            params, lr, num_data, temperature, metric=metric, generator=generator, **kwargs
        )


class WenzelSGLD(SGRLDOptimizer):
    """Layer-wise scalar metric (Wenzel et al. 2020).

    G = I until the first :meth:`update_preconditioner`; the paper refreshes at every epoch end.
    Give the schedule with ``batch_size`` (refresh every ⌈num_data / batch_size⌉ steps, i.e.
    once per epoch) or ``refresh_every`` (steps), and the optimizer refreshes itself after those
    steps; without either, call :meth:`update_preconditioner` yourself (as the runner does at each
    epoch end) — a warning says so once if more than ``num_data`` steps go by without it.
    """

    _config_attrs = (*SGRLDOptimizer._config_attrs, "refresh_every", "_last_refresh", "_warned")

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
    """Monge metric G = I + α² m mᵀ, m an EMA of gradients (paper §4.1).

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
    """Kronecker-factored Shampoo metric per parameter tensor (paper §4.2).

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
        noise: NoiseSource | None = None,
        compile: bool = False,
        capturable: bool = False,
        sync_checks: bool | None = None,
        low_precision: LowPrecision = "master",
        master_dtype: torch.dtype = torch.float32,
        telemetry: bool = False,
        masks: Mapping[Tensor, Tensor] | None = None,
        data_parallel: bool | None = None,
        adapt_until: int | None = DEFAULT_WARMUP,
        localization: float = 0.0,
        **metric_options: Any,
    ) -> None:
        check_options(ShampooMetric, metric_options, "ShampooSGLD", _facade_arguments())
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
            low_precision=low_precision,
            master_dtype=master_dtype,
            telemetry=telemetry,
            masks=masks,
            data_parallel=data_parallel,
            adapt_until=adapt_until,
            localization=localization,
        )

    def partition(self) -> dict[str, TensorBlocks]:
        """How Shampoo merges and blocks each parameter on this rank, by name: its whole shape,
        the rows this rank holds (all of them unsharded), the merged shape and every block's
        shape (:meth:`ShampooMetric.partition`). Under FSDP2 each rank reports its own shard's
        blocks; they differ with the number of ranks (``docs/distributed.md``)."""
        out: dict[str, TensorBlocks] = {}
        for metric, state in zip(self._group_metrics, self._group_states, strict=True):
            assert isinstance(metric, ShampooMetric)
            out.update((t.name, t) for t in metric.partition(state.layout))
        return out
