"""A sample run from the command's options (``sgrld sample`` builds the configs and a
:class:`LaunchOptions`, and holds the lock): the device and data, the ``--out`` folder's checks,
the loop (:mod:`~.run.loop`), the summary and the curves."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from sgrld.data import DATA_DIR_ENV, dataset_info
from sgrld.experiments.base.exits import UsageError
from sgrld.experiments.base.files import (
    CheckpointError,
    make_out_dir,
    read_file,
    remove_stale_temporaries,
)
from sgrld.experiments.run.build import build_run_model
from sgrld.experiments.run.checkpoint import load_checkpoint, tensor_mismatches
from sgrld.experiments.run.config import (
    CHECKPOINT_FILE,
    TIMING_SKIP_STEPS,
    RunConfig,
    config_fields_differing,
)
from sgrld.experiments.run.loop import run_sampling
from sgrld.experiments.run.naming import chain_label, cli_names, option_text
from sgrld.experiments.run.observers import ProgressBar, breakdown_message
from sgrld.experiments.run.parallel import DataParallel
from sgrld.experiments.run.plots import plot_run_curves
from sgrld.experiments.run.results import RESULTS_FILE, Results, scored_by, short_name


class DataOptions(Protocol):
    """Where a command's data comes from (``sgrld sample``'s, ``tune``'s and ``sweep``'s)."""

    @property
    def data_dir(self) -> str | None: ...
    @property
    def download(self) -> bool: ...
    @property
    def no_verify(self) -> bool: ...
    @property
    def threads(self) -> int | None: ...


@dataclass(frozen=True, kw_only=True)
class LaunchOptions:
    """What ``sgrld sample`` asks of its run beyond the configs (its command line's flags)."""

    data_dir: str | None = None
    download: bool = False
    no_verify: bool = False
    threads: int | None = None
    resume: bool = False
    progress: bool = True
    plot: bool = True
    graph: bool = True  # capture the step on CUDA (``--no-graph``: the eager loop)
    parallel: str = "none"
    chain_batch: int | None = None


def resolve_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        hint = " (a GPU is cuda here)" if name.strip().lower().startswith("gpu") else ""
        raise UsageError(
            f"--device {name!r} is not a device: give cpu, cuda or cuda:K{hint}"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: CUDA is not available on this machine")
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {name}: only cpu and cuda are supported")
    return device


def data_dir_of(args: DataOptions, datasets: set[str] | None = None) -> Path | None:
    """The data directory; ``None`` when every data set of ``datasets`` ships with a package."""
    value = args.data_dir or os.environ.get(DATA_DIR_ENV)
    if datasets is not None and all(dataset_info(d).bundled for d in datasets):
        return Path(value) if value else None
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


def refuse_held(out: Path) -> None:
    """Without ``--resume``, an ``--out`` that holds a run is refused, with what to do instead."""
    status = None
    with contextlib.suppress(OSError, ValueError, AttributeError):
        status = json.loads(read_file(out / RESULTS_FILE)).get("status")
    if status == "broken_down":
        raise UsageError(
            f"{out} holds a run that broke down ({out / RESULTS_FILE}); it cannot be continued: "
            "start a new run in another --out (with a smaller --lr, for example)"
        )
    if status == "completed":
        raise UsageError(
            f"{out} holds a completed run; pass --resume with a larger --epochs to extend it, "
            "or choose another --out"
        )
    raise UsageError(
        f"{out} already holds a run; pass --resume to continue it (its options are read from "
        "its checkpoint) or choose another --out"
    )


def refuse_other_options(checkpoint: Path, saved: list[Any], wanted: list[Any]) -> None:
    """A checkpoint made with other options than these runs' (``epochs`` may grow)."""
    for old, new in zip(saved, wanted, strict=True):
        names = config_fields_differing(old, new)
        olds, news = old.flat(), new.flat()
        if names:
            raise UsageError(
                f"cannot resume {checkpoint}: it was made with "
                + "; ".join(
                    f"{option_text(n, olds[n])}, not {option_text(n, news[n])}" for n in names
                )
                + ". Drop these flags (--resume with --out reads the run's options from its "
                "checkpoint), or choose another --out for a new run"
            )


def refuse_other_threads(results: list[Path], threads: int | None) -> None:
    """A run resumed with another thread count than it ran with: float reductions split
    differently, so the chain would not continue bit-identically (``timing.threads``)."""
    wanted = torch.get_num_threads() if threads is None else threads
    for path in results:
        try:
            saved = json.loads(read_file(path))["timing"]["threads"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if isinstance(saved, int) and saved != wanted:
            raise UsageError(
                f"cannot resume {path.parent}: it ran with --threads {saved}, this run would use "
                f"{wanted} and not continue bit-identically; pass --threads {saved}"
            )


def check_out_dir(out: Path, configs: list[Any], resume: bool) -> None:
    """Refuse an ``--out`` that holds a run (without ``--resume``), or whose checkpoint is
    damaged, of other runs or options, or further along than ``--epochs``."""
    checkpoint = out / CHECKPOINT_FILE
    multi = len(configs) > 1
    if not resume:
        folders = run_folders(out, configs)
        if checkpoint.exists() or any((f / RESULTS_FILE).exists() for f in folders):
            refuse_held(out)
        return
    if not checkpoint.exists():
        return
    try:  # a damaged, foreign or misfitting checkpoint is refused before any work
        state = load_checkpoint(checkpoint, chains=multi)
        saved = [RunConfig.from_dict(c) for c in (state["configs"] if multi else [state["config"]])]
    except (ValueError, TypeError) as exc:
        raise UsageError(f"cannot resume: {exc}") from exc
    if multi and [chain_label(c) for c in saved] != [chain_label(c) for c in configs]:
        raise UsageError(
            f"cannot resume {checkpoint}: it holds other chains ("
            + ", ".join(c.label() for c in saved)
            + ")"
        )
    refuse_other_options(checkpoint, saved, configs)
    if not multi:  # K chains' fit is checked by Chains itself
        model = build_run_model(configs[0]).state_dict()
        wrong = "; ".join(tensor_mismatches(state["model"], model, "model"))
        if wrong:
            raise UsageError(
                f"cannot resume: checkpoint {checkpoint} does not fit this run: {wrong}"
            )
    if int(state["epoch"]) > configs[0].epochs:
        raise UsageError(
            f"cannot resume {checkpoint}: it already has {state['epoch']} epochs > --epochs"
        )


def run_folders(out: Path, configs: list[Any]) -> list[Path]:
    """Where each run's ``results.json`` goes: ``OUT`` for one, ``OUT/<label>`` for K."""
    return [out / chain_label(c) for c in configs] if len(configs) > 1 else [out]


def load_splits(args: DataOptions, config: Any, data_dir: Path | None, out: Path) -> Any:
    """The dataset (and a writable ``out``), or ``None`` after reporting why not."""
    from sgrld.data import DownloadError, load_dataset

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    make_out_dir(out)  # OutputError: exit 74
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
    except (OSError, ValueError, DownloadError) as exc:
        print(f"sgrld sample: error: {cli_names(str(exc))}", file=sys.stderr)
        return None
    return splits


def join_parallel(mode: str, device: Any, multi: bool) -> DataParallel | None:
    """This process's place in a ``--parallel ddp|fsdp`` job, or ``None`` for a run of its own.

    Raises:
        UsageError: ``--parallel`` with ``--chains`` or comma lists, or outside torchrun.
    """
    if mode == "none":
        return None
    if multi:
        raise UsageError(f"--parallel {mode} runs one chain over the processes: drop --chains")
    try:
        return DataParallel.join(device, mode)
    except RuntimeError as exc:
        raise UsageError(str(exc)) from None


def run_locked(
    options: LaunchOptions,
    configs: list[Any],
    device: Any,
    data_dir: Path | None,
    out: Path,
    parallel: DataParallel | None = None,
) -> int:
    """Run ``configs`` (one run, or K chains in one process) in the locked ``out``; report."""
    main = parallel is None or parallel.is_main
    check_out_dir(out, configs, options.resume)
    folders = run_folders(out, configs)
    if main:  # of killed runs (OUT's own went with its lock); nobody else writes here
        for folder in folders:
            remove_stale_temporaries(folder)
    if options.resume:
        refuse_other_threads([f / RESULTS_FILE for f in folders], options.threads)
    splits = load_splits(options, configs[0], data_dir, out)
    if splits is None:
        return 2
    multi = len(configs) > 1
    observer = ProgressBar(report_breakdown=False) if options.progress and main else None
    try:
        results = run_sampling(
            configs if multi else configs[0],
            splits,
            out,
            device=device,
            resume=options.resume,
            observer=observer,
            step_mode="eager" if not (options.graph or multi) else "auto",  # K are never captured
            parallel=parallel,
            chain_batch=options.chain_batch,
        )
    except CheckpointError as exc:
        raise UsageError(str(exc)) from exc
    except ValueError as exc:  # what this run cannot do (BatchNorm under --parallel): one line
        raise UsageError(cli_names(str(exc))) from exc
    if main:  # rank 0 reports for the job
        for config, result, folder in zip(configs, results, folders, strict=True):
            if result["broken_down"] is not None:  # on stderr, progress bar or not
                who = f"{config.label()}: " if multi else ""
                message = cli_names(breakdown_message(result["broken_down"]))
                print(f"sgrld sample: {who}{message}", file=sys.stderr)
            if options.plot:
                plot_results(result, folder)
        print_summary(configs, results, out)
    return 0 if all(r["status"] == "completed" for r in results) else 3


def plot_results(results: Results, out: Path) -> None:
    """``out/curves.png`` (an OutputError, from :func:`~.base.files.write_atomic`, names it)."""
    try:
        plot_run_curves(results, out / "curves.png")
    except ImportError as exc:  # matplotlib is an optional dependency (extra "plots")
        print(f"sgrld sample: no curves.png ({exc}); install sgrld[plots]", file=sys.stderr)


def print_summary(configs: list[Any], results: list[Results], out: Path) -> None:
    """One run's scores, or a line per chain of K."""

    def fmt(value: float | None) -> str:
        return "–" if value is None else f"{value:.4f}"  # None: no sample scored

    if len(results) > 1:
        done = sum(r["status"] == "completed" for r in results)
        print(f"{done} of {len(results)} chains completed; results: {out}/<run>/results.json")
        width = max(len(c.label()) for c in configs)
        for config, r in zip(configs, results, strict=True):
            val, test = r["final"]["val"], r["final"]["test"]
            second = scored_by(test).second()
            print(
                f"  {config.label():<{width}}  {r['status']:<11} val LP {fmt(val['lp'])}  "
                f"test LP {fmt(test['lp'])}  {short_name(second)} {fmt(test[second])}"
            )
        return
    (results_,) = results
    final = results_["final"]
    print(
        f"{results_['status']}: {count(results_['epochs_completed'], 'epoch')}, "
        f"{count(results_['num_samples'], 'sample')}, {speed_text(results_)}"
    )
    warmup = results_.get("warmup") or {}
    if warmup.get("samples_adapting"):
        until = warmup["adapt_until"]
        when = "at every update" if until is None else f"until update {until}"
        hint = "--adapt wait (the default) freezes it before the first once the chain has arrived"
        if results_["config"].get("adapt") == "wait":  # the chain had not arrived by then
            hint = "the chain was still travelling at the burn-in's end: a longer --burn-in"
            hint += f" (beyond {until}) keeps them out"
        print(
            f"  {warmup['samples_adapting']} of {results_['num_samples']} samples were drawn "
            f"while the metric adapted ({when}); {hint}"
        )
    if all(final[split].get("lp") is None for split in ("val", "test")):
        print("  no scores: the chain stopped before its first epoch ended")
    for split in ("val", "test"):
        m = final[split]
        if m.get("lp") is None:
            continue
        headline = list(scored_by(m).headline.values())
        second, third = headline[0], headline[-1]
        line = f"LP {fmt(m['lp'])}  {short_name(second)} {fmt(m[second])}"
        print(f"  {split:<4} {line}  {short_name(third)} {fmt(m[third])}")
    if results_["curvature"] is not None:
        print(f"  curvature {fmt(results_['curvature']['mean'])}")
    print(f"  results: {out / 'results.json'}")


def speed_text(results: Results) -> str:
    """``0.1234 s/epoch``; for a run too short to time past the warm-up, why there is no rate."""
    timing = results["timing"]
    basis = timing.get("seconds_per_epoch_basis", "")
    if timing.get("steps_all") and not timing.get("steps_after_skip"):
        return (
            f"s/epoch not measured: all {timing['steps_all']} updates fall in the first "
            f"{TIMING_SKIP_STEPS}, whose times include compilation and warm-up; sampling took "
            f"{sum(timing.get('sampling_seconds', [])):.1f} s in all"
        )
    value = results["seconds_per_epoch"]
    estimated = f" ({basis})" if basis.startswith("estimated") else ""
    return f"{'nan' if value is None else f'{value:.4f}'} s/epoch{estimated}"


def count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"
