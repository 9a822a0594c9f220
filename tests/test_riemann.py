"""The exact Riemannian drift Γ for Monge with m = ∇u(θ) (issue 14 §2), against dense oracles."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from sgrld.metrics import MongeMetric
from sgrld.metrics.monge_exact import exact_monge_step, hutchinson_trace, monge_divergence

D = 5
SCALES = torch.linspace(0.5, 2.0, D, dtype=torch.float64)


def potential(x: torch.Tensor) -> torch.Tensor:
    """A non-quadratic, non-separable u: (*batch, D) → (*batch,)."""
    quad = 0.5 * (SCALES * x * x).sum(-1)
    return (
        quad
        + 0.1 * (x**4).sum(-1)
        + 0.3 * torch.sin(x[..., 0] * x[..., 1])
        + torch.logsumexp(x, -1)
    )


def grad_u(x: torch.Tensor) -> torch.Tensor:
    x = x.detach().requires_grad_(True)
    return torch.autograd.grad(potential(x).sum(), x)[0]


def dense_g_inv(metric: MongeMetric, x: torch.Tensor) -> torch.Tensor:
    """inv(I + α² m mᵀ) with m = ∇u(x), by a dense inverse (the oracle)."""
    m = grad_u(x)
    alpha2 = metric.alpha2 / float(m @ m) if metric.alpha2_rule == "normalized" else metric.alpha2
    return torch.linalg.inv(torch.eye(D, dtype=torch.float64) + alpha2 * torch.outer(m, m))


def fd_divergence(metric: MongeMetric, x: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """Γ_i = Σ_j ∂(G⁻¹)_ij/∂θ_j by central differences of the dense G⁻¹."""
    gamma = torch.zeros(D, dtype=torch.float64)
    for j in range(D):
        e = torch.zeros(D, dtype=torch.float64)
        e[j] = eps
        gamma += (dense_g_inv(metric, x + e)[:, j] - dense_g_inv(metric, x - e)[:, j]) / (2 * eps)
    return gamma


METRICS = [
    MongeMetric(alpha2=0.7),
    MongeMetric(alpha2=3.0),
    MongeMetric(alpha2=0.5, alpha2_rule="normalized"),
    MongeMetric(alpha2=4.0, alpha2_rule="normalized"),
]


@pytest.mark.parametrize("metric", METRICS, ids=lambda m: f"{m.alpha2_rule}-{m.alpha2}")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_divergence_matches_finite_differences_of_dense_g_inv(
    metric: MongeMetric, seed: int
) -> None:
    x = torch.randn(D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    m = grad_u(x)
    hess = torch.autograd.functional.hessian(potential, x)
    gamma = monge_divergence(metric, m, hess @ m, torch.trace(hess))
    torch.testing.assert_close(gamma, fd_divergence(metric, x), rtol=1e-6, atol=1e-8)
    if metric.alpha2_rule == "fixed":  # the issue's closed form
        beta = metric.alpha2 / (1 + metric.alpha2 * float(m @ m))
        hm = hess @ m
        issue = 2 * beta**2 * float(m @ hm) * m - beta * hm - beta * torch.trace(hess) * m
        torch.testing.assert_close(gamma, issue, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("metric", METRICS[::2], ids=lambda m: m.alpha2_rule)
@pytest.mark.parametrize("trace", ["exact", "hutchinson"])
def test_step_is_the_dense_euler_maruyama_step_plus_gamma(metric: MongeMetric, trace: str) -> None:
    """θ' = θ − ℓG⁻¹∇u + (ℓτ/n)Γ + √(2ℓτ/n)G^{-1/2}ξ, three chains at once (float64)."""
    lr, n, tau = 0.05, 4.0, 0.7
    theta = torch.randn(3, D, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    gen = torch.Generator().manual_seed(9)
    kwargs = {"metric": metric, "lr": lr, "num_data": n, "temperature": tau, "generator": gen}
    out = exact_monge_step(potential, theta, correction=True, trace=trace, probes=2, **kwargs)
    # replay the generator: Hutchinson's probes first, then ξ
    replay = torch.Generator().manual_seed(9)
    if trace == "hutchinson":
        probes = torch.randint(0, 2, (2, 3, D), generator=replay).double() * 2 - 1
    xi = torch.randn(3, D, generator=replay, dtype=torch.float64)
    for c in range(3):
        x, m = theta[c], grad_u(theta[c])
        hess = torch.autograd.functional.hessian(potential, x)
        tr = torch.trace(hess)
        if trace == "hutchinson":
            tr = sum(p[c] @ hess @ p[c] for p in probes) / 2
        g_inv = dense_g_inv(metric, x)
        evals, evecs = torch.linalg.eigh(g_inv)
        root = evecs @ torch.diag(evals.sqrt()) @ evecs.T
        gamma = monge_divergence(metric, m, hess @ m, torch.as_tensor(tr))
        expect = (
            x - lr * g_inv @ m + lr * tau / n * gamma + math.sqrt(2 * lr * tau / n) * root @ xi[c]
        )
        torch.testing.assert_close(out[c], expect, rtol=1e-10, atol=1e-12)


def test_without_correction_gamma_is_dropped_and_tau_zero_is_descent() -> None:
    metric = MongeMetric(alpha2=1.5)
    theta = torch.randn(2, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    gen_a, gen_b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    kw = {"metric": metric, "lr": 0.1, "num_data": 1.0, "temperature": 1.0, "trace": "exact"}
    plain = exact_monge_step(potential, theta, correction=False, generator=gen_a, **kw)
    full = exact_monge_step(potential, theta, correction=True, generator=gen_b, **kw)
    for c in range(2):
        m = grad_u(theta[c])
        hess = torch.autograd.functional.hessian(potential, theta[c])
        gamma = monge_divergence(metric, m, hess @ m, torch.trace(hess))
        torch.testing.assert_close(full[c] - plain[c], 0.1 * gamma, rtol=1e-9, atol=1e-12)
    descent = exact_monge_step(potential, theta, **{**kw, "temperature": 0.0})
    for c in range(2):
        m = grad_u(theta[c])
        torch.testing.assert_close(
            descent[c], theta[c] - 0.1 * dense_g_inv(metric, theta[c]) @ m, rtol=1e-12, atol=0
        )


def test_hutchinson_is_unbiased() -> None:
    """mean of zᵀHz → tr H within Monte-Carlo error; Var zᵀHz = 2 Σ_{i≠j} H_ij²."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(6, 6, generator=gen, dtype=torch.float64)
    hess = a + a.T
    like = torch.zeros(4000, 6, dtype=torch.float64)  # 4,000 independent estimates at once
    estimates = hutchinson_trace(lambda v: v @ hess, like, probes=1, generator=gen)
    off = hess - torch.diag(torch.diag(hess))
    std = math.sqrt(2 * float((off**2).sum()) / 4000)
    assert abs(float(estimates.mean()) - float(torch.trace(hess))) < 4 * std
    assert float(estimates.var()) == pytest.approx(2 * float((off**2).sum()), rel=0.1)
    # diagonal H: zᵀHz = Σ H_ii z_i² = tr H for every probe
    diag = torch.diag(torch.diag(hess))
    exact = hutchinson_trace(lambda v: v @ diag, like[:10], probes=3, generator=gen)
    torch.testing.assert_close(exact, torch.trace(hess).expand(10), rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"metric": MongeMetric(scope="tensor")}, "scope='global'"),
        ({"metric": MongeMetric(fallback_threshold=10.0)}, "no fallback"),
        ({"trace": "stochastic"}, "invalid trace"),
        ({"probes": 0}, "invalid probes"),
        ({"lr": -1.0}, "invalid lr"),
    ],
)
def test_bad_values_are_refused(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"metric": MongeMetric(), "lr": 0.1, "num_data": 1.0, **kwargs}
    with pytest.raises(ValueError, match=message):
        exact_monge_step(potential, torch.zeros(D, dtype=torch.float64), **args)  # type: ignore[arg-type]


@pytest.mark.parametrize(("correction", "second_moment"), [(True, 1.0), (False, 2.0)])
def test_gamma_makes_the_chain_sample_the_target(correction: bool, second_moment: float) -> None:
    """1-D u = θ²/2, α² = 1: with Γ the chain samples N(0, 1) (E θ² = 1); without it the
    stationary law is G(θ)e^{−u} ∝ (1 + θ²)e^{−θ²/2}, whose E θ² = (1 + 3)/(1 + 1) = 2."""
    gen = torch.Generator().manual_seed(0)
    theta = torch.randn(2000, 1, generator=gen, dtype=torch.float64)  # exact draws of N(0, 1)
    metric = MongeMetric(alpha2=1.0, alpha2_rule="fixed")  # G(θ) = 1 + θ²
    total = torch.zeros((), dtype=torch.float64)
    for step in range(600):
        grad = theta.clone()
        theta = exact_monge_step(
            lambda x: 0.5 * (x * x).sum(-1),
            theta,
            metric=metric,
            lr=0.02,
            num_data=1.0,
            correction=correction,
            generator=gen,
        )
        assert grad.shape == theta.shape
        if step >= 300:  # 300 steps = 6 time units: the no-Γ chains have relaxed to their law
            total += (theta * theta).mean()
    # O(ℓ) discretisation bias ≈ 1-2 %; Monte-Carlo standard error ≈ 0.01
    assert float(total / 300) == pytest.approx(second_moment, abs=0.06)


# --- sgrld funnel --exact-metric --------------------------------------------------------------


def test_funnel_exact_metric_cli(tmp_path: Path) -> None:
    from sgrld.cli import main

    argv = ["funnel", "--steps", "300", "--chains", "2", "--no-compile", "--no-plot"]
    argv += ["--no-progress", "--start", "exact", "--samplers", "identity,monge"]
    argv += ["--exact-metric", "--correction", "--alpha2-rule", "normalized", "--alpha2", "2"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    samplers = json.loads((tmp_path / "funnel.json").read_text())["samplers"]
    assert list(samplers) == ["identity", "monge", "monge-current+Γ"]
    exact = samplers["monge-current+Γ"]["settings"]
    assert exact["correction"] is True and exact["gradient_noise_std"] == 0.0
    assert (exact["alpha2"], exact["alpha2_rule"], exact["lr"]) == (2.0, "normalized", 0.003)
    ema = samplers["monge"]["settings"]
    assert (ema["alpha2"], ema["alpha2_rule"], ema["gradient_noise_std"]) == (
        2.0,
        "normalized",
        0.0,
    )
    assert len(samplers["identity"]["distances"]["wasserstein1"]["per_chain"]) == 2


@pytest.mark.parametrize(
    "flag", [["--correction"], ["--alpha2", "1"], ["--alpha2-rule", "normalized"]]
)
def test_funnel_exact_options_need_exact_metric(
    flag: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from sgrld.cli import main

    assert main(["funnel", "--out", str(tmp_path), "--no-plot", *flag]) == 2
    assert "need --exact-metric" in capsys.readouterr().err
