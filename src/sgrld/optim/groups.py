"""A parameter group's chain (:class:`GroupChain`: one functional :class:`~sgrld.core.Sampler`,
its state and stand-ins), made by :class:`Recipe` from the group's options; the group's checks,
shards and extra state entries."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import torch
from torch import Tensor

from sgrld.core.contract import Metric, option_names
from sgrld.core.engine import validate_grads
from sgrld.core.layout import FlatLayout
from sgrld.core.param_state import MASTER, publish, shard_key
from sgrld.core.precision import LowPrecision, StandIns
from sgrld.core.sampler import Sampler, validate_hyperparameters
from sgrld.core.shards import local
from sgrld.core.state import SamplerState
from sgrld.core.warmup import check_adapt_until, drawn_while_adapting, warmup_length

#: a localised chain's centre θ₀ in a parameter's state
CENTER = "center"


def validate_group(
    lr: float | Tensor, num_data: float, temperature: float, adapt_until: int | None = None
) -> None:
    """ℓ, n, τ and the warm-up of a group, as torch.optim takes ℓ: a float or any one-element
    tensor."""
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError(
                f"invalid lr: a tensor of shape {tuple(lr.shape)} (expected a float or a "
                "one-element tensor)"
            )
        lr = lr.reshape(())
    validate_hyperparameters(lr, num_data, temperature)
    check_adapt_until(adapt_until)


def refuse_duplicates(params: Any) -> Any:
    """A group's parameters (a tensor, or tensors or ``(name, tensor)`` pairs) as a list; one
    listed twice would be stepped twice per step, so it is refused."""
    if isinstance(params, set):
        return params  # torch refuses a set (it has no order)
    listed = [params] if isinstance(params, Tensor) else list(params)
    seen: set[int] = set()
    for item in listed:
        name, p = item if isinstance(item, tuple) else (None, item)
        if id(p) in seen:
            what = f"{name!r}" if name is not None else f"of shape {tuple(p.shape)}"
            raise ValueError(
                f"duplicate parameter: {what} is listed twice in one group, so it would be "
                "stepped twice per step; list each parameter once"
            )
        seen.add(id(p))
    return listed


def as_scalar(lr: float | Tensor) -> float | Tensor:
    """ℓ as the engine takes it: a float, or a 0-d view of any one-element tensor."""
    return lr.view(()) if isinstance(lr, Tensor) and lr.dim() > 0 else lr


def group_names(group: Mapping[str, Any], index: int) -> list[str]:
    """The names of group ``index``'s parameters: given (``named_parameters()``) or made up."""
    if "param_names" in group:
        return list(group["param_names"])
    return [f"group{index}.param{i}" for i in range(len(group["params"]))]


def metric_options(metric: Metric) -> dict[str, Any]:
    """The metric's public hyper-parameters and their values, e.g. ``alpha2``, ``decay``."""
    return {name: getattr(metric, name) for name in option_names(type(metric))}


#: metric fields that fix the layout of the statistics: not changeable after the first step
STRUCTURAL = ("block_size", "tiling", "precondition_vectors", "row_shards", "scope")


def group_metric(base: Metric, group: Mapping[str, Any], current: Metric | None = None) -> Metric:
    """The metric of a group: ``base`` with the group's own options (validated); ``current``: the
    group's metric so far, whose layout fields cannot change."""
    mine = metric_options(base)
    options = {k: group[k] for k in mine}
    if current is not None and metric_options(current) == options:
        return current
    if options == mine:
        return base
    for k in STRUCTURAL if current is not None else ():
        if k in options and options[k] != getattr(current, k):
            raise ValueError(
                f"{k} of a parameter group cannot change after its first step "
                f"({getattr(current, k)!r} → {options[k]!r}): it fixes the statistics' layout"
            )
    return dataclasses.replace(base, **options)  # type: ignore[type-var]


