"""Every metric at its defaults from a far start: posteriors' 2-D Gaussian test, in this library's
units (n = 1, τ = 1, so θ ← θ − ℓG⁻¹∇U + √(2ℓ) G^{-1/2}ξ with U the negative log density).

The protocol (normal-computing/posteriors, ``tests/sgmcmc/utils.py``): a random 2-D Gaussian, a
start drawn with variance 100, 100,000 steps of which 15,000 are burn-in; the samples' mean and
covariance within 0.1 of the target's, and the KL divergence of the Gaussian fitted to the samples
from the target under 1 % of the start's (of N(0, 100 I)). Here K chains run at once, each with its
own start: the full protocol (``slow``) checks every chain as posteriors checks its one; the fast
version runs fewer, shorter chains and tests the pooled mean and covariance against thresholds
of Z Monte-Carlo standard errors (from the chains' spread) plus the step's discretisation bias,
which the Lyapunov equation of ``tests/test_stationary.py`` gives for a frozen G.

A start 100 σ away is run too: every metric arrives at its defaults. RMSprop and Adam move about
ℓ per step while G follows |ĝ|, so their warm-up must outlast the journey: the default warm-up
waits for the chain to arrive before it freezes G (``docs/posterior.md``).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import sgrld
from linear_gaussian import lyapunov
from sgrld.core.warmup import Windows, warmup_end

SLOW = pytest.mark.slow
#: every metric at its defaults (Wenzel: refreshed once per "epoch" of 100 steps, as the facade
#: does with batch_size; Shampoo: the 2-vector gets a full-matrix factor)
METRICS: dict[str, dict[str, Any]] = {
    "identity": {},
    "rmsprop": {},
    "adam": {},
    "wenzel": {},
    "monge": {},
    "shampoo": {"precondition_vectors": True},
}


def target() -> tuple[torch.Tensor, torch.Tensor]:
    """posteriors' kind of target: a random mean, a random rotation of variances 1/4 and 1."""
    gen = torch.Generator().manual_seed(0)
    mean = torch.randn(2, generator=gen, dtype=torch.float64)
    q, _ = torch.linalg.qr(torch.randn(2, 2, generator=gen, dtype=torch.float64))
    cov = q @ torch.diag(torch.tensor([0.25, 1.0], dtype=torch.float64)) @ q.T
    return mean, cov


def gaussian_kl(m1: torch.Tensor, c1: torch.Tensor, m0: torch.Tensor, c0: torch.Tensor) -> float:
    """KL(N(m1, c1) ‖ N(m0, c0))."""
    inv = torch.linalg.inv(c0)
    dm = m0 - m1
    logdet = torch.logdet(c0) - torch.logdet(c1)
    return float(0.5 * (torch.trace(inv @ c1) + dm @ inv @ dm - 2 + logdet))


