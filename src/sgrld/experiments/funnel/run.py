"""The paper's funnel experiment (Figure 2) on the library's samplers, scored against the exact
v-marginal N(0, 80); protocol, outputs and faults: ``docs/funnel.md``.
"""

from __future__ import annotations

import io
import json
import math
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from sgrld.experiments.base.files import (
    OutputError,
    read_file,
    sha256_hex,
    write_atomic,
)
from sgrld.experiments.base.process import die_with_parent
from sgrld.experiments.base.progress import Progress
from sgrld.experiments.funnel.figure import plot_funnel
from sgrld.experiments.funnel.verdict import V_THRESHOLD, mean_and_error

__all__ = [
    "SETTINGS",
    "FunnelConfig",
    "SamplerRun",
    "SamplerSetting",
    "read_outputs",
    "run_funnel",
    "run_sampler",
    "sample_quality",
    "write_outputs",
]

OUTPUT_FILES = ("funnel.json", "funnel_samples.npz", "funnel.png")
WENZEL_NOTE = (
    "wenzel is not run on the funnel: its metric is one scale per parameter tensor, divided by "
    "the smallest, and the funnel's θ is one tensor, so Wenzel is Identity here step for step"
)
#: Registered samplers the funnel does not run, with the reason.
NOT_RUN = {"wenzel": WENZEL_NOTE}


@dataclass(frozen=True)
class SamplerSetting:
    """One sampler of the funnel experiment: registry metric, η (= ``lr``) and metric options."""

    metric: str
    lr: float
    options: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "lr": self.lr, "num_data": 1, **self.options}


