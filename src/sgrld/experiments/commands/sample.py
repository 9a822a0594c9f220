"""``sgrld sample``: one Bayesian-neural-network sampling run (the paper's Tables 1-3).

Example (the paper's best Monge run on MNIST, N = 400, horseshoe prior)::

    sgrld sample --dataset mnist --model fc --width 400 --prior horseshoe --sampler monge \\
        --lr 0.25 --alpha2 1.25 --epochs 400 --seed 0 --data-dir DIR --out OUT

Outputs, ``--resume``, exit statuses and faults: ``docs/experiments.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path
from typing import Any

from sgrld.experiments.base import exits
from sgrld.experiments.base.exits import UsageError
from sgrld.experiments.base.files import read_file
from sgrld.experiments.commands.common import fail
from sgrld.experiments.commands.options import (
    add_run_options,
    as_list,
    configs_from_args,
    is_multichain,
)
from sgrld.experiments.run import launch
from sgrld.experiments.run.config import TUNED_FIELDS
from sgrld.experiments.run.naming import (
    cli_names,
    default_chains_out_dir,
    default_out_dir,
    option_text,
)
from sgrld.experiments.run.options import OPTIONS, by_field

EXIT_IO_ERROR = exits.IO_ERROR


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``sgrld sample`` options: every run option (:mod:`sgrld.experiments.run.options`)."""
    parser.epilog = exits.epilog("sample")
    add_run_options(parser)


def _saved_configs(out: Path) -> list[Any]:
    """The configs of the run in ``out`` (its checkpoint's, else its ``results.json``'s)."""
    from sgrld.experiments.base.files import CheckpointError, load_checkpoint
    from sgrld.experiments.run.config import CHECKPOINT_FILE, RunConfig
    from sgrld.experiments.run.results import RESULTS_FILE

    checkpoint, results = out / CHECKPOINT_FILE, out / RESULTS_FILE
    try:
        if checkpoint.exists() or checkpoint.is_symlink():  # what is there: the reader judges
            state = load_checkpoint(checkpoint)
            saved = state.get("configs", [state.get("config")]) if isinstance(state, dict) else []
            configs = [RunConfig.from_dict(c) for c in saved]
            _refuse_foreign(out, checkpoint, configs)
            return configs
        if results.exists() or results.is_symlink():
            return [RunConfig.from_dict(json.loads(read_file(results))["config"])]
    except UsageError:
        raise
    except (CheckpointError, OSError, ValueError, TypeError, KeyError) as exc:
        raise UsageError(f"cannot resume the run in {out}: {exc}") from exc
    return []


def _refuse_foreign(out: Path, checkpoint: Path, configs: list[Any]) -> None:
    """Refuse a checkpoint of another run than the ``results.json`` beside it: resuming would
    continue the other run over this one's results."""
    from sgrld.experiments.run.config import RunConfig, config_differences
    from sgrld.experiments.run.results import RESULTS_FILE

    for folder, config in zip(launch.run_folders(out, configs), configs, strict=True):
        results = folder / RESULTS_FILE
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
    """``--resume --out OUT``: flags not given take the run's values (from its checkpoint, or
    results.json); flags given must agree with them, ``--epochs`` aside (a larger one extends).

    Raises:
        UsageError: a given flag disagrees with the run, or its checkpoint cannot be read.
    """
    saved = _saved_configs(out)
    if not saved:
        return
    given = _given_options(args)
    options = by_field()
    values: dict[str, Any] = {}
    first = saved[0]
    listed = ("lr", *TUNED_FIELDS)  # one value per chain
    for field, value in first.flat().items():
        if field not in (*listed, "seed"):
            values[options[field].name] = value
    for name in listed:
        chosen = list(dict.fromkeys(c.flat()[name] for c in saved))
        values[name] = None if chosen == [None] else chosen
    seeds = sorted({c.seed for c in saved})
    values["seed"], values["chains"] = seeds[0], len(seeds)
    conflicts = []
    for name, value in values.items():
        if name not in given or name == "epochs":
            continue
        mine = getattr(args, name, None)
        if name in listed and mine is not None:
            same = value is not None and sorted(as_list(mine)) == sorted(value)
        else:
            same = mine == value
        if not same:
            field = OPTIONS[name].config_field  # None for --chains
            theirs, yours = (
                option_text(field, v) if field else f"--chains {v}" for v in (value, mine)
            )
            conflicts.append(f"{yours} (the run has {theirs})")
    if conflicts:
        raise UsageError(
            f"cannot resume the run in {out}: "
            + "; ".join(conflicts)
            + ". --resume reads the run's options from its checkpoint: drop these flags, or "
            "choose another --out for a new run"
        )
    for name, value in values.items():
        if name not in given:
            setattr(args, name, value)


def _given_options(args: argparse.Namespace) -> set[str]:
    """The options written on the command line (recorded by :mod:`sgrld.cli`), else non-defaults."""
    given = getattr(args, "_given", None)
    if given is not None:
        return set(given)
    return {n for n, o in OPTIONS.items() if hasattr(args, n) and getattr(args, n) != o.default}


def run(args: argparse.Namespace) -> int:
    """Validate everything, lock ``--out``, load the data, run, write results and the plot."""
    from sgrld.experiments.base.files import (
        DirectoryLockedError,
        OutputError,
        check_out_dir,
        locked_out_dir,
        sigint_deferred,
    )

    with sigint_deferred():  # Ctrl-C inside torch's start-up would abort: exit 130 instead
        import torch
    parallel = None
    try:
        if args.resume and args.out:
            adopt_saved_options(args, check_out_dir(args.out))
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
        options = launch.LaunchOptions(
            data_dir=args.data_dir,
            download=args.download,
            no_verify=args.no_verify,
            threads=args.threads,
            resume=args.resume,
            progress=not args.no_progress,
            plot=not args.no_plot,
            graph=not getattr(args, "no_graph", False),
            parallel=getattr(args, "parallel", "none"),
            chain_batch=args.chain_batch,
        )
        data_dir = launch.data_dir_of(options, {c.dataset for c in configs})
        default = default_chains_out_dir(configs) if multi else default_out_dir(configs[0])
        out = check_out_dir(args.out if args.out else default)
        parallel = launch.join_parallel(options.parallel, device, multi)
        # Held until the run ends: a second run on this --out is refused, not interleaved
        # (under --parallel by rank 0, for the whole job).
        with (
            locked_out_dir(out, "sgrld sample")
            if parallel is None or parallel.is_main
            else (contextlib.nullcontext())
        ):
            return launch.run_locked(options, configs, device, data_dir, out, parallel)
    except (UsageError, DirectoryLockedError) as exc:
        return fail("sample", str(exc), 2)
    except OutputError as exc:  # e.g. disk full; the last good checkpoint is kept
        return fail("sample", str(exc), EXIT_IO_ERROR)
    except RuntimeError as exc:  # under torchrun: another rank died (killed, disk full)
        lost = isinstance(exc, torch.distributed.DistError) or "Connection" in str(exc)
        if parallel is None or not lost:
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return fail(
            "sample",
            f"rank {parallel.rank} lost the other ranks ({first}); another "
            "rank died (its own error says why); the last good checkpoint is kept: rerun with "
            "--resume",
            exits.FAILED,
        )
