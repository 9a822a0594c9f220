"""The run options of ``sgrld sample``, ``sweep`` and ``tune``, declared once (:data:`OPTIONS`):
the parsers (``commands/options.py``), a sweep config's keys and kinds and the flag of a config
field are generated from it. A metric's tuned option (``--alpha2``) is read from the metric
registry when used, so a plug-in registered after import has its flag."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from sgrld.experiments.run.choices import DATASETS, MODELS, NOISE, PRIORS, SAMPLERS, Table
from sgrld.experiments.run.config import ADAPT_CHOICES, TUNED_FIELDS, samplers_taking, symbol
from sgrld.experiments.run.tuned import lr_value
from sgrld.metrics import get_metric, resolve_metric_name

__all__ = [
    "MACHINE_OPTIONS",
    "OPTIONS",
    "RunOption",
    "Table",
    "adapt_choice",
    "by_field",
    "comma_list",
    "number",
]

DEFAULT_ALPHA2 = 1.0  # the reference's config default


@dataclass(frozen=True, kw_only=True)
class RunOption:
    """One run option: ``--name`` (dashes for underscores) on the command line, ``name`` (argparse's
    ``dest``) in a sweep config. ``kind``: ``bool`` (a switch), ``int``, ``float``, ``str`` or
    ``table`` (``--option KEY=VALUE``, repeatable); ``parse`` reads one value (default: by
    ``kind``); ``many``: a comma list runs one chain per value; ``axis``: a sweep takes a list;
    ``machine``: where and how to run (no config field); ``field`` and ``flag`` where not
    ``name`` and ``--name``."""

    name: str
    help: str
    group: str
    kind: str = "str"
    default: Any = None
    choices: Sequence[str] | None = None
    parse: Callable[[str], Any] | None = None
    metavar: str | None = None
    many: bool = False
    axis: bool = False
    machine: bool = False
    field: str | None = None
    flag: str | None = None

    @property
    def config_field(self) -> str | None:
        """The :class:`~sgrld.experiments.run.config.RunConfig` field it sets, if any."""
        return None if self.machine else self.field or self.name

    @property
    def flags(self) -> tuple[str, ...]:
        return (self.flag or "--" + self.name.replace("_", "-"),)


def comma_list(
    item_type: Callable[[str], Any], choices: Iterable[Any] | None = None
) -> Callable[[str], list[Any]]:
    """A parser of ``a,b,c``: a list of ``item_type`` values from ``choices``."""
    valid = None if choices is None else tuple(choices)

    def parse(text: str) -> list[Any]:
        values = []
        for part in text.split(","):
            if not part.strip():
                raise ValueError(f"empty item in {text!r}")
            value = item_type(part.strip())
            if valid is not None and value not in valid:
                raise ValueError(f"{value!r} is not one of {', '.join(map(str, valid))}")
            values.append(value)
        return values

    parse.__name__ = f"comma-separated {getattr(item_type, '__name__', 'value')}"
    return parse


def number(text: str) -> float:
    """One number (``--alpha2``)."""
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"not a number: {text!r}") from None


def adapt_choice(text: str) -> str | int:
    """``wait``, ``burnin``, ``always`` or a count of warm-up updates N >= 0."""
    if text in ADAPT_CHOICES:
        return text
    if text.isdigit():
        return int(text)
    raise ValueError(f"expected {', '.join(ADAPT_CHOICES)} or an integer >= 0, not {text!r}")


WHAT, SCHEDULE, MACHINE = "what to sample", "schedule and evaluation", "data, output and machine"


def tuned_option(name: str) -> RunOption:
    """The option of a metric's tuned option (:data:`~.run.config.TUNED_FIELDS`, ``--alpha2``)."""
    owners = samplers_taking(name)
    default = next(f.default for f in fields(get_metric(owners[0])) if f.name == name)  # type: ignore[arg-type]
    return RunOption(
        name=name, group=WHAT, kind="float", parse=number, many=True, axis=True,
        metavar="A[,A...]",
        help=f"{' or '.join(o.capitalize() for o in owners)}'s {symbol(name)}; "
        f"default: the paper's for the setting, else {default}. A comma list runs one chain "
        "per value",
    )  # fmt: skip


