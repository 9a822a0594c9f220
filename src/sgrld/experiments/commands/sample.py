"""``sgrld sample``: one Bayesian-neural-network sampling run (the paper's Tables 1-3).

Example (the paper's best Monge run on MNIST, N = 400, horseshoe prior)::

    sgrld sample --dataset mnist --model fc --width 400 --prior horseshoe --sampler monge \\
        --lr 0.25 --alpha2 1.25 --epochs 400 --seed 0 --data-dir DIR --out OUT

writes ``OUT/results.json`` (config, seeds, per-epoch curves, final validation and test LP,
accuracy, ECE, curvature if measured, seconds per epoch, number of samples), ``OUT/curves.png``
and ``OUT/checkpoint.pt`` (every epoch; ``--resume`` continues a killed run exactly). Without
``--lr`` (and ``--alpha2`` for Monge) the paper's selected values for the setting are used
(Tables 4-5). The protocol is in :mod:`sgrld.experiments.run.single`.

Exit status: 0 when the run completed, 3 when the chain broke down (a non-finite potential, or
parameters blown up while finite: ``docs/health.md``; the results are still written), 2 for bad
input, a damaged checkpoint or an ``--out`` that another run holds (refused before any work
starts), 74 when an output cannot be written (disk full: the last good checkpoint is kept), 130
when interrupted. ``docs/experiments.md`` lists what survives which fault.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import sys
from pathlib import Path
from typing import Any

from sgrld.experiments.base import exits
from sgrld.experiments.base.exits import UsageError
from sgrld.experiments.base.files import read_file
from sgrld.experiments.run import launch
from sgrld.experiments.run.choices import DATASETS as DATASET_CHOICES
from sgrld.experiments.run.choices import MODELS as MODEL_CHOICES
from sgrld.experiments.run.choices import NOISE as NOISE_CHOICES
from sgrld.experiments.run.choices import PRIORS, SAMPLERS
from sgrld.experiments.run.naming import (
    cli_names,
    default_chains_out_dir,
    default_out_dir,
    dest_of,
    option_text,
)
from sgrld.experiments.run.tuned import lr_value, tuned_options
from sgrld.metrics import resolve_metric_name

PRIOR_CHOICES = tuple(PRIORS)
SAMPLER_CHOICES = SAMPLERS

DEFAULT_ALPHA2 = 1.0  # the reference's config default
EXIT_IO_ERROR = exits.IO_ERROR
EXIT_STATUS = exits.epilog("sample")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``sgrld sample`` options."""
    parser.epilog = EXIT_STATUS
    what = parser.add_argument_group("what to sample")
    what.add_argument(
        "--dataset", choices=DATASET_CHOICES, default="mnist", help="the data set (default mnist)"
    )
    what.add_argument(
        "--model", choices=MODEL_CHOICES, help="default: fc for mnist, resnet20 for cifar10"
    )
    what.add_argument("--width", type=int, default=400, help="hidden width N of fc (400)")
    what.add_argument(
        "--prior",
        choices=PRIOR_CHOICES,
        default="gaussian",
        help="the prior on the weights (default gaussian; the paper's MNIST tables use "
        "horseshoe too)",
    )
    what.add_argument(
        "--sampler",
        type=sampler_name,
        choices=SAMPLER_CHOICES,
        help="the metric G (aliases: sgld = identity, psgld = rmsprop)",
    )
    what.add_argument(
        "--lr",
        type=lr_list,
        metavar="LR[,LR...]",
        help="learning rate ℓ (h = ℓ/n), or tuned:DIR for the ℓ that sgrld tune --out DIR "
        "chose for the sampler; default: the paper's for the setting. A comma list "
        "runs one chain per value (crossed with --alpha2 and the seeds of --chains)",
    )
    what.add_argument(
        "--alpha2",
        type=float_list,
        metavar="A[,A...]",
        help=f"Monge's α²; default: the paper's for the setting, else {DEFAULT_ALPHA2}. A comma "
        "list runs one chain per value",
    )
    what.add_argument(
        "--alpha2-rule",
        choices=("fixed", "normalized"),
        default="fixed",
        help="Monge: fixed α² (the paper's; the default) or normalized α²_t = c/‖m_t‖² with "
        f"c = --alpha2 (default c = {DEFAULT_ALPHA2}; the stretch along m is 1 + c)",
    )
    what.add_argument(
        "--option",
        dest="sampler_options",
        action=OptionAction,
        metavar="KEY=VALUE",
        help="any other option of the sampler's metric, e.g. decay=0.95 (rmsprop, wenzel, "
        "monge, shampoo) or block_size=64 (shampoo); repeatable; the metric checks it",
    )
    what.add_argument(
        "--likelihood-scale",
        type=float,
        help="regression data: the Gaussian likelihood's σ (standardised units), fixed; "
        "default: learned, sampled with the weights",
    )
    what.add_argument("--temperature", type=float, default=1.0, help="τ (1)")
    what.add_argument("--epochs", type=int, default=400, help="epochs (default 400, the paper's)")
    what.add_argument("--seed", type=int, default=0, help="master seed >= 0 (0)")
    what.add_argument(
        "--chains",
        type=int,
        default=1,
        metavar="K",
        help="run seeds --seed .. --seed+K-1 as K chains in one process (1); each chain writes "
        "OUT/<run name>/results.json as its single run would",
    )
    what.add_argument(
        "--chain-batch",
        type=int,
        metavar="B",
        help="at most B chains per vectorised call (default: all; fewer bound the memory)",
    )
    what.add_argument(
        "--noise",
        choices=NOISE_CHOICES,
        default="philox",
        help="noise source: philox (counter-based, per-chain keys; the default, needed by "
        "--chains) or torch (normal_ from a generator)",
    )
    what.add_argument(
        "--compile",
        action="store_true",
        help="compile each step's metric and move (identity, wenzel, rmsprop)",
    )

    schedule = parser.add_argument_group("schedule and evaluation")
    schedule.add_argument(
        "--schedule",
        choices=("constant", "cyclical"),
        default="constant",
        help="ℓ schedule: constant (the paper's) or cosine-cyclical (cSG-MCMC)",
    )
    schedule.add_argument("--cycles", type=int, default=1, help="cyclical: cycles M (1)")
    schedule.add_argument(
        "--explore-fraction",
        type=float,
        default=0.0,
        help="cyclical: leading fraction r in [0, 1) of each cycle without noise or samples (0)",
    )
    schedule.add_argument("--batch-size", type=int, default=100, help="minibatch size (100)")
    schedule.add_argument("--burn-in", type=int, default=1000, help="burn-in updates (1000)")
    schedule.add_argument(
        "--thinning", type=int, default=100, help="a sample every K updates (100)"
    )
    schedule.add_argument(
        "--adapt",
        type=adapt_choice,
        default="burnin",
        metavar="{burnin,always,N}",
        help="when the metric adapts: during the burn-in, then frozen (burnin, the default: the "
        "chain samples the posterior), at every update (always: the paper's protocol, biased; "
        "docs/posterior.md) or during the first N updates",
    )
    schedule.add_argument("--curvature", action="store_true", help="measure C(θ) of every sample")
    schedule.add_argument("--curvature-points", type=int, default=1000, help="test points (1000)")
    schedule.add_argument(
        "--eval-batch-size", type=int, default=1000, help="points per evaluation batch (1000)"
    )
    schedule.add_argument(
        "--subset",
        type=int,
        metavar="N",
        help="train on the first N training points only (smoke tests; n becomes N, so the "
        "same --lr is a larger step h = ℓ/N: scale --lr by N/n to keep it)",
    )
    schedule.add_argument(
        "--eval-subset", type=int, metavar="M", help="evaluate on the first M val/test points"
    )
    schedule.add_argument(
        "--num-val",
        type=int,
        help="validation size (the data set's: 10000 for mnist and cifar10, 44 for diabetes)",
    )

    io = parser.add_argument_group("data, output and machine")
    io.add_argument("--data-dir", help="dataset directory (default: $SGRLD_DATA_DIR)")
    io.add_argument("--no-verify", action="store_true", help="skip the files' SHA-256 checks")
    io.add_argument("--download", action="store_true", help="fetch missing files if possible")
    io.add_argument(
        "--out", help="output directory (default: runs/<dataset>-<model>-<prior>-<sampler>-...)"
    )
    io.add_argument(
        "--resume",
        action="store_true",
        help="continue (or, with a larger --epochs, extend) the run in --out; its options "
        "(--sampler included) are read from its checkpoint, and flags given must agree",
    )
    io.add_argument("--device", default="cpu", help="cpu, cuda or cuda:K (cpu)")
    io.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    io.add_argument(
        "--parallel",
        choices=("none", "ddp", "fsdp"),
        default="none",
        help="one chain over the processes of torchrun --nproc-per-node W, each taking its "
        "slice of every minibatch (gloo on CPU, NCCL on CUDA): ddp holds the whole model and "
        "sampler state on every process, fsdp shards them (FSDP2); none: this process alone "
        "(none)",
    )
    io.add_argument(
        "--no-graph",
        action="store_true",
        help="CUDA: take each step eagerly, with a host sync per step, instead of replaying the "
        "step captured in a CUDA graph (the default when the run allows it: philox noise, "
        "constant schedule, no --compile); single runs only",
    )
    io.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    io.add_argument("--no-plot", action="store_true", help="do not draw curves.png")