def run_chains(
    name: str, *, lr: float, steps: int, burnin: int, chains: int, start: str, seed: int = 1,
    ends: list[int] | None = None, laws: list[tuple[torch.Tensor, ...]] | None = None,
    **extra: Any,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Per chain, the mean (K, 2) and covariance (K, 2, 2) of its samples after ``burnin``; the
    step the warm-up ended at (as the chains extended it) appended to ``ends``, and the frozen
    chains' :func:`frozen_law` to ``laws``."""
    mean, cov = target()
    prec = torch.linalg.inv(cov)
    gen = torch.Generator().manual_seed(seed)
    if start == "var100":
        theta0 = 10.0 * torch.randn(chains, 2, generator=gen, dtype=torch.float64)
    else:  # 100 σ away along a random direction: θ₀ = μ + 100 L u, ‖u‖ = 1, cov = L Lᵀ
        u = torch.randn(chains, 2, generator=gen, dtype=torch.float64)
        theta0 = mean + 100.0 * (u / u.norm(dim=1, keepdim=True)) @ torch.linalg.cholesky(cov).T
    options = {**METRICS[name], **extra}
    sampler = sgrld.build(name, lr=lr, num_data=1.0, **options)
    state = sampler.init({"x": theta0}, num_chains=chains, generator=gen)
    total = torch.zeros(chains, 2, dtype=torch.float64)
    outer = torch.zeros(chains, 2, 2, dtype=torch.float64)
    for t in range(steps):
        x = state.params["x"]
        sampler.step(state, {"x": (x - mean) @ prec})
        if name == "wenzel" and (t + 1) % 100 == 0:
            sampler.refresh(state)
        if t >= burnin:
            x = state.params["x"]
            total += x
            outer += x[:, :, None] * x[:, None, :]
    sampler.check(state)
    if ends is not None:
        end = warmup_end(sampler.adapt_until, state.warmup)
        ends.append(steps if end is None else end)
    if laws is not None:
        laws.append(frozen_law(sampler, state, lr, steps - burnin))
    m = total / (steps - burnin)
    return m, outer / (steps - burnin) - m[:, :, None] * m[:, None, :]


def frozen_law(
    sampler: Any, state: Any, lr: float, draws: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a chain samples once its G is frozen, per chain: θ' = Bθ + c + √(2ℓ) G^{-½}ξ with
    B = I − ℓG⁻¹A is a Gaussian AR(1) (n = τ = 1), whose stationary covariance C solves the
    discrete Lyapunov equation C = BCBᵀ + 2ℓG^{-½}G^{-½}ᵀ; and the Monte-Carlo standard deviations
    of ``draws`` consecutive samples' mean and covariance: n·Var(x̄) = Σₕ Γ(h) and, by Isserlis,
    n·Var(Ĉᵢⱼ) = Σₕ Γᵢᵢ(h)Γⱼⱼ(h) + Γᵢⱼ(h)Γⱼᵢ(h), Γ(h) = BʰC (h ≥ 0), in closed form through
    Σₕ Bʰ ⊗ Bʰ = (I − B ⊗ B)⁻¹. Returns C (K, 2, 2), sd of the mean (K, 2), of Ĉ (K, 2, 2)."""
    _, cov = target()
    k, d = state.params["x"].shape
    eye = torch.eye(d, dtype=torch.float64)

    def dense(apply: Any) -> torch.Tensor:  # (K, d, d): column j is the operator on e_j
        cols = [apply(state.stats, state.layout, eye[j].expand(k, d).clone()) for j in range(d)]
        return torch.stack(cols, dim=-1)

    inv, inv_sqrt = dense(sampler.metric.inverse), dense(sampler.metric.inverse_sqrt)
    b = eye - lr * inv @ torch.linalg.inv(cov)
    c = lyapunov(b, 2 * lr * inv_sqrt @ inv_sqrt.transpose(1, 2))
    sd_mean = torch.empty(k, d, dtype=torch.float64)
    sd_cov = torch.empty(k, d, d, dtype=torch.float64)
    for chain in range(k):
        bk, ck = b[chain], c[chain]
        long_run = torch.linalg.solve(eye - bk, ck)  # Σ_{h≥0} Γ(h)
        sd_mean[chain] = ((long_run + long_run.T - ck).diagonal() / draws).sqrt()
        sums = torch.linalg.solve(torch.eye(d * d, dtype=b.dtype) - torch.kron(bk, bk),
                                  torch.kron(ck, ck))  # fmt: skip
        for i in range(d):
            for j in range(d):
                ij, ji = i * d + j, j * d + i
                both = 2 * (sums[ij, ij] + sums[ij, ji]) - (ck[i, i] * ck[j, j] + ck[i, j] ** 2)
                sd_cov[chain, i, j] = (both / draws).sqrt()
    return c, sd_mean, sd_cov


def start_kl() -> float:
    """The KL of the start's law N(0, 100 I) from the target: the 1 % criterion's unit."""
    mean, cov = target()
    return gaussian_kl(
        torch.zeros(2, dtype=torch.float64), 100.0 * torch.eye(2, dtype=torch.float64), mean, cov
    )


# --- the fast version: pooled over chains, thresholds from the chains' spread ----------------

FAST_LR, FAST_STEPS, FAST_BURNIN, FAST_CHAINS = 0.05, 2000, 1000, 16
Z = 5.0


def _check_pooled(means: torch.Tensor, covs: torch.Tensor) -> None:
    mean, cov = target()
    k = means.shape[0]
    # the chains are independent: their spread gives the pooled estimates' standard errors; the
    # frozen chain's discretisation bias at ℓ = 0.05 is ≤ ℓλ_max/2 = 10 % of a variance (Lyapunov)
    se_mean = means.std(0) / math.sqrt(k)
    assert bool(((means.mean(0) - mean).abs() < Z * se_mean + 0.02).all()), (means.mean(0), mean)
    se_cov = covs.std(0) / math.sqrt(k)
    err = (covs.mean(0) - cov).abs()
    assert bool((err < Z * se_cov + 0.1 * cov.diagonal().max()).all()), (covs.mean(0), cov)


@pytest.mark.parametrize("name", list(METRICS))
def test_defaults_reach_the_gaussian_from_a_start_of_variance_100(name: str) -> None:
    means, covs = run_chains(name, lr=FAST_LR, steps=FAST_STEPS, burnin=FAST_BURNIN,
                             chains=FAST_CHAINS, start="var100")  # fmt: skip
    _check_pooled(means, covs)


@SLOW
@pytest.mark.parametrize("name", ["identity", "wenzel", "monge", "shampoo"])
def test_defaults_reach_the_gaussian_from_100_sigma(name: str) -> None:
    means, covs = run_chains(name, lr=FAST_LR, steps=FAST_STEPS, burnin=FAST_BURNIN,
                             chains=FAST_CHAINS, start="far")  # fmt: skip
    _check_pooled(means, covs)


@SLOW
@pytest.mark.parametrize("name", ["rmsprop", "adam"])
def test_the_default_warmup_waits_for_the_journey_from_100_sigma(name: str) -> None:
    """RMSprop and Adam travel ~ℓ per step: from ~70 away at ℓ = 0.05 the journey is ~1,400
    steps, so the default warm-up, still travelling at step 950, waits (slow windows of 1,000
    steps) and freezes once the chain has arrived, before the burn-in of 4,000 ends; Adam's
    restarted second moment has forgotten the journey's gradients by then."""
    ends: list[int] = []
    means, covs = run_chains(name, lr=FAST_LR, steps=FAST_STEPS + 3000, burnin=4000,
                             chains=FAST_CHAINS, start="far", ends=ends)  # fmt: skip
    assert 950 < ends[0] <= 4000, ends
    _check_pooled(means, covs)


# --- posteriors' full protocol: every chain on its own ------------------------------------------


#: (metric, start, warm-up) of the full protocol, each measured to pass on all three chains;
#: the others and their figures are in docs/results/warmup.md: at the default warm-up (which
#: waits for the chain) RMSprop and Adam miss the 0.1 on their worst chain's covariance by
#: 0.006-0.047 from either start, the Monte-Carlo error of one chain's covariance (sd up to 0.06
#: at ℓ = 0.01), not a bias: their per-chain test is the one below.
PROTOCOL = [
    ("identity", "var100", None),
    ("shampoo", "var100", None),
    ("identity", "far", None),
    ("monge", "far", None),
    ("shampoo", "far", None),  # waits until step 3,950 (0.247 when frozen at 950)
    ("rmsprop", "far", Windows(15000)),  # the journey is ~7,000 steps at ℓ = 0.01
]


@SLOW
@pytest.mark.parametrize(("name", "start", "warmup"), PROTOCOL, ids=str)
def test_posteriors_protocol(name: str, start: str, warmup: Windows | None) -> None:
    """100,000 steps at ℓ = 0.01, burn-in 15,000, three chains: each chain's mean and covariance
    within 0.1, its KL under 1 % of the start's."""
    extra = {} if warmup is None else {"adapt_until": warmup}
    means, covs = run_chains(name, lr=0.01, steps=100_000, burnin=15_000, chains=3, start=start,
                             **extra)  # fmt: skip
    mean, cov = target()
    unit = start_kl()
    for m, c in zip(means, covs, strict=True):
        assert float((m - mean).abs().max()) < 0.1, (m, mean)
        assert float((c - cov).abs().max()) < 0.1, (c, cov)
        assert gaussian_kl(m, c, mean, cov) < 0.01 * unit


#: the standard deviations a chain's sample moments may stray from what its frozen G samples:
#: 4 sd on each of 5 moments of 3 chains in 4 runs, a false alarm in ~1 % of suites
Z_CHAIN = 4.0


@SLOW
@pytest.mark.parametrize("start", ["var100", "far"])
@pytest.mark.parametrize("name", ["rmsprop", "adam"])
def test_posteriors_protocol_within_each_chains_monte_carlo_error(name: str, start: str) -> None:
    """RMSprop and Adam at their defaults (the warm-up waits for the chain) in the full protocol:
    each chain's frozen G samples the target within posteriors' tolerance (its exact stationary
    moments, :func:`frozen_law`: the step's bias, ~ℓG⁻¹/2 < 0.005 here), and its samples stray
    from those moments by no more than :data:`Z_CHAIN` of their Monte-Carlo sd. A single chain
    can miss posteriors' fixed 0.1 on its own: their G⁻¹ ≈ 0.3-0.9 mixes the unit-variance
    direction over ~150 steps at ℓ = 0.01, so 85,000 draws hold ~600 effective ones and a
    covariance's sd is up to 0.06 (docs/results/warmup.md)."""
    laws: list[tuple[torch.Tensor, ...]] = []
    means, covs = run_chains(name, lr=0.01, steps=100_000, burnin=15_000, chains=3, start=start,
                             laws=laws)  # fmt: skip
    mean, cov = target()
    law, sd_mean, sd_cov = laws[0]
    unit = start_kl()
    for k in range(3):
        assert float((law[k] - cov).abs().max()) < 0.1, (law[k], cov)
        assert gaussian_kl(mean, law[k], mean, cov) < 0.01 * unit
        assert bool(((means[k] - mean).abs() < Z_CHAIN * sd_mean[k]).all()), (means[k], sd_mean[k])
        assert bool(((covs[k] - law[k]).abs() < Z_CHAIN * sd_cov[k]).all()), (covs[k], sd_cov[k])


def main() -> None:
    """``python tests/test_metric_starts.py [metric ...]``: posteriors' full protocol at the
    defaults from both starts, the worst chain's errors and KL and where the warm-up ended,
    and per chain what its frozen G samples (:func:`frozen_law`) and how many Monte-Carlo sd
    its sample moments are from that (the figures of ``docs/results/warmup.md``)."""
    import sys

    torch.set_num_threads(1)
    mean, cov = target()
    unit = start_kl()
    names = [a for a in sys.argv[1:] if not a.startswith("--seed=")] or list(METRICS)
    seeds = [int(a.split("=")[1]) for a in sys.argv[1:] if a.startswith("--seed=")] or [1]
    for name in names:
        for seed in seeds:
            for start in ("var100", "far"):
                ends: list[int] = []
                laws: list[tuple[torch.Tensor, ...]] = []
                means, covs = run_chains(name, lr=0.01, steps=100_000, burnin=15_000, chains=3,
                                         start=start, seed=seed, ends=ends, laws=laws)  # fmt: skip
                worst_mean = max(float((m - mean).abs().max()) for m in means)
                worst_cov = max(float((c - cov).abs().max()) for c in covs)
                pairs = zip(means, covs, strict=True)
                kl = max(gaussian_kl(m, c, mean, cov) for m, c in pairs)
                print(f"{name} {start} seed {seed}: mean {worst_mean:.3f} cov {worst_cov:.3f} "
                      f"KL {100 * kl / unit:.3f} % (warm-up ended at {ends[0]})")  # fmt: skip
                law, sd_mean, sd_cov = laws[0]
                for k in range(len(means)):
                    z_mean = float(((means[k] - mean) / sd_mean[k]).abs().max())
                    z_cov = float(((covs[k] - law[k]) / sd_cov[k]).abs().max())
                    print(f"  chain {k}: cov error {float((covs[k] - cov).abs().max()):.3f}, "
                          f"frozen G's bias {float((law[k] - cov).abs().max()):.4f}, "
                          f"sd {float(sd_cov[k].max()):.3f}; |z| mean {z_mean:.2f} "
                          f"cov {z_cov:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
