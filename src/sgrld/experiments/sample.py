"""``sgrld sample``: one Bayesian-neural-network sampling run (the paper's Tables 1-3).

Example (the paper's best Monge run on MNIST, N = 400, horseshoe prior)::

    sgrld sample --dataset mnist --model fc --width 400 --prior horseshoe --sampler monge \\
        --lr 0.25 --alpha2 1.25 --epochs 400 --seed 0 --data-dir DIR --out OUT

writes ``OUT/results.json`` (config, seeds, per-epoch curves, final validation and test LP,
accuracy, ECE, curvature if measured, seconds per epoch, number of samples), ``OUT/curves.png``
and ``OUT/checkpoint.pt`` (every epoch; ``--resume`` continues a killed run exactly). Without
``--lr`` (and ``--alpha2`` for Monge) the paper's selected values for the setting are used
(spec §8, Tables 4-5). The protocol is in :mod:`sgrld.experiments.runner`.

Exit status: 0 when the run completed, 3 when the chain broke down (non-finite potential; the
results are still written), 2 for bad input, a damaged checkpoint or an ``--out`` that another run
holds (refused before any work starts), 74 when an output cannot be written (disk full: the last
good checkpoint is kept), 130 when interrupted. ``docs/experiments.md`` lists what survives which
fault.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from pathlib import Path
from typing import Any

from sgrld.experiments.choices import DATASETS as DATASET_CHOICES
from sgrld.experiments.choices import MODELS as MODEL_CHOICES
from sgrld.experiments.choices import NOISE as NOISE_CHOICES
from sgrld.experiments.choices import PRIORS, SAMPLERS

PRIOR_CHOICES = tuple(PRIORS)
SAMPLER_CHOICES = SAMPLERS

DEFAULT_ALPHA2 = 1.0  # the reference's config default (spec §1.2)
EXIT_IO_ERROR = 74  # sgrld.experiments._io.EXIT_IO_ERROR, without importing torch
EXIT_STATUS = (
    "Exit status: 0 completed; 2 bad input, a damaged checkpoint or --out in use by another run "
    "(refused before any work); 3 the chain broke down (results still written); 74 an output "
    "could not be written, e.g. disk full (the last good checkpoint is kept; --resume continues); "
    "130 interrupted."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``sgrld sample`` options."""
    parser.epilog = EXIT_STATUS
    what = parser.add_argument_group("what to sample")
    what.add_argument("--dataset", choices=DATASET_CHOICES, default="mnist")
    what.add_argument(
        "--model", choices=MODEL_CHOICES, help="default: fc for mnist, resnet20 for cifar10"
    )
    what.add_argument("--width", type=int, default=400, help="hidden width N of fc (400)")
    what.add_argument("--prior", choices=PRIOR_CHOICES, default="gaussian")
    what.add_argument("--sampler", choices=SAMPLER_CHOICES, required=True)
    what.add_argument(
        "--lr", type=float, help="learning rate ℓ (h = ℓ/n); default: the paper's for the setting"
    )
    what.add_argument(
        "--alpha2",
        type=float,
        help=f"Monge's α²; default: the paper's for the setting, else {DEFAULT_ALPHA2}",
    )
    what.add_argument(
        "--alpha2-rule",
        choices=("fixed", "normalized"),
        default="fixed",
        help="Monge: fixed α² (the paper's) or normalized α²_t = c/‖m_t‖² with c = --alpha2 "
        f"(default c = {DEFAULT_ALPHA2}; the stretch along m is 1 + c)",
    )
    what.add_argument("--temperature", type=float, default=1.0, help="τ (1)")
    what.add_argument("--epochs", type=int, default=400, help="epochs (400 in the paper)")
    what.add_argument("--seed", type=int, default=0, help="master seed >= 0 (0)")
    what.add_argument(
        "--noise",
        choices=NOISE_CHOICES,
        default="torch",
        help="noise source: torch (normal_) or philox (compiled; faster on some CPUs, slower on "
        "others: README)",
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
    schedule.add_argument("--thinning", type=int, default=100, help="a sample every K updates")
    schedule.add_argument(
        "--curvature", action="store_true", help="measure C(θ) of every sample (spec §4.5)"
    )
    schedule.add_argument("--curvature-points", type=int, default=1000, help="test points (1000)")
    schedule.add_argument("--eval-batch-size", type=int, default=1000)
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
        "--num-val", type=int, default=10_000, help="validation size (10000; less for tiny data)"
    )

    io = parser.add_argument_group("data, output and machine")
    io.add_argument("--data-dir", help="dataset directory (default: $SGRLD_DATA_DIR)")
    io.add_argument("--no-verify", action="store_true", help="skip the files' SHA-256 checks")
    io.add_argument("--download", action="store_true", help="fetch missing files if possible")
    io.add_argument(
        "--out", help="output directory (default: runs/<dataset>-<model>-<prior>-<sampler>-...)"
    )
    io.add_argument("--resume", action="store_true", help="continue the run in --out")
    io.add_argument("--device", default="cpu", help="cpu, cuda or cuda:K (cpu)")
    io.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    io.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    io.add_argument("--no-plot", action="store_true", help="do not draw curves.png")


