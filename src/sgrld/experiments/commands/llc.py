"""``sgrld llc``: the local learning coefficient with every metric (``docs/llc.md``): λ̂ ± its
standard error and its verdict per target and sampler, ``llc.json`` and ``llc.png`` (loss traces
per chain). The target is a built-in model or the user's, ``module:function``.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sgrld import build
from sgrld.core import NonFiniteGradientError
from sgrld.core.contract import option_names
from sgrld.experiments.base import exits
from sgrld.experiments.base.files import (
    DirectoryLockedError,
    OutputError,
    locked_out_dir,
    save_figure,
    write_atomic,
)
from sgrld.experiments.commands.common import fail
from sgrld.experiments.commands.options import OptionAction
from sgrld.experiments.run.results import nan_to_none
from sgrld.metrics import get_metric
from sgrld.slt import LLCEstimate, against_sgld, llc, targets
from sgrld.slt.language import CausalLM, next_token_loss, synthetic_language, train

TARGETS = ("logistic", "rrr", "transformer")
#: the most steps per chain (the trace is held in memory: chains × steps float64)
MAX_STEPS = 10_000_000


def _ints(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected integers separated by commas: {text!r}"
        ) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``sgrld llc`` options."""
    parser.epilog = exits.epilog("llc")
    parser.add_argument(
        "target", metavar="{logistic,rrr,transformer,MODULE:FUNCTION}",
        help="the model whose LLC is estimated: a built-in one, or yours: MODULE:FUNCTION names "
        "a function (imported from the current directory or the Python path) that returns a "
        "sgrld.slt.targets.Target, or a dict with model, loss, loader, num_data (and optional "
        "name, theory); see docs/llc.md",
    )  # fmt: skip
    parser.add_argument(
        "--samplers",
        default="identity,rmsprop,monge,shampoo",
        help="metrics of the registry, comma-separated (default: %(default)s)",
    )
    parser.add_argument("--chains", type=int, default=4, help="chains per estimate (default 4)")
    parser.add_argument("--steps", type=int, help="steps per chain (default 3000; transformer 200)")
    parser.add_argument("--lr", type=float, help="devinterp's ε (default: calibrated)")
    parser.add_argument("--nbeta", type=float, help="inverse temperature nβ (default n/log n)")
    parser.add_argument("--localization", type=float, default=100.0, help="γ (default %(default)s)")
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the data, the chains and the model (default 0)"
    )
    parser.add_argument(
        "--mode", choices=("as-is", "train", "eval"), default="as-is",
        help="the model's mode during the chains: train() (dropout on, devinterp's), eval(), or "
        "as the target left it (default %(default)s; the built-in targets have no dropout)",
    )  # fmt: skip
    parser.add_argument(
        "--rrr", type=_ints, default=[4, 4, 3, 1], metavar="M,N,H,R",
        help="reduced-rank regression: inputs, outputs, hidden, true rank (default 4,4,3,1)",
    )  # fmt: skip
    parser.add_argument(
        "--checkpoints", type=_ints, default=[0, 25, 50, 100, 200, 400], metavar="STEPS",
        help="transformer: training steps at which the LLC is estimated (default "
        "0,25,50,100,200,400)",
    )  # fmt: skip
    parser.add_argument(
        "--width", type=int, default=16, help="transformer: model width (default 16; 2 heads)"
    )
    parser.add_argument("--layers", type=int, default=2, help="transformer: blocks (default 2)")
    parser.add_argument(
        "--sequential", action="store_true",
        help="chains one after the other on the model's own parameters (default: vectorised)",
    )  # fmt: skip
    parser.add_argument(
        "--option", dest="sampler_options", action=OptionAction, metavar="KEY=VALUE",
        help="an option of the metrics that have it, e.g. eps=0.1 (rmsprop, adam) or "
        "precondition_vectors=true (shampoo); repeatable",
    )  # fmt: skip
    parser.add_argument(
        "--out", type=Path, default=Path("out/llc"), help="output directory (default out/llc)"
    )


