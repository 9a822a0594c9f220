"""``sgrld funnel``: the paper's funnel experiment (Figure 2), :mod:`sgrld.experiments.funnel`."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from sgrld.experiments.base import exits
from sgrld.experiments.base.exits import UsageError
from sgrld.experiments.base.files import (
    EXIT_IO_ERROR,
    LOCK_FILE,
    DirectoryLockedError,
    OutputError,
    Terminated,
    locked_out_dir,
    sigint_deferred,
    sigterm_raises,
)
from sgrld.experiments.base.progress import Progress
from sgrld.experiments.commands.common import fail
from sgrld.experiments.funnel.run import (
    NOT_RUN,
    SETTINGS,
    WENZEL_NOTE,
    FunnelConfig,
    SamplerRun,
    SamplerSetting,
    print_table,
    read_outputs,
    run_funnel,
    run_sampler,
    sample_quality,
    write_outputs,
)
from sgrld.experiments.funnel.verdict import V_THRESHOLD

__all__ = [
    "SETTINGS",
    "FunnelConfig",
    "SamplerRun",
    "SamplerSetting",
    "add_arguments",
    "read_outputs",
    "run",
    "run_funnel",
    "run_sampler",
    "sample_quality",
    "write_outputs",
]

#: The longer run a shortened one points to: the paper's length.
FULL_RUN = "sgrld funnel --out DIR --chains 8 (the paper's 2×10⁶ steps, compiled)"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def parse_samplers(text: str) -> list[str]:
    """``"identity,monge"`` → ``["identity", "monge"]``; unknown or repeated names raise."""
    import difflib

    from sgrld.metrics import ALIASES

    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise ValueError("--samplers is empty")
    names = [ALIASES.get(s.lower(), s.lower()) for s in names]
    for name in names:
        if name in NOT_RUN:
            raise ValueError(NOT_RUN[name])
    unknown = [s for s in names if s not in SETTINGS]
    if unknown:
        close = difflib.get_close_matches(unknown[0], SETTINGS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"unknown sampler(s) {', '.join(map(repr, unknown))}{hint}; choose from "
            f"{', '.join(SETTINGS)} (aliases: sgld = identity, psgld = rmsprop)"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"repeated sampler in --samplers {text!r}")
    return names


def add_arguments(
    parser: argparse.ArgumentParser,
    *,
    default_steps: int = 2_000_000,
    default_out: str | None = None,
    default_compile: bool = True,
    default_chains: int = 1,
) -> None:
    """The ``sgrld funnel`` options (``demo`` reuses them with other defaults)."""
    default_compile_text = "--compile" if default_compile else "--no-compile"
    parser.epilog = exits.epilog("funnel")
    out: dict[str, Any] = {"required": True, "help": "output directory"}
    if default_out is not None:
        out = {"default": Path(default_out), "help": f"output directory (default {default_out})"}
    parser.add_argument("--out", type=Path, **out)
    parser.add_argument(
        "--steps",
        type=_positive_int,
        default=default_steps,
        help=f"iterations per chain (default {default_steps})",
    )
    parser.add_argument("--seed", type=int, default=1, help="master seed (default 1)")
    parser.add_argument(
        "--samplers",
        default=",".join(SETTINGS),
        help="comma-separated subset of " + ",".join(SETTINGS) + " (default: these four, every "
        "sampler but wenzel, which is identity on the funnel)",
    )
    parser.add_argument(
        "--chains",
        type=_positive_int,
        default=default_chains,
        help="independent chains per sampler, run batched in one state: they give every figure "
        f"its spread (default {default_chains})",
    )
    parser.add_argument(
        "--start",
        choices=("reference", "exact"),
        default="reference",
        help="(1, 1) as the paper (reference, the default), or exact funnel draws (exact: a "
        "stationarity check)",
    )
    parser.add_argument(
        "--jobs",
        type=_positive_int,
        default=min(2, os.cpu_count() or 1),
        help="worker processes, one sampler each (default: min(2, cores))",
    )
    parser.add_argument(
        "--block", type=_positive_int, default=10, help="steps per compiled call (default 10)"
    )
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=default_compile,
        help="compile --block steps at a time with torch.compile (pays off for long runs: "
        "tens of seconds per sampler to compile, then ~10x faster steps); --no-compile runs the "
        f"same step code eagerly (no C++ compiler needed). Default: {default_compile_text}",
    )
    parser.add_argument(
        "--force", action="store_true", help="replace the funnel outputs already in --out"
    )
    parser.add_argument("--no-plot", action="store_true", help="skip funnel.png")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    exact = parser.add_argument_group("exact metric (sgrld.experiments.funnel.exact)")
    exact.add_argument(
        "--exact-metric",
        action="store_true",
        help="exact gradients for --samplers, plus Monge with m = ∇u(θ) (monge-current)",
    )
    exact.add_argument("--correction", action="store_true", help="add Γ to monge-current")
    exact.add_argument("--alpha2", type=float, help="both Monge metrics' α² or c (0.1)")
    exact.add_argument(
        "--alpha2-rule",
        choices=("fixed", "normalized"),
        default="fixed",
        help="fixed α² (the default) or normalized α²_t = c/‖m_t‖²",
    )


def prepare(args: argparse.Namespace, command: str) -> tuple[list[str], FunnelConfig] | int:
    """Validate the options before any work; return the plan or an exit status."""
    try:
        names = parse_samplers(args.samplers)
    except ValueError as exc:
        return fail(command, str(exc), 2)
    if not args.no_plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return fail(
                command,
                "funnel.png needs matplotlib (pip install 'sgrld[plots]'), or pass --no-plot",
                2,
            )
    exact = (args.correction, args.alpha2 is not None, args.alpha2_rule != "fixed")
    if any(exact) and not args.exact_metric:
        return fail(command, "--correction, --alpha2 and --alpha2-rule need --exact-metric", 2)
    config = FunnelConfig(
        steps=args.steps,
        seed=args.seed,
        chains=args.chains,
        start=args.start,
        block=args.block,
        compile=args.compile,
    )
    return names, config


def execute(args: argparse.Namespace, command: str) -> int:
    """Run, print the table, write the outputs (``funnel`` and ``demo``), ``--out`` locked."""
    plan = prepare(args, command)
    if isinstance(plan, int):
        return plan
    names, config = plan
    try:
        with locked_out_dir(args.out, f"sgrld {command}"), sigterm_raises():
            return _execute_locked(args, command, names, config)
    except (UsageError, DirectoryLockedError) as exc:
        return fail(command, str(exc), 2)
    except OutputError as exc:  # taking the lock, e.g. a read-only --out: as sample, EX_IOERR
        return fail(command, f"cannot write to --out {str(args.out)!r}: {exc}", EXIT_IO_ERROR)
    except Terminated:
        print(f"sgrld {command}: terminated; workers stopped", file=sys.stderr)
        return exits.TERMINATED


def _execute_locked(
    args: argparse.Namespace, command: str, names: list[str], config: FunnelConfig
) -> int:
    with sigint_deferred():  # Ctrl-C inside torch's start-up would abort: exit 130 instead
        from sgrld.core.sampler import NonFiniteGradientError

    present = sorted(p.name for p in args.out.iterdir() if p.name != LOCK_FILE)
    if present and not args.force:
        return fail(
            command,
            f"--out {str(args.out)!r} is not empty "
            f"({', '.join(present[:4])}{', ...' if len(present) > 4 else ''}); pass --force to "
            "replace its funnel outputs, or choose another --out",
            2,
        )
    print(
        f"funnel (μ = 2, σ² = 80): {', '.join(names)}; {config.steps} steps x "
        f"{config.chains} chain(s), start {config.start}, seed {config.seed}; "
        f"{'compiled' if config.compile else 'eager (no compilation)'}",
        flush=True,
    )
    print(f"({WENZEL_NOTE})", flush=True)
    started = time.perf_counter()
    try:
        progress = False if args.no_progress else None
        if args.exact_metric:
            from sgrld.experiments.funnel.exact import run_exact_funnel, total_steps

            with Progress(total_steps(names, config), "funnel", enabled=progress) as bar:
                runs = run_exact_funnel(
                    names,
                    config,
                    correction=args.correction,
                    alpha2=args.alpha2,
                    alpha2_rule=args.alpha2_rule,
                    progress=bar.update,
                )
        else:
            runs = run_funnel(names, config, jobs=args.jobs, progress=progress)
    except NonFiniteGradientError as exc:
        return fail(command, f"{exc}; no outputs written", 3)
    wall = time.perf_counter() - started
    compiled = sum(r.compile_seconds for r in runs.values())
    print_table(runs)
    print_verdicts(runs, args.steps < FunnelConfig().steps)
    print(
        f"{wall:.1f} s wall for the samplers ({args.jobs} at a time); summed over samplers "
        f"{compiled:.1f} s compiling and "
        f"{sum(r.wall_seconds for r in runs.values()) - compiled:.1f} s sampling"
    )
    try:
        written = write_outputs(runs, config, args.out, plot=not args.no_plot)
    except OSError as exc:
        return fail(command, f"writing outputs failed: {exc}", EXIT_IO_ERROR)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def print_verdicts(runs: dict[str, SamplerRun], shortened: bool) -> None:
    """What the numbers show against the truth, one line per sampler (``verdict.verdicts``)."""
    from sgrld.data.funnel import FunnelTarget
    from sgrld.experiments.funnel.verdict import verdicts
    from sgrld.metrics import IdentityMetric, get_metric

    chains = len(next(iter(runs.values())).distances["min_v"])
    identity = [
        n for n in runs if n in SETTINGS and get_metric(SETTINGS[n].metric) is IdentityMetric
    ]
    longer = FULL_RUN if shortened else "more chains (--chains) or steps (--steps)"
    over = f"{chains} chain{'s' * (chains != 1)}"
    print(f"What the numbers show (mean ± 2 standard errors over {over}):")
    truth = FunnelTarget().prob_v_below(V_THRESHOLD)
    distances = {name: r.distances for name, r in runs.items()}
    for line in verdicts(distances, truth, baseline=next(iter(identity), None), longer=longer):
        print(f"  {line}")


def run(args: argparse.Namespace) -> int:
    """Entry point of ``sgrld funnel``."""
    return execute(args, "funnel")
