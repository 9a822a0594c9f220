"""A gold-standard λ̂ for the LLC targets: the localised tempered posterior sampled exactly.

``sgrld.llc`` estimates λ̂ = nβ·(E_w[L_n(w)] − L_n(w₀)) under the posterior
∝ exp(−nβ·L_n(w) − γ/2·‖w − w₀‖²). On the small targets of ``sgrld.slt.targets`` that
posterior can be sampled without any step bias: Hamiltonian Monte Carlo on the whole-data
potential with a Metropolis correction (float64, the step adapted to an acceptance of 0.8 during
the first fifth of the iterations, then fixed; a leapfrog count jittered ±50 %). Its value is the
reference every SGLD-type estimate at a finite step should approach as ε → 0 — not the
asymptotic λ of theory, which this n and γ do not reach (``docs/llc.md``, "A gold standard").

    python benchmarks/llc_gold.py [--targets "rrr(6,4,2,2)"] [--iterations 20000] [--seeds 2]

Prints, per target, each seed's λ̂ ± its batch-means standard error, the pooled value, the
acceptance rate and the step; ``--json`` writes them.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time

import torch
from torch.func import functional_call

import llc_theory  # beside this script
from sgrld.slt import targets

#: name → (target, γ), the targets and γ of benchmarks/llc_theory.py
TARGETS = llc_theory.TARGETS


def hmc_llc(
    target: targets.Target,
    *,
    gamma: float,
    iterations: int,
    leapfrog: int = 20,
    seed: int = 0,
) -> dict[str, float]:
    """λ̂ of ``target``'s localised posterior (nβ = n/log n, the llc default) by HMC."""
    model = target.model
    names = [name for name, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    sizes = [p.numel() for _, p in model.named_parameters()]
    w0 = torch.cat([p.detach().reshape(-1) for _, p in model.named_parameters()]).double()
    x = torch.cat([b[0] for b in target.batches])
    y = torch.cat([b[1] for b in target.batches])
    n = target.num_data
    nbeta = n / math.log(n)

    def loss(w: torch.Tensor) -> torch.Tensor:  # L_n(w): the whole data's mean NLL
        params = {k: v.view(s) for k, v, s in zip(names, w.split(sizes), shapes, strict=True)}
        return target.loss(lambda inp: functional_call(model, params, (inp,)), (x, y))

    def potential(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = w.detach().requires_grad_(True)
        u = nbeta * loss(w) + 0.5 * gamma * (w - w0).square().sum()
        (g,) = torch.autograd.grad(u, w)
        return u.detach(), g

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        start_loss = float(loss(w0))
    w, (u, grad) = w0.clone(), potential(w0)
    step, accepted, trace = 0.01, 0, []
    adapt = iterations // 5
    for it in range(iterations):
        p = torch.randn(w.shape, generator=gen, dtype=w.dtype)
        h0 = u + 0.5 * p @ p
        wn, pn = w.clone(), p - 0.5 * step * grad
        count = max(1, int(leapfrog * (0.5 + float(torch.rand(1, generator=gen)))))
        for s in range(count):
            wn = wn + step * pn
            un, gn = potential(wn)
            if s < count - 1:
                pn = pn - step * gn
        pn = pn - 0.5 * step * gn
        accept = math.exp(min(0.0, float(h0 - (un + 0.5 * pn @ pn))))
        if float(torch.rand(1, generator=gen)) < accept:
            w, u, grad = wn, un, gn
            accepted += it >= adapt
        if it < adapt:  # Robbins-Monro on log(step) towards an acceptance of 0.8
            step *= math.exp(0.02 * (accept - 0.8))
        else:
            with torch.no_grad():
                trace.append(float(loss(w)))
    values = torch.tensor(trace, dtype=torch.float64)
    batches = 50  # batch means: the trace is autocorrelated
    means = values[: len(values) // batches * batches].view(batches, -1).mean(1)
    return {
        "llc": nbeta * (float(values.mean()) - start_loss),
        "se": nbeta * float(means.std()) / math.sqrt(batches),
        "acceptance": accepted / max(1, iterations - adapt),
        "step": step,
        "nbeta": nbeta,
        "gamma": gamma,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default="rrr(6,4,2,2),rrr(8,6,5,2),rrr(10,2,2,1)")
    parser.add_argument("--iterations", type=int, default=20_000)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = {}
    names = re.findall(r"logistic|rrr\([^)]*\)", args.targets)
    unknown = [name for name in names if name not in TARGETS]
    if not names or unknown:
        parser.error(f"--targets {args.targets!r}: expected some of {', '.join(TARGETS)}")
    for name in names:
        target, gamma = TARGETS[name]()
        runs = []
        for seed in range(args.seeds):
            began = time.perf_counter()
            run = hmc_llc(target, gamma=gamma, iterations=args.iterations, seed=seed)
            run["seconds"] = time.perf_counter() - began
            runs.append(run)
            print(
                f"{name} seed {seed}: λ̂ {run['llc']:.3f} ± {run['se']:.3f} (acceptance "
                f"{run['acceptance']:.2f}, step {run['step']:.3g}, {run['seconds']:.0f} s)",
                flush=True,
            )
        pooled = sum(r["llc"] for r in runs) / len(runs)
        se = math.sqrt(sum(r["se"] ** 2 for r in runs)) / len(runs)
        rows[name] = {"llc": pooled, "se": se, "theory": target.theory, "runs": runs}
        print(f"{name}: λ̂ {pooled:.3f} ± {se:.3f} (theory λ {target.theory:g})", flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