def run(args: argparse.Namespace) -> int:
    """Estimate, print, write ``llc.json`` and ``llc.png``."""
    samplers = [s.strip() for s in args.samplers.split(",") if s.strip()]
    try:
        import matplotlib  # noqa: F401  (llc.png, at the end: refuse before the work)
    except ImportError:
        return fail("llc", "it draws llc.png with matplotlib: pip install 'sgrld[plots]'", 2)
    try:
        if not samplers:
            raise ValueError(f"--samplers names no metric: {args.samplers!r}")
        for name in samplers:
            get_metric(name)  # the registry's message, with the closest name
        if args.target not in TARGETS and ":" not in args.target:
            close = difflib.get_close_matches(args.target, TARGETS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"unknown target {args.target!r}{hint}: expected one of {', '.join(TARGETS)} "
                f"or MODULE:FUNCTION"
            )
        if len(args.rrr) != 4:
            raise ValueError("--rrr takes four integers M,N,H,R")
        _check_ranges(args)
        samplers = [get_metric(name).name for name in samplers]  # aliases: their registry name
        # SGLD (G = I) first: every other metric's verdict is checked against its estimate
        samplers.sort(key=lambda name: get_metric(name).preconditions)
        options = {name: _options(name, args.sampler_options or {}, samplers) for name in samplers}
    except (ValueError, TypeError) as exc:
        return fail("llc", str(exc), exits.USAGE)
    try:  # one writer per --out, held until llc.json and llc.png are written
        with locked_out_dir(args.out, "sgrld llc"):
            return _run_locked(args, samplers, options)
    except (exits.UsageError, DirectoryLockedError) as exc:
        return fail("llc", str(exc), exits.USAGE)
    except OutputError as exc:
        return fail("llc", f"cannot write to {args.out}: {exc}", exits.IO_ERROR)


def _run_locked(args: argparse.Namespace, samplers: list[str], options: dict[str, dict]) -> int:
    torch.set_num_threads(min(2, torch.get_num_threads()))
    try:
        cases = _cases(args)
    except (ValueError, TypeError, ImportError, AttributeError) as exc:
        return fail("llc", str(exc), exits.USAGE)
    steps = args.steps or (200 if args.target == "transformer" else 3000)
    mode = {"as-is": None, "train": True, "eval": False}[args.mode]
    rows: list[dict[str, Any]] = []
    traces: dict[str, Any] = {}
    print(
        f"{'model':24} {'sampler':9} {'ε':>9} {'λ̂ ± se':>15} {'theory':>7} {'wall s':>7}  verdict"
    )
    for label, model, loss, batches, num_data, theory in cases:
        reference: LLCEstimate | None = None
        for name in samplers:
            start = time.perf_counter()
            try:
                est = llc(model, loss, batches, num_data=num_data, sampler=name, nbeta=args.nbeta,
                          localization=args.localization, num_chains=args.chains, num_steps=steps,
                          seed=args.seed, lr=args.lr, vectorize=not args.sequential, train=mode,
                          warn=False, check_sgld=None if reference is None else False,
                          **options[name])  # fmt: skip
                if not get_metric(name).preconditions:  # SGLD: the reference
                    reference = est
                elif reference is not None:
                    est = against_sgld(est, reference)
            except NonFiniteGradientError as exc:
                print(f"sgrld llc: {label}, {name}: a chain broke down ({exc}); lower --lr")
                return exits.BROKEN_DOWN
            except (ValueError, TypeError, RuntimeError) as exc:  # the user's model or options
                return fail("llc", f"{label}, {name}: {exc}", exits.USAGE)
            wall = time.perf_counter() - start
            rows.append(_row(label, name, est, theory, wall))
            traces[f"{label}/{name}"] = est.trace
            traces["window"] = len(batches) if hasattr(batches, "__len__") else 32
            shown = "" if theory is None else f"{theory:7.2f}"
            print(f"{label:24} {name:9} {est.lr:9.2e} {est.mean:7.2f} ± {est.std_error:5.2f} "
                  f"{shown:>7} {wall:7.1f}  {est.verdict}", flush=True)  # fmt: skip
    bad = [r for r in rows if not r["ok"]]
    if bad:
        print(f"sgrld llc: warning: {len(bad)} of {len(rows)} estimates failed their verdict "
              "(above; docs/llc.md says what each problem means)", file=sys.stderr)  # fmt: skip
    try:
        write_atomic(args.out / "llc.json", json.dumps(nan_to_none(rows), indent=1) + "\n")
        _figure(args, rows, traces, samplers)
    except OSError as exc:
        return fail("llc", f"cannot write to {args.out}: {exc}", exits.IO_ERROR)
    print(f"wrote {args.out / 'llc.json'} and {args.out / 'llc.png'}")
    return 0