class UsageError(ValueError):
    """Bad command-line input (reported with exit status 2)."""


def config_from_args(args: argparse.Namespace) -> Any:
    """The :class:`~sgrld.experiments.runner.RunConfig` of the command line.

    Raises:
        UsageError: invalid or inconsistent options.
    """
    from sgrld.experiments.choices import MODEL_FOR_DATASET
    from sgrld.experiments.config import RunConfig
    from sgrld.experiments.paper import paper_entry

    model = args.model or MODEL_FOR_DATASET[args.dataset]
    lr, alpha2 = args.lr, args.alpha2
    paper = paper_entry(args.dataset, args.prior, args.width, args.sampler)
    if lr is None and paper is not None:
        lr = paper.lr
    if args.sampler == "monge":
        if alpha2 is None:
            known = paper.alpha2 if paper is not None else None
            # the paper's α² is not a c: the normalized rule defaults to c = 1
            fixed = args.alpha2_rule == "fixed" and known is not None
            alpha2 = known if fixed else DEFAULT_ALPHA2
    elif alpha2 is not None:
        raise UsageError(f"--alpha2 is a Monge option; it does nothing for {args.sampler}")
    if args.sampler != "monge" and args.alpha2_rule != "fixed":
        raise UsageError(f"--alpha2-rule is a Monge option; it does nothing for {args.sampler}")
    if args.schedule != "cyclical" and (args.cycles, args.explore_fraction) != (1, 0.0):
        raise UsageError("--cycles and --explore-fraction need --schedule cyclical")
    # every other field comes from its flag (one table, _FLAGS, for names that differ)
    computed = {"model": model, "lr": 1.0 if lr is None else lr, "alpha2": alpha2}
    values = {
        f.name: computed[f.name] if f.name in computed else getattr(args, _dest(f.name))
        for f in dataclasses.fields(RunConfig)
    }
    try:
        config = RunConfig(**values)  # ℓ is checked after the other options
    except ValueError as exc:
        raise UsageError(_cli_names(str(exc))) from exc
    if lr is None:
        raise UsageError(
            f"no paper learning rate for {args.sampler} on {args.dataset} with the {args.prior} "
            "prior (the paper found Identity optimal there, or the setting is not in the paper); "
            "give --lr"
        )
    return config


def _flag(field: str) -> str:
    """The command-line flag of a config field."""
    return _FLAGS.get(field, "--" + field.replace("_", "-"))


def _dest(field: str) -> str:
    """The argparse attribute of a config field's flag."""
    return _flag(field)[2:].replace("-", "_")


#: Config fields whose command-line flag is not ``--`` + the field name.
_FLAGS = {
    "max_train": "--subset",
    "max_eval": "--eval-subset",
    "burnin": "--burn-in",
    "batch_size": "--batch-size",
    "eval_batch_size": "--eval-batch-size",
    "curvature_points": "--curvature-points",
    "num_val": "--num-val",
    "explore_fraction": "--explore-fraction",
    "alpha2_rule": "--alpha2-rule",
    "cycles": "--cycles",  # named whole-word in messages ("invalid cycles: 0")
}
_PLAIN = ("lr", "epochs", "width", "seed", "thinning", "alpha2", "temperature")


