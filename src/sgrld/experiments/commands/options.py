"""The run options on the command line: the parsers of ``sample``, ``sweep`` and ``tune`` made
from :data:`~sgrld.experiments.run.options.OPTIONS`, and :func:`configs_from_args`, the one place
a command line becomes :class:`~sgrld.experiments.run.config.RunConfig` s.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from sgrld.core.contract import check_hyperparameters
from sgrld.data import dataset_info
from sgrld.experiments.base.exits import UsageError
from sgrld.experiments.report.paper import paper_entry
from sgrld.experiments.run.choices import MODEL_FOR_DATASET
from sgrld.experiments.run.config import METRIC_FIELDS, TUNED_FIELDS, RunConfig
from sgrld.experiments.run.naming import cli_names
from sgrld.experiments.run.options import OPTIONS, RunOption, by_field, comma_list
from sgrld.experiments.run.tuned import check_setting, tuned_options
from sgrld.metrics import get_metric

_TYPES: dict[str, Callable[[str], Any]] = {"int": int, "float": float, "str": str}


def add_run_options(
    parser: argparse.ArgumentParser,
    *,
    lists: Collection[str] = (),
    grid: bool = False,
    own: Mapping[str, Mapping[str, Any]] | None = None,
) -> None:
    """Every run option, under its heading.

    Args:
        parser: the command's parser.
        lists: options that take comma lists on this command (beyond ``--lr``, ``--alpha2``).
        grid: a sweep's: the runs' options default to "not given" (only typed flags override).
        own: the command's own words for an option, as ``add_argument`` keywords (and
            ``flags``).
    """
    groups: dict[str, Any] = {}
    for option in OPTIONS.values():
        if option.group not in groups:
            groups[option.group] = parser.add_argument_group(option.group)
        words = dict((own or {}).get(option.name, {}))
        flags = words.pop("flags", option.flags)
        keywords = {**_keywords(option, option.name in lists), **words}
        if grid and not option.machine:
            keywords["default"] = argparse.SUPPRESS
        groups[option.group].add_argument(*flags, **keywords)


def _keywords(option: RunOption, listed: bool) -> dict[str, Any]:
    keywords = {"dest": option.name, "default": option.default, "help": option.help}
    if option.kind == "bool":
        return {**keywords, "action": "store_true"}
    if option.kind == "table":
        return {**keywords, "action": OptionAction, "metavar": option.metavar}
    parse = option.parse or _TYPES[option.kind]
    if listed or option.many:
        parse = comma_list(parse, option.choices)
        metavar = "A,B,..." if listed else option.metavar
        return {**keywords, "type": argparse_type(parse), "metavar": metavar}
    checked = argparse_type(parse) if option.parse else parse  # int's own "invalid int value"
    return {**keywords, "type": checked, "choices": option.choices, "metavar": option.metavar}


def argparse_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` as an argparse ``type`` that shows its ValueError's message (argparse hides it)."""

    def checked(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    checked.__name__ = parse.__name__
    return checked


def option_value(text: str) -> bool | int | float | str | None:
    """A ``--option`` value as JSON reads it (``0.95``, ``true``, ``null``), else the word."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    return value if value is None or isinstance(value, (bool, int, float, str)) else text


class OptionAction(argparse.Action):
    """``--option KEY=VALUE``, repeatable, collected into one table."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        key, sep, text = str(values).partition("=")
        if not sep or not key.strip():
            parser.error(f"{option_string} takes KEY=VALUE, got {values!r}")
        options = dict(getattr(namespace, self.dest, None) or {})
        name = key.strip().replace("-", "_")
        if name in options:  # the last one would silently win
            parser.error(
                f"{option_string} {name} given twice ({name}={options[name]!r} and "
                f"{values!r}); give each option once"
            )
        options[name] = option_value(text.strip())
        setattr(namespace, self.dest, options)


def given_options(argv: Sequence[str]) -> set[str]:
    """The run options written in ``argv`` (a unique prefix counts, as for argparse)."""
    names = {flag: o.name for o in OPTIONS.values() for flag in o.flags}
    given = set()
    for token in argv:
        if not token.startswith("--"):
            continue
        flag = token.split("=", 1)[0]
        matches = (
            {names[flag]} if flag in names else {n for f, n in names.items() if f.startswith(flag)}
        )
        if len(matches) == 1:
            given |= matches
    return given


def as_list(value: Any) -> list[Any]:
    """An option's values: ``None`` → ``[None]``, a number → ``[number]``, a list → itself."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _values(args: argparse.Namespace | Mapping[str, Any]) -> Mapping[str, Any]:
    return args if isinstance(args, Mapping) else vars(args)


def is_multichain(args: argparse.Namespace | Mapping[str, Any]) -> bool:
    """Whether the options ask for more than one chain."""
    values = _values(args)
    lists = [values.get(name) for name in ("lr", *TUNED_FIELDS)]
    return values.get("chains", 1) != 1 or any(len(as_list(v)) > 1 for v in lists)


def configs_from_args(args: argparse.Namespace | Mapping[str, Any]) -> list[RunConfig]:
    """The runs of a command line (or a sweep's point): every tuned option (α²) × ℓ × seed, α²
    outermost so that chains with equal α² share a sampler call.

    Raises:
        UsageError: invalid or inconsistent options.
    """
    values = _values(args)
    chains = values.get("chains", 1)
    if isinstance(chains, bool) or not isinstance(chains, int) or chains < 1:
        raise UsageError(f"--chains must be >= 1, got {chains}")
    batch = values.get("chain_batch")
    if batch is not None and batch < 1:
        raise UsageError(f"--chain-batch must be >= 1, got {batch}")
    lists = [as_list(values.get(name)) for name in TUNED_FIELDS]
    return [
        _config(values, lr, dict(zip(TUNED_FIELDS, tuned, strict=True)), values["seed"] + k)
        for tuned in itertools.product(*lists)
        for lr in as_list(values["lr"])
        for k in range(chains)
    ]


def config_from_args(args: argparse.Namespace | Mapping[str, Any]) -> RunConfig:
    """The :class:`~sgrld.experiments.run.config.RunConfig` of a single-run command line.

    Raises:
        UsageError: invalid or inconsistent options, or more than one run asked for.
    """
    if is_multichain(args):
        raise UsageError("more than one run asked for (--chains or comma lists)")
    return configs_from_args(args)[0]


def _config(
    values: Mapping[str, Any], lr: float | str | None, tuned: dict[str, Any], seed: int
) -> RunConfig:
    run = {field: values[option.name] for field, option in by_field().items()}
    dataset, sampler = run["dataset"], run["sampler"]
    paper = paper_entry(dataset, run["prior"], run["width"], sampler)
    tuned_from = lr if isinstance(lr, str) else None
    if isinstance(lr, str):  # tuned:DIR: its ℓ, and its tuned options (α²) not given
        chosen = tuned_options(lr, sampler)
        for n in METRIC_FIELDS:
            if n not in tuned and n in chosen and chosen[n] != run[n]:  # e.g. another α² rule
                raise UsageError(f"--lr {lr}: tuned with {n} = {chosen[n]}, not {run[n]}")
        tuned = {n: chosen.get(n) if v is None else v for n, v in tuned.items()}
        lr = float(chosen["lr"])
    if lr is None and paper is not None:
        lr = paper.lr
    defaults = {f.name: f.default for f in dataclasses.fields(RunConfig)}
    metric = {f.name: f.default for f in dataclasses.fields(get_metric(sampler))}  # type: ignore[arg-type]
    # a tuned option not given: the paper's value where the run's other metric options are the
    # paper's (its α² is not a normalized rule's c), else the metric's default
    as_paper = paper is not None and all(
        run[n] == defaults[n] for n in METRIC_FIELDS if n not in tuned
    )
    for name, value in tuned.items():
        if value is None and name in metric:
            known = getattr(paper, name, None) if as_paper else None
            tuned[name] = metric[name] if known is None else known
    if run["schedule"] != "cyclical" and (run["cycles"], run["explore_fraction"]) != (1, 0):
        raise UsageError("--cycles and --explore-fraction need --schedule cyclical")
    num_val = run["num_val"]
    run |= {
        "model": run["model"] or MODEL_FOR_DATASET[dataset],
        "lr": 1.0 if lr is None else lr,
        "seed": seed,
        **tuned,
        "sampler_options": dict(run["sampler_options"] or {}),
        "num_val": dataset_info(dataset).num_val if num_val is None else num_val,
    }
    try:
        config = RunConfig.from_dict(run)  # ℓ is checked after the other options
    except ValueError as exc:
        raise UsageError(cli_names(str(exc))) from exc
    if lr is None:
        raise UsageError(
            f"no paper learning rate for {sampler} on {dataset} with the {run['prior']} "
            "prior (the paper found Identity optimal there, or the setting is not in the paper); "
            "give --lr"
        )
    pool = dataset_info(config.dataset).train_pool
    if config.num_val >= pool:
        raise UsageError(
            f"--num-val {config.num_val} leaves no training point of the {pool} {config.dataset} "
            f"splits into training and validation: give --num-val between 1 and {pool - 1}"
        )
    try:  # as the sampler will: finite, and a step that fits a float32
        check_hyperparameters(config.lr, config.max_num_data(), config.temperature)
    except ValueError as exc:
        raise UsageError(cli_names(str(exc))) from exc
    if tuned_from is not None:
        for line in _check_tuned_setting(tuned_from, config):
            print(f"sgrld: warning: {line}", file=sys.stderr)
    return config


def _check_tuned_setting(value: str, config: RunConfig) -> list[str]:
    """:func:`~sgrld.experiments.run.tuned.check_setting` with the run's setting: n, τ and
    the options the tuner kept fixed (the metric's defaults where the run gives none)."""
    setting = {
        **{f: getattr(config, f) for f in ("sampler", "dataset", "model", "width", "prior")},
        **{f: getattr(config, f) for f in ("batch_size", "epochs")},
        "num_train": config.max_num_data(),
    }
    metric = get_metric(config.sampler)
    defaults = {
        f.name: f.default
        for f in dataclasses.fields(metric)  # type: ignore[arg-type]
        if f.default is not dataclasses.MISSING
    }
    fixed = {**defaults, **config.metric_options}
    fixed |= {"temperature": config.temperature, "adapt_until": config.adapt_until}
    return check_setting(value, setting, fixed)