def _check_ranges(args: argparse.Namespace) -> None:
    """Every numeric option in its range, before any work (a ValueError names the flag)."""
    at_least_one = {"--chains": args.chains, "--width": args.width, "--layers": args.layers}
    at_least_one |= {"--steps": args.steps} if args.steps is not None else {}
    at_least_one |= {"--rrr": min(args.rrr)}
    bad = [f"{flag} must be >= 1, got {value}" for flag, value in at_least_one.items() if value < 1]
    positive = {"--lr": args.lr, "--nbeta": args.nbeta}
    bad += [
        f"{flag} must be a finite number > 0, got {v}"
        for flag, v in positive.items()
        if v is not None and not (math.isfinite(v) and v > 0)
    ]
    if not (math.isfinite(args.localization) and args.localization >= 0):
        bad.append(f"--localization must be a finite number >= 0, got {args.localization}")
    if not 0 <= args.seed <= 2**63 - 1 - args.chains:
        bad.append(f"--seed must be in [0, 2**63 - 1 - chains], got {args.seed}")
    if args.steps is not None and args.steps > MAX_STEPS:
        bad.append(f"--steps must be <= {MAX_STEPS:,}, got {args.steps:,}")
    if args.target == "rrr" and len(args.rrr) == 4 and args.rrr[3] > args.rrr[2]:
        bad.append(f"--rrr: the true rank R ({args.rrr[3]}) must be <= the hidden width H "
                   f"({args.rrr[2]})")  # fmt: skip
    if args.width % 2:
        bad.append(f"--width must be even (2 attention heads), got {args.width}")
    if min(args.checkpoints) < 0:
        bad.append(f"--checkpoints must be training steps >= 0, got {min(args.checkpoints)}")
    if bad:
        raise ValueError("; ".join(bad))


def _options(name: str, options: dict[str, Any], samplers: list[str]) -> dict[str, Any]:
    """The ``--option`` entries that the metric ``name`` has, checked by building it (a
    ValueError naming a bad value); an entry no metric of ``samplers`` has is refused, with
    the closest option name."""
    every = {n for s in samplers for n in option_names(get_metric(s))}
    unknown = [k for k in options if k not in every]
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(every), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"--option {unknown[0]!r}{hint}: no metric of --samplers has it; their options: "
            f"{', '.join(sorted(every))}"
        )
    mine = {k: v for k, v in options.items() if k in option_names(get_metric(name))}
    try:
        build(name, lr=1e-3, num_data=100, **mine)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"--option for {name}: {exc}") from None
    return mine


def _cases(args: argparse.Namespace) -> list[tuple[str, Any, Any, Any, int, float | None]]:
    """(label, model, loss, batches, n, theory) per estimate."""
    if ":" in args.target:
        return [_user_target(args.target)]
    if args.target == "logistic":
        t = targets.logistic(seed=args.seed)
        return [(t.name, t.model, t.loss, t.batches, t.num_data, t.theory)]
    if args.target == "rrr":
        m, n, h, r = args.rrr
        t = targets.reduced_rank_regression(m, n, h, r, seed=args.seed)
        return [(t.name, t.model, t.loss, t.batches, t.num_data, t.theory)]
    ids = synthetic_language(2048, 16, 16, seed=args.seed)
    held = ids[:1024]  # the LLC's data; training draws from all of it
    batches = [held[i : i + 64] for i in range(0, len(held), 64)]
    tokens = int((held[:, 1:] != -100).sum())
    size = {"vocab": 16, "width": args.width, "heads": 2, "layers": args.layers, "context": 16}
    torch.manual_seed(args.seed)  # the initialisation: the run is a function of --seed
    model = CausalLM(**size)
    saved = train(model, ids, sorted(set(args.checkpoints)), seed=args.seed)
    cases: list[tuple[str, Any, Any, Any, int, float | None]] = []
    for step, state in saved.items():
        m = CausalLM(**size)
        m.load_state_dict(state)
        cases.append((f"transformer@{step}", m, next_token_loss, batches, tokens, None))
    return cases