def _cli_names(message: str) -> str:
    """Config field names → their command-line flags in an error message.

    Whole words only (``eval_batch_size`` is not ``eval_`` + ``batch_size``); ``name=value``
    becomes ``--flag value``; a plain word (``epochs``) is a flag only where it starts the
    message or is written ``epochs=``.
    """
    for field, flag in _FLAGS.items():
        message = re.sub(rf"\b{field}=", flag + " ", message)
        message = re.sub(rf"\b{field}\b", flag, message)
    for word in _PLAIN:
        message = re.sub(rf"(?<![-\w]){word}=", f"--{word} ", message)
        if message.startswith(word + " "):
            message = "--" + message
    return message


def default_out_dir(config: Any) -> Path:
    """``runs/<dataset>-<model>[N]-<prior>-<sampler>-lr<ℓ>[-a2<α²>|-c<c>][-cyc<M>r<r>]-seed<s>``."""
    model = f"fc{config.width}" if config.model == "fc" else config.model
    alpha = f"-a2{config.alpha2:g}" if config.alpha2 is not None else ""
    if config.alpha2_rule == "normalized":
        alpha = f"-c{config.alpha2:g}"
    if config.schedule == "cyclical":
        alpha += f"-cyc{config.cycles}r{config.explore_fraction:g}"
    subset = f"-sub{config.max_train}" if config.max_train is not None else ""
    name = (
        f"{config.dataset}-{model}-{config.prior}-{config.sampler}-lr{config.lr:g}{alpha}"
        f"{subset}-seed{config.seed}"
    )
    return Path("runs") / name


def _device(name: str) -> Any:
    import torch

    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise UsageError(f"--device {name!r} is not a device ({exc})") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: CUDA is not available on this machine")
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {name}: only cpu and cuda are supported")
    return device


def _data_dir(args: argparse.Namespace) -> Path:
    from sgrld.data import DATA_DIR_ENV

    value = args.data_dir or os.environ.get(DATA_DIR_ENV)
    if not value:
        raise UsageError(f"no data directory: give --data-dir or set {DATA_DIR_ENV}")
    path = Path(value)
    flag = "--data-dir" if args.data_dir else DATA_DIR_ENV
    if path.exists() and not path.is_dir():
        raise UsageError(
            f"data directory {path} ({flag}) is a file, not a directory: give the folder "
            "that holds the dataset"
        )
    if not path.is_dir() and not args.download:
        raise UsageError(f"data directory {path} ({flag}) does not exist (--download creates it)")
    return path


def _check_out_dir(out: Path, config: Any, resume: bool) -> None:
    from sgrld.experiments.checkpoint import check_checkpoint_fits, load_checkpoint
    from sgrld.experiments.config import (
        CHECKPOINT_FILE,
        RESULTS_FILE,
        RunConfig,
        config_differences,
    )

    checkpoint = out / CHECKPOINT_FILE
    if not resume:
        if checkpoint.exists() or (out / RESULTS_FILE).exists():
            raise UsageError(
                f"{out} already holds a run; pass --resume to continue it or choose another --out"
            )
        return
    if not checkpoint.exists():
        return
    try:  # a damaged, foreign or misfitting checkpoint is refused before any work
        state = load_checkpoint(checkpoint)
        saved = RunConfig.from_dict(state["config"])
    except (ValueError, TypeError) as exc:
        raise UsageError(f"cannot resume: {exc}") from exc
    differences = config_differences(saved, config)
    if differences:
        raise UsageError(
            f"cannot resume {checkpoint}: it was made with other options ("
            + "; ".join(differences)
            + ")"
        )
    try:
        check_checkpoint_fits(state, config)
    except ValueError as exc:
        message = f"cannot resume: checkpoint {checkpoint} does not fit this run: {exc}"
        raise UsageError(message) from exc
    if int(state["epoch"]) > config.epochs:
        raise UsageError(
            f"cannot resume {checkpoint}: it already has {state['epoch']} epochs > --epochs"
        )