def option_value(text: str) -> bool | int | float | str | None:
    """A ``--option`` value as JSON reads it (``0.95``, ``64``, ``true``, ``null``), else
    the word itself (``eigh``)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    return value if value is None or isinstance(value, (bool, int, float, str)) else text


class OptionAction(argparse.Action):
    """``--option KEY=VALUE``, repeatable, collected into one table."""

    kind = "table"  # a sweep config takes a TOML table (or a list of them: an axis)

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


def sampler_name(text: str) -> str:
    """An argparse ``type``: a sampler's registry name from itself or an alias (``sgld``)."""
    try:
        return resolve_metric_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


sampler_name.__name__ = "sampler"  # argparse's "invalid sampler value" before the message


def float_list(text: str) -> list[float]:
    """An argparse ``type``: ``0.1,0.25`` → ``[0.1, 0.25]`` (one value or more)."""
    values = []
    for part in text.split(","):
        try:
            values.append(float(part.strip()))
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {part.strip()!r}") from None
    return values


def adapt_choice(text: str) -> str | int:
    """An argparse ``type``: ``burnin``, ``always`` or a count of warm-up updates N >= 0."""
    if text in ("burnin", "always"):
        return text
    if text.isdigit():
        return int(text)
    raise argparse.ArgumentTypeError(f"expected burnin, always or an integer >= 0, not {text!r}")