@dataclasses.dataclass
class GroupChain:
    """One parameter group's chain: the functional sampler that steps it (the group's metric, ℓ,
    n, τ and warm-up), its state, the stand-ins stepped in the parameters' place (master copies,
    masked elements), the group options its metric was made from and the group's parameters."""

    sampler: Sampler
    state: SamplerState
    standins: StandIns | None
    options: dict[str, Any]
    lr: float | Tensor  # the group's ℓ the sampler was made with (a tensor: by identity)
    params: list[Tensor]
    names: list[str]

    def follow(self, group: Mapping[str, Any], flags: Mapping[str, Any]) -> Sampler:
        """The sampler with the group's ℓ, n, τ and warm-up and the optimizer's ``flags`` as they
        are now (a scheduler or the user sets them; ℓ, n, τ checked by ``check_groups``)."""
        s, lr = self.sampler, group["lr"]
        tensors = isinstance(lr, Tensor) or isinstance(self.lr, Tensor)
        same_lr = lr is self.lr or (not tensors and lr == self.lr)
        now = {k: group[k] for k in ("num_data", "temperature", "adapt_until")} | dict(flags)
        if not same_lr or any(getattr(s, k) != v for k, v in now.items()):
            self.sampler, self.lr = s.retuned(lr=as_scalar(lr), **now), lr
        return self.sampler

    def grads(self) -> list[Tensor | None]:
        """The gradients of the group's parameters, in the dtype and shape of the tensors stepped
        (master copies, selected elements)."""
        grads = [None if p.grad is None else local(p.grad) for p in self.params]
        if self.standins is None:
            return grads
        # checked against the parameters (their shards): the stand-ins' are then made from them
        validate_grads(dict(zip(self.names, map(local, self.params), strict=True)), grads)
        return self.standins.grads(grads)

    def move(self, grads: list[Tensor | None], **options: Any) -> None:
        """:meth:`Sampler.move <sgrld.core.Sampler.move>` of the group (``options``: its keywords)
        over its stand-ins (master copies, scratch or selected elements), pulled before and pushed
        after, or its parameters' current shards."""
        state, standins = self.state, self.standins
        if standins is not None:
            standins.pull()
        elif state.layout.shards is not None:
            follow_shards(state, self.params)
        self.sampler.move(state, grads, **options)
        if standins is not None:
            standins.push(state.keys, state.device_step)


#: the optimizer's attributes its groups' samplers take (a user may set them between steps)
FLAGS = ("check_finite", "noise", "compile", "capturable", "sync_checks", "localization")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """What an optimizer's group chains are made from besides the group: its metric (with the
    options a group may override), its :data:`FLAGS` and the masks and precision of stand-ins."""

    metric: Metric
    flags: Mapping[str, Any]
    low_precision: LowPrecision
    master_dtype: torch.dtype
    masks: Mapping[Tensor, Tensor]

    def sampler(self, group: Mapping[str, Any], metric: Metric) -> Sampler:
        lr, until = as_scalar(group["lr"]), group["adapt_until"]
        return Sampler(metric, lr, group["num_data"], group["temperature"], **self.flags,
                       adapt_until=until)  # fmt: skip

    def chain(
        self,
        group: Mapping[str, Any],
        index: int,
        generator: torch.Generator,
        metric: Metric | None = None,
    ) -> GroupChain:
        """A fresh chain of group ``index`` over its parameters or their stand-ins; its noise key
        is the caller's to set."""
        metric = group_metric(self.metric, group) if metric is None else metric
        params: list[Tensor] = group["params"]
        masks = [self.masks.get(p) for p in params]
        names, standins = group_names(group, index), None
        if StandIns.needed(params, masks, self.low_precision, self.master_dtype):
            standins = StandIns(params, masks, self.low_precision, self.master_dtype)
            params = standins.work
            layout = standins.layout(names)
        else:
            layout = FlatLayout.from_tensors(names, params)
        sampler = self.sampler(group, metric)
        if layout.shards is not None:
            check_sharded(names[0], sampler.noise, sampler.compile, sampler.capturable)
        shards = [local(p) for p in params]  # the rank's shards of sharded parameters
        state = sampler.new_state(dict(zip(names, shards, strict=True)), layout, generator)
        options = {k: group[k] for k in metric_options(self.metric)}
        return GroupChain(sampler, state, standins, options, group["lr"], group["params"], names)


def check_masks(masks: Mapping[Tensor, Tensor], params: list[Tensor]) -> None:
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


def masks_by_parameter(
    masks: Mapping[Any, Tensor], named: Iterable[tuple[str, Tensor]]
) -> dict[Tensor, Tensor]:
    """``masks`` keyed by parameter, from keys that are parameters or their names (devinterp's
    convention, ``{"blocks.0.attn.weight": mask}``); ``named``: the ``(name, parameter)`` pairs
    the names refer to. A name that is none of them is refused, listing a few that are."""
    by_name = dict(named)
    out: dict[Tensor, Tensor] = {}
    for key, mask in masks.items():
        if not isinstance(key, str):
            out[key] = mask
        elif key in by_name:
            out[by_name[key]] = mask
        else:
            known = ", ".join(repr(n) for n in list(by_name)[:5]) or "none"
            raise ValueError(
                f"masks: no parameter named {key!r} (names: {known}{', ...' * (len(by_name) > 5)}"
                "; an optimizer knows its parameters' names when given model.named_parameters())"
            )
    return out


