"""``sgrld sweep``: a grid of ``sgrld sample`` runs, resumable, on local processes or SLURM.

Example::

    sgrld sweep --sampler identity,rmsprop --lr 0.05,0.1,0.25 --seeds 0-9 --prior horseshoe \\
        --data-dir DIR --out runs/hs400 --jobs 2

The flags are ``sgrld sample``'s, the axes taking comma lists; ``docs/experiments.md``
("Sweeps and reports") describes folders, resuming, engines and exit statuses.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sgrld.experiments.base import exits
from sgrld.experiments.base.exits import UsageError
from sgrld.experiments.commands.common import fail
from sgrld.experiments.commands.options import add_run_options, argparse_type, config_from_args
from sgrld.experiments.run import launch
from sgrld.experiments.run.choices import PRIORS, SAMPLERS
from sgrld.experiments.run.options import OPTIONS
from sgrld.experiments.sweep import grid
from sgrld.experiments.sweep.grid import GridError, PlannedRun
from sgrld.experiments.sweep.jobs import Machine, make_jobs, run_state

ENGINES = ("local", "submitit", "submitit-local")
_RECORDED = "; recorded in sweep.json: a rerun must give the same"

#: The sweep's own words for the run options (the axes take comma lists).
# fmt: off
SWEEP_WORDS: dict[str, dict[str, Any]] = {
    "sampler": {"help": f"samplers to sweep, comma-separated ({', '.join(SAMPLERS)})"},
    "width": {"help": "hidden widths N of fc to sweep"},
    "prior": {"help": f"priors to sweep ({', '.join(PRIORS)})"},
    "lr": {"help": "learning rates ℓ to sweep (h = ℓ/n); default: the paper's for each setting"},
    "alpha2": {"help": "Monge's α² values to sweep (Monge's runs only); default: the paper's, "
               "else 1"},
    "adapt": {"help": "when the metric adapts, comma-separated to sweep: wait (a warm-up over "
              "the burn-in that waits for the chain to arrive, then frozen; the default), burnin "
              "(during exactly the burn-in: the default of sweeps made before wait), always (the "
              "paper's protocol) or N (the first N updates)"},
    "seed": {"flags": ("--seeds", "--seed"), "dest": "seeds", "metavar": "RANGE",  # one option
             "type": argparse_type(grid.parse_seeds), "help": "seeds: 0-9, 0,3,5 or 0-2,7 (0)"},
    "out": {"required": True, "help": "the sweep folder (required)"},
    "resume": {"help": argparse.SUPPRESS},  # accepted (a sample flag): a sweep always resumes
    "no_plot": {"default": True, "help": argparse.SUPPRESS},  # --plot turns the plots on
    "chains": {"help": "pack up to K runs of one setting and sampler (differing in seed, lr, "
               "alpha2) into one process as chains (1: a process per run)" + _RECORDED},
    "chain_batch": {"help": "at most B chains of a pack per vectorised call (default: all)"
                    + _RECORDED},
    "threads": {"help": "torch CPU threads per job (default: torch's choice)" + _RECORDED},
    "device": {"help": "cpu, cuda or cuda:K (cpu); its kind is" + _RECORDED[1:]},
    "no_graph": {"help": "CUDA: eager steps instead of replaying a captured step" + _RECORDED},
    "parallel": {"help": "spread each run over the --nodes × --tasks-per-node processes of its "
                 "submitit job, as sample --parallel under torchrun (none: a process per job)"
                 + _RECORDED},
}
# fmt: on


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``sgrld sample``'s options (the axes as comma lists, defaulting to "not given" so that
    only typed flags override ``--config``), plus the sweep's own."""
    parser.epilog = exits.epilog("sweep")
    add_run_options(parser, lists=grid.AXES, grid=True, own=SWEEP_WORDS)
    sweep = parser.add_argument_group("sweep")
    # fmt: off
    configs = ", ".join(grid.shipped_configs())
    sweep.add_argument("--config", metavar="FILE",
                       help=f"a TOML grid, by path or shipped name: {configs}")
    sweep.add_argument("--plot", dest="no_plot", action="store_false",
                       help="draw each run's curves.png (off)")
    sweep.add_argument("--engine", choices=ENGINES, default="local", help="how jobs run (local)")
    sweep.add_argument("--jobs", type=int, metavar="J",
                       help="jobs at once (local engines: 1; submitit: as many as SLURM allows)")
    sweep.add_argument("--tasks-per-node", type=int, default=1, metavar="W",
                       help="--parallel: processes per node of each job, one rank each (one per "
                       "GPU on cuda) (1)")
    sweep.add_argument("--nodes", type=int, default=1, metavar="N",
                       help="--parallel: nodes per job (--engine submitit; submitit-local has "
                       "one) (1)")
    sweep.add_argument("--partition", help="SLURM partition (--engine submitit)")
    sweep.add_argument("--gpus-per-job", type=int, default=0, metavar="G", help="GPUs per job (0)")
    sweep.add_argument("--cpus-per-job", type=int, default=1, metavar="C",
                       help="CPUs per job, per process under --parallel (1)")
    sweep.add_argument("--timeout-min", type=int, default=60, metavar="T",
                       help="job time limit in minutes (60)")
    sweep.add_argument("--no-wait", action="store_true",
                       help="submit the SLURM jobs and return without following")
    sweep.add_argument("--dry-run", action="store_true", help="list the grid's runs and stop")
    # fmt: on