def _user_target(spec: str) -> tuple[str, Any, Any, Any, int, float | None]:
    """The user's ``MODULE:FUNCTION``: called without arguments, it returns a
    :class:`~sgrld.slt.targets.Target` or a dict with ``model``, ``loss``, ``loader``,
    ``num_data`` (and optional ``name``, ``theory``)."""
    module_name, _, function_name = spec.partition(":")
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")  # the current directory, as ``python -m`` has it
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(f"cannot import {module_name!r} (from {spec!r}): {exc}") from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ValueError(f"{spec!r}: {module_name} has no function {function_name!r}")
    made = function()
    if isinstance(made, targets.Target):
        return (made.name, made.model, made.loss, made.batches, made.num_data, made.theory)
    if not isinstance(made, dict) or not {"model", "loss", "loader", "num_data"} <= made.keys():
        raise ValueError(
            f"{spec} returned {type(made).__name__}: expected a sgrld.slt.targets.Target or a "
            f"dict with model, loss, loader and num_data"
        )
    theory = made.get("theory")
    return (str(made.get("name", function_name)), made["model"], made["loss"], made["loader"],
            made["num_data"], None if theory is None else float(theory))  # fmt: skip


def _row(label: str, name: str, est: LLCEstimate, theory: float | None, wall: float) -> dict:
    return {
        "model": label, "sampler": name, "llc": est.mean, "std_error": est.std_error,
        "per_chain": est.per_chain.tolist(), "lr": est.lr, "calibrated": est.calibrated,
        "nbeta": est.nbeta, "localization": est.localization, "init_loss": est.init_loss,
        "theory": theory, "wall_s": wall, "ok": est.ok, "verdict": str(est.verdict),
        "diagnostics": {k: v for k, v in dataclasses.asdict(est.verdict).items()
                        if k not in ("ok", "problems")} if est.verdict else None,
        "problems": list(est.verdict.problems) if est.verdict else [],
    }  # fmt: skip


def _figure(args: argparse.Namespace, rows: list[dict], traces: dict, samplers: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = args.target == "transformer"
    last = rows[-1]["model"]
    fig, axes = plt.subplots(1, 2 if curve else 1, figsize=(11 if curve else 6, 4), squeeze=False)
    ax = axes[0][0]
    for i, name in enumerate(samplers):
        trace = traces[f"{last}/{name}"]
        init = next(r["init_loss"] for r in rows if r["model"] == last and r["sampler"] == name)
        window = min(traces["window"], trace.shape[1])
        kernel = np.ones(window) / window  # one pass over the batches: their spread cancels
        for k, chain in enumerate(trace):
            smooth = np.convolve(chain - init, kernel, mode="valid")
            ax.plot(np.arange(window - 1, trace.shape[1]), smooth, color=f"C{i}", lw=0.8,
                    alpha=0.8, label=name if k == 0 else None)  # fmt: skip
    ax.set(xlabel="step", ylabel=f"batch loss − L(w₀), mean of {traces['window']}",
           title=f"loss traces per chain: {last}")  # fmt: skip
    ax.legend()
    if curve:
        ax = axes[0][1]
        for i, name in enumerate(samplers):
            mine = [r for r in rows if r["sampler"] == name]
            steps = [int(r["model"].split("@")[1]) for r in mine]
            ax.errorbar(steps, [r["llc"] for r in mine], yerr=[r["std_error"] for r in mine],
                        color=f"C{i}", marker="o", capsize=3, label=name)  # fmt: skip
        ax.set_xscale("symlog", linthresh=25)
        ax.set(xlabel="training step", ylabel="λ̂ ± se", title="LLC across training")
        ax.legend()
    fig.tight_layout()
    save_figure(fig, args.out / "llc.png", dpi=120)
    plt.close(fig)