def check_sharded(name: str, noise: str, compile: bool, capturable: bool) -> None:
    """Refuse, with the reason, the options that sharded parameters (FSDP2) do not have."""
    unsharded = "not implemented for sharded parameters"
    for option, given, reason in (
        ("noise='torch'", noise == "torch", "a generator's stream cannot be drawn at a shard's "
         "global indices, so the ranks would not form one chain (use noise='philox', the "
         "default for sharded parameters)"),
        ("compile=True", compile, unsharded),
        ("capturable=True", capturable, unsharded),
    ):  # fmt: skip
        if given:
            raise NotImplementedError(
                f"parameter {name!r} is sharded (DTensor, FSDP2) and the optimizer has "
                f"{option}: {reason}"
            )


def follow_shards(state: SamplerState, params: list[Tensor]) -> None:
    """Point the state at the parameters' current shards (FSDP2 moves them lazily)."""
    for name, p in zip(state.params, params, strict=True):
        shard = local(p)
        if shard.data_ptr() != state.params[name].data_ptr():
            state.params[name] = shard


#: the first parameter's entries of a warm-up that waits for the chain
WARMUP_SUMS, WARMUP_COUNT = "warmup_sums", "warmup_extensions"


def publish_group(
    metric: Metric, state: SamplerState, standins: StandIns | None
) -> list[dict[str, Tensor]]:
    """:func:`~sgrld.core.param_state.publish` plus master copies and the localisation's centre."""
    entries = publish(metric, state)
    if state.warmup is not None:  # the waiting warm-up's sums and windows added (core.warmup)
        entries[0][WARMUP_SUMS], entries[0][WARMUP_COUNT] = state.warmup.sums, state.warmup.count
    shards = state.layout.shards
    for name, tensors in ((MASTER, standins and standins.masters), (CENTER, state.center)):
        for j, (entry, tensor) in enumerate(zip(entries, tensors or [], strict=False)):
            if shards is not None and j in shards.uneven:
                entry[shard_key(name, shards)] = tensor
            elif shards is not None and name == CENTER:
                entry[name] = shards.global_view(tensor, j)
            else:
                entry[name] = tensor
    return entries


#: the optimizer stepping each parameter (weakly held on both sides), so that a
#: :class:`~sgrld.SampleStore` given only the model can tell whether a sample was drawn while
#: the metric was still adapting (:func:`drawn_adapting`)
_OWNERS: dict[int, tuple[weakref.ref[Tensor], weakref.ref[Owner]]] = {}


class Owner(Protocol):
    """What :func:`drawn_adapting` and the health watch (:mod:`sgrld.optim.watch`) read of the
    optimizer stepping a parameter: its groups and their chains, and the figures the last step
    recorded (per group, :func:`~sgrld.core.engine.record_telemetry`'s sums; ``None`` when it
    recorded none)."""

    param_groups: list[dict[str, Any]]
    recorded: list[Tensor] | None

    @property
    def num_steps(self) -> int: ...

    @property
    def group_metrics(self) -> list[Metric]: ...

    @property
    def sampler_states(self) -> list[SamplerState]: ...


def own(p: Tensor, opt: Owner) -> None:
    """Record ``opt`` as ``p``'s optimizer (by id: the entry goes when ``p`` does)."""
    key = id(p)
    _OWNERS[key] = (weakref.ref(p, lambda _: _OWNERS.pop(key, None)), weakref.ref(opt))


def drawn_adapting(params: Iterable[Tensor]) -> tuple[bool, int, int | None] | None:
    """``(adapting, steps taken, adapt_until)`` of the optimizer stepping ``params``: whether their
    state came from a step that adapted the metric; ``None`` if no sgrld optimizer steps them.
    """
    for p in params:
        refs = _OWNERS.get(id(p))
        opt = None if refs is None or refs[0]() is not p else refs[1]()
        if opt is None:
            continue
        found = [i for i, g in enumerate(opt.param_groups) if any(q is p for q in g["params"])]
        if not found:
            continue
        group, steps = opt.param_groups[found[0]], opt.num_steps
        until, adapt = group["adapt_until"], bool(group["adapt_metric"])
        metric = opt.group_metrics[found[0]]
        arrival = opt.sampler_states[found[0]].warmup
        drawn = drawn_while_adapting(metric, steps, until, adapt, arrival)
        return drawn, steps, warmup_length(until, arrival)  # as the chain extended it
    return None
