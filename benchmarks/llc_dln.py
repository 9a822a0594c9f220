"""Deep linear networks against Aoyagi's learning coefficient, every metric (Furman & Lau 2024).

Furman & Lau's protocol, scaled to a CPU: a deep linear network at a rank-r truth
(``sgrld.slt.targets.deep_linear_network``: y = W_L⋯W₁x + N(0, I)), n data, batch 500,
nβ = n/ln n, γ = 1, the estimate from the last 10 % of every trace (``burnin`` = 90 %), ε
calibrated per metric; λ from ``sgrld.slt.theory.deep_linear_network_llc``. Size buckets of
about 1K, 10K and 100K parameters; per estimate λ̂ ± s.e., the relative error, ε, the verdict
and the wall time; per metric the median and worst relative error; a figure of λ̂ against λ.
Wall times are this machine's (shared-load dependent).

    python benchmarks/llc_dln.py [--buckets 1k,10k,100k] [--chains 4] [--steps 2000]
        [--samplers identity,rmsprop,monge,shampoo] [--json out.json] [--figure out.png]
"""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np
import torch

import sgrld
from sgrld.slt import targets

#: bucket → (widths H₁ … H_{L+1}, true rank, n)
BUCKETS = {
    "1k": ([10, 20, 20, 10], 5, 100_000),
    "10k": ([40, 60, 60, 40], 20, 100_000),
    "100k": ([100, 200, 200, 100], 50, 100_000),
}
#: the metrics' options as in benchmarks/llc_theory.py
SAMPLERS = {
    "identity": {},
    "rmsprop": {"decay": 0.99, "eps": 0.1},
    "monge": {"alpha2": 1.0},
    "shampoo": {"precondition_vectors": True},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--buckets", default="1k,10k,100k")
    parser.add_argument("--samplers", default=",".join(SAMPLERS))
    parser.add_argument("--chains", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--steps-100k", type=int, default=None, help="steps in the 100k bucket")
    parser.add_argument("--num-data", type=int, default=None, help="n (default per bucket)")
    parser.add_argument(
        "--lr", type=float, default=None, help="also SGLD at this ε (devinterp's lr), as a row"
    )
    parser.add_argument("--json", default=None)
    parser.add_argument("--figure", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for bucket in args.buckets.split(","):
        widths, rank, n = BUCKETS[bucket]
        t = targets.deep_linear_network(widths, rank, num_data=args.num_data or n, batch_size=500,
                                        dtype=torch.float32)  # fmt: skip
        size = sum(p.numel() for p in t.model.parameters())
        steps = args.steps_100k if bucket == "100k" and args.steps_100k else args.steps
        nbeta = t.num_data / math.log(t.num_data)
        runs = [(name, None) for name in args.samplers.split(",")]
        runs += [("identity", args.lr)] if args.lr else []
        for name, lr in runs:
            start = time.perf_counter()
            est = sgrld.llc(t.model, t.loss, t.batches, num_data=t.num_data, sampler=name,
                            nbeta=nbeta, localization=1.0, num_chains=args.chains,
                            num_steps=steps, burnin=steps - steps // 10, seed=0, lr=lr,
                            warn=False, **SAMPLERS[name])  # fmt: skip
            rows.append({
                "bucket": bucket, "target": t.name, "params": size, "n": t.num_data,
                "theory": t.theory, "sampler": name if lr is None else f"{name}@{lr:g}",
                "lr": est.lr, "mean": est.mean,
                "se": est.std_error, "rel_err": est.mean / t.theory - 1,
                "verdict": str(est.verdict), "ok": est.ok,
                "relaxations": est.verdict.relaxations, "step_bias": est.verdict.step_bias,
                "chains": args.chains,
                "steps": steps, "wall_s": time.perf_counter() - start,
            })  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n{'target':26} {'params':>7} {'λ':>7} {'sampler':9} {'ε':>9} {'λ̂ ± se':>17} "
          f"{'err':>7} {'wall s':>7}  verdict")  # fmt: skip
    for r in rows:
        print(f"{r['target']:26} {r['params']:7d} {r['theory']:7.1f} {r['sampler']:9} "
              f"{r['lr']:9.2e} {r['mean']:8.1f} ± {r['se']:6.1f} {r['rel_err']:+7.1%} "
              f"{r['wall_s']:7.0f}  {r['verdict']}")  # fmt: skip
    print(f"\n{'sampler':9} {'median |err|':>12} {'worst |err|':>12}")
    for name in dict.fromkeys(r["sampler"] for r in rows):
        errs = [abs(r["rel_err"]) for r in rows if r["sampler"] == name]
        print(f"{name:9} {np.median(errs):12.1%} {max(errs):12.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.figure:
        figure(rows, args.figure)


def figure(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    names = list(dict.fromkeys(r["sampler"] for r in rows))
    for i, name in enumerate(names):  # filled: the verdict is ok; open: it is not
        for j, r in enumerate(r for r in rows if r["sampler"] == name):
            ax.errorbar(r["theory"] * (1 + 0.03 * (i - 1.5)), r["mean"], yerr=r["se"], fmt="o",
                        color=f"C{i}", mfc=f"C{i}" if r["ok"] else "none", capsize=3,
                        label=name if j == 0 else None)  # fmt: skip
    lo = min(r["theory"] for r in rows) / 2
    hi = max(max(r["theory"], r["mean"]) for r in rows) * 2
    ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="λ̂ = λ")
    ax.set(xscale="log", yscale="log", xlabel="λ (Aoyagi 2024)", ylabel="λ̂ ± s.e.",
           title="deep linear networks: estimate against theory")  # fmt: skip
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