def _make_out_dir(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise UsageError(f"cannot write to --out {out}: {exc}") from exc


def run(args: argparse.Namespace) -> int:
    """Validate everything, lock ``--out``, load the data, run, write results and the plot."""
    from sgrld.experiments._io import (
        DirectoryLock,
        DirectoryLockedError,
        OutputError,
        sigint_deferred,
    )

    with sigint_deferred():  # Ctrl-C inside torch's start-up would abort: exit 130 instead
        import torch  # noqa: F401
    try:
        config = config_from_args(args)
        device = _device(args.device)
        if args.threads is not None and args.threads < 1:
            raise UsageError(f"--threads must be >= 1, got {args.threads}")
        data_dir = _data_dir(args)
        out = Path(args.out) if args.out else default_out_dir(config)
        if out.exists() and not out.is_dir():
            raise UsageError(f"--out {out} exists and is not a directory")
        # Held until the run ends: a second run on this --out is refused, not interleaved.
        with DirectoryLock(out, "sgrld sample"):
            return _run_locked(args, config, device, data_dir, out)
    except (UsageError, DirectoryLockedError) as exc:
        print(f"sgrld sample: error: {exc}", file=sys.stderr)
        return 2
    except OutputError as exc:  # e.g. disk full; the last good checkpoint is kept
        print(f"sgrld sample: error: {exc}", file=sys.stderr)
        return EXIT_IO_ERROR


def _run_locked(
    args: argparse.Namespace, config: Any, device: Any, data_dir: Path, out: Path
) -> int:
    from sgrld.experiments._io import remove_stale_temporaries

    remove_stale_temporaries(out)  # of killed runs; nobody else writes here while we hold it
    _check_out_dir(out, config, args.resume)

    import torch

    from sgrld.data import DownloadError, load_dataset
    from sgrld.experiments.runner import CheckpointError, ProgressBar, run_sampling

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        splits = load_dataset(
            config.dataset,
            data_dir,
            num_val=config.num_val,
            verify=not args.no_verify,
            download=args.download,
        )
        if config.max_train is not None and config.max_train > splits.num_train:
            raise UsageError(
                f"--subset {config.max_train} exceeds the {splits.num_train} training points"
            )
        _make_out_dir(out)
    except (OSError, ValueError, DownloadError) as exc:
        print(f"sgrld sample: error: {_cli_names(str(exc))}", file=sys.stderr)
        return 2

    observer = None if args.no_progress else ProgressBar(report_breakdown=False)
    try:
        results = run_sampling(
            config, splits, out, device=device, resume=args.resume, observer=observer
        )
    except CheckpointError as exc:
        raise UsageError(str(exc)) from exc
    if results["broken_down"] is not None:  # always on stderr, progress bar or not
        from sgrld.experiments.runner import breakdown_message

        print(
            f"sgrld sample: {_cli_names(breakdown_message(results['broken_down']))}",
            file=sys.stderr,
        )
    if not args.no_plot:
        _plot(results, out)
    _summary(results, out)
    return 0 if results["status"] == "completed" else 3


def _plot(results: dict[str, Any], out: Path) -> None:
    try:
        from sgrld.experiments.plots import plot_run_curves

        plot_run_curves(results, out / "curves.png")
    except ImportError as exc:  # matplotlib is an optional dependency (extra "plots")
        print(f"sgrld sample: no curves.png ({exc}); install sgrld[plots]", file=sys.stderr)
    except OSError as exc:
        from sgrld.experiments._io import OutputError

        reason = os.strerror(exc.errno).lower() if exc.errno else str(exc)
        raise OutputError(exc.errno, f"cannot write {out / 'curves.png'}: {reason}") from exc


def _summary(results: dict[str, Any], out: Path) -> None:
    def fmt(value: float | None) -> str:
        return "nan" if value is None else f"{value:.4f}"

    final = results["final"]
    basis = results["timing"].get("seconds_per_epoch_basis", "")
    estimated = f" ({basis})" if basis.startswith("estimated") else ""
    print(
        f"{results['status']}: {results['epochs_completed']} epochs, "
        f"{results['num_samples']} samples, {fmt(results['seconds_per_epoch'])} s/epoch" + estimated
    )
    for split in ("val", "test"):
        m = final[split]
        print(f"  {split:<4} LP {fmt(m['lp'])}  acc {fmt(m['accuracy'])}  ECE {fmt(m['ece'])}")
    if results["curvature"] is not None:
        print(f"  curvature {fmt(results['curvature']['mean'])}")
    print(f"  results: {out / 'results.json'}")
