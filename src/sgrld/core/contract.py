"""The metric plug-in contract and the registry: what the core calls, owned by the core.

A metric G updates its statistics, applies G⁻¹ and G^{-1/2} to flat ``(*batch, D)`` vectors and
may refresh a scheduled part (``docs/conventions.md``). Each statistic's kind is declared, so
the core can restrict the state to the tensors with gradients: ``"element"`` (last dim D),
``"tensor"`` (last dim the tensors), ``"global"`` or :class:`PerTensor`.
"""

from __future__ import annotations

import abc
import contextvars
import difflib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

from sgrld.core.layout import FlatLayout

Stats = dict[str, Tensor]

#: Whether the step now running may read the device on the host (its checks are ``"sync"``): a
#: metric's refresh then refuses a bad result at once; with deferred checks (a captured or
#: ``sync_checks=False`` step, or one being traced) it keeps its previous state instead, without a
#: host read.
host_reads: contextvars.ContextVar[bool] = contextvars.ContextVar("sgrld_host_reads", default=True)


@dataclass(frozen=True)
class PerTensor:
    """The kind of a statistic of parameter tensor ``tensor`` alone (Shampoo's factors), stored
    under :attr:`key` and published as ``stat`` in that parameter's state."""

    stat: str
    tensor: int

    @property
    def key(self) -> str:
        return f"{self.stat}@{self.tensor}"


StatKind = Literal["element", "tensor", "global"] | PerTensor


class Metric(abc.ABC):
    """Base class of the Riemannian metrics G (one instance = one hyper-parameter setting)."""

    #: registry name, e.g. ``"monge"``
    name: ClassVar[str]
    #: whether ``compile=True`` samplers may trace this metric; opt-in, for metrics whose code
    #: traces and measurably gains (the elementwise ones; :mod:`sgrld.core.compiled`)
    compilable: ClassVar[bool] = False
    #: whether runners refresh G at each epoch end (Wenzel's layer-wise scales, as the paper's
    #: code does); the facade's users call ``refresh_metric()`` themselves
    refresh_per_epoch: ClassVar[bool] = False
    #: whether G may differ from I; ``False`` (identity only) lets the step engine move by the
    #: gradients themselves, without the flat copy :meth:`inverse` would read
    preconditions: ClassVar[bool] = True
    #: other names the sampler is known by (matched without regard to case), e.g. ``("psgld",)``
    aliases: ClassVar[tuple[str, ...]] = ()
    #: options tuned with ℓ (Monge's ``("alpha2",)``): a run sweeps them as axes of their own,
    #: varies them per chain (:class:`sgrld.Chains`) and names its folder by them
    tuned: ClassVar[tuple[str, ...]] = ()
    #: option values at which G = I (Monge's ``{"alpha2": 0.0}``): the paper's selection then
    #: takes Identity's run as this metric's point there (Tables 4-5: "α² = 0")
    identity_at: ClassVar[Mapping[str, float]] = {}
    #: how tables and figures write an option (Monge's ``{"alpha2": "α²"}``; default: its name)
    symbols: ClassVar[Mapping[str, str]] = {}

    @abc.abstractmethod
    def init(self, layout: FlatLayout, like: Tensor) -> Stats:
        """Fresh statistics for ``layout``; ``like`` gives dtype and device."""

    def stat_kinds(self, layout: FlatLayout) -> dict[str, StatKind]:
        """The kind of every statistic that :meth:`init` makes for ``layout``."""
        return {}

    def checked_init(self, layout: FlatLayout, like: Tensor) -> Stats:
        """:meth:`init`, refused at once if a statistic's kind is undeclared."""
        stats = self.init(layout, like)
        undeclared = sorted(set(stats) - set(self.stat_kinds(layout)))
        if undeclared:
            raise TypeError(
                f"{type(self).__name__}.stat_kinds(layout) does not declare {undeclared}: give "
                "each statistic its kind ('element', 'tensor', 'global' or PerTensor(stat, i))"
            )
        return stats

    @abc.abstractmethod
    def update(self, stats: Stats, layout: FlatLayout, grad: Tensor, step: int | Tensor) -> None:
        """Fold the flat gradient into the statistics, in place. ``step`` counts from 1: an int
        eagerly, a 0-d int64 device tensor in compiled and captured steps (tensor arithmetic only).
        """

    @abc.abstractmethod
    def inverse(self, stats: Stats, layout: FlatLayout, grad: Tensor) -> Tensor:
        """Return G⁻¹ · grad (after :meth:`update`); may overwrite ``grad``, a private copy."""

    @abc.abstractmethod
    def inverse_sqrt(self, stats: Stats, layout: FlatLayout, noise: Tensor) -> Tensor:
        """Return G^{-1/2} · noise. May overwrite ``noise`` (a scratch buffer) in place."""

    @property
    def refresh_interval(self) -> int | None:
        """Steps between the refreshes the step engine runs itself, right after :meth:`update`
        (``None``: never); decided on the host.
        """
        return None

    def refresh(self, stats: Stats, layout: FlatLayout) -> None:  # noqa: B027 - optional hook
        """Recompute an explicitly scheduled part of G (Wenzel's preconditioner at an epoch end,
        Shampoo's inverse roots every :attr:`refresh_interval` steps)."""

    @property
    def restarts(self) -> bool:
        """Whether :meth:`restart` forgets the statistics at a warm-up window's start (Stan's
        windows; ``update`` then counts its steps from there)."""
        return False

    def restart(  # noqa: B027 - optional hook
        self, stats: Stats, layout: FlatLayout, where: Tensor | None = None
    ) -> None:
        """Forget the statistics at the start of a warm-up's slow window, where the metric can
        start afresh cleanly (:attr:`restarts`); by default they are kept. ``where``: only where
        this bool tensor (0-d, or of the batch shape: per chain) holds, read on the device (a
        captured step's restart)."""

    def diagnostics(self, stats: Stats, layout: FlatLayout) -> dict[str, Tensor]:
        """Health figures of the current G for telemetry (read outside steps), e.g. Monge's
        stretch.
        """
        return {}


