"""``sgrld tune``: choose each sampler's ℓ for an experiment's run with :func:`sgrld.tune`.

Example (MNIST, N = 400, horseshoe prior, a 3-epoch run, every sampler)::

    sgrld tune --dataset mnist --width 400 --prior horseshoe --epochs 3 \\
        --data-dir DIR --out OUT

``--out`` is locked while it runs (a second ``sgrld tune`` on it is refused), and a line per
round of the search goes to standard error (``--no-progress``: none).

writes ``OUT/tune.json`` and ``OUT/tune.png``, which ``sample --lr tuned:OUT`` and ``report
--tuned OUT`` read (``docs/tuning.md``).
"""

from __future__ import annotations

import argparse
import io
import json
import math
from itertools import product
from pathlib import Path
from typing import Any

from sgrld.experiments.base import exits
from sgrld.experiments.base.files import write_atomic
from sgrld.experiments.commands.common import fail
from sgrld.experiments.commands.options import add_run_options, config_from_args
from sgrld.experiments.run.choices import SAMPLERS
from sgrld.experiments.run.config import METRIC_FIELDS, TUNED_FIELDS
from sgrld.experiments.run.options import OPTIONS
from sgrld.experiments.run.tuned import TUNE_FILE

FIGURE = "tune.png"

#: ``sgrld sample``'s options that say nothing about the run the ℓ is chosen for (how a run is
#: sampled, recorded or resumed, and ``--lr``, which tune chooses): not tune's, refused if given
NOT_TUNES = (
    "lr", "chains", "chain_batch", "noise", "compile", "schedule", "cycles", "explore_fraction",
    "thinning", "curvature", "curvature_points", "resume", "parallel", "no_graph", "no_plot",
)  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of the run to tune for (``sgrld sample``'s that matter to it) and the
    search's own; ``--help`` lists these only."""
    parser.epilog = exits.epilog("tune")
    samplers = {
        "metavar": "S[,S...]",
        "help": f"the samplers to tune (default: all of {', '.join(SAMPLERS)})",
    }
    out = {"type": Path, "required": True, "help": "the folder for tune.json and tune.png"}
    hidden = {"help": argparse.SUPPRESS, "default": argparse.SUPPRESS}
    own: dict[str, dict[str, Any]] = {name: hidden for name in NOT_TUNES}
    own |= {
        "sampler": samplers,
        "out": out,
        "burn_in": {"help": "burn-in updates: with --adapt, the metric's warm-up (1000)"},
        "no_progress": {"help": "no line per round of the search on stderr"},
    }
    add_run_options(parser, lists=("sampler",), own=own)
    search = parser.add_argument_group("the search")
    search.add_argument(
        "--budget",
        type=int,
        default=None,
        help="gradient evaluations per sampler (one minibatch gradient of one chain; default "
        "ten runs' worth: 10 × epochs × batches per epoch)",
    )
    search.add_argument(
        "--score",
        choices=("validation", "train", "ksd", "loss"),
        default="validation",
        help="the validation log predictive (default: the paper's rule, right on networks), "
        "the log predictive of the first training data, the kernel Stein discrepancy, or the "
        "mean potential (docs/tuning.md)",
    )


def run(args: argparse.Namespace) -> int:
    """Entry point of ``sgrld tune``."""
    from sgrld.experiments.base.files import (
        DirectoryLockedError,
        OutputError,
        locked_out_dir,
    )

    given = [n for n in NOT_TUNES if hasattr(args, n)]
    if given:
        flag = OPTIONS[given[0]].flags[0]
        why = "it chooses ℓ" if given[0] == "lr" else "it is not a sampling run"
        return fail("tune", f"sgrld tune takes no {flag} ({why}): leave it out", exits.USAGE)
    if args.threads is not None and args.threads < 1:
        return fail("tune", f"--threads must be >= 1, got {args.threads}", exits.USAGE)
    try:  # one writer (a second tune is refused); a killed tune's temporaries removed
        with locked_out_dir(args.out, "sgrld tune"):
            return _locked(args)
    except (exits.UsageError, DirectoryLockedError) as exc:
        return fail("tune", str(exc), exits.USAGE)
    except OutputError as exc:
        return fail("tune", str(exc), exits.IO_ERROR)


def _locked(args: argparse.Namespace) -> int:
    """``sgrld tune`` with ``--out`` locked."""
    import torch

    from sgrld.experiments.base.files import OutputError
    from sgrld.experiments.run import launch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    names = args.sampler or list(SAMPLERS)
    values = {**{n: o.default for n, o in OPTIONS.items()}, **vars(args), "lr": [1.0]}
    try:  # lr: a placeholder; the config's other fields are the run's
        configs = {s: config_from_args({**values, "sampler": s}) for s in names}
        first = configs[names[0]]
        data_dir = launch.data_dir_of(args, {first.dataset})
        splits = launch.load_splits(args, first, data_dir, args.out)
        if splits is None:
            return exits.USAGE
        device = launch.resolve_device(args.device)
        results = {s: _tune(configs[s], splits, args, device) for s in names}
    except OutputError as exc:
        return fail("tune", str(exc), exits.IO_ERROR)
    except ValueError as exc:  # bad options (UsageError) and the tuner's refusals: one line each
        return fail("tune", str(exc), exits.USAGE)
    data = {"config": _setting(first, args, splits), "samplers": results}
    try:
        buffer = io.BytesIO()
        plot(results, buffer)
        write_atomic(args.out / FIGURE, buffer.getvalue())
        write_atomic(args.out / TUNE_FILE, (json.dumps(data, indent=1) + "\n").encode())
    except OSError as exc:
        return fail("tune", f"writing failed: {exc}", exits.IO_ERROR)
    for name, result in results.items():
        grid = result["grid"]
        share = f", {result['spent'] / grid['evaluations']:.0%} of its grid" if grid else ""
        runs = result["spent"] / result["steps"]
        print(f"{name}: {_chosen(result)} ({result['spent']} gradients = {runs:.1f} runs of "
              f"{result['steps']} steps{share}; {result['seconds']:.0f} s)")  # fmt: skip
    print(f"wrote {args.out / TUNE_FILE}, {args.out / FIGURE}")
    return exits.OK


def _tune(config: Any, splits: Any, args: argparse.Namespace, device: Any) -> dict[str, Any]:
    """One sampler's search for ``config``'s run, as a JSON-ready dict with its grid."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import sgrld
    from sgrld.experiments.run.build import build_run_model
    from sgrld.models import potential

    n = config.max_train or splits.num_train
    x, y = splits.x_train[:n].to(device), splits.y_train[:n].to(device)
    gen = torch.Generator().manual_seed(config.seed)
    model = build_run_model(config, splits, generator=gen).to(device)
    fixed: dict[str, Any] = {**config.sampler_options, "temperature": config.temperature}
    fixed["adapt_until"] = config.adapt_until
    if config.tuned:  # searched unless given (--alpha2), with the run's rule (Monge's α² rule)
        fixed |= {n: v for n, v in config.metric_options.items() if n in METRIC_FIELDS}
        fixed |= {n: v for n, v in config.tuned.items() if getattr(args, n) is not None}
    batches = math.ceil(n / config.batch_size)
    validation, log_likelihood = None, None
    if args.score == "validation":
        m = config.max_eval or len(splits.y_val)
        xv, yv = splits.x_val[:m].to(device), splits.y_val[:m].to(device)
        step = config.eval_batch_size
        val = [(xv[i : i + step], yv[i : i + step]) for i in range(0, m, step)]
        validation = (val, lambda mod, b: mod.likelihood.log_prob(mod(b[0]), b[1]))
    elif args.score == "train":
        log_likelihood = lambda mod, b: mod.likelihood.log_prob(mod(b[0]), b[1])  # noqa: E731

    def per_datum(mod: Any, batch: Any) -> Any:
        return potential(mod, batch[0], batch[1], n)

    result = sgrld.tune(
        config.sampler, model, per_datum,
        DataLoader(TensorDataset(x, y), batch_size=config.batch_size, shuffle=True),
        num_data=n, steps=config.epochs * batches, budget=args.budget, seed=config.seed,
        validation=validation, log_likelihood=log_likelihood, score=args.score,
        progress=not args.no_progress, **fixed,
    )  # fmt: skip
    out = result.to_dict()
    out["grid"] = paper_grid(config, config.epochs * batches)
    return out


def _chosen(result: dict[str, Any]) -> str:
    """``ℓ = 0.1, alpha2 = 1``: the searched options' chosen values."""
    return ", ".join(
        f"{'ℓ' if n == 'lr' else n} = {result['options'][n]:.3g}" for n in result["searched"]
    )


_SETTING = ("dataset", "prior", "width", "sampler")  # what a paper grid block must match


def paper_grid(config: Any, steps: int) -> dict[str, Any] | None:
    """The paper's ℓ (× α²) grid for the setting, one seed, and its gradient evaluations."""
    from sgrld.experiments.sweep.grid import parse_config, read_config, shipped_configs

    points = []
    for name in shipped_configs():
        if not name.startswith("paper/"):
            continue
        for block in parse_config(*read_config(name)):  # its defaults merged in
            if all(getattr(config, k) in _list(block.get(k)) for k in _SETTING):
                tuned = [_list(block.get(n)) or [None] for n in TUNED_FIELDS]
                points += [(lr, *t) for lr in _list(block.get("lr")) for t in product(*tuned)]
    if not points:
        return None
    unique = sorted(set(points), key=lambda p: (p[0], *(t or 0.0 for t in p[1:])))
    return {
        "runs": len(unique),
        "lrs": sorted({p[0] for p in unique}),
        "evaluations": len(unique) * steps,
    }


def _list(value: Any) -> list[Any]:
    return [] if value is None else list(value) if isinstance(value, list) else [value]


def _setting(config: Any, args: argparse.Namespace, splits: Any) -> dict[str, Any]:
    keys = ("dataset", "model", "width", "prior", "epochs", "batch_size", "seed", "max_train")
    return {
        **{k: getattr(config, k) for k in keys},
        "num_train": config.max_train or splits.num_train,
        "budget": args.budget,  # None: each sampler's default (its result's "budget")
        "score": args.score,
    }


def plot(samplers: dict[str, dict[str, Any]], target: Any) -> None:
    """Score against each searched option per sampler: a line per round, the chosen value
    marked, diverged candidates as crosses on the top edge."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    panels = [(name, option) for name, r in samplers.items() for option in r["searched"]]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3), squeeze=False)
    for ax, (name, option) in zip(axes[0], panels, strict=True):
        result = samplers[name]
        rounds = [r for r in result["rounds"] if r["name"] != "probe" and r["option"] == option]
        top = max((s for r in rounds for s in r["scores"] if s is not None), default=1.0)
        for i, r in enumerate(rounds):
            pairs = list(zip(r["values"], r["scores"], strict=True))
            fine = [(v, s) for v, s in pairs if s is not None and v > 0]
            label = f"{r['name']} {i}: {r['length']} steps"
            ax.plot([p[0] for p in fine], [p[1] for p in fine], "o-", ms=3, label=label)
            bad = [v for v, s in pairs if s is None and v > 0]
            ax.plot(bad, [top] * len(bad), "x", color="red")
            zero = [s for v, s in pairs if v == 0 and s is not None]  # G = I: a level
            if zero:
                ax.axhline(zero[0], color="grey", lw=0.8, ls=":", label=f"{option} = 0")
        chosen = result["options"][option]
        if chosen > 0:
            ax.axvline(chosen, color="black", lw=0.8, ls="--")
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # decades only: no overlapping labels
        symbol = "ℓ" if option == "lr" else option
        ax.set_title(f"{name}: {symbol} = {chosen:.3g}", fontsize=9)
        ax.set_xlabel(symbol)
        labels = {"ksd": "KSD", "train": "−training log p", "loss": "mean potential"}
        ax.set_ylabel(labels.get(result["score"], "−validation log p"))
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(target, format="png", dpi=110)
    plt.close(fig)
