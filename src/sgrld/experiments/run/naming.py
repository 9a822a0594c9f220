"""Names in one format: run, chain and setting folders (a chain of ``--chains`` is named as the
single run it equals), and the command-line flag of a field."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from sgrld.experiments.run.choices import Names
from sgrld.experiments.run.config import TUNED_FIELDS, symbol
from sgrld.experiments.run.options import by_field

#: A tuned option's word in folder names where it is not its name (as the first runs wrote it).
_FOLDER_WORDS = {"alpha2": "alpha"}


def model_label(model: str, width: int | None) -> str:
    """``fc400`` for the fully connected net of width 400, else the model's name."""
    return f"fc{width}" if model == "fc" else model


def options_label(options: Mapping[str, Any]) -> str:
    """``-decay0.95-block_size64`` for a metric's options (empty for its defaults)."""

    def text(value: Any) -> str:
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        return f"{value:g}" if number else str(value).lower()

    return "".join(f"-{name}{text(value)}" for name, value in sorted(options.items()))


def default_out_dir(config: Any) -> Path:
    """``runs/<dataset>-<model>[N]-<prior>-<sampler>-lr<ℓ>[-alpha<α²>|-c<c>][-cyc<M>r<r>]
    [-sub<N>]-seed<s>`` (``lr…-alpha…-seed…`` as in a sweep's run folders)."""
    return default_chains_out_dir([config], seeds=str(config.seed))


def default_chains_out_dir(configs: list[Any], seeds: str | None = None) -> Path:
    """``runs/<dataset>-<model>[N]-<prior>-<sampler>-lr<ℓ,...>[-alpha<α²,...>]-seed<first>-<last>``
    for a multi-chain run."""
    first = configs[0]
    model = model_label(first.model, first.width)

    def values(name: str) -> str:
        return ",".join(dict.fromkeys(f"{c.flat()[name]:g}" for c in configs))

    alpha = "".join(f"-{_FOLDER_WORDS.get(n, n)}{values(n)}" for n in first.tuned)
    if first.alpha2_rule == "normalized":  # Monge's c
        alpha = f"-c{values('alpha2')}"
    alpha += options_label(first.sampler_options)
    if first.schedule == "cyclical":
        alpha += f"-cyc{first.cycles}r{first.explore_fraction:g}"
    subset = f"-sub{first.max_train}" if first.max_train is not None else ""
    if seeds is None:
        ordered = sorted({c.seed for c in configs})
        seeds = f"{ordered[0]}-{ordered[-1]}"
    name = (
        f"{first.dataset}-{model}-{first.prior}-{first.sampler}-lr{values('lr')}{alpha}"
        f"{subset}-seed{seeds}"
    )
    return Path("runs") / name


def chain_label(config: Any) -> str:
    """The chain's folder name: the single run's default ``--out`` name."""
    return default_out_dir(config).name


def setting_name(config: Mapping[str, Any], varying: Iterable[str] = ()) -> str:
    """``mnist-fc400-horseshoe``, plus ``-<field><value>`` for other fields the grid varies."""
    model = model_label(config["model"], config["width"])
    extra = "".join(f"-{name}{config[name]}" for name in sorted(varying))
    return f"{config['dataset']}-{model}-{config['prior']}{extra}"


def run_label(config: Mapping[str, Any]) -> str:
    """``lr0.25-alpha1.25-seed0`` (the tuned options' parts, α², only where the sampler has
    them)."""
    alpha = "".join(f"-{_FOLDER_WORDS.get(n, n)}{config[n]:g}" for n in _given(config))
    alpha += options_label(config.get("sampler_options", {}))
    return f"lr{config['lr']:g}{alpha}-seed{config['seed']}"


def tuned_text(config: Mapping[str, Any]) -> str:
    """``, α² 1.25``: the tuned options a config (as the files write it) holds, by symbol."""
    return "".join(f", {symbol(n)} {config[n]:g}" for n in _given(config))


def _given(config: Mapping[str, Any]) -> list[str]:
    """The tuned options a config (as the files write it) holds: α² for Monge's."""
    return [n for n in TUNED_FIELDS if config.get(n) is not None]


def flag_of(field: str) -> str:
    """The command-line flag of a config field (:data:`~.run.options.OPTIONS`)."""
    option = by_field().get(field)
    return option.flags[0] if option else "--" + field.replace("_", "-")


#: Fields that are flags in messages only at the start or as ``name=`` (common words).
_PLAIN = Names(lambda: ("lr", "epochs", "width", "seed", "thinning", *TUNED_FIELDS, "temperature"))


def cli_names(message: str) -> str:
    """Config field names → their command-line flags in an error message: whole words,
    ``name=value`` as ``--flag value``, a :data:`_PLAIN` word only at the start or as ``name=``."""
    named = {field: flag_of(field) for field in by_field()}
    words = {f: flag for f, flag in named.items() if flag != f"--{f}" or f == "cycles"}
    for field, flag in words.items():
        message = re.sub(rf"\b{field}=", flag + " ", message)
        message = re.sub(rf"\b{field}\b", flag, message)
    for word in _PLAIN:
        message = re.sub(rf"(?<![-\w]){word}=", f"--{word} ", message)
        if message.startswith(word + " "):
            message = "--" + message
    return message


def option_text(field: str, value: Any) -> str:
    """A config value as written on the command line: ``--prior horseshoe``, ``no --subset``."""
    flag = flag_of(field)
    if isinstance(value, bool):
        return flag if value else f"no {flag}"
    if value is None:
        return f"no {flag}"
    if isinstance(value, (list, tuple)):
        return f"{flag} {','.join(f'{v:g}' if isinstance(v, float) else str(v) for v in value)}"
    return f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}"