_REGISTRY: dict[str, type[Metric]] = {}


#: Other names a sampler is known by (alias → registry name), collected from the metrics'
#: :attr:`Metric.aliases`: the facade classes' (``SGLD`` is ``identity``) and the literature's
#: (pSGLD is RMSprop-preconditioned SGLD).
ALIASES: dict[str, str] = {}


def register(cls: type[Metric]) -> type[Metric]:
    """Class decorator adding a metric to the registry under ``cls.name`` and its aliases."""
    _REGISTRY[cls.name] = cls
    ALIASES.update(dict.fromkeys((a.lower() for a in cls.aliases), cls.name))
    return cls


def resolve_metric_name(name: str) -> str:
    """The registry name of ``name``: itself, or the metric an alias (:data:`ALIASES`) names.

    Raises:
        ValueError: an unknown name; the message suggests the closest known one.
    """
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key in _REGISTRY:
        return key
    close = difflib.get_close_matches(key, [*_REGISTRY, *ALIASES], n=1)
    hint = ""
    if close:
        target = ALIASES.get(close[0])
        hint = f"did you mean {close[0]!r}{f' ({target})' if target else ''}? "
    aliases = ", ".join(f"{a} = {m}" for a, m in ALIASES.items() if a != f"{m}sgld")
    raise ValueError(
        f"unknown sampler {name!r}; {hint}choose one of {', '.join(sorted(_REGISTRY))} "
        f"(aliases: {aliases})"
    )


def get_metric(name: str) -> type[Metric]:
    """Look a metric class up by registry name (:func:`metric_names`) or alias.

    Raises:
        ValueError: an unknown name (the message suggests the closest known one).
    """
    return _REGISTRY[resolve_metric_name(name)]


def metric_names() -> list[str]:
    """The registry's names, sorted."""
    return sorted(_REGISTRY)


def option_names(cls: type) -> list[str]:
    """A metric class's options: its public dataclass fields (``alpha2``, ``decay``, ...)."""
    import dataclasses

    if not dataclasses.is_dataclass(cls):
        return []
    return [f.name for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_")]


def check_options(
    cls: type, given: Iterable[str], owner: str, others: Iterable[str] = (), instance: bool = False
) -> None:
    """Refuse options that ``cls`` (a metric class) does not have, by name, with the closest valid
    names and the list of options.

    Args:
        cls: the metric's class; its options are its dataclass fields.
        given: the option names given.
        owner: who was given them (``"MongeSGLD"``, ``"build('rmsprop')"``), for the message.
        others: other valid names of ``owner`` (the optimizer's own arguments).
        instance: the metric was given as an instance: its own options are refused too.

    Raises:
        TypeError: naming each refused option.
    """
    mine = option_names(cls)
    valid = sorted({*mine, *others})
    given = list(given)
    if instance and given:
        ours = [k for k in given if k in mine]
        if ours:
            raise TypeError(
                f"{owner}: options {ours} given with a {cls.__name__} instance; set them on the "
                f"instance ({cls.__name__}(..., {ours[0]}=...)), or pass the metric by name"
            )
    unknown = [k for k in given if k not in mine]
    if not unknown:
        return
    words = []
    for key in unknown:
        close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
        words.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise TypeError(
        f"{owner} has no option {', '.join(words)}; the options of {cls.__name__}: "
        f"{', '.join(mine) or 'none'}"
    )


def check_range(name: str, value: float, ok: Callable[[float], bool], expect: str) -> None:
    """Eager argument validation with a message naming the argument (torch.optim style)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not ok(float(value)):
        raise ValueError(f"invalid {name}: {value!r} (expected {expect})")


def check_int(name: str, value: int, low: int) -> None:
    """Refuse anything but an integer >= ``low`` (a bool is not one)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"invalid {name}: {value!r} (expected an integer >= {low})")


