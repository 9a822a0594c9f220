"""A run's configuration: :class:`RunConfig`, its validation (before any work), the seeds and
the sampling schedule."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from sgrld.core.compiled import check_compilable
from sgrld.core.noise import NOISE_SOURCES
from sgrld.core.warmup import Windows
from sgrld.data import dataset_info
from sgrld.experiments.run.build import build_metric, option_names
from sgrld.experiments.run.choices import MODEL_FOR_DATASET, PRIORS, SAMPLERS, Names
from sgrld.metrics import get_metric, metric_names
from sgrld.schedules import check_cyclical

GRAD_MAX = 1e6  # the reference clamps every gradient element to ±grad_max
TIMING_SKIP_STEPS = 1000  # the reference discards the first 1,000 step times
CHECKPOINT_FILE = "checkpoint.pt"
CHECKPOINT_FORMAT = "sgrld-sample-checkpoint/1"
SEED_STREAMS = ("init", "chain", "data_order", "curvature")
#: Fields added after the first format, with the value meaning "as before" (then not written).
LATER_FIELDS: dict[str, Any] = {"sampler_options": {}, "likelihood_scale": None}
#: ``RunConfig.adapt``'s named protocols (besides an integer count of warm-up updates): the
#: default ``"wait"`` (Stan's windows over the burn-in, extended until the chain has arrived),
#: ``"burnin"`` (adapt for exactly the burn-in: the default of runs made before ``"wait"``, which
#: their configs keep) and ``"always"`` (the paper's protocol).
ADAPT_CHOICES = ("wait", "burnin", "always")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything that defines a run; two runs with equal configs give identical results.

    Attributes:
        dataset: ``"mnist"`` or ``"cifar10"``.
        model: ``"fc"`` (MNIST, 784-N-N-10) or ``"resnet20"`` (CIFAR-10).
        prior: ``"gaussian"``, ``"horseshoe"`` (fc) or ``"correlated"`` (resnet20 convolutions).
        sampler: ``identity``, ``wenzel``, ``rmsprop``, ``monge`` or ``shampoo``.
        lr: learning rate ℓ > 0 (h = ℓ/n, ``docs/conventions.md``).
        epochs: passes over the training set, ≥ 1 (400 in the paper).
        seed: master seed ≥ 0; the init, chain, data-order and curvature generators derive from it.
        width: hidden width N of ``fc`` (400, 800, 1200); ignored for ``resnet20``.
        tuned: the metric's tuned options (:attr:`sgrld.metrics.Metric.tuned`; Monge's
            ``{"alpha2": 1.25}``, α² ≥ 0), each required by a metric that has it and refused by
            the others; the config files write each as a key of its own (``"alpha2": 1.25``,
            ``null`` where the sampler has none).
        temperature: τ ≥ 0 (1 in the paper).
        batch_size: minibatch size (100).
        burnin: updates before the first sample can be taken (1,000).
        thinning: a sample every ``thinning`` updates by global step (100).
        curvature: measure C(θ) of every sample (costly).
        curvature_points: leading test points used for C(θ) (1,000).
        num_val: validation size drawn from the official training set (10,000).
        max_train: use only the first ``max_train`` training points (smoke tests; ``None`` = all).
            n in the potential is then ``max_train``.
        max_eval: evaluate on the first ``max_eval`` validation and test points (``None`` = all).
        eval_batch_size: batch size of the (eval-mode) ensemble evaluation.
        noise: ``"philox"`` (counter-based keys from the chain's seed: chain s of a
            multi-chain run is the single run of seed s) or ``"torch"`` (``normal_``).
        compile: compile each step's metric and move (identity, wenzel and rmsprop only).
        alpha2_rule: Monge's ``"fixed"`` α² (the paper's) or ``"normalized"`` (α²_t = c/‖m_t‖²
            with c = ``alpha2`` > 0).
        schedule: ``"constant"`` ℓ (the paper's) or ``"cyclical"`` (:class:`~sgrld.CyclicalLR`
            over all ``epochs``).
        cycles: M ≥ 1 (cyclical only).
        explore_fraction: r in [0, 1) of each cycle noise-free, without samples (cyclical only).
        sampler_options: the metric's other options (``{"decay": 0.95}``), validated by the
            metric; empty = its defaults, the paper's.
        likelihood_scale: regression's fixed Gaussian σ in standardised units; ``None``: σ is
            learned (``docs/likelihoods.md``).
        adapt: when the metric adapts: ``"wait"`` (default) a warm-up over the burn-in that
            waits for the chain (:attr:`adapt_until`), then frozen; ``"burnin"`` during exactly
            the ``burnin`` updates, then frozen (the default before ``"wait"``: a config that
            says so keeps it); ``"always"`` (the paper's protocol); or an integer N ≥ 0: the
            first N updates (``docs/posterior.md``).
    """

    dataset: str
    model: str
    prior: str
    sampler: str
    lr: float
    epochs: int
    seed: int = 0
    width: int = 400
    tuned: Mapping[str, float] = field(default_factory=dict)
    temperature: float = 1.0
    batch_size: int = 100
    burnin: int = 1000
    thinning: int = 100
    curvature: bool = False
    curvature_points: int = 1000
    num_val: int = 10_000
    max_train: int | None = None
    max_eval: int | None = None
    eval_batch_size: int = 1000
    noise: str = "philox"
    compile: bool = False
    alpha2_rule: str = "fixed"
    schedule: str = "constant"
    cycles: int = 1
    explore_fraction: float = 0.0
    adapt: str | int = "wait"
    sampler_options: Mapping[str, Any] = field(default_factory=dict)
    likelihood_scale: float | None = None

    def __post_init__(self) -> None:
        def choice(name: str, valid: Sequence[str]) -> None:
            if getattr(self, name) not in valid:
                raise ValueError(
                    f"unknown {name} {getattr(self, name)!r}; valid names: {', '.join(valid)}"
                )

        choice("dataset", tuple(MODEL_FOR_DATASET))
        choice("model", tuple(MODEL_FOR_DATASET.values()))
        choice("prior", tuple(PRIORS))
        choice("sampler", SAMPLERS)
        choice("noise", NOISE_SOURCES)
        if self.compile:
            check_compilable(get_metric(self.sampler)())
        if MODEL_FOR_DATASET[self.dataset] != self.model:
            raise ValueError(
                f"model {self.model!r} does not fit dataset {self.dataset!r}; "
                f"use --model {MODEL_FOR_DATASET[self.dataset]} with --dataset {self.dataset}"
            )
        if self.prior == "correlated" and self.model != "resnet20":
            raise ValueError("the correlated prior acts on convolutions: use it with resnet20")
        if self.prior == "horseshoe" and self.model != "fc":
            raise ValueError("the horseshoe prior is the paper's MNIST prior: use it with fc")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a finite number > 0, got {self.lr}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        # a tuned option (Monge's α²) is required by a metric that has it, refused by the others,
        # as a metric option with a field of its own (Monge's α² rule) not at its default is
        if not isinstance(self.tuned, Mapping) or not set(self.tuned) <= set(TUNED_FIELDS):
            raise ValueError(f"invalid tuned options {self.tuned!r}; valid: {TUNED_FIELDS}")
        given = {n: v for n, v in self.tuned.items() if v is not None}
        object.__setattr__(self, "tuned", given)  # None: not given, as the files write it
        for name in get_metric(self.sampler).tuned:
            if name not in given:
                raise ValueError(f"{self.sampler} needs {name}")
        takes, values = option_names(self.sampler), self.flat()
        defaults = {f.name: f.default for f in fields(self)}
        for name in (*given, *METRIC_FIELDS):
            if name not in takes and values[name] != defaults.get(name):
                owner = " or ".join(n.capitalize() for n in samplers_taking(name))
                raise ValueError(f"{name} is a {owner} option; leave it unset for {self.sampler}")
        if self.schedule not in ("constant", "cyclical"):
            raise ValueError(f"unknown schedule {self.schedule!r}; valid: constant, cyclical")
        count = isinstance(self.adapt, int) and not isinstance(self.adapt, bool) and self.adapt >= 0
        if not (self.adapt in ADAPT_CHOICES or count):
            raise ValueError(
                f"invalid adapt {self.adapt!r}; valid: 'wait' (the default: a warm-up over the "
                "burn-in that waits for the chain), 'burnin' (adapt during exactly the burn-in), "
                "'always' (the paper's protocol) or an integer >= 0 (updates of warm-up)"
            )
        if self.schedule == "cyclical":
            check_cyclical(1, self.cycles, self.explore_fraction)
        elif (self.cycles, self.explore_fraction) != (1, 0.0):
            raise ValueError("cycles and explore_fraction need schedule 'cyclical'")
        if not isinstance(self.sampler_options, Mapping):
            raise ValueError(
                f"sampler_options must be a table of options, got {self.sampler_options!r}"
            )
        for name, value in self.sampler_options.items():  # JSON values; the metric checks them
            if not isinstance(name, str) or not (
                value is None or isinstance(value, (bool, int, float, str))
            ):
                raise ValueError(
                    f"invalid sampler option {name}={value!r} (a number, true/false or a name)"
                )
            if name in METRIC_FIELDS or name in TUNED_FIELDS:
                raise ValueError(f"give {name} as its own option, not among the sampler options")
        build_metric(self.sampler, self.metric_options)
        scale = self.likelihood_scale
        if scale is not None and dataset_info(self.dataset).likelihood != "gaussian":
            raise ValueError(f"likelihood_scale is for regression data; {self.dataset} has none")
        if scale is not None and not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"likelihood_scale must be a finite number > 0, got {scale}")
        minimum = {"epochs": 1, "seed": 0, "width": 1, "batch_size": 1, "burnin": 0}
        minimum |= {"thinning": 1, "curvature_points": 1, "num_val": 1, "eval_batch_size": 1}
        for name, low in minimum.items():
            _check_int(name, getattr(self, name), low)
        for name in ("max_train", "max_eval"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 1)
        num_data = self.max_num_data()
        if num_data >= 1:  # else the split itself is refused, with its own message
            check_collects_samples(self, num_data)

    def max_num_data(self) -> int:
        """n on the official data (a bound: a smaller look-alike dataset only lowers it)."""
        num_data = dataset_info(self.dataset).train_pool - self.num_val
        return num_data if self.max_train is None else min(num_data, self.max_train)

    @property
    def metric_options(self) -> dict[str, Any]:
        """The metric's options: ``sampler_options``, the tuned ones and the fields of its own
        it takes."""
        own = {n: getattr(self, n) for n in METRIC_FIELDS if n in option_names(self.sampler)}
        return {**self.sampler_options, **self.tuned, **own}

    @property
    def adapt_until(self) -> int | None:
        """The sampler's ``adapt_until``: ``None`` to adapt throughout (``"always"``); for
        ``"wait"``, ``Windows(burnin, arrival=True)`` (:mod:`sgrld.core.warmup`: Stan's windows
        over the burn-in, G frozen for its terminal window if the chain has arrived, else more
        windows until it has, at most 16 × the burn-in), the default of the library's other
        APIs; else an integer count of updates (``"burnin"``: the burn-in's)."""
        if self.adapt == "always":
            return None
        if self.adapt == "wait":
            return Windows(self.burnin, arrival=True)
        return self.burnin if self.adapt == "burnin" else int(self.adapt)

    def flat(self) -> dict[str, Any]:
        """Every field by name, each of :data:`TUNED_FIELDS` as a field of its own (``None``
        where the sampler has no such option): the names the files and the flags use."""
        values: dict[str, Any] = {}
        for name, value in asdict(self).items():
            if name == "tuned":
                values |= {n: self.tuned.get(n) for n in TUNED_FIELDS}
            else:
                values[name] = value
        return values

    def to_dict(self) -> dict[str, Any]:
        """The config as plain JSON values: :meth:`flat` (:data:`LATER_FIELDS` only when not as
        before)."""
        values = self.flat()
        values["sampler_options"] = dict(sorted(self.sampler_options.items()))
        for name, default in LATER_FIELDS.items():
            if values[name] == default:
                del values[name]  # a config without it reads as before it existed
        return values

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> RunConfig:
        """Inverse of :meth:`to_dict` and :meth:`flat` (unknown keys are an error; no ``adapt``:
        written before the warm-up, when the metric adapted throughout; the tuned options as
        keys of their own or as one ``tuned`` table)."""
        values = {"adapt": "always", **values}
        tuned = dict(values.pop("tuned", None) or {})
        tuned |= {n: values.pop(n) for n in TUNED_FIELDS if n in values}
        known = {f.name for f in fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"unknown config keys: {sorted(unknown)}")
        return cls(**values, tuned=tuned)

    def label(self) -> str:
        """Short human-readable name, e.g. ``monge ℓ=0.25 α²=1.25 seed 0``."""
        extra = "".join(f" {symbol(n)}={v:g}" for n, v in self.tuned.items())
        extra += "".join(f" {k}={v}" for k, v in sorted(self.sampler_options.items()))
        return f"{self.sampler} ℓ={self.lr:g}{extra} seed {self.seed}"


