"""Top-label expected calibration error (ECE) with the reference's binning.

As Google ``uncertainty_metrics``' ``ece(labels, probs, num_bins=30)`` (top-label, L1, 30
equal-width bins), including ``np.digitize``'s extra bin for a confidence of exactly 1.0 (an
ordinary bin for the sum); the reference's ``+ eps`` on the counts cancels, so the ECE is
``Σ_b |Σ_{i∈b} (correct_i − conf_i)| / N``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

__all__ = ["ReliabilityBins", "expected_calibration_error", "reliability_bins", "top_label"]

ArrayOrTensor = npt.ArrayLike | torch.Tensor


def _as_numpy(array: ArrayOrTensor) -> np.ndarray:
    if isinstance(array, torch.Tensor):
        return array.detach().cpu().numpy()
    return np.asarray(array)


@dataclass(frozen=True, kw_only=True)
class ReliabilityBins:
    """Per-bin statistics of a top-label reliability diagram; ``num_bins + 1`` entries each, the
    last the extra bin of confidences of exactly 1.0.

    Attributes:
        upper_edges: Upper edge of each regular bin, ``(1/B, 2/B, ..., 1)``, length ``num_bins``.
        counts: Number of points per bin.
        confidence: Mean confidence per bin (0 for empty bins).
        accuracy: Fraction of correct top-label predictions per bin (0 for empty bins).
    """

    upper_edges: np.ndarray
    counts: np.ndarray
    confidence: np.ndarray
    accuracy: np.ndarray


def top_label(probs: ArrayOrTensor, labels: ArrayOrTensor) -> tuple[np.ndarray, np.ndarray]:
    """The top-label confidence and correctness of each point.

    Args:
        probs: Class probabilities, shape ``(N, C)``.
        labels: Integer class labels, shape ``(N,)``.

    Returns:
        ``(confidence, correct)``: the max probability and whether its argmax (first on ties)
        equals the label (0/1), float64 of shape ``(N,)``.
    """
    probs_np = _as_numpy(probs).astype(np.float64, copy=False)
    labels_np = _as_numpy(labels)
    if probs_np.ndim != 2 or labels_np.shape != probs_np.shape[:1]:
        raise ValueError(
            f"expected probs (N, C) and labels (N,), got {probs_np.shape} and {labels_np.shape}"
        )
    predicted = probs_np.argmax(axis=1)
    confidence = probs_np[np.arange(len(probs_np)), predicted]
    correct = (predicted == labels_np).astype(np.float64)
    return confidence, correct


def reliability_bins(
    confidence: ArrayOrTensor, correct: ArrayOrTensor, num_bins: int = 30
) -> ReliabilityBins:
    """Bin top-label confidences into ``num_bins`` equal-width bins plus the extra 1.0 bin.

    Args:
        confidence: Top-label confidences in [0, 1], shape ``(N,)``.
        correct: 1 where the top label is right, else 0, shape ``(N,)``.
        num_bins: Number of equal-width bins on [0, 1] (the reference uses 30).

    Returns:
        The per-bin statistics, see :class:`ReliabilityBins`.

    References:
        Spec §4.4; Nixon et al. (2019), "Measuring Calibration in Deep Learning".
    """
    if num_bins < 1:
        raise ValueError(f"num_bins must be >= 1, got {num_bins}")
    conf = _as_numpy(confidence).astype(np.float64, copy=False).reshape(-1)
    hits = _as_numpy(correct).astype(np.float64, copy=False).reshape(-1)
    if conf.shape != hits.shape:
        raise ValueError(f"confidence and correct differ in size: {conf.shape} vs {hits.shape}")
    upper_edges, counts, conf_sum, hit_sum = _binned_sums(conf, hits, num_bins)
    safe = np.maximum(counts, 1)
    return ReliabilityBins(
        upper_edges=upper_edges, counts=counts, confidence=conf_sum / safe, accuracy=hit_sum / safe
    )


def _binned_sums(
    conf: np.ndarray, hits: np.ndarray, num_bins: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Upper edges, counts, and per-bin sums of confidence and correctness (B + 1 bins)."""
    # Upper edges exactly as np.histogram_bin_edges([], bins=B, range=(0, 1))[1:] (reference).
    upper_edges = np.linspace(0.0, 1.0, num_bins + 1)[1:]
    index = np.digitize(conf, upper_edges)
    counts = np.bincount(index, minlength=num_bins + 1)
    conf_sum = np.bincount(index, weights=conf, minlength=num_bins + 1)
    hit_sum = np.bincount(index, weights=hits, minlength=num_bins + 1)
    return upper_edges, counts, conf_sum, hit_sum


def expected_calibration_error(
    probs: ArrayOrTensor, labels: ArrayOrTensor, num_bins: int = 30
) -> float:
    """Top-label L1 expected calibration error, ``Σ_b (n_b / N) |acc_b - conf_b|`` (module
    docstring).

    Args:
        probs: Class probabilities (for the paper: the ensemble-averaged predictive), ``(N, C)``.
        labels: Integer class labels, ``(N,)``.
        num_bins: Number of equal-width bins (30 in the paper, Tables 8-9).

    Returns:
        The ECE in [0, 1]; 0.0 for an empty input, as the reference.

    References:
        The paper's Tables 8-9; Guo et al. (2017), "On Calibration of Modern Neural Networks".

    Examples:
        >>> expected_calibration_error([[0.9, 0.1], [1.0, 0.0]], [0, 1])
        0.55
    """
    if num_bins < 1:
        raise ValueError(f"num_bins must be >= 1, got {num_bins}")
    confidence, correct = top_label(probs, labels)
    if confidence.size == 0:
        return 0.0
    _, _, conf_sum, hit_sum = _binned_sums(confidence, correct, num_bins)
    # n_b |acc_b - conf_b| = |Σ_{i∈b} (correct_i - conf_i)|; the eps of the reference cancels.
    return float(np.abs(hit_sum - conf_sum).sum() / confidence.size)
