""":class:`SGRLDOptimizer`: every sampler as a ``torch.optim`` optimizer, a step being
:meth:`Sampler.move <sgrld.core.Sampler.move>` per parameter group (:mod:`sgrld.optim.groups`)."""

from __future__ import annotations

import inspect
import itertools
import math
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, Literal, overload

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from sgrld.chain_health import WATCH_EVERY, Health
from sgrld.core import engine
from sgrld.core.contract import check_bool, check_groups, check_localization, check_options
from sgrld.core.layout import check_one_buffer
from sgrld.core.noise import NoiseSource
from sgrld.core.param_state import GENERATOR
from sgrld.core.precision import LowPrecision, check_low_precision, is_low_precision
from sgrld.core.replicas import check_same_noise
from sgrld.core.sampler import check_generator
from sgrld.core.shards import is_sharded, local
from sgrld.core.state import SamplerState, new_generator
from sgrld.core.warmup import DEFAULT_WARMUP, adapting
from sgrld.integrations.huggingface import TrainerWatch
from sgrld.metrics import Metric, get_metric
from sgrld.optim import groups, loading
from sgrld.optim.watch import WATCH_KEY, HealthWatch, chain_sums, new_sums, over_the_mesh

ParamsT = Iterable[Tensor] | Iterable[tuple[str, Tensor]] | Iterable[dict[str, Any]]


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
        # ℓ, n, τ and the warm-up are checked per group, the flags by each group's Sampler
        check_localization(localization)
        metric = self._make_metric(metric, metric_options)
        if data_parallel is not None and not isinstance(data_parallel, bool):
            raise ValueError(f"invalid data_parallel: {data_parallel!r} (expected None or a bool)")
        check_bool("telemetry", telemetry)
        _check_schedule(refresh_every, batch_size, metric)
        check_low_precision(low_precision, master_dtype)
        check_generator(generator)
        self.metric = metric
        self._options = groups.metric_options(metric)
        defaults = {
            "lr": lr,
            "num_data": num_data,
            "temperature": temperature,
            "adapt_metric": True,
            "adapt_until": adapt_until,
            **self._options,
        }
        self._chains: list[groups.GroupChain] = []  # per group: its sampler, state and stand-ins
        self._ready = False  # groups get their chain once the generator exists
        self.low_precision: LowPrecision = low_precision
        self.master_dtype = master_dtype
        self._warned_nearest = False
        self.telemetry_enabled = telemetry
        self._telemetry: dict[int, Tensor] = {}  # per group: float64 (4,) device sums
        self.data_parallel = data_parallel
        self.localization = float(localization)
        self._replicas_checked = data_parallel is False
        self.refresh_every = refresh_every
        #: per group, the last step's (‖drift‖², ‖noise‖², ‖θ‖², 1) on the device if it recorded
        #: them (one step in ``WATCH_EVERY``), else ``None``: what post-step hooks read
        self.recorded: list[Tensor] | None = None
        super().__init__(params, defaults)
        if batch_size is not None:
            self.refresh_every = math.ceil(num_data / batch_size)
        self.register_step_pre_hook(TrainerWatch())  # what transformers.Trainer changes, warned
        self._watch_hook: RemovableHandle | None = None
        self._start_watch()
        named = [
            pair
            for g in self.param_groups
            for pair in zip(g.get("param_names", ()), g["params"], strict=False)
        ]
        self._masks = groups.masks_by_parameter(masks or {}, named)  # keys: parameters or names
        groups.check_masks(self._masks, [p for g in self.param_groups for p in g["params"]])
        sharded = any(is_sharded(p) for g in self.param_groups for p in g["params"])
        # a sharded chain's noise is drawn at each shard's global indices (sgrld.core.shards)
        default: NoiseSource = "philox" if capturable is True or sharded else "torch"
        self.noise: NoiseSource = default if noise is None else noise
        self.check_finite, self.compile = check_finite, compile
        self.capturable, self.sync_checks = capturable, sync_checks
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
        param_group = {**param_group, "params": groups.refuse_duplicates(param_group["params"])}
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        index = len(self.param_groups) - 1
        params: list[Tensor] = group["params"]
        # stepped as one flat buffer: one dtype and device, floating
        names = groups.group_names(group, index)
        check_one_buffer(names, params, " (put the others in a group of their own)")
        groups.validate_group(
            group["lr"], group["num_data"], group["temperature"], group["adapt_until"]
        )
        groups.group_metric(self.metric, group)  # validates the group's metric options now
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
            groups.own(p, self)
        if self._ready:
            self._build(index)

    def _recipe(self) -> groups.Recipe:
        """What this optimizer's group chains are made from (:mod:`sgrld.optim.groups`)."""
        return groups.Recipe(
            self.metric, self._flags(), self.low_precision, self.master_dtype, self._masks
        )

    def _flags(self) -> dict[str, Any]:
        """The flags a group's sampler takes (:data:`~sgrld.optim.groups.FLAGS`), as they are."""
        return {name: getattr(self, name) for name in groups.FLAGS}

    def _build(self, index: int, keys: Tensor | None = None) -> None:
        """Make group ``index``'s chain (with noise keys ``keys``, or new ones), published in
        ``self.state``."""
        chain = self._recipe().chain(self.param_groups[index], index, self.generator)
        if keys is None:
            keys = loading.new_key(self.noise, self.generator, chain.state.keys.device)
        chain.state.keys.copy_(keys)
        self._install(index, chain)

    def _install(self, index: int, chain: groups.GroupChain) -> None:
        """Make ``chain`` group ``index``'s, its state published in ``self.state``."""
        self._chains[index : index + 1] = [chain]  # replaced, or appended (a new group)
        entries = groups.publish_group(chain.sampler.metric, chain.state, chain.standins)
        self.state.update(zip(self.param_groups[index]["params"], entries, strict=True))
        if index == 0:
            self._snapshot_generator()

    def _snapshot_generator(self) -> None:
        """Write the generator's state into the first parameter's state."""
        first = self.param_groups[0]["params"][0]
        self.state[first][GENERATOR] = self.generator.get_state()

    def _start_watch(self, first: dict[str, float] | None = None) -> None:
        """A new health watch (:class:`~sgrld.optim.watch.HealthWatch`), a post-step hook: it
        reads the figures a step :attr:`recorded` after the step, so its warnings come once the
        step is done."""
        if self._watch_hook is not None:
            self._watch_hook.remove()
        self._watch = HealthWatch(first)
        self._watch_hook = self.register_step_post_hook(self._watch)

    def _follow(self, index: int) -> groups.GroupChain:
        """Group ``index``'s chain, its sampler as the group's options, ℓ, n, τ and warm-up and the
        optimizer's flags are now (:meth:`GroupChain.follow`); after a metric option changed, before
        the first step, the chain is made again (a layout may still change)."""
        chain, group = self._chains[index], self.param_groups[index]
        options = {k: group[k] for k in self._options}
        if options != chain.options:
            if chain.state.step == 0:
                self._build(index, chain.state.keys.clone())
                chain = self._chains[index]
            else:
                metric = groups.group_metric(self.metric, group, chain.sampler.metric)
                chain.sampler, chain.options = chain.sampler.retuned(metric=metric), options
        chain.follow(group, self._flags())
        return chain

    def _followed(self) -> list[groups.GroupChain]:
        """Every group's chain, followed (:meth:`_follow`)."""
        return [self._follow(i) for i in range(len(self.param_groups))]

    # --- what the functional core sees (capture, the runner) ---------------------------------

    @property
    def sampler_states(self) -> list[SamplerState]:
        """Each parameter group's :class:`sgrld.SamplerState`: the live tensors the next
        :meth:`step` reads and writes."""
        return [chain.state for chain in self._followed()]

    @property
    def group_metrics(self) -> list[Metric]:
        """Each parameter group's metric: :attr:`metric` with the group's own options."""
        return [chain.sampler.metric for chain in self._followed()]

    def refreshes_next(self) -> bool:
        """Whether the coming step refreshes G on the host (Shampoo's roots, the warm-up's end, a
        ``refresh_every`` refresh): a step a CUDA graph cannot replay.
        """
        pairs = zip(self._followed(), self.param_groups, strict=True)
        # a frozen metric (adapt_metric False) is not refreshed
        if any(
            g["adapt_metric"] and c.sampler.refresh_due(c.state, c.state.step + 1) for c, g in pairs
        ):
            return True
        every = self.refresh_every
        return every is not None and (self.num_steps + 1) % every == 0

    def after_replay(self) -> None:
        """The host's part of a step replayed from a CUDA graph: counters advance, the schedule
        runs.
        """
        for chain in self._chains:
            chain.state.step += 1
        self._after_step()

    def _after_step(self) -> None:
        """The host's schedule after a step: the metric's refresh every ``refresh_every``."""
        if self.refresh_every is not None and self.num_steps % self.refresh_every == 0:
            self.refresh_metric()

    # --- the step ----------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One sampler step for every parameter group (grads of ``None`` are skipped), each its
        group's :meth:`Sampler.move <sgrld.core.Sampler.move>`; every group's gradients are
        validated before any group moves, so a refused step changes nothing.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.recorded = None
        check_groups(self.param_groups)  # ℓ, n, τ may have been set since (contract)
        chains = self._followed()
        traced = engine.in_graph()
        if not self._replicas_checked and not traced:
            self._check_replicas()
        grads = [chain.grads() for chain in chains]
        modes = [c.sampler.checks(c.state, defer_traced=True) for c in chains]
        # one step in WATCH_EVERY records its figures for the post-step hooks (sgrld.health's)
        record = not traced and (chains[0].state.step + 1) % WATCH_EVERY == 0
        recorded = []
        try:
            if len(chains) > 1:  # refuse before the first group moves
                for index, (chain, gs) in enumerate(zip(chains, grads, strict=True)):
                    engine.validate_grads(chain.state.params, gs)
                    if modes[index] == "sync":
                        engine.check_finite_now(chain.state.layout, gs)
                        modes[index] = "off"  # checked just now: not again inside the step
            for index, (group, chain) in enumerate(zip(self.param_groups, chains, strict=True)):
                telemetry = self._accumulator(index)
                sums = new_sums(group["params"][0].device) if record else telemetry
                chain.move(
                    grads[index],
                    adapt=bool(group["adapt_metric"]),
                    telemetry=sums,
                    checks=modes[index],
                    noise="philox" if traced else None,
                )
                if record:  # a recorded step's sums go to the hooks and the user's telemetry
                    assert sums is not None
                    recorded.append(sums)
                    if telemetry is not None:
                        telemetry.add_(sums)
        except engine.NonFiniteGradientError as exc:
            message = self._watch.nonfinite_message(self, str(exc))  # a read on the error path
            raise engine.NonFiniteGradientError(message) from None
        self._after_step()
        self.recorded = recorded if record else None
        return loss

    def _check_replicas(self) -> None:
        """Before the first step, under a process group (DistributedDataParallel, or FSDP2's
        shards of one chain), every rank must draw the same noise (one all-gather)."""
        keys = [chain.state.keys.reshape(-1).cpu() for chain in self._chains]
        generator = self.generator.get_state().to(torch.int64)
        device = self.param_groups[0]["params"][0].device
        check_same_noise(torch.cat([*keys, generator]).to(device))
        self._replicas_checked = True

    # --- health and telemetry ----------------------------------------------------------------

    def health(self) -> Health:
        """The chain's health (:func:`sgrld.health`) from every step so far. Every optimizer watches
        one step in 16 on the device and reads the figures once per 512 steps, warning once per
        verdict (:class:`sgrld.HealthWarning`); this reads the open window too (under FSDP an
        all-reduce: call it on every rank)."""
        return self._watch.health(self)

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
        for index, chain in enumerate(self._chains):
            acc, state = self._accumulator(index), chain.state
            assert acc is not None
            diagnostics = chain.sampler.metric.diagnostics(state.stats, state.layout)
            sums = acc.clone()
            if state.layout.shards is not None:
                sums, diagnostics = over_the_mesh(state.layout.shards, sums, diagnostics)
            sums_of.append(sums.tolist())
            extras.append({key: float(value) for key, value in diagnostics.items()})
            if reset:
                acc.zero_()
        if per_group:
            return [engine.telemetry_figures(s, e) for s, e in zip(sums_of, extras, strict=True)]
        extra: dict[str, float] = {}
        for e in extras:
            for key, value in e.items():
                extra[key] = max(value, extra.get(key, -math.inf))
        return engine.telemetry_figures(chain_sums(sums_of), extra)

    # --- checks, refreshes, the metric's adaptation ------------------------------------------

    def check(self) -> None:
        """Raise :class:`~sgrld.core.NonFiniteGradientError` if a deferred check recorded a NaN/Inf
        gradient, naming the first bad step and parameter.
        """
        for index, chain in enumerate(self._chains):
            engine.check(chain.state, f"param group {index}: " if len(self._chains) > 1 else "")

    def refresh_if_due(self) -> bool:
        """Run a due scheduled refresh (Shampoo's roots) in every group, for ``capturable``
        optimizers; returns whether one ran."""
        return any([chain.sampler.refresh_if_due(chain.state) for chain in self._followed()])

    def refresh_metric(self) -> None:
        """Recompute the explicitly scheduled part of the metric in every group (Wenzel's
        scales).
        """
        for chain in self._followed():
            chain.sampler.refresh(chain.state)
        self._last_refresh = self.num_steps

    def adapts(self, index: int = 0) -> bool:
        """Whether group ``index``'s next step updates its metric."""
        group, state = self.param_groups[index], self._chains[index].state
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
            for name, p in zip(groups.group_names(group, index), group["params"], strict=True):
                out[name] = sum(  # a sharded statistic's bytes on this rank: its shard's
                    local(v).numel() * v.element_size()
                    for v in self.state[p].values()
                    if isinstance(v, Tensor)
                )
        return out

    @property
    def num_steps(self) -> int:
        """Steps taken by the first parameter group (the optimizer's own counter)."""
        return self._chains[0].state.step

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
        load = loading.plan(self._recipe(), self.param_groups, self.generator, state_dict)
        self.param_groups = load.groups
        self.state = defaultdict(dict)
        self._chains = []
        self._start_watch(load.watch_first)
        load.copy()
        self.generator.set_state(load.generator_state.to("cpu", torch.uint8))
        for index, chain in enumerate(load.fresh):
            self._install(index, chain)

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
        self._chains, self._watch_hook, self.recorded = [], None, None
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