def blocks_from_args(args: argparse.Namespace) -> tuple[list[dict[str, Any]], str]:
    """The grid's blocks (config file and typed flags merged) and where they came from.

    Raises:
        GridError: a bad config file.
    """
    defaults = grid.run_defaults()
    typed = {k: v for k, v in vars(args).items() if k in defaults}
    if args.config is None:
        return [{**defaults, **typed}], "command line"
    text, source = grid.read_config(args.config)
    blocks = grid.parse_config(text, source)
    tuned = grid.tuned_options()
    return [{**defaults, **grid.narrow(block, typed, tuned)} for block in blocks], str(source)


def plan(args: argparse.Namespace) -> tuple[list[PlannedRun], str]:
    """Expand and validate every run of the grid (each as ``sgrld sample`` would).

    Raises:
        GridError: an empty or invalid grid.
        UsageError: an invalid run.
    """
    blocks, source = blocks_from_args(args)
    configs: dict[str, dict[str, Any]] = {}
    for point in grid.expand(blocks, grid.tuned_options()):
        if point.get("sampler") is None:
            raise GridError("no sampler: give --sampler or set sampler in the config")
        config = config_from_args(point).to_dict()
        configs.setdefault(repr(sorted(config.items())), config)
    return grid.place_runs(list(configs.values())), source


def _check(args: argparse.Namespace) -> None:
    if args.jobs is not None and args.jobs < 1:
        raise GridError(f"--jobs must be >= 1, got {args.jobs}")
    if args.threads is not None and args.threads < 1:
        raise GridError(f"--threads must be >= 1, got {args.threads}")
    if args.timeout_min < 1 or args.gpus_per_job < 0 or args.cpus_per_job < 1:
        raise GridError("--timeout-min and --cpus-per-job must be >= 1, --gpus-per-job >= 0")
    if args.engine != "submitit" and (args.partition or args.gpus_per_job or args.no_wait):
        raise GridError("--partition, --gpus-per-job and --no-wait need --engine submitit")
    _check_parallel(args)
    if args.engine.startswith("submitit"):
        try:
            import submitit  # noqa: F401
        except ImportError as exc:
            raise GridError(
                f"--engine {args.engine} needs submitit: pip install 'sgrld[cluster]'"
            ) from exc


def parallel_modes() -> tuple[str, ...]:
    """The values of ``--parallel`` that spread a run over processes (all but ``none``)."""
    return tuple(c for c in OPTIONS["parallel"].choices or () if c != "none")