float_list.item_type = float  # type: ignore[attr-defined]  # what a sweep's comma list holds


def lr_list(text: str) -> list[float | str]:
    """An argparse ``type``: ``0.1,0.25`` → ``[0.1, 0.25]``; ``tuned:DIR`` is kept as text and
    read once the sampler is known (:mod:`sgrld.experiments.run.tuned`)."""
    return [lr_value(part.strip()) for part in text.split(",")]


lr_list.item_type = lr_value  # type: ignore[attr-defined]
lr_value.config_kind = "float"  # type: ignore[attr-defined]  # a config's lr: numbers


def _values(value: Any) -> list[Any]:
    """A flag's values: ``None`` → ``[None]``, a number → ``[number]``, a list → itself."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


def is_multichain(args: argparse.Namespace) -> bool:
    """Whether the command line asks for more than one chain."""
    from sgrld.experiments.run.config import TUNED_FIELDS

    lists = [getattr(args, dest_of(n), None) for n in ("lr", *TUNED_FIELDS)]
    return getattr(args, "chains", 1) != 1 or any(len(_values(v)) > 1 for v in lists)


def configs_from_args(args: argparse.Namespace) -> list[Any]:
    """The runs of the command line: every tuned option (α²) × ℓ × seed (α² outermost, so that
    chains with equal α² are neighbours and share a sampler call).

    Raises:
        UsageError: invalid or inconsistent options.
    """
    from sgrld.experiments.run.config import TUNED_FIELDS

    chains = getattr(args, "chains", 1)
    if isinstance(chains, bool) or not isinstance(chains, int) or chains < 1:
        raise UsageError(f"--chains must be >= 1, got {chains}")
    batch = getattr(args, "chain_batch", None)
    if batch is not None and batch < 1:
        raise UsageError(f"--chain-batch must be >= 1, got {batch}")
    lists = [_values(getattr(args, dest_of(n), None)) for n in TUNED_FIELDS]
    return [
        _config(args, lr, dict(zip(TUNED_FIELDS, tuned, strict=True)), args.seed + k)
        for tuned in itertools.product(*lists)
        for lr in _values(args.lr)
        for k in range(chains)
    ]


def config_from_args(args: argparse.Namespace) -> Any:
    """The :class:`~sgrld.experiments.run.single.RunConfig` of a single-run command line.

    Raises:
        UsageError: invalid or inconsistent options, or more than one run asked for.
    """
    if is_multichain(args):
        raise UsageError("more than one run asked for (--chains or comma lists)")
    return configs_from_args(args)[0]


def _config(
    args: argparse.Namespace, lr: float | str | None, tuned: dict[str, Any], seed: int
) -> Any:
    from sgrld.data import dataset_info
    from sgrld.experiments.report.paper import paper_entry
    from sgrld.experiments.run.choices import MODEL_FOR_DATASET
    from sgrld.experiments.run.config import METRIC_FIELDS, RunConfig
    from sgrld.metrics import get_metric

    model = args.model or MODEL_FOR_DATASET[args.dataset]
    paper = paper_entry(args.dataset, args.prior, args.width, args.sampler)
    if isinstance(lr, str):  # tuned:DIR: its ℓ, and its tuned options (α²) not given
        chosen = tuned_options(lr, args.sampler)
        given = {n: getattr(args, dest_of(n)) for n in METRIC_FIELDS if n not in tuned}
        for n, value in given.items():
            if n in chosen and chosen[n] != value:  # e.g. an α² chosen for another rule
                raise UsageError(f"--lr {lr}: tuned with {n} = {chosen[n]}, not {value}")
        tuned = {n: chosen.get(n) if v is None else v for n, v in tuned.items()}
        lr = float(chosen["lr"])
    if lr is None and paper is not None:
        lr = paper.lr
    defaults = {f.name: f.default for f in dataclasses.fields(RunConfig)}
    metric = {f.name: f.default for f in dataclasses.fields(get_metric(args.sampler))}  # type: ignore[arg-type]
    # a tuned option not given: the paper's value where the run's other metric options are the
    # paper's (its α² is not a normalized rule's c), else the metric's default
    as_paper = paper is not None and all(
        getattr(args, dest_of(n)) == defaults[n] for n in METRIC_FIELDS if n not in tuned
    )
    for name, value in tuned.items():
        if value is None and name in metric:
            known = getattr(paper, name, None) if as_paper else None
            tuned[name] = metric[name] if known is None else known
    if args.schedule != "cyclical" and (args.cycles, args.explore_fraction) != (1, 0.0):
        raise UsageError("--cycles and --explore-fraction need --schedule cyclical")
    # every other field comes from its flag (one table, _FLAGS, for names that differ)
    computed: dict[str, Any] = {
        "model": model,
        "lr": 1.0 if lr is None else lr,
        "seed": seed,
        **tuned,
        "sampler_options": dict(getattr(args, "sampler_options", None) or {}),
        "num_val": dataset_info(args.dataset).num_val if args.num_val is None else args.num_val,
    }
    values = {
        f.name: computed[f.name] if f.name in computed else getattr(args, dest_of(f.name))
        for f in dataclasses.fields(RunConfig)
    }
    try:
        config = RunConfig(**values)  # ℓ is checked after the other options
    except ValueError as exc:
        raise UsageError(cli_names(str(exc))) from exc
    if lr is None:
        raise UsageError(
            f"no paper learning rate for {args.sampler} on {args.dataset} with the {args.prior} "
            "prior (the paper found Identity optimal there, or the setting is not in the paper); "
            "give --lr"
        )
    return config


def _saved_configs(out: Path) -> list[Any]:
    """The configs of the run in ``out`` (its checkpoint's, else its ``results.json``'s)."""
    from sgrld.experiments.base.files import CheckpointError, load_checkpoint
    from sgrld.experiments.run.config import CHECKPOINT_FILE, RunConfig
    from sgrld.experiments.run.results import RESULTS_FILE

    checkpoint, results = out / CHECKPOINT_FILE, out / RESULTS_FILE
    try:
        if checkpoint.is_file():
            state = load_checkpoint(checkpoint)
            saved = state.get("configs", [state.get("config")]) if isinstance(state, dict) else []
            configs = [RunConfig.from_dict(c) for c in saved]
            _refuse_foreign(out, checkpoint, configs)
            return configs
        if results.is_file():
            return [RunConfig.from_dict(json.loads(read_file(results))["config"])]
    except UsageError:
        raise
    except (CheckpointError, OSError, ValueError, TypeError, KeyError) as exc:
        raise UsageError(f"cannot resume the run in {out}: {exc}") from exc
    return []


def _refuse_foreign(out: Path, checkpoint: Path, configs: list[Any]) -> None:
    """A checkpoint that is not the run whose ``results.json`` lies beside it (one copied in
    from another run) is refused, naming both sides: resuming would continue the other run and
    overwrite this one's results."""
    from sgrld.experiments.run.config import RunConfig, config_differences
    from sgrld.experiments.run.naming import chain_label
    from sgrld.experiments.run.results import RESULTS_FILE

    beside = [(out / RESULTS_FILE, configs[0])] if len(configs) == 1 else []
    beside += [(out / chain_label(c) / RESULTS_FILE, c) for c in configs if len(configs) > 1]
    for results, config in beside:
        if not results.is_file():
            continue
        theirs = RunConfig.from_dict(json.loads(read_file(results))["config"])
        differences = config_differences(config, theirs)
        if differences:
            raise UsageError(
                f"cannot resume the run in {out}: {checkpoint.name} is not the run of "
                f"{results.relative_to(out)}: the checkpoint holds {config.label()}, the results "
                f"{theirs.label()} ({'; '.join(differences)}); move the checkpoint that does not "
                "belong there away, or choose another --out"
            )