_OPTIONS = (
    RunOption(name="dataset", group=WHAT, choices=DATASETS, default="mnist",
              help="the data set (default mnist)"),
    RunOption(name="model", group=WHAT, choices=MODELS,
              help="default: fc for mnist, resnet20 for cifar10"),
    RunOption(name="width", group=WHAT, kind="int", default=400, axis=True,
              help="hidden width N of fc (400)"),
    RunOption(name="prior", group=WHAT, choices=tuple(PRIORS), default="gaussian", axis=True,
              help="the prior on the weights (default gaussian; the paper's MNIST tables use "
              "horseshoe too)"),
    RunOption(name="sampler", group=WHAT, choices=SAMPLERS, parse=resolve_metric_name,
              axis=True, help="the metric G (aliases: sgld = identity, psgld = rmsprop)"),
    RunOption(name="lr", group=WHAT, kind="float", parse=lr_value, many=True, axis=True,
              metavar="LR[,LR...]",
              help="learning rate ℓ (h = ℓ/n), or tuned:DIR for the ℓ that sgrld tune --out DIR "
              "chose for the sampler; default: the paper's for the setting. A comma list "
              "runs one chain per value (crossed with --alpha2 and the seeds of --chains)"),
    RunOption(name="alpha2_rule", group=WHAT, choices=("fixed", "normalized"), default="fixed",
              help="Monge: fixed α² (the paper's; the default) or normalized α²_t = c/‖m_t‖² "
              f"with c = --alpha2 (default c = {DEFAULT_ALPHA2}; the stretch along m is 1 + c)"),
    RunOption(name="sampler_options", flag="--option", group=WHAT, kind="table", axis=True,
              metavar="KEY=VALUE",
              help="any other option of the sampler's metric, e.g. decay=0.95 (rmsprop, wenzel, "
              "monge, shampoo) or block_size=64 (shampoo); repeatable; the metric checks it"),
    RunOption(name="likelihood_scale", group=WHAT, kind="float",
              help="regression data: the Gaussian likelihood's σ (standardised units), fixed; "
              "default: learned, sampled with the weights"),
    RunOption(name="temperature", group=WHAT, kind="float", default=1.0, help="τ (1)"),
    RunOption(name="epochs", group=WHAT, kind="int", default=400,
              help="epochs (default 400, the paper's)"),
    RunOption(name="seed", group=WHAT, kind="int", default=0, axis=True,
              help="master seed >= 0 (0)"),
    RunOption(name="chains", group=WHAT, kind="int", default=1, metavar="K", machine=True,
              help="run seeds --seed .. --seed+K-1 as K chains in one process (1); each chain "
              "writes OUT/<run name>/results.json as its single run would"),
    RunOption(name="chain_batch", group=WHAT, kind="int", metavar="B", machine=True,
              help="at most B chains per vectorised call (default: all; fewer bound the memory)"),
    RunOption(name="noise", group=WHAT, choices=NOISE, default="philox",
              help="noise source: philox (counter-based, per-chain keys; the default, needed by "
              "--chains) or torch (normal_ from a generator)"),
    RunOption(name="compile", group=WHAT, kind="bool", default=False,
              help="compile each step's metric and move (identity, wenzel, rmsprop)"),
    RunOption(name="schedule", group=SCHEDULE, choices=("constant", "cyclical"),
              default="constant",
              help="ℓ schedule: constant (the paper's) or cosine-cyclical (cSG-MCMC)"),
    RunOption(name="cycles", group=SCHEDULE, kind="int", default=1, help="cyclical: cycles M (1)"),
    RunOption(name="explore_fraction", group=SCHEDULE, kind="float", default=0.0,
              help="cyclical: leading fraction r in [0, 1) of each cycle without noise or "
              "samples (0)"),
    RunOption(name="batch_size", group=SCHEDULE, kind="int", default=100,
              help="minibatch size (100)"),
    RunOption(name="burn_in", field="burnin", group=SCHEDULE, kind="int", default=1000,
              help="burn-in updates (1000)"),
    RunOption(name="thinning", group=SCHEDULE, kind="int", default=100,
              help="a sample every K updates (100)"),
    RunOption(name="adapt", group=SCHEDULE, parse=adapt_choice, default="wait", axis=True,
              metavar="{wait,burnin,always,N}",
              help="when the metric adapts: a warm-up over the burn-in that waits for the chain "
              "to arrive, then frozen (wait, the default: the chain samples the posterior; a "
              "chain still travelling adapts on past the burn-in), during exactly the burn-in "
              "(burnin: the default of runs made before wait, which they keep), at every update "
              "(always: the paper's protocol, biased; docs/posterior.md) or during the first N "
              "updates"),
    RunOption(name="curvature", group=SCHEDULE, kind="bool", default=False,
              help="measure C(θ) of every sample"),
    RunOption(name="curvature_points", group=SCHEDULE, kind="int", default=1000,
              help="test points (1000)"),
    RunOption(name="eval_batch_size", group=SCHEDULE, kind="int", default=1000,
              help="points per evaluation batch (1000)"),
    RunOption(name="subset", field="max_train", group=SCHEDULE, kind="int", metavar="N",
              help="train on the first N training points only (smoke tests; n becomes N, so the "
              "same --lr is a larger step h = ℓ/N: scale --lr by N/n to keep it)"),
    RunOption(name="eval_subset", field="max_eval", group=SCHEDULE, kind="int", metavar="M",
              help="evaluate on the first M val/test points"),
    RunOption(name="num_val", group=SCHEDULE, kind="int",
              help="validation size (the data set's: 10000 for mnist and cifar10, 44 for "
              "diabetes)"),
    RunOption(name="data_dir", group=MACHINE, machine=True,
              help="dataset directory (default: $SGRLD_DATA_DIR)"),
    RunOption(name="no_verify", group=MACHINE, kind="bool", default=False, machine=True,
              help="skip the files' SHA-256 checks"),
    RunOption(name="download", group=MACHINE, kind="bool", default=False, machine=True,
              help="fetch missing files if possible"),
    RunOption(name="out", group=MACHINE, machine=True,
              help="output directory (default: runs/<dataset>-<model>-<prior>-<sampler>-...)"),
    RunOption(name="resume", group=MACHINE, kind="bool", default=False, machine=True,
              help="continue (or, with a larger --epochs, extend) the run in --out; its options "
              "(--sampler included) are read from its checkpoint, and flags given must agree"),
    RunOption(name="device", group=MACHINE, default="cpu", machine=True,
              help="cpu, cuda or cuda:K (cpu)"),
    RunOption(name="threads", group=MACHINE, kind="int", machine=True,
              help="torch CPU threads (default: torch's choice)"),
    RunOption(name="parallel", group=MACHINE, choices=("none", "ddp", "fsdp"), default="none",
              machine=True,
              help="one chain over the processes of torchrun --nproc-per-node W, each taking its "
              "slice of every minibatch (gloo on CPU, NCCL on CUDA): ddp holds the whole model "
              "and sampler state on every process, fsdp shards them (FSDP2); none: this process "
              "alone (none)"),
    RunOption(name="no_graph", group=MACHINE, kind="bool", default=False, machine=True,
              help="CUDA: take each step eagerly, with a host sync per step, instead of "
              "replaying the step captured in a CUDA graph (the default when the run allows it: "
              "philox noise, constant schedule, no --compile); single runs only"),
    RunOption(name="no_progress", group=MACHINE, kind="bool", default=False, machine=True,
              help="no progress bar on stderr"),
    RunOption(name="no_plot", group=MACHINE, kind="bool", default=False, machine=True,
              help="do not draw curves.png"),
)  # fmt: skip


def _all_options() -> dict[str, RunOption]:
    """The run options, each metric's tuned options (:data:`~.run.config.TUNED_FIELDS`, read
    from the registry now) after ``lr``."""
    options: dict[str, RunOption] = {}
    for option in _OPTIONS:
        options[option.name] = option
        if option.name == "lr":
            options |= {name: tuned_option(name) for name in TUNED_FIELDS}
    return options


#: Every run option by name, in the order ``--help`` lists them (read when used: a metric
#: plug-in's tuned option is among them).
OPTIONS: Mapping[str, RunOption] = Table(_all_options)
#: The options that say where and how to run, not what (none is a metric's tuned option).
MACHINE_OPTIONS = frozenset(option.name for option in _OPTIONS if option.machine)


def by_field() -> dict[str, RunOption]:
    """Config field → the option that sets it."""
    return {o.config_field: o for o in OPTIONS.values() if o.config_field is not None}