def _check_parallel(args: argparse.Namespace) -> None:
    """``--parallel``, ``--nodes`` and ``--tasks-per-node``: submitit engines only."""
    mode = getattr(args, "parallel", "none")
    if args.nodes < 1 or args.tasks_per_node < 1:
        raise GridError("--nodes and --tasks-per-node must be >= 1")
    if mode == "none":
        if args.nodes != 1 or args.tasks_per_node != 1:
            raise GridError(
                "--nodes and --tasks-per-node spread each run over processes: they need "
                f"--parallel ({', '.join(parallel_modes())})"
            )
        return
    if args.engine == "local":
        raise GridError(
            f"--parallel {mode} needs --engine submitit (SLURM) or submitit-local (this machine): "
            "they start each job's --nodes × --tasks-per-node processes; --engine local runs a "
            "job in one process"
        )
    if args.chains != 1:
        raise GridError(f"--parallel {mode} runs one chain over the processes: drop --chains")
    if args.engine == "submitit-local" and args.nodes > 1:
        raise GridError(
            f"--nodes {args.nodes}: --engine submitit-local runs each job on this machine "
            "(submitit's LocalExecutor has one node); use --engine submitit or --nodes 1"
        )
    most = 4 * (os.cpu_count() or 1)  # ranks may share a core (gloo), not by the hundred
    if args.engine == "submitit-local" and args.tasks_per_node > most:
        raise GridError(
            f"--tasks-per-node {args.tasks_per_node}: --engine submitit-local starts that many "
            f"processes per job on this machine, which has {os.cpu_count()} CPU cores; give at "
            f"most {most} (4 per core)"
        )
    kind, _, index = str(args.device).partition(":")
    if kind == "cuda" and index:
        raise GridError(
            f"--device {args.device}: under --parallel each rank takes the GPU of its place on "
            "its node (cuda:LOCAL_RANK); give --device cuda"
        )
    if kind == "cuda" and args.gpus_per_job not in (0, args.tasks_per_node):
        raise GridError(
            f"--gpus-per-job {args.gpus_per_job}: under --parallel on cuda a job has one GPU per "
            f"rank, --tasks-per-node ({args.tasks_per_node}) per node; leave --gpus-per-job out"
        )


def processes(args: argparse.Namespace) -> int:
    """The processes of each job: nodes × tasks per node (1 without ``--parallel``)."""
    return args.nodes * args.tasks_per_node if args.parallel != "none" else 1


def gpus_per_node(args: argparse.Namespace) -> int:
    """GPUs a job asks for on each node: one per rank on cuda under ``--parallel`` or
    submitit-local (its executor hides the GPUs it is not given); else ``--gpus-per-job``."""
    on_cuda = str(args.device).startswith("cuda")
    if on_cuda and (args.parallel != "none" or args.engine == "submitit-local"):
        return args.tasks_per_node
    return int(args.gpus_per_job)


def chain_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options outside the runs' configs that shape them (:data:`grid.CHAIN_OPTIONS`)."""
    options: dict[str, Any] = {
        "chains": args.chains,
        "chain_batch": args.chain_batch,
        "threads": args.threads,
        "device": str(args.device).split(":")[0],
        "graph": not args.no_graph,
    }
    if getattr(args, "parallel", "none") != "none":
        options["parallel"] = args.parallel
        options["processes"] = processes(args)
    return options