def adopt_saved_options(args: argparse.Namespace, out: Path) -> None:
    """``--resume --out OUT``: take the run's options from its checkpoint (or results.json).

    Flags given on the command line must agree with the run's, ``--epochs`` aside (a larger one
    extends the run); a flag that disagrees is refused by name, with the fix. Flags not given
    take the run's values. Nothing changes when ``out`` holds no run yet.

    Raises:
        UsageError: a given flag disagrees with the run, or its checkpoint cannot be read.
    """
    from sgrld.experiments.run.config import TUNED_FIELDS

    saved = _saved_configs(out)
    if not saved:
        return
    given = _given_options(args)
    values: dict[str, Any] = {}
    first = saved[0]
    listed = ("lr", *TUNED_FIELDS)  # one value per chain
    for f in dataclasses.fields(first):
        if f.name not in (*listed, "seed"):
            values[dest_of(f.name)] = getattr(first, f.name)
    for name in listed:
        chosen = list(dict.fromkeys(getattr(c, name) for c in saved))
        values[dest_of(name)] = None if chosen == [None] else chosen
    seeds = sorted({c.seed for c in saved})
    values["seed"], values["chains"] = seeds[0], len(seeds)
    conflicts = []
    for dest, value in values.items():
        if dest not in given or dest == "epochs":
            continue
        mine = getattr(args, dest, None)
        if dest in listed and mine is not None:
            same = value is not None and sorted(_values(mine)) == sorted(value)
        else:
            same = mine == value
        if not same:
            field = {dest_of(f.name): f.name for f in dataclasses.fields(first)}.get(dest, dest)
            flag = "--chains" if dest == "chains" else None
            theirs = f"--chains {value}" if flag else option_text(field, value)
            yours = f"--chains {mine}" if flag else option_text(field, mine)
            conflicts.append(f"{yours} (the run has {theirs})")
    if conflicts:
        raise UsageError(
            f"cannot resume the run in {out}: "
            + "; ".join(conflicts)
            + ". --resume reads the run's options from its checkpoint: drop these flags, or "
            "choose another --out for a new run"
        )
    for dest, value in values.items():
        if dest not in given:
            setattr(args, dest, value)