#: The paper's App. A.4, in the library's terms.
SETTINGS: dict[str, SamplerSetting] = {
    "identity": SamplerSetting("identity", 0.001),
    "rmsprop": SamplerSetting("rmsprop", 0.0025, {"decay": 0.995, "eps": 0.0, "floor": 0.0}),
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
        scatter: iterates drawn for the figure's scatter, spread over every chain.
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
    scatter: np.ndarray  # (≤ scatter, 2), from every chain
    hist_density: np.ndarray  # 30-bin density histogram of v, every chain pooled
    hist_edges: np.ndarray
    pooled: dict[str, float] | None = None  # all iterates of all chains (K > 1)


def derive_seeds(seed: int) -> dict[str, int]:
    """The three streams of a run: sampler noise ξ, gradient noise, exact start."""
    rng = np.random.default_rng(seed)
    xi, grad, start = (int(s) for s in rng.integers(0, 2**62, size=3))
    return {"sampler_noise": xi, "gradient_noise": grad, "start": start}


def v_distances(v: np.ndarray, variance: float) -> dict[str, float]:
    """``wasserstein1`` and ``ks`` of the iterates ``v`` (any shape) to N(0, ``variance``), the
    fraction below −5 (truth 0.288) and the minimum v."""
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
    """Run one sampler of :data:`SETTINGS` on the funnel.

    Args:
        name: a key of :data:`SETTINGS`.
        config: steps, chains, seed, start and fast-path options.
        progress: called with the number of steps just taken, after each chunk.

    Returns:
        The distances of every chain, the thinned first chain, the figure's scatter and
        histogram, and the wall and compile seconds of the sampling.
    """
    import torch

    torch.set_num_threads(1)  # (K, 2) tensors: threads only add overhead
    return run_blocks(name, config, SETTINGS[name], progress)


def start_points(config: FunnelConfig) -> Any:
    """The chains' start: every chain at (1, 1), or exact funnel draws (``start="exact"``)."""
    import torch

    from sgrld.data.funnel import FunnelTarget

    if config.start == "exact":
        gen = torch.Generator().manual_seed(derive_seeds(config.seed)["start"])
        return FunnelTarget().sample(config.chains, generator=gen)
    return torch.ones(config.chains, 2, dtype=torch.float64)


def run_blocks(
    name: str,
    config: FunnelConfig,
    setting: SamplerSetting,
    progress: Callable[[int], None] | None,
    *,
    exact: bool = False,
) -> SamplerRun:
    """``setting``'s sampler through the block runner on ĝ = −(∇log p + noise), or (``exact``)
    on ĝ = −∇log p with the scatter and histogram of the first chain only."""
    import torch

    import sgrld
    from sgrld.core.multistep import BlockRunner
    from sgrld.data.funnel import FunnelTarget

    target, seeds = FunnelTarget(), derive_seeds(config.seed)
    noise_std = 0.0 if exact else 1.0
    settings = setting.as_dict() | ({"gradient_noise_std": 0.0} if exact else {})
    keeper = Keeper(config, progress, every_chain=not exact)
    # the paper's fixed α² and Shampoo without a floor, whatever the library's defaults (not
    # recorded: the settings as before)
    paper: dict[str, dict[str, Any]] = {"monge": {"alpha2_rule": "fixed"}, "shampoo": {"floor": 0}}
    rule = paper.get(setting.metric, {})
    sampler = sgrld.build(
        setting.metric, lr=setting.lr, num_data=1.0, adapt_until=None, **(rule | setting.options)
    )
    state = sampler.init(
        {"theta": start_points(config)},
        num_chains=config.chains,
        generator=torch.Generator().manual_seed(seeds["sampler_noise"]),
    )
    runner = BlockRunner(
        sampler,
        state,
        lambda x, noise: target.potential_grad(x, noise, noise_std),
        grad_generator=torch.Generator().manual_seed(seeds["gradient_noise"]),
        block=config.block,
        compile=config.compile,
    )
    t0 = time.perf_counter()
    runner.run(config.steps, keeper)
    return keeper.result(name, settings, time.perf_counter() - t0, runner.compile_seconds)


class Keeper:
    """Collects what a :class:`SamplerRun` keeps of the iterates: v of every iterate, the
    thinned first chain, the scatter and the histogram (of every chain, or of the first)."""

    def __init__(
        self, config: FunnelConfig, progress: Callable[[int], None] | None, every_chain: bool
    ) -> None:
        steps, self.config, self.progress = config.steps, config, progress
        self.every_chain = every_chain
        self.v_all = np.empty((steps, config.chains))
        self.thinned = np.empty((steps // config.thin, 2))
        rng = np.random.default_rng(config.seed)
        # The scatter's iterates: distinct steps, chain = step mod K (or the first chain).
        self.picks = np.sort(rng.choice(steps, min(config.scatter, steps), replace=False))
        self.scatter = np.empty((self.picks.size, 2))

    def __call__(self, first: int, iterates: Any) -> None:
        it, thin = iterates.numpy(), self.config.thin
        count = it.shape[0]
        self.v_all[first : first + count] = it[:, :, 1]
        j0 = (thin - 1 - first % thin) % thin  # iterate first + j0 + 1 is a multiple of thin
        rows = it[j0::thin, 0]
        r0 = (first + j0 + 1) // thin - 1
        self.thinned[r0 : r0 + rows.shape[0]] = rows
        lo, hi = np.searchsorted(self.picks, [first, first + count])
        picks = self.picks[lo:hi]
        chains = picks % self.config.chains if self.every_chain else 0
        self.scatter[lo:hi] = it[picks - first, chains]
        if self.progress is not None:
            self.progress(count)

    def result(
        self, name: str, settings: dict[str, Any], wall: float, compile_s: float
    ) -> SamplerRun:
        from sgrld.data.funnel import FunnelTarget

        variance, k = FunnelTarget().v_variance, self.config.chains
        per_chain = [v_distances(self.v_all[:, c], variance) for c in range(k)]
        # Pooled over chains: from exact starts, a sampler that preserves the target keeps the
        # pooled law at N(0, 80) at every step, however slowly each chain mixes.
        pooled = v_distances(self.v_all.reshape(-1), variance) if k > 1 else None
        v = self.v_all if self.every_chain else self.v_all[:, 0]
        density, edges = np.histogram(v, bins=30, density=True)
        return SamplerRun(
            name=name,
            settings=settings,
            wall_seconds=wall,
            compile_seconds=compile_s,
            distances={key: [d[key] for d in per_chain] for key in per_chain[0]},
            thinned=self.thinned,
            scatter=self.scatter,
            hist_density=density,
            hist_edges=edges,
            pooled=pooled,
        )


_COUNTERS: Any = None  # per-worker progress counters (a shared array), set by _init_worker


def _init_worker(counters: Any, parent: int) -> None:
    global _COUNTERS
    _COUNTERS = counters
    die_with_parent(parent)
    import torch._inductor.config

    # Compile in this process: a pool of compile workers per sampler process only competes
    # for the same cores (and takes seconds to start).
    torch._inductor.config.compile_threads = 1


def _stop_workers(others: set[Any]) -> None:
    """Terminate, then kill, the pool's workers: this process's children but ``others``."""
    children = [child for child in mp.active_children() if child not in others]
    for child in children:
        child.terminate()
    for child in children:
        child.join(timeout=2.0)
        if child.is_alive():
            child.kill()
            child.join()


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
    with Progress(total, "funnel", enabled=progress) as bar:
        if jobs <= 1 or len(names) == 1:
            return {name: run_sampler(name, config, bar.update) for name in names}
        ctx = mp.get_context("spawn")
        counters = ctx.Array("q", len(names), lock=False)
        # Longest first (Shampoo's root every step, then Monge) to balance the workers.
        order = sorted(range(len(names)), key=lambda i: -_COST.get(names[i], 1.0))
        others = set(mp.active_children())  # not ours to stop
        pool = ProcessPoolExecutor(
            max_workers=jobs,
            mp_context=ctx,
            initializer=_init_worker,
            initargs=(counters, os.getpid()),
        )
        try:
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
            results = {name: futures[name].result() for name in names}
        except BaseException:
            # Ctrl-C, SIGTERM (sigterm_raises) or a failed sampler: do not wait for the others
            # to finish their samplers; end them now.
            _stop_workers(others)
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        pool.shutdown(wait=True)
    return results


_COST = {"shampoo": 4.0, "monge": 2.0, "rmsprop": 1.2, "identity": 1.0}


KSD_POINTS = 2000  # evenly spaced thinned iterates of the first chain (the KSD is O(m²))


def sample_quality(r: SamplerRun) -> dict[str, float | None]:
    """KSD of the first chain's v, its bulk/tail ESS (ArviZ; ``None`` without it), and ESS per
    second of sampling (compile time excluded).

    The KSD is of v/σ against N(0, 1), v's exact marginal: the joint score reaches ~1e11 in the
    neck and would rank exact draws below ones that miss it (``tests/test_stein.py``).
    """
    from sgrld.data.funnel import FunnelTarget
    from sgrld.evaluation.stein import kernel_stein_discrepancy

    v = r.thinned[:, 1]
    run_seconds = r.wall_seconds - r.compile_seconds
    out: dict[str, float | None] = {"run_seconds": run_seconds, "ksd_v": None}
    out |= {"ess_bulk_v": None, "ess_tail_v": None, "ess_bulk_per_second": None}
    if not v.size:
        return out
    u = v[np.linspace(0, v.size - 1, min(KSD_POINTS, v.size)).astype(int), None]
    u = u / FunnelTarget().v_std
    out["ksd_v"] = kernel_stein_discrepancy(u, -u)
    try:
        from sgrld.evaluation.diagnostics import summarize

        stats = summarize({"v": v[None, :]})["v"]
    except ImportError:
        return out
    for key in ("ess_bulk", "ess_tail"):  # NaN (too few draws) is written as null
        out[f"{key}_v"] = stats[key] if math.isfinite(stats[key]) else None
    bulk = out["ess_bulk_v"]
    if run_seconds > 0 and bulk is not None:
        out["ess_bulk_per_second"] = bulk / run_seconds
    return out


def summary(runs: dict[str, SamplerRun]) -> dict[str, Any]:
    """Per sampler: every distance (mean, spread, per chain), KSD, ESS and ESS per second."""
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
            **sample_quality(r),
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
        "reference": "the paper's Figure 2 (its code: sgmcmc/two_d.py)",
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
        "ksd_v_of": (
            f"v/σ against N(0, 1), IMQ kernel (c = 1, β = -1/2), at most {KSD_POINTS} evenly "
            "spaced thinned iterates of the first chain"
        ),
        "ess_of": "thinned iterates of v of the first chain (ArviZ bulk and tail ESS; null "
        "without sgrld[diagnostics]); per second of sampling, compile time excluded",
        "spread": "std is the population std (ddof = 0) over chains",
        "torch": torch.__version__,
        "samplers": summary(runs),
    }


def write_outputs(
    runs: dict[str, SamplerRun], config: FunnelConfig, out_dir: Path, *, plot: bool = True
) -> list[Path]:
    """Write ``funnel_samples.npz``, (``plot``) ``funnel.png``, then ``funnel.json``, as one unit:
    rendered in memory first, the old ``funnel.json`` removed first and the new one, listing the
    others' SHA-256 (:func:`read_outputs`), written last.

    Raises:
        OutputError: a file could not be written (the message names it).
    """
    buffer = io.BytesIO()
    savez: Any = np.savez_compressed  # (numpy's stubs reject **arrays)
    savez(buffer, **{name: r.thinned for name, r in runs.items()})
    files = {"funnel_samples.npz": buffer.getvalue()}
    if plot:
        buffer = io.BytesIO()
        start = "exact draws" if config.start == "exact" else "(1, 1)"
        chains = f"{config.chains} chain{'s' * (config.chains != 1)}"
        title = f"The funnel: {chains} × {config.steps:,} steps from {start}"
        plot_funnel(runs, buffer, title=title)
        files["funnel.png"] = buffer.getvalue()
    record = results_json(runs, config)
    record["files"] = {name: sha256_hex(data) for name, data in files.items()}
    text = json.dumps(record, indent=2, allow_nan=False) + "\n"
    for name in OUTPUT_FILES:  # funnel.json first: from here on the old set is gone
        try:
            (out_dir / name).unlink(missing_ok=True)
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise OutputError(exc.errno, f"cannot replace {out_dir / name}: {reason}") from exc
    for name, data in files.items():
        write_atomic(out_dir / name, data)
    write_atomic(out_dir / OUTPUT_FILES[0], text)
    return [out_dir / name for name in (*files, OUTPUT_FILES[0])]


def read_outputs(out_dir: Path | str) -> dict[str, Any]:
    """``funnel.json`` of ``out_dir``, after checking that every file it lists is the one written.

    Raises:
        ValueError: no ``funnel.json`` (an incomplete or interrupted run), or a listed file is
            missing or is not the one written with it (the message names it).
    """
    out_dir = Path(out_dir)
    record_path = out_dir / OUTPUT_FILES[0]
    if not record_path.is_file():
        raise ValueError(f"{out_dir} holds no complete funnel run (no {OUTPUT_FILES[0]})")
    try:  # never through a link or from a special file planted at a name
        record: dict[str, Any] = json.loads(read_file(record_path))
        for name, digest in record.get("files", {}).items():
            path = out_dir / name
            if not path.is_file():
                raise ValueError(f"{path} is missing ({record_path} lists it)")
            if sha256_hex(read_file(path, limit=None)) != digest:
                raise ValueError(f"{path} is not the file written with {record_path} (SHA-256)")
    except OSError as exc:
        raise ValueError(f"cannot read {exc.filename or out_dir}: {exc.strerror}") from None
    return record


#: What the table's columns mean, printed under it.
LEGEND = """\
How to read it (v is the funnel's log-scale coordinate; its exact law is N(0, 80)):
  W1(v), KS(v)  Wasserstein-1 and Kolmogorov-Smirnov distance of the iterates of v to N(0, 80):
                lower is better, 0 is exact (mean ± 2 standard errors over chains)
  P(v<-5)       fraction of iterates in the funnel's narrow neck: closer to the truth
                ({truth:.3f}) is better; below it, the sampler misses the neck
  min v         the deepest point of the neck reached (lower = explored further)
  KSD(v)        kernel Stein discrepancy of v against N(0, 80): lower is better
  ESS/s         effective sample size of v (ArviZ bulk ESS) per second of sampling: higher is
                better ("-" without sgrld[diagnostics])
  run s         seconds sampling; compile s: seconds in torch.compile (0 when run eagerly)"""


def print_table(runs: dict[str, SamplerRun], file: Any = None, *, legend: bool = True) -> None:
    """One line per sampler: mean (± 2 standard errors over chains) of each distance, and
    seconds; then (``legend``) :data:`LEGEND`."""
    from sgrld.data.funnel import FunnelTarget

    out = file if file is not None else sys.stdout
    truth = FunnelTarget().prob_v_below(V_THRESHOLD)
    print(
        f"{'sampler':<10}{'W1(v)':>14}{'KS(v)':>16}{'P(v<-5)':>16}{'min v':>10}"
        f"{'KSD(v)':>9}{'ESS/s':>9}{'run s':>10}{'compile s':>11}",
        file=out,
    )
    for name, r in runs.items():
        cells = []
        for key, fmt in (("wasserstein1", ".3f"), ("ks", ".4f"), ("frac_v_below_minus5", ".4f")):
            mean, error = mean_and_error(r.distances[key])  # the verdicts' ±: 2 s.e.
            cell = f"{mean:{fmt}}" + ("" if math.isnan(error) else f"±{error:{fmt}}")
            cells.append(cell)
        min_v = float(np.min(r.distances["min_v"]))
        quality = sample_quality(r)
        ksd, rate = quality["ksd_v"], quality["ess_bulk_per_second"]
        print(
            f"{name:<10}{cells[0]:>14}{cells[1]:>16}{cells[2]:>16}{min_v:>10.2f}"
            f"{'-' if ksd is None else f'{ksd:.4f}':>9}{'-' if rate is None else f'{rate:.1f}':>9}"
            f"{r.wall_seconds - r.compile_seconds:>10.1f}{r.compile_seconds:>11.1f}",
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
    if legend:
        print(LEGEND.format(truth=truth), file=out)
