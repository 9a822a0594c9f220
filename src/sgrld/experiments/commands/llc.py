"""``sgrld llc``: the local learning coefficient with every metric (``docs/llc.md``): λ̂ ± its
standard error per target and sampler, ``llc.json`` and ``llc.png`` (loss traces per chain).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sgrld.core import NonFiniteGradientError
from sgrld.experiments.base import exits
from sgrld.experiments.base.files import save_figure, write_atomic
from sgrld.experiments.commands.common import fail
from sgrld.experiments.commands.options import OptionAction
from sgrld.metrics import get_metric
from sgrld.slt import LLCEstimate, llc, targets
from sgrld.slt.language import CausalLM, next_token_loss, synthetic_language, train

TARGETS = ("logistic", "rrr", "transformer")


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
    parser.add_argument("target", choices=TARGETS, help="the model whose LLC is estimated")
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
        for name in samplers:
            get_metric(name)  # the registry's message, with the closest name
        if len(args.rrr) != 4:
            raise ValueError("--rrr takes four integers M,N,H,R")
        _check_ranges(args)
    except ValueError as exc:
        return fail("llc", str(exc), exits.USAGE)
    try:  # an unwritable --out is refused before the work, not after it
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return fail("llc", f"cannot write to {args.out}: {exc}", exits.IO_ERROR)
    samplers = [get_metric(name).name for name in samplers]  # aliases: their registry name
    torch.set_num_threads(min(2, torch.get_num_threads()))
    cases = _cases(args)
    steps = args.steps or (200 if args.target == "transformer" else 3000)
    rows: list[dict[str, Any]] = []
    traces: dict[str, Any] = {}
    print(f"{'model':24} {'sampler':9} {'ε':>9} {'λ̂ ± se':>15} {'theory':>7} {'wall s':>7}")
    for label, model, loss, batches, num_data, theory in cases:
        for name in samplers:
            start = time.perf_counter()
            try:
                est = llc(model, loss, batches, num_data=num_data, sampler=name, nbeta=args.nbeta,
                      localization=args.localization, num_chains=args.chains, num_steps=steps,
                          seed=args.seed, lr=args.lr, vectorize=not args.sequential,
                          **_options(name, args.sampler_options or {}))  # fmt: skip
            except NonFiniteGradientError as exc:
                print(f"sgrld llc: {label}, {name}: a chain broke down ({exc}); lower --lr")
                return exits.BROKEN_DOWN
            wall = time.perf_counter() - start
            rows.append(_row(label, name, est, theory, wall))
            traces[f"{label}/{name}"] = est.trace
            traces["window"] = len(batches)
            shown = "" if theory is None else f"{theory:7.2f}"
            print(f"{label:24} {name:9} {est.lr:9.2e} {est.mean:7.2f} ± {est.std_error:5.2f} "
                  f"{shown:>7} {wall:7.1f}", flush=True)  # fmt: skip
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        write_atomic(args.out / "llc.json", json.dumps(rows, indent=1) + "\n")
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
        f"{flag} must be > 0, got {v}" for flag, v in positive.items() if v is not None and v <= 0
    ]
    if args.localization < 0:
        bad.append(f"--localization must be >= 0, got {args.localization}")
    if args.width % 2:
        bad.append(f"--width must be even (2 attention heads), got {args.width}")
    if min(args.checkpoints) < 0:
        bad.append(f"--checkpoints must be training steps >= 0, got {min(args.checkpoints)}")
    if bad:
        raise ValueError("; ".join(bad))


def _options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """The ``--option`` entries that the metric ``name`` has."""
    fields = {f.name for f in dataclasses.fields(get_metric(name))}  # type: ignore[arg-type]
    return {k: v for k, v in options.items() if k in fields}


def _cases(args: argparse.Namespace) -> list[tuple[str, Any, Any, Any, int, float | None]]:
    """(label, model, loss, batches, n, theory) per estimate."""
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


def _row(label: str, name: str, est: LLCEstimate, theory: float | None, wall: float) -> dict:
    return {
        "model": label, "sampler": name, "llc": est.mean, "std_error": est.std_error,
        "per_chain": est.per_chain.tolist(), "lr": est.lr, "calibrated": est.calibrated,
        "nbeta": est.nbeta, "localization": est.localization, "init_loss": est.init_loss,
        "theory": theory, "wall_s": wall,
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