def samplers_taking(option: str) -> list[str]:
    """The samplers whose metric takes ``option``."""
    return [name for name in metric_names() if option in option_names(name)]


def symbol(option: str) -> str:
    """How labels and tables write a metric option (:attr:`~sgrld.metrics.Metric.symbols`:
    Monge's ``α²``), else its name."""
    return next(
        (s for m in samplers_taking(option) if (s := get_metric(m).symbols.get(option))), option
    )


#: The metrics' options tuned with ℓ (:attr:`sgrld.metrics.Metric.tuned`), in registry order,
#: read from the registry when used (a metric registered later counts): :attr:`RunConfig.tuned`'s
#: names, keys of the files, flags, axes of a sweep, varied per chain.
TUNED_FIELDS: Sequence[str] = Names(
    lambda: dict.fromkeys(n for m in metric_names() for n in get_metric(m).tuned)
)

#: RunConfig fields that are metric options (Monge's α² rule, with the paper's default).
METRIC_FIELDS = tuple(f.name for f in fields(RunConfig) if samplers_taking(f.name))


def _check_int(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def check_collects_samples(config: RunConfig, num_data: int) -> None:
    """Refuse a run whose schedule takes no sample: burn-in and thinning leave none.

    Raises:
        ValueError: naming burn-in, updates and thinning (``name=value``, so that the command
            line can show its flags).
    """
    per_epoch = math.ceil(num_data / config.batch_size)
    updates = config.epochs * per_epoch
    if num_samples_after(updates, config.burnin, config.thinning) > 0:
        return
    first = (config.burnin // config.thinning + 1) * config.thinning
    raise ValueError(
        f"this run would collect no sample: burnin={config.burnin} with thinning="
        f"{config.thinning} takes the first sample after update {first}, but "
        f"epochs={config.epochs} of {per_epoch} updates (n = {num_data}, batch_size="
        f"{config.batch_size}) make only {updates} updates; set epochs="
        f"{math.ceil(first / per_epoch)} or more, or lower burnin"
    )


def config_differences(saved: RunConfig, wanted: RunConfig) -> list[str]:
    """Fields (other than ``epochs``) in which two configs differ, as ``"name: a vs b"``.

    With a cyclical schedule ``epochs`` counts too: the cycles span the whole run.
    """
    old, new = saved.flat(), wanted.flat()
    return [f"{n}: {old[n]!r} vs {new[n]!r}" for n in config_fields_differing(saved, wanted)]


def config_fields_differing(saved: RunConfig, wanted: RunConfig) -> list[str]:
    """The names (:meth:`RunConfig.flat`'s) of the fields :func:`config_differences` lists."""
    free = "epochs" if wanted.schedule != "cyclical" else None
    old, new = saved.flat(), wanted.flat()
    return [n for n in old if n != free and old[n] != new[n]]


def derive_seed(seed: int, stream: str) -> int:
    """An independent 63-bit seed for one of :data:`SEED_STREAMS`, derived from the master seed."""
    entropy = np.random.SeedSequence([seed, SEED_STREAMS.index(stream)])
    return int(entropy.generate_state(1, np.uint64)[0] >> np.uint64(1))


def is_sample_step(global_step: int, burnin: int = 1000, thinning: int = 100) -> bool:
    """Whether the state after update ``global_step`` (1-based) is a sample.

    With the paper's values the first sample is taken after 1,100 updates, as in the reference
    (0-based step 1099 with ``(i + 1) % 100 == 0 and step > 1000``).
    """
    return global_step > burnin and global_step % thinning == 0


def num_samples_after(num_steps: int, burnin: int = 1000, thinning: int = 100) -> int:
    """Number of samples taken in the first ``num_steps`` updates (1,990 for 200,000 on MNIST)."""
    return max(0, num_steps // thinning - burnin // thinning)