def run(args: argparse.Namespace) -> int:
    """Plan and check everything, then run what is missing and summarise."""
    from sgrld.experiments.base.files import check_out_dir

    try:
        out = check_out_dir(args.out)
        _check(args)
        runs, source = plan(args)
        if args.chains < 1 or (args.chain_batch is not None and args.chain_batch < 1):
            raise GridError("--chains and --chain-batch must be >= 1")
        options = chain_options(args)
        standing = grid.check_out_folder(out, runs, options)
        if args.dry_run:
            for r in runs:
                print(f"{run_state(out / r.path, r.config):<8} {r.path}")
            print(
                f"{len(runs)} runs"
                + (" (--epochs grew: finished runs extend)" * (standing == "grown"))
            )
            return exits.OK
        data_dir = launch.data_dir_of(args, {r.config["dataset"] for r in runs})
        if args.engine != "submitit":  # a login node may have no GPU where the jobs will
            launch.resolve_device(args.device)
        machine = Machine(
            data_dir=os.fspath(data_dir.resolve()) if data_dir is not None else "",
            device=args.device,
            threads=args.threads,
            verify=not args.no_verify,
            download=args.download,
            plot=not args.no_plot,
            chain_batch=args.chain_batch,
            graph=not args.no_graph,
            parallel=args.parallel,
        )
        try:
            jobs = make_jobs(runs, out.resolve(), machine, args.chains)
        except ValueError as exc:
            raise GridError(f"--chains {args.chains}: {exc}") from exc
    except (GridError, UsageError) as exc:
        return fail("sweep", str(exc), exits.USAGE)
    try:  # the folder's own lock, for a moment: its manifest, what killed sweeps left there
        with _root_locked(out):
            if standing != "same":  # new, a lost manifest rebuilt, or --epochs grown
                grid.write_manifest(out, runs, source, options)
    except OSError as exc:  # e.g. a read-only --out
        return fail("sweep", f"cannot write {out / grid.MANIFEST_FILE}: {exc}", exits.IO_ERROR)
    except RuntimeError as exc:  # DirectoryLockedError: another sweep held it for 30 s
        return fail("sweep", str(exc), exits.BUSY)

    states = [run_state(out / r.path, r.config) for r in runs]
    todo = [r for r, s in zip(runs, states, strict=True) if s != "done"]
    resumed = states.count("partial")
    spread = args.parallel != "none"
    print(
        f"sweep {out}: {len(runs)} runs, {len(runs) - len(todo)} finished, "
        f"{resumed} to resume, {len(todo) - resumed} to start ({args.engine}"
        + (f", --parallel {args.parallel} over {processes(args)} processes per run" * spread)
        + ")",
        file=sys.stderr,
    )
    if not todo:
        print("nothing to do", file=sys.stderr)
        return exits.OK
    from sgrld.experiments.base.files import OutputError
    from sgrld.experiments.sweep.engines import (
        ClusterOptions,
        GridProgress,
        run_local,
        run_submitit,
    )

    progress = GridProgress(len(runs), len(runs) - len(todo), enabled=not args.no_progress)
    started = time.perf_counter()
    try:
        if args.engine == "local":
            run_local(jobs, args.jobs or 1, progress)
        else:
            cluster = ClusterOptions(
                local=args.engine == "submitit-local",
                partition=args.partition,
                gpus_per_job=gpus_per_node(args),
                cpus_per_job=args.cpus_per_job,
                timeout_min=args.timeout_min,
                parallel=args.jobs,
                wait=not args.no_wait,
                nodes=args.nodes,
                tasks_per_node=args.tasks_per_node,
            )
            run_submitit(jobs, out, cluster, progress)
    except OutputError as exc:  # .submitit or its log planted as a link: nothing was submitted
        progress.close()
        return fail("sweep", str(exc), exits.IO_ERROR)
    finally:
        progress.close()
    if args.no_wait:
        return exits.OK
    return _summary(progress.tally, runs, out, time.perf_counter() - started)


@contextlib.contextmanager
def _root_locked(out: Path) -> Iterator[None]:
    """``--out`` locked (:func:`~sgrld.experiments.base.files.locked_out_dir`) while the manifest
    is written: a sweep locks each run for its whole run, the folder itself only for this
    moment, so a second sweep of the grid waits for it (up to 30 s) instead of being refused."""
    from sgrld.experiments.base.files import DirectoryLockedError, locked_out_dir

    for attempt in range(300):
        try:
            with locked_out_dir(out, "sgrld sweep (writing its manifest)"):
                yield
            return
        except DirectoryLockedError:
            if attempt == 299:
                raise
            time.sleep(0.1)


def _summary(tally: Any, runs: list[PlannedRun], out: Path, seconds: float) -> int:
    """Print how the runs ended; the exit status: 1 a run failed, 75 runs still held elsewhere."""
    configs = {r.path: r.config for r in runs}
    # A run held by another sweep or job may have finished meanwhile: then it is done.
    busy = [path for path in tally.busy if run_state(out / path, configs[path]) != "done"]
    print(
        f"{tally.completed} completed, {tally.broken_down} broke down, {len(tally.failed)} "
        f"failed, {len(busy)} running elsewhere, in {seconds:.1f} s",
        file=sys.stderr,
    )
    for path, why in tally.retried:
        print(f"  retried {path}: {why}", file=sys.stderr)
    for path, error in tally.failed:
        print(f"  failed {path}: {error}", file=sys.stderr)
    if tally.failed:
        return exits.FAILED
    if busy:
        print(
            f"  {len(busy)} runs are held by another sweep or job (e.g. {busy[0]}); "
            "run this sweep again when it ends",
            file=sys.stderr,
        )
        return exits.BUSY
    return exits.OK
