"""Ensemble metrics, ECE, curvature and the equal-time analysis against brute-force oracles."""

from __future__ import annotations

import io
import itertools
import math

import numpy as np
import pytest
import torch
from torch import nn

from sgrld.evaluation.curvature import measure_curvature
from sgrld.evaluation.ensemble import EnsemblePredictive
from sgrld.evaluation.equal_time import (
    SamplerCurves,
    equal_time_table,
    interpolate_at_time,
    mean_std_over_runs,
    select_at_time,
)
from sgrld.likelihoods.calibration import (
    expected_calibration_error,
    reliability_bins,
)

# ---------------------------------------------------------------------------------------------
# ECE


def _google_ece(probs: np.ndarray, labels: np.ndarray, num_bins: int = 30) -> float:
    """Step-by-step transcription of uncertainty_metrics' top-label L1 ECE (eps included)."""
    predicted = np.argmax(probs, axis=1)
    conf = probs[np.arange(len(probs)), predicted]
    hits = (predicted == labels).astype(np.float64)
    upper = np.histogram_bin_edges([], bins=num_bins, range=(0.0, 1.0))[1:]
    index = np.digitize(conf, upper)
    counts = np.bincount(index, minlength=num_bins) + np.finfo(np.float64).eps
    confidences = np.bincount(index, weights=conf, minlength=num_bins) / counts
    accuracies = np.bincount(index, weights=hits, minlength=num_bins) / counts
    return float(np.sum(np.abs((accuracies - confidences) * counts / len(conf))))


def test_ece_hand_computed_with_edge_and_extra_bins() -> None:
    # (confidence, correct) pairs, two classes, so a row is (p, 1 - p) with label 0 or 1.
    rows = [
        (1.0, True),  # extra bin 30: contributes |1 - 1| = 0
        (1.0, False),  # extra bin 30: |0 - 1| = 1
        (0.99, True),  # bin 29 [29/30, 1): |1 - 0.99| = 0.01; would merge with the 1.0s if
        #                 1.0 were put in the last regular bin
        (0.5, True),  # 0.5 is the lower edge of bin 15, not the top of bin 14
        (0.52, False),  # bin 15 too: |(1 + 0) - (0.5 + 0.52)| = 0.02
        (0.7, False),  # bin 21: |0 - 0.7| = 0.7
    ]
    probs = np.array([[p, 1.0 - p] for p, _ in rows])
    labels = np.array([0 if correct else 1 for _, correct in rows])
    expected = (0.0 + 1.0 + 0.01 + 0.02 + 0.7) / 6
    assert expected_calibration_error(probs, labels) == pytest.approx(expected, abs=1e-15)
    assert _google_ece(probs, labels) == pytest.approx(expected, abs=1e-15)
    bins = reliability_bins(probs.max(axis=1), labels == 0)
    assert bins.counts.tolist() == [0] * 15 + [2] + [0] * 5 + [1] + [0] * 7 + [1, 2]
    assert bins.accuracy[30] == 0.5 and bins.confidence[30] == 1.0


def test_ece_matches_reference_algorithm_on_random_problems() -> None:
    rng = np.random.default_rng(0)
    for num_classes in (2, 3, 10):
        logits = 4.0 * rng.standard_normal((500, num_classes))
        probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
        probs[:20] = np.eye(num_classes)[rng.integers(num_classes, size=20)]  # exact 1.0s
        labels = rng.integers(num_classes, size=500)
        for num_bins in (1, 10, 30):
            ours = expected_calibration_error(probs, labels, num_bins)
            assert ours == pytest.approx(_google_ece(probs, labels, num_bins), abs=1e-14)
    assert expected_calibration_error(np.zeros((0, 3)), np.zeros(0)) == 0.0


# ---------------------------------------------------------------------------------------------
# Streaming ensemble


