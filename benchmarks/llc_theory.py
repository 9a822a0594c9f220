"""The LLC against closed forms with every metric, and against devinterp 2.x's SGLD.

For each target (a logistic regression at its MLE, reduced-rank regressions in every regime of
Aoyagi & Watanabe's formula) and sampler: the estimate ± its standard error, its verdict, the
theory, the relative error, the ε used (given or calibrated) and the variance per gradient
evaluation, Var(per-chain λ̂)·num_steps, as a ratio to SGLD's (below 1: fewer gradients for the
same precision). devinterp's own SGLD (``pip install --no-deps devinterp==2.0.1``) runs the
same chains where it is installed. Wall times are this machine's and shared-load dependent.

    python benchmarks/llc_theory.py [--steps 3000] [--burnin 0] [--chains 8]
        [--targets logistic,rrr(4,4,3,1)] [--no-devinterp] [--json out.json]

Every metric's verdict is checked against the calibrated SGLD row of its target
(``sgrld.slt.against_sgld``: beyond 3 combined standard errors and 5 %), as ``check_sgld``
would, without running SGLD again per metric.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
import warnings

import numpy as np
import torch

import sgrld
from sgrld.slt import against_sgld, targets

#: name → (target, γ): γ = 1 for the regular model (γ = 100 rivals its curvature, docs/llc.md)
TARGETS = {
    "logistic": lambda: (targets.logistic(), 1.0),
    **{
        f"rrr({m},{n},{h},{r})": (
            lambda m=m, n=n, h=h, r=r: (targets.reduced_rank_regression(m, n, h, r), 100.0)
        )
        for m, n, h, r in [(4, 4, 3, 1), (8, 2, 3, 1), (8, 6, 5, 2), (10, 2, 2, 1), (6, 4, 2, 2)]
    },
}

SAMPLERS = {
    "identity": {},
    "rmsprop": {"decay": 0.99, "eps": 0.1},  # devinterp's RMSprop-SGLD defaults
    "monge": {"alpha2": 1.0},
    "shampoo": {"precondition_vectors": True},  # the (1, d) and (N, H) weights get factors
}


def devinterp_llc(target, *, lr, nbeta, gamma, chains, steps, seed):
    """devinterp 2.x's SGMCMC.sgld chains (one after the other, the same batches) and its
    estimator nβ·(mean trace − init loss), init loss over the same initial batches."""
    from devinterp.optim import SGMCMC

    with torch.no_grad():  # one epoch, as sgrld.llc's default (32 batches would bias both)
        init = float(np.mean([float(target.loss(target.model, b)) for b in target.batches]))
    per_chain = []
    for k in range(chains):
        model = copy.deepcopy(target.model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = SGMCMC.sgld(model.parameters(), lr=lr, nbeta=nbeta, localization=gamma)
        gen = torch.Generator().manual_seed(seed + k)
        trace = []
        for t in range(steps):
            opt.zero_grad()
            value = target.loss(model, target.batches[t % len(target.batches)])
            value.backward()
            trace.append(float(value.detach()))
            opt.step(noise_generator=gen)
        per_chain.append(nbeta * (np.mean(trace) - init))
    per_chain = np.array(per_chain)
    return per_chain.mean(), per_chain.std(ddof=1) / math.sqrt(chains), per_chain


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--burnin", type=int, default=0, help="steps left out (>= the warm-up)")
    parser.add_argument("--chains", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4, help="SGLD's ε (devinterp's lr)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--targets", default=",".join(TARGETS), help="comma-separated names")
    parser.add_argument("--no-devinterp", action="store_true", help="leave devinterp's rows out")
    args = parser.parse_args()
    torch.set_num_threads(1)
    given = args.targets.replace(" ", "")  # names hold commas: found as substrings, in order
    wanted = sorted((name for name in TARGETS if name in given), key=given.index)
    cases = [TARGETS[name]() for name in wanted]
    rows = []
    for target, gamma in cases:
        nbeta = target.num_data / math.log(target.num_data)
        exact = target.exact(nbeta, gamma)
        base_var, reference = None, None
        runs = [("identity", args.lr)] + [(s, None) for s in SAMPLERS]
        for name, lr in runs:
            start = time.perf_counter()
            est = sgrld.llc(target.model, target.loss, target.batches, num_data=target.num_data,
                            sampler=name, nbeta=nbeta, localization=gamma,
                            num_chains=args.chains, num_steps=args.steps, seed=0, lr=lr,
                            burnin=args.burnin, warn=False, check_sgld=False,
                            **SAMPLERS[name])  # fmt: skip
            wall = time.perf_counter() - start
            if name == "identity" and lr is None:
                reference = est
            elif reference is not None:
                est = against_sgld(est, reference)
            var = float(est.per_chain.var(ddof=1)) * args.steps
            if name == "identity" and lr is not None:
                base_var = var
            rows.append({
                "target": target.name, "gamma": gamma, "theory": target.theory,
                "exact": exact, "sampler": name, "calibrated": est.calibrated,
                "lr": est.lr, "mean": est.mean, "se": est.std_error,
                "rel_err": est.mean / exact - 1, "var_per_grad": var,
                "vs_sgld": est.mean / reference.mean - 1 if reference else None,
                "var_ratio": var / base_var, "wall_s": wall, "verdict": str(est.verdict),
                "rhat": est.verdict.rhat, "ess": est.verdict.ess,
                "last_half": est.verdict.last_half, "inflation": est.verdict.inflation,
                "relaxations": est.verdict.relaxations,
            })  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
        try:
            if args.no_devinterp:
                continue
            start = time.perf_counter()
            mean, se, per_chain = devinterp_llc(
                target,
                lr=args.lr,
                nbeta=nbeta,
                gamma=gamma,
                chains=args.chains,
                steps=args.steps,
                seed=0,
            )
            var = float(per_chain.var(ddof=1)) * args.steps
            rows.append({
                "target": target.name, "gamma": gamma, "theory": target.theory, "exact": exact,
                "sampler": "devinterp sgld", "calibrated": False, "lr": args.lr, "mean": mean,
                "se": se, "rel_err": mean / exact - 1, "var_per_grad": var,
                "var_ratio": var / base_var, "wall_s": time.perf_counter() - start,
                "verdict": "(none)",
            })  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
        except ImportError:
            print("devinterp is not installed: its row is left out")
    print(f"\n{'target':16} {'γ':>5} {'exact':>6} {'sampler':15} {'ε':>9} {'λ̂ ± se':>15} "
          f"{'err':>7} {'var/grad ÷ SGLD':>16} {'wall s':>7}  verdict")  # fmt: skip
    for r in rows:
        tag = r["sampler"] + (" (cal.)" if r["calibrated"] else "")
        print(f"{r['target']:16} {r['gamma']:5g} {r['exact']:6.2f} {tag:15} {r['lr']:9.2e} "
              f"{r['mean']:7.2f} ± {r['se']:5.2f} {r['rel_err']:+7.1%} {r['var_ratio']:16.2f} "
              f"{r['wall_s']:7.1f}  {r['verdict']}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
