"""The NUTS reference posterior of ``benchmarks/gold.py``, written to ``benchmarks/gold_nuts.json``.

Needs the ``gold`` extra (``pip install -e '.[gold]'``: NumPyro on JAX, CPU). Four chains of
5,000 draws after 2,000 warm-up steps each (target acceptance 0.9, float64); the file keeps the
provenance (library versions, seed, draws, R̂, bulk ESS) and, per parameter, the mean, the
standard deviation and 199 quantiles (levels 0.005, 0.010, …, 0.995), from which the benchmark
and the slow test compute mean errors, σ ratios and 1-Wasserstein distances. About a minute on
two CPU cores.

    python benchmarks/gold_reference.py
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np

from gold_data import NAMES, REFERENCE, REFERENCE_RAW, load

LEVELS = np.round(np.arange(1, 200) / 200, 3)


def dump(summary: dict[str, object]) -> str:
    """JSON with one line per entry and per parameter's quantiles (a small, diffable file)."""
    lines = []
    for key, value in summary.items():
        if key == "quantiles":
            rows = ",\n  ".join(json.dumps(row) for row in value)  # type: ignore[attr-defined]
            lines.append(f' "{key}": [\n  {rows}\n ]')
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chains", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2000)
    parser.add_argument("--draws", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--raw", action="store_true", help="unscaled features (ill-conditioned)")
    args = parser.parse_args()

    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import numpyro
    import numpyro.distributions as dist
    from numpyro.diagnostics import effective_sample_size, split_gelman_rubin
    from numpyro.infer import MCMC, NUTS

    numpyro.set_host_device_count(args.chains)
    x, y = load(args.raw)

    def model(x: jnp.ndarray, y: jnp.ndarray) -> None:
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
        b = numpyro.sample("b", dist.Normal(0.0, 1.0))
        numpyro.sample("y", dist.Bernoulli(logits=x @ w + b), obs=y)

    started = time.perf_counter()
    mcmc = MCMC(
        NUTS(model, target_accept_prob=0.9),
        num_warmup=args.warmup,
        num_samples=args.draws,
        num_chains=args.chains,
        chain_method="sequential",
        progress_bar=False,
    )
    mcmc.run(jax.random.PRNGKey(args.seed), jnp.asarray(x), jnp.asarray(y))
    samples = mcmc.get_samples(group_by_chain=True)
    draws = np.concatenate([np.asarray(samples["w"]), np.asarray(samples["b"])[..., None]], -1)
    rhat = np.asarray(split_gelman_rubin(draws))
    ess = np.asarray(effective_sample_size(draws))
    flat = draws.reshape(-1, draws.shape[-1])
    summary = {
        "problem": "benchmarks/gold_data.py: breast cancer, 455 x 30, N(0, 1) prior, logistic"
        + (", raw features" if args.raw else ""),
        "provenance": {
            "script": "benchmarks/gold_reference.py",
            "library": f"numpyro {numpyro.__version__}, jax {jax.__version__}",
            "python": platform.python_version(),
            "sampler": "NUTS, target_accept_prob 0.9, float64",
            "seed": args.seed,
            "chains": args.chains,
            "warmup": args.warmup,
            "draws_per_chain": args.draws,
            "max_rhat": float(rhat.max()),
            "min_bulk_ess": float(ess.min()),
            "seconds": round(time.perf_counter() - started, 1),
        },
        "names": NAMES,
        "mean": flat.mean(0).tolist(),
        "std": flat.std(0, ddof=1).tolist(),
        "quantile_levels": LEVELS.tolist(),
        "quantiles": np.quantile(flat, LEVELS, axis=0).T.round(6).tolist(),
    }
    (REFERENCE_RAW if args.raw else REFERENCE).write_text(dump(summary), encoding="utf-8")
    print(json.dumps(summary["provenance"], indent=1))


if __name__ == "__main__":
    main()