def _brute_force_metrics(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Metrics from all stored samples ``(S, N, C)`` by direct averaging of probabilities."""
    probs = torch.softmax(logits.double(), dim=-1).mean(dim=0)
    lps = torch.log_softmax(logits.double(), dim=-1)[:, torch.arange(len(labels)), labels]
    lp = (torch.logsumexp(lps, dim=0) - math.log(len(logits))).mean()
    return {
        "lp": float(lp),
        "accuracy": float((probs.argmax(dim=1) == labels).double().mean()),
        "ece": _google_ece(probs.numpy(), labels.numpy()),
        "confidence": float(probs.max(dim=1).values.mean()),
    }


def _random_problem(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    num_samples, num_points, num_classes = 7, 97, 5
    base = 3.0 * torch.randn(num_points, num_classes, generator=gen)
    logits = base + 2.0 * torch.randn(num_samples, num_points, num_classes, generator=gen)
    logits[:, :5, 0] += 60.0  # points whose averaged probability rounds to exactly 1.0
    labels = torch.randint(num_classes, (num_points,), generator=gen)
    return logits.float(), labels


@pytest.mark.parametrize("seed", [0, 1])
def test_streaming_ensemble_equals_brute_force_after_every_sample(seed: int) -> None:
    logits, labels = _random_problem(seed)
    ensemble = EnsemblePredictive(logits.shape[1], logits.shape[2])
    for s in range(len(logits)):
        ensemble.add(logits[s])
        got = ensemble.metrics(labels)
        want = _brute_force_metrics(logits[: s + 1], labels)
        assert got["num_samples"] == s + 1
        for key, value in want.items():
            assert got[key] == pytest.approx(value, abs=1e-12), key
    assert ensemble.log_predictive().exp().max() == 1.0  # the extra ECE bin is exercised


def test_minibatched_samples_equal_whole_samples() -> None:
    logits, labels = _random_problem(2)
    whole = EnsemblePredictive(logits.shape[1], logits.shape[2])
    batched = EnsemblePredictive(logits.shape[1], logits.shape[2])
    bounds = [0, 10, 40, 41, 97]
    for sample in logits:
        whole.add(sample)
        for start, stop in reversed(list(itertools.pairwise(bounds))):
            batched.add_batch(start, sample[start:stop])
        batched.commit()
    assert torch.equal(whole.log_predictive(), batched.log_predictive())
    assert whole.metrics(labels) == batched.metrics(labels)


def test_resume_from_state_dict_equals_uninterrupted() -> None:
    logits, labels = _random_problem(3)
    uninterrupted = EnsemblePredictive(logits.shape[1], logits.shape[2])
    first = EnsemblePredictive(logits.shape[1], logits.shape[2])
    for sample in logits:
        uninterrupted.add(sample)
    for sample in logits[:4]:
        first.add(sample)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = EnsemblePredictive(logits.shape[1], logits.shape[2])
    resumed.load_state_dict(torch.load(buffer))
    for sample in logits[4:]:
        resumed.add(sample)
    assert resumed.num_samples == uninterrupted.num_samples
    assert torch.equal(resumed.log_predictive(), uninterrupted.log_predictive())
    assert resumed.metrics(labels) == uninterrupted.metrics(labels)


def test_ensemble_guards() -> None:
    ensemble = EnsemblePredictive(4, 3)
    empty = ensemble.metrics(torch.zeros(4, dtype=torch.long))
    assert empty["num_samples"] == 0 and math.isnan(empty["lp"]) and math.isnan(empty["ece"])
    ensemble.add_batch(0, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="already given"):
        ensemble.add_batch(1, torch.zeros(2, 3))
    with pytest.raises(RuntimeError, match="commit first"):
        ensemble.state_dict()
    with pytest.raises(RuntimeError, match="2 of 4 points"):
        ensemble.commit()
    with pytest.raises(ValueError, match="outside"):
        ensemble.add_batch(3, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="state is for"):
        EnsemblePredictive(5, 3).load_state_dict(EnsemblePredictive(4, 3).state_dict())


# ---------------------------------------------------------------------------------------------
# Curvature


def _linear_oracle(
    layer: nn.Linear, x: torch.Tensor, y: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top two eigenvalues of ∇²ₓ NLL_i = Wᵀ(diag p − p pᵀ)W and ‖∇ₓ NLL_i‖ = ‖Wᵀ(p − e_y)‖."""
    weight = layer.weight.detach()
    p = torch.softmax(layer(x.flatten(1)).detach(), dim=1)
    hessians = weight.T @ (torch.diag_embed(p) - p[:, :, None] * p[:, None, :]) @ weight
    grads = (p - nn.functional.one_hot(y, p.shape[1]).double()) @ weight
    eigenvalues = torch.linalg.eigvalsh(hessians)
    return eigenvalues[:, -1], eigenvalues[:, -2], grads.norm(dim=1)


def _linear_model(seed: int) -> tuple[nn.Module, nn.Linear, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    layer = nn.Linear(6, 4).double()
    with torch.no_grad():
        layer.weight.mul_(6.0)
    model = nn.Sequential(nn.Flatten(), nn.Dropout(0.5), layer)
    x = torch.randn(10, 2, 3, dtype=torch.float64)  # non-flat inputs: norms over all dims
    y = torch.randint(4, (10,))
    return model, layer, x, y


def test_curvature_matches_analytic_linear_softmax_hessian() -> None:
    model, layer, x, y = _linear_model(0)
    lam, second, grad_norm = _linear_oracle(layer, x, y)
    assert torch.all(second / lam < 0.6)  # eigengap: 20 iterations converge to ~0.6**40
    batch_size = 4  # batches of 4, 4 and 2 points: the last one is scaled by 1/2
    scale = torch.tensor([4.0] * 8 + [2.0] * 2, dtype=torch.float64)
    rng_state = torch.get_rng_state()
    stats = measure_curvature(
        model,
        x,
        y,
        generator=torch.Generator().manual_seed(0),
        num_points=10,
        batch_size=batch_size,
    )
    assert torch.equal(torch.get_rng_state(), rng_state)  # no global draw
    torch.testing.assert_close(stats.grad_norm, grad_norm / scale, rtol=1e-12, atol=0.0)
    # ρ = s‖u‖² with s = λ/B; the reference's u ← Hu / (‖Hu‖ + 1e-6) settles at
    # ‖u‖ = 1 − 1e-6/s, so ρ = (s − 1e-6)² / s (module docstring).
    s = lam / scale
    torch.testing.assert_close(stats.rho_abs, (s - 1e-6) ** 2 / s, rtol=1e-9, atol=0.0)
    # c_i = |ρ_i| / (‖g_i‖ + 1e-6) ≈ |λ_i| / (‖∇NLL_i‖ + B·1e-6): the spec's equivalence.
    torch.testing.assert_close(stats.curvature, stats.rho_abs / (stats.grad_norm + 1e-6))
    torch.testing.assert_close(stats.curvature, lam / (grad_norm + scale * 1e-6), rtol=1e-4, atol=0)
    assert stats.mean == pytest.approx(float(stats.curvature.mean()))
    assert stats.std == pytest.approx(float(stats.curvature.std()))
    assert stats.rho_abs_mean == pytest.approx(float(stats.rho_abs.mean()))
    assert stats.grad_norm_mean == pytest.approx(float((grad_norm / scale).mean()))


def test_curvature_has_no_side_effects() -> None:
    model, _, x, y = _linear_model(1)  # Flatten, Dropout, Linear
    norm = nn.BatchNorm1d(6).double()
    full = nn.Sequential(model[0], norm, *model[1:]).train()
    full[0].eval()  # a mixed-mode model must come back mixed
    running_mean = norm.running_mean.clone()
    rng_state = torch.get_rng_state()
    first = measure_curvature(full, x, y, generator=torch.Generator().manual_seed(5), num_points=8)
    assert torch.equal(torch.get_rng_state(), rng_state)  # no global draw
    assert [m.training for m in full.modules()] == [True, False, True, True, True]
    assert all(p.grad is None for p in full.parameters())
    assert torch.equal(norm.running_mean, running_mean)  # eval mode: no BN statistics update
    # Eval mode and a dedicated generator make the result deterministic despite the dropout.
    full.eval()
    again = measure_curvature(full, x, y, generator=torch.Generator().manual_seed(5), num_points=8)
    assert torch.equal(first.curvature, again.curvature)
    assert not any(m.training for m in full.modules())


# ---------------------------------------------------------------------------------------------
# Equal computation time


def test_interpolation_follows_epoch_end_times() -> None:
    curve = np.array([np.nan, -1.0, -0.5, -0.25])
    assert interpolate_at_time(curve, 2.0, 4.0) == -1.0  # epoch 1 ends at 2·2 s
    assert interpolate_at_time(curve, 2.0, 5.0) == pytest.approx(-0.75)
    assert interpolate_at_time(curve, 2.0, 8.0) == -0.25
    assert math.isnan(interpolate_at_time(curve, 2.0, 3.0))  # before the first sample
    rng = np.random.default_rng(0)
    values = rng.standard_normal(50)
    for budget in rng.uniform(3.3, 50 * 3.3, size=20):
        want = np.interp(budget, 3.3 * np.arange(1, 51), values)
        assert interpolate_at_time(values, 3.3, budget) == pytest.approx(want, abs=1e-14)
    with pytest.raises(ValueError, match="outside"):
        interpolate_at_time(curve, 2.0, 8.5)
    with pytest.raises(ValueError, match="outside"):
        interpolate_at_time(curve, 2.0, 1.0)


def test_equal_time_reselects_at_the_budget() -> None:
    runs = np.array([[0.0, 1.0, 2.0], [2.0, 3.0, 4.0]])
    mean, std = mean_std_over_runs(runs)
    np.testing.assert_array_equal(mean, [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(std, [1.0, 1.0, 1.0])  # ddof = 0

    # Setting "b" wins after 4 epochs but "a" is ahead at the budget of 4 × 1 s = epoch 2 of 4
    # for the slow sampler (T = 2 s).
    slow = SamplerCurves(
        seconds_per_epoch=2.0,
        selection={"a": [-1.0, -0.2, -0.2, -0.2], "b": [-2.0, -0.9, -0.3, -0.1]},
        test_mean={"a": {"lp": [-1.1, -0.3, -0.3, -0.3]}, "b": {"lp": [-2.1, -1.0, -0.4, -0.2]}},
        test_std={"a": {"lp": [0.4, 0.2, 0.2, 0.2]}, "b": {"lp": [0.4, 0.3, 0.1, 0.1]}},
    )
    fast = SamplerCurves(
        seconds_per_epoch=1.0,
        selection={"c": [np.nan, -0.5, -0.4, -0.3]},
        test_mean={"c": {"lp": [np.nan, -0.6, -0.5, -0.4], "acc": [np.nan, 0.5, 0.6, 0.7]}},
        test_std={"c": {"lp": [np.nan, 0.1, 0.1, 0.1], "acc": [np.nan, 0.0, 0.0, 0.1]}},
    )
    table = equal_time_table({"slow": slow, "fast": fast})
    assert table["slow"].setting == "a" and table["slow"].selection_value == -0.2
    assert table["slow"].metrics == {"lp": (-0.3, 0.2)}
    assert table["fast"].metrics == {"lp": (-0.4, 0.1), "acc": (0.7, 0.1)}
    at_end = equal_time_table({"slow": slow}, budget_s=8.0)["slow"]
    assert at_end.setting == "b" and at_end.metrics["lp"] == (-0.2, 0.1)
    half = equal_time_table({"slow": slow}, budget_s=3.0)["slow"]  # halfway through epoch 1
    assert half.setting == "a" and half.metrics["lp"] == pytest.approx((-0.7, 0.3))
    assert select_at_time({"x": [np.nan, 1.0], "y": [0.0, 2.0]}, 1.0, 2.0) == ("y", 2.0)
    with pytest.raises(ValueError, match="finite"):
        select_at_time({"x": [np.nan, np.nan]}, 1.0, 1.0)