def _given_options(args: argparse.Namespace) -> set[str]:
    """The options written on the command line (recorded by :mod:`sgrld.cli`); otherwise those
    whose values differ from the defaults."""
    given = getattr(args, "_given", None)
    if given is not None:
        return set(given)
    defaults = argparse.ArgumentParser()
    add_arguments(defaults)
    return {
        a.dest
        for a in defaults._actions
        if hasattr(args, a.dest) and getattr(args, a.dest) != a.default
    }


def run(args: argparse.Namespace) -> int:
    """Validate everything, lock ``--out``, load the data, run, write results and the plot."""
    from sgrld.experiments.base.files import (
        DirectoryLock,
        DirectoryLockedError,
        OutputError,
        sigint_deferred,
    )

    with sigint_deferred():  # Ctrl-C inside torch's start-up would abort: exit 130 instead
        import torch
    parallel = None
    try:
        if args.resume and args.out:
            adopt_saved_options(args, Path(args.out))
        if args.sampler is None:
            raise UsageError(
                "--sampler is required (with --resume --out OUT it comes from the run in OUT)"
            )
        configs = configs_from_args(args)
        multi = is_multichain(args)
        if multi:
            from sgrld.experiments.run.chains import check_chain_configs

            try:
                check_chain_configs(configs)
            except ValueError as exc:
                raise UsageError(cli_names(str(exc))) from exc
        device = launch.resolve_device(args.device)
        if args.threads is not None and args.threads < 1:
            raise UsageError(f"--threads must be >= 1, got {args.threads}")
        data_dir = launch.data_dir_of(args, {c.dataset for c in configs})
        default = default_chains_out_dir(configs) if multi else default_out_dir(configs[0])
        out = Path(args.out) if args.out else default
        if out.exists() and not out.is_dir():
            raise UsageError(f"--out {out} exists and is not a directory")
        parallel = launch.join_parallel(args, device, multi)
        # Held until the run ends: a second run on this --out is refused, not interleaved
        # (under --parallel by rank 0, for the whole job).
        with (
            DirectoryLock(out, "sgrld sample")
            if parallel is None or parallel.is_main
            else (contextlib.nullcontext())
        ):
            if multi:
                return launch.run_chains_locked(args, configs, device, data_dir, out)
            return launch.run_locked(args, configs[0], device, data_dir, out, parallel)
    except (UsageError, DirectoryLockedError) as exc:
        print(f"sgrld sample: error: {exc}", file=sys.stderr)
        return 2
    except OutputError as exc:  # e.g. disk full; the last good checkpoint is kept
        print(f"sgrld sample: error: {exc}", file=sys.stderr)
        return EXIT_IO_ERROR
    except RuntimeError as exc:  # under torchrun: another rank died (killed, disk full)
        lost = isinstance(exc, torch.distributed.DistError) or "Connection" in str(exc)
        if parallel is None or not lost:
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(
            f"sgrld sample: error: rank {parallel.rank} lost the other ranks ({first}); another "
            "rank died (its own error says why); the last good checkpoint is kept: rerun with "
            "--resume",
            file=sys.stderr,
        )
        return exits.FAILED
