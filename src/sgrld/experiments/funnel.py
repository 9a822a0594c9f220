"""``sgrld funnel``: the paper's funnel experiment (Figure 2), measured against the ground truth.

Reproduces ``sgmcmc/two_d.py`` of the reference code as it ran (reference §5): the funnel with
μ = 2, σ² = 80 and softplus(v) the variance of θ₁ (:class:`~sgrld.data.funnel.FunnelTarget`), the
clipped exact gradient plus N(0, 1) noise, start (1, 1), 2×10⁶ iterations with every iterate
kept, and the per-sampler settings of §5.3 (:data:`SETTINGS`), on **the library's samplers**
(``sgrld.build``; the update ascends log p with step η, i.e. ĝ = −∇log p, ``num_data = 1``,
``lr = η``; see ``docs/conventions.md``).

Where the paper only compares pictures, each sampler is scored against the exact v-marginal
N(0, 80): Wasserstein-1 and Kolmogorov–Smirnov distances of all iterates of v
(:mod:`sgrld.evaluation.distances`), the fraction of iterates with v < −5 (truth 0.288, the mass
of the neck) and the minimum v reached. ``--chains K`` runs K independent replicates in one
batched state and reports the mean and spread over chains; ``--start exact`` starts every chain
from an exact draw of the funnel instead of (1, 1), the stationarity check that separates "cannot
explore from (1, 1)" from "does not preserve the target".

Speed: the steps run through :class:`~sgrld.experiments._fastpath.BlockRunner` (the library's
metric code compiled ``--block`` steps at a time, noise pre-drawn per chunk), one process per
sampler (``--jobs``). Randomness: from ``--seed`` three seeds are derived — the sampler noise ξ,
the gradient noise and the exact start — and every sampler gets the same streams, as in the
reference, which re-seeds before each sampler.

Outputs in ``--out DIR`` (written to temporary files, renamed only when all are complete):
``funnel.json`` (settings, wall seconds, distances), ``funnel_samples.npz`` (per sampler
``(steps // 10, 2)`` array of (θ₁, v) at every 10th iterate of the first chain) and ``funnel.png``
(per sampler: log-density contours with 1,000 iterates, beside a histogram of v against the true
density; reference §5.4).

Exit status: 0 done, 2 bad input (refused before any work), 3 a chain produced a non-finite
iterate, 1 the outputs could not be written.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from sgrld.experiments._progress import Progress

__all__ = [
    "SETTINGS",
    "FunnelConfig",
    "SamplerRun",
    "SamplerSetting",
    "add_arguments",
    "run",
    "run_funnel",
    "run_sampler",
    "write_outputs",
]

OUTPUT_FILES = ("funnel.json", "funnel_samples.npz", "funnel.png")
V_THRESHOLD = -5.0  # the neck: P(v < −5) = 0.288 under N(0, 80)


@dataclass(frozen=True)
class SamplerSetting:
    """One sampler of the funnel experiment: registry metric, η (= ``lr``) and metric options."""

    metric: str
    lr: float
    options: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "lr": self.lr, "num_data": 1, **self.options}


#: Reference §5.3 (paper App. A.4), in the library's terms.
SETTINGS: dict[str, SamplerSetting] = {
    "identity": SamplerSetting("identity", 0.001),
    "rmsprop": SamplerSetting("rmsprop", 0.0025, {"decay": 0.995, "eps": 0.0}),
    # The funnel code's explosion fallback: if ‖G⁻¹ĝ‖ > 1000 use G = (‖ĝ‖/1000)·I this step.
    "monge": SamplerSetting(
        "monge", 0.003, {"alpha2": 0.1, "decay": 0.7, "fallback_threshold": 1000.0}
    ),
    # Full-matrix RMSprop on the 2-vector: H ← λH + (1−λ)ĝĝᵀ, H₀ = εI, G⁻¹ = H^{−1/2},
    # G^{−1/2} = H^{−1/4}, roots every step, no ridge.
    "shampoo": SamplerSetting(
        "shampoo",
        0.003,
        {
            "decay": 0.9995,
            "eps": 1e-6,
            "update_interval": 1,
            "precondition_vectors": True,
            "ridge": "none",
        },
    ),
}


@dataclass(frozen=True)
class FunnelConfig:
    """What to run (defaults: the paper's run).

    Attributes:
        steps: iterations per chain (2×10⁶).
        seed: master seed of the three noise streams.
        chains: independent chains K per sampler, run batched.
        start: ``"reference"`` (every chain at (1, 1)) or ``"exact"`` (exact funnel draws).
        block: steps per compiled call.
        compile: use the compiled fast path (``False``: the same code, eagerly).
        thin: keep every ``thin``-th iterate of the first chain for ``funnel_samples.npz``.
        scatter: iterates of the first chain drawn for the figure's scatter.
    """

    steps: int = 2_000_000
    seed: int = 1
    chains: int = 1
    start: Literal["reference", "exact"] = "reference"
    block: int = 10
    compile: bool = True
    thin: int = 10
    scatter: int = 1000


@dataclass
class SamplerRun:
    """What one sampler's run leaves behind (small: the full chains stay in the worker)."""

    name: str
    settings: dict[str, Any]
    wall_seconds: float
    compile_seconds: float
    distances: dict[str, list[float]]  # per chain
    thinned: np.ndarray  # (steps // thin, 2), first chain
    scatter: np.ndarray  # (≤ scatter, 2), first chain
    hist_density: np.ndarray  # 30-bin density histogram of v, first chain
    hist_edges: np.ndarray
    pooled: dict[str, float] | None = None  # all iterates of all chains (K > 1)


def derive_seeds(seed: int) -> dict[str, int]:
    """The three streams of a run: sampler noise ξ, gradient noise, exact start."""
    rng = np.random.default_rng(seed)
    xi, grad, start = (int(s) for s in rng.integers(0, 2**62, size=3))
    return {"sampler_noise": xi, "gradient_noise": grad, "start": start}


def v_distances(v: np.ndarray, variance: float) -> dict[str, float]:
    """Distances of v-iterates to the exact marginal N(0, ``variance``) (spec §5.1).

    Args:
        v: the iterates of v (any shape; flattened).
        variance: σ² of the exact v-marginal (80).

    Returns:
        ``wasserstein1`` and ``ks`` (exact formulas, :mod:`sgrld.evaluation.distances`), the
        fraction of iterates below −5 (truth 0.288) and the minimum v.
    """
    from sgrld.evaluation.distances import ks_normal, wasserstein1_normal

    std = math.sqrt(variance)
    return {
        "wasserstein1": wasserstein1_normal(v, 0.0, std),
        "ks": ks_normal(v, 0.0, std),
        "frac_v_below_minus5": float(np.mean(v < V_THRESHOLD)),
        "min_v": float(np.min(v)),
    }


def run_sampler(
    name: str, config: FunnelConfig, progress: Callable[[int], None] | None = None
) -> SamplerRun:
    """Run one sampler of :data:`SETTINGS` on the funnel (spec §5.2-5.3).

    Args:
        name: a key of :data:`SETTINGS`.
        config: steps, chains, seed, start and fast-path options.
        progress: called with the number of steps just taken, after each chunk.

    Returns:
        The distances of every chain, the thinned first chain, the figure's scatter and
        histogram, and the wall and compile seconds of the sampling.
    """
    import torch

    import sgrld
    from sgrld.data.funnel import FunnelTarget
    from sgrld.experiments._fastpath import BlockRunner

    torch.set_num_threads(1)  # (K, 2) tensors: threads only add overhead
    setting = SETTINGS[name]
    seeds = derive_seeds(config.seed)
    target = FunnelTarget()
    k, steps = config.chains, config.steps
    if config.start == "exact":
        start = target.sample(k, generator=torch.Generator().manual_seed(seeds["start"]))
    else:
        start = torch.ones(k, 2, dtype=torch.float64)
    sampler = sgrld.build(setting.metric, lr=setting.lr, num_data=1.0, **setting.options)
    state = sampler.init(
        {"theta": start.clone()},
        num_chains=k,
        generator=torch.Generator().manual_seed(seeds["sampler_noise"]),
    )
    runner = BlockRunner(
        sampler,
        state,
        target.potential_grad,
        grad_generator=torch.Generator().manual_seed(seeds["gradient_noise"]),
        block=config.block,
        compile=config.compile,
    )
    v_all = np.empty((steps, k))
    thinned = np.empty((steps // config.thin, 2))
    picks = np.sort(
        np.random.default_rng(config.seed).choice(steps, min(config.scatter, steps), replace=False)
    )
    scatter = np.empty((picks.size, 2))

    def keep(first: int, iterates: torch.Tensor) -> None:
        it = iterates.numpy()
        count = it.shape[0]
        v_all[first : first + count] = it[:, :, 1]
        j0 = (config.thin - 1 - first % config.thin) % config.thin  # iterate first+j+1 ≡ 0
        rows = it[j0 :: config.thin, 0]
        r0 = (first + j0 + 1) // config.thin - 1
        thinned[r0 : r0 + rows.shape[0]] = rows
        lo, hi = np.searchsorted(picks, [first, first + count])
        scatter[lo:hi] = it[picks[lo:hi] - first, 0]
        if progress is not None:
            progress(count)

    t0 = time.perf_counter()
    runner.run(steps, keep)
    wall = time.perf_counter() - t0
    per_chain = [v_distances(v_all[:, c], target.v_variance) for c in range(k)]
    # Pooled over chains: from exact starts, a sampler that preserves the target keeps the
    # pooled law at N(0, 80) at every step, however slowly each chain mixes.
    pooled = v_distances(v_all.reshape(-1), target.v_variance) if k > 1 else None
    density, edges = np.histogram(v_all[:, 0], bins=30, density=True)
    return SamplerRun(
        name=name,
        settings=setting.as_dict(),
        wall_seconds=wall,
        compile_seconds=runner.compile_seconds,
        distances={key: [d[key] for d in per_chain] for key in per_chain[0]},
        thinned=thinned,
        scatter=scatter,
        hist_density=density,
        hist_edges=edges,
        pooled=pooled,
    )


# ---------------------------------------------------------------------- several samplers

_COUNTERS: Any = None  # per-worker progress counters (a shared array), set by _init_worker


def _init_worker(counters: Any) -> None:
    global _COUNTERS
    _COUNTERS = counters
    import torch._inductor.config

    # Compile in this process: a pool of compile workers per sampler process only competes
    # for the same cores (and takes seconds to start).
    torch._inductor.config.compile_threads = 1


def _worker(index: int, name: str, config: FunnelConfig) -> SamplerRun:
    def report(n: int) -> None:
        _COUNTERS[index] += n  # only this worker writes this slot

    return run_sampler(name, config, report)


def run_funnel(
    names: Sequence[str], config: FunnelConfig, *, jobs: int = 1, progress: bool | None = None
) -> dict[str, SamplerRun]:
    """Run the samplers ``names``; with ``jobs > 1`` in that many worker processes.

    Args:
        names: keys of :data:`SETTINGS`, in the order of the results.
        config: what to run (shared by all samplers, so they share the noise streams).
        jobs: worker processes (spawned; each runs whole samplers, the longest first).
        progress: a bar over all steps on stderr; ``None`` draws it only on a terminal.

    Returns:
        ``{name: SamplerRun}`` in the order of ``names``.
    """
    total = len(names) * config.steps
    results: dict[str, SamplerRun] = {}
    with Progress(total, "funnel", enabled=progress) as bar:
        if jobs <= 1 or len(names) == 1:
            for name in names:
                results[name] = run_sampler(name, config, bar.update)
            return results
        ctx = mp.get_context("spawn")
        counters = ctx.Array("q", len(names), lock=False)
        # Longest first (Shampoo's root every step, then Monge) to balance the workers.
        order = sorted(range(len(names)), key=lambda i: -_COST.get(names[i], 1.0))
        with ProcessPoolExecutor(
            max_workers=jobs, mp_context=ctx, initializer=_init_worker, initargs=(counters,)
        ) as pool:
            futures: dict[str, Future[SamplerRun]] = {
                names[i]: pool.submit(_worker, i, names[i], config) for i in order
            }
            seen = 0
            while not all(f.done() for f in futures.values()):
                time.sleep(0.2)
                now = sum(counters)
                bar.update(now - seen)
                seen = now
            bar.update(total - seen)
            for name in names:
                results[name] = futures[name].result()
    return results


_COST = {"shampoo": 4.0, "monge": 2.0, "rmsprop": 1.2, "identity": 1.0}


# ---------------------------------------------------------------------- outputs


def summary(runs: dict[str, SamplerRun]) -> dict[str, Any]:
    """Per sampler: mean, spread (population std) and per-chain values of every distance."""
    out: dict[str, Any] = {}
    for name, r in runs.items():
        dist = {}
        for key, values in r.distances.items():
            arr = np.asarray(values)
            dist[key] = {
                "mean": float(arr.mean()),
                "std": float(arr.std()),
                "min": float(arr.min()),
                "max": float(arr.max()),
                "per_chain": [float(x) for x in arr],
            }
        out[name] = {
            "settings": r.settings,
            "wall_seconds": r.wall_seconds,
            "compile_seconds": r.compile_seconds,
            "distances": dist,
            "pooled_distances": r.pooled,
        }
    return out


def results_json(runs: dict[str, SamplerRun], config: FunnelConfig) -> dict[str, Any]:
    """The content of ``funnel.json``."""
    import torch

    from sgrld.data.funnel import FunnelTarget

    target = FunnelTarget()
    return {
        "experiment": "funnel",
        "reference": "spec §5 (sgmcmc/two_d.py, paper Figure 2)",
        "target": {
            "mean": target.mean,
            "v_variance": target.v_variance,
            "gradient_noise_std": 1.0,
            "clip_norm": target.clip_norm,
            "truth": {
                "v_marginal": f"N(0, {target.v_variance:g})",
                "frac_v_below_minus5": target.prob_v_below(V_THRESHOLD),
            },
        },
        "config": asdict(config),
        "seeds": derive_seeds(config.seed),
        "distances_of": "all iterates of v of each chain, against N(0, 80)",
        "pooled_distances_of": "all iterates of v of all chains together (null for one chain)",
        "spread": "std is the population std (ddof = 0) over chains",
        "torch": torch.__version__,
        "samplers": summary(runs),
    }


def plot_funnel(runs: dict[str, SamplerRun], path: Path | str) -> None:
    """The paper's Figure 2 (reference §5.4), one panel pair per sampler, saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    from sgrld.data.funnel import FunnelTarget

    target = FunnelTarget()
    x0 = np.arange(-5.0, 9.0, 0.1)
    x1 = np.arange(-25.0, 25.0, 0.1)
    grid = torch.from_numpy(np.stack(np.meshgrid(x0, x1), axis=-1))
    logp = target.log_prob(grid).numpy()
    true_density = target.v_pdf(torch.from_numpy(x1)).numpy()

    n = len(runs)
    cols = 2 if n > 1 else 1
    rows = math.ceil(n / cols)
    fig = plt.figure(figsize=(9 * cols, 6 * rows))
    subfigs: Any = fig.subfigures(rows, cols, squeeze=False).ravel()
    for sub in subfigs[n:]:
        sub.set_visible(False)
    for sub, (name, r) in zip(subfigs, runs.items(), strict=False):
        ax, axh = sub.subplots(1, 2, gridspec_kw={"width_ratios": [2, 1], "wspace": 0.1})
        ax.contour(x0, x1, logp, [-10.0, -7.5, -5.0, -2.5])
        ax.scatter(r.scatter[:, 0], r.scatter[:, 1], alpha=0.15, s=20, marker="o", zorder=2)
        ax.set_xlim(-5.0, 9.0)
        ax.set_ylim(-25.0, 25.0)
        ax.set_xlabel("θ₁")
        ax.set_ylabel("v")
        widths = np.diff(r.hist_edges)
        axh.barh(
            r.hist_edges[:-1],
            r.hist_density,
            height=widths,
            align="edge",
            color="tab:orange",
            label="Estimate",
        )
        axh.plot(true_density, x1, label="True")
        axh.set_ylim(-25.0, 25.0)
        axh.set_yticklabels([])
        axh.legend(loc="lower right", fontsize=10)
        w1, ks = np.mean(r.distances["wasserstein1"]), np.mean(r.distances["ks"])
        min_v = min(r.distances["min_v"])
        sub.suptitle(f"{name}: W₁ = {w1:.2f}, KS = {ks:.3f}, min v = {min_v:.1f}")
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_outputs(
    runs: dict[str, SamplerRun], config: FunnelConfig, out_dir: Path, *, plot: bool = True
) -> list[Path]:
    """Write ``funnel.json``, ``funnel_samples.npz`` and (``plot``) ``funnel.png`` atomically.

    Everything is first written to temporary files in ``out_dir``; they are renamed to their
    final names only once all of them are complete, so a failure leaves no partial result.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    targets = [out_dir / f for f in OUTPUT_FILES[: 3 if plot else 2]]
    temps: list[Path] = []
    try:
        for final in targets:
            fd, name = tempfile.mkstemp(prefix=f".{final.stem}-", suffix=final.suffix, dir=out_dir)
            os.close(fd)
            temps.append(Path(name))
        text = json.dumps(results_json(runs, config), indent=2, allow_nan=False)
        temps[0].write_text(text + "\n")
        savez: Any = np.savez_compressed  # (numpy's stubs reject **arrays)
        with open(temps[1], "wb") as f:
            savez(f, **{name: r.thinned for name, r in runs.items()})
        if plot:
            plot_funnel(runs, temps[2])
        mode = _file_mode()
        for tmp, final in zip(temps, targets, strict=True):
            os.chmod(tmp, mode)  # mkstemp makes 0600 files
            os.replace(tmp, final)
    finally:
        for tmp in temps:
            tmp.unlink(missing_ok=True)
    return targets


def _file_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def print_table(runs: dict[str, SamplerRun], file: Any = None) -> None:
    """One line per sampler: mean (± spread over chains) of each distance, and seconds."""
    from sgrld.data.funnel import FunnelTarget

    out = file if file is not None else sys.stdout
    truth = FunnelTarget().prob_v_below(V_THRESHOLD)
    print(
        f"{'sampler':<10}{'W1(v)':>14}{'KS(v)':>16}{'P(v<-5)':>16}{'min v':>10}{'seconds':>10}",
        file=out,
    )
    for name, r in runs.items():
        cells = []
        for key, fmt in (("wasserstein1", ".3f"), ("ks", ".4f"), ("frac_v_below_minus5", ".4f")):
            arr = np.asarray(r.distances[key])
            cell = f"{arr.mean():{fmt}}" + (f"±{arr.std():{fmt}}" if arr.size > 1 else "")
            cells.append(cell)
        min_v = float(np.min(r.distances["min_v"]))
        print(
            f"{name:<10}{cells[0]:>14}{cells[1]:>16}{cells[2]:>16}{min_v:>10.2f}"
            f"{r.wall_seconds:>10.1f}",
            file=out,
        )
    print(f"{'truth':<10}{0.0:>14.3f}{0.0:>16.4f}{truth:>16.4f}{'-inf':>10}", file=out)
    pooled = {name: r.pooled for name, r in runs.items() if r.pooled is not None}
    if pooled:
        print("pooled over chains:", file=out)
        for name, d in pooled.items():
            print(
                f"{name:<10}{d['wasserstein1']:>14.3f}{d['ks']:>16.4f}"
                f"{d['frac_v_below_minus5']:>16.4f}{d['min_v']:>10.2f}",
                file=out,
            )


# ---------------------------------------------------------------------- command line


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
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise ValueError("--samplers is empty")
    unknown = [s for s in names if s not in SETTINGS]
    if unknown:
        raise ValueError(
            f"unknown sampler(s) {', '.join(map(repr, unknown))}; choose from {', '.join(SETTINGS)}"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"repeated sampler in --samplers {text!r}")
    return names


def add_arguments(
    parser: argparse.ArgumentParser,
    *,
    default_steps: int = 2_000_000,
    default_out: str | None = None,
) -> None:
    """The ``sgrld funnel`` options (``demo`` reuses them with other defaults)."""
    parser.epilog = (
        "Exit status: 0 done, 2 bad input (refused before any work), 3 non-finite iterate, "
        "1 outputs could not be written."
    )
    if default_out is None:
        parser.add_argument("--out", required=True, type=Path, help="output directory")
    else:
        parser.add_argument(
            "--out",
            default=Path(default_out),
            type=Path,
            help=f"output directory (default {default_out})",
        )
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
        help="comma-separated subset of " + ",".join(SETTINGS),
    )
    parser.add_argument(
        "--chains",
        type=_positive_int,
        default=1,
        help="independent chains per sampler, run batched (default 1)",
    )
    parser.add_argument(
        "--start",
        choices=("reference", "exact"),
        default="reference",
        help="(1, 1) as the paper, or exact funnel draws (stationarity check)",
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
        "--no-compile",
        action="store_true",
        help="run the same step code eagerly (slow; no C++ compiler needed)",
    )
    parser.add_argument("--no-plot", action="store_true", help="skip funnel.png")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    exact = parser.add_argument_group("exact metric (sgrld.experiments.funnel_exact)")
    exact.add_argument(
        "--exact-metric",
        action="store_true",
        help="exact gradients for --samplers, plus Monge with m = ∇u(θ) (monge-current)",
    )
    exact.add_argument("--correction", action="store_true", help="add Γ to monge-current")
    exact.add_argument("--alpha2", type=float, help="both Monge metrics' α² or c (0.1)")
    exact.add_argument("--alpha2-rule", choices=("fixed", "normalized"), default="fixed")


def _check_out_dir(path: Path) -> None:
    """Create ``path`` if needed and prove it is writable, before any work."""
    path.mkdir(parents=True, exist_ok=True)
    if not path.is_dir():
        raise OSError(f"{path} is not a directory")
    fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=path)
    os.close(fd)
    os.unlink(probe)


def prepare(args: argparse.Namespace, command: str) -> tuple[list[str], FunnelConfig] | int:
    """Validate everything before running; return the plan or an exit status."""
    try:
        names = parse_samplers(args.samplers)
    except ValueError as exc:
        print(f"sgrld {command}: error: {exc}", file=sys.stderr)
        return 2
    if not args.no_plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(
                f"sgrld {command}: error: funnel.png needs matplotlib "
                "(pip install 'sgrld[plots]'), or pass --no-plot",
                file=sys.stderr,
            )
            return 2
    try:
        _check_out_dir(args.out)
    except OSError as exc:
        print(
            f"sgrld {command}: error: cannot write to --out {str(args.out)!r}: {exc}",
            file=sys.stderr,
        )
        return 2
    exact = (args.correction, args.alpha2 is not None, args.alpha2_rule != "fixed")
    if any(exact) and not args.exact_metric:
        print(
            f"sgrld {command}: error: --correction, --alpha2 and --alpha2-rule need --exact-metric",
            file=sys.stderr,
        )
        return 2
    config = FunnelConfig(
        steps=args.steps,
        seed=args.seed,
        chains=args.chains,
        start=args.start,
        block=args.block,
        compile=not args.no_compile,
    )
    return names, config


def execute(args: argparse.Namespace, command: str) -> int:
    """Run, print the table, write the outputs (shared by ``funnel`` and ``demo``)."""
    from sgrld.core.sampler import NonFiniteGradientError

    plan = prepare(args, command)
    if isinstance(plan, int):
        return plan
    names, config = plan
    print(
        f"funnel (μ = 2, σ² = 80): {', '.join(names)}; {config.steps} steps x "
        f"{config.chains} chain(s), start {config.start}, seed {config.seed}",
        flush=True,
    )
    try:
        if args.exact_metric:
            runs = _run_exact(names, config, args)
        else:
            runs = run_funnel(
                names, config, jobs=args.jobs, progress=False if args.no_progress else None
            )
    except NonFiniteGradientError as exc:
        print(f"sgrld {command}: error: {exc}; no outputs written", file=sys.stderr)
        return 3
    print_table(runs)
    try:
        written = write_outputs(runs, config, args.out, plot=not args.no_plot)
    except OSError as exc:
        print(f"sgrld {command}: error: writing outputs failed: {exc}", file=sys.stderr)
        return 1
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def _run_exact(names: list[str], config: FunnelConfig, args: argparse.Namespace) -> Any:
    from sgrld.experiments.funnel_exact import run_exact_funnel, total_steps

    bar = Progress(
        total_steps(names, config), "funnel", enabled=False if args.no_progress else None
    )
    with bar:
        return run_exact_funnel(
            names,
            config,
            correction=args.correction,
            alpha2=args.alpha2,
            alpha2_rule=args.alpha2_rule,
            progress=bar.update,
        )


def run(args: argparse.Namespace) -> int:
    """Entry point of ``sgrld funnel``."""
    return execute(args, "funnel")