def check_bool(name: str, value: bool) -> None:
    """Refuse anything but ``True`` or ``False``."""
    if not isinstance(value, bool):
        raise ValueError(f"invalid {name}: {value!r} (expected True or False)")


def check_choice(name: str, value: object, choices: Sequence[object]) -> None:
    """Refuse ``value`` unless it is one of ``choices``, with a message naming them."""
    if value not in choices:
        *rest, last = map(repr, choices)
        raise ValueError(f"invalid {name}: {value!r} (expected {', '.join(rest)} or {last})")


#: the largest ℓ and noise scale σ = √(2ℓτ/n) a step may take: float32's largest value (the
#: parameters are float32 unless asked otherwise; a larger step cannot be represented, and torch
#: would fail mid-step with "value cannot be converted to type float without overflow")
LARGEST_STEP = 3.4028234663852886e38
_LARGEST_SQUARED = LARGEST_STEP * LARGEST_STEP  # finite in float64
_NUMBERS = (int, float)  # exact types: a bool is refused by the full check


def check_hyperparameters(lr: float | Tensor, num_data: float, temperature: float) -> None:
    """ℓ, n and τ of a sampler or a parameter group: ℓ in [0, :data:`LARGEST_STEP`], n ≥ 1 and
    τ ≥ 0 finite, and the noise scale √(2ℓτ/n) at most :data:`LARGEST_STEP`. A tensor ℓ's
    entries are read on the host (at construction, never in a step: :func:`check_groups`).

    Raises:
        ValueError: naming the argument, its value and the valid range.
    """
    check_num_data(num_data)
    check_range("temperature", temperature, lambda v: 0.0 <= v < math.inf, "finite >= 0")
    if isinstance(lr, Tensor):
        if lr.is_floating_point() and not bool(torch.isfinite(lr).all()):
            raise ValueError("invalid lr: every entry must be finite")
        largest = float(lr.detach().abs().max()) if lr.numel() and lr.is_floating_point() else 0.0
    else:
        check_range("lr", lr, lambda v: 0.0 <= v <= LARGEST_STEP,
                    f"finite >= 0 and <= {LARGEST_STEP:.3g}, the largest float32")  # fmt: skip
        largest = float(lr)
    _check_noise_scale(largest, float(num_data), float(temperature))


def _check_noise_scale(lr: float, num_data: float, temperature: float) -> None:
    scale = math.sqrt(2.0 * lr * temperature / num_data) if lr * temperature else 0.0
    if not scale <= LARGEST_STEP:
        raise ValueError(
            f"invalid temperature: {temperature!r} with lr {lr!r} and num_data {num_data!r} gives "
            f"a noise scale sqrt(2 lr temperature / num_data) = {scale:.3g}, beyond the largest "
            f"float32 ({LARGEST_STEP:.3g})"
        )


def check_groups(groups: Iterable[Mapping[str, Any]]) -> None:
    """Each parameter group's ℓ, n and τ as a step reads them (set in ``param_groups`` since
    construction, as torch.optim allows): floats only, so that a step reads nothing on the host
    (a tensor ℓ was checked where it was set).

    Raises:
        ValueError: naming the group, the argument and the valid range.
    """
    for index, group in enumerate(groups):
        lr, num_data, temperature = group["lr"], group["num_data"], group["temperature"]
        if isinstance(lr, Tensor):
            lr = 0.0
        if (  # the common case, in a few comparisons (NaN fails each); else the full check
            type(lr) in _NUMBERS
            and type(num_data) in _NUMBERS
            and type(temperature) in _NUMBERS
            and 0.0 <= lr <= LARGEST_STEP
            and 1.0 <= num_data < math.inf
            and num_data == int(num_data)
            and 0.0 <= temperature < math.inf
            and 2.0 * lr * temperature <= num_data * _LARGEST_SQUARED
        ):
            continue
        try:
            check_hyperparameters(lr, num_data, temperature)
        except ValueError as exc:
            raise ValueError(f"param_groups[{index}]: {exc}") from None


def check_localization(value: float) -> None:
    """The pull c ≥ 0 towards θ₀ of a localised chain: finite (as the optimizer takes it)."""
    check_range("localization", value, lambda v: 0.0 <= v < math.inf, "finite >= 0")


def check_num_data(num_data: float) -> None:
    """n, the number of training data: a whole number ``num_data >= 1``, finite (an int, or a
    float that is one, such as ``5e4``); ``64.5`` is refused rather than read as another count."""
    check_range(
        "num_data",
        num_data,
        lambda v: 1.0 <= v < math.inf and v.is_integer(),
        "a whole number num_data >= 1 and finite, the number of training data",
    )
