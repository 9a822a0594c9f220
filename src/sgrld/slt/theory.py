"""Closed-form learning coefficients, the references the LLC estimates are tested against."""

from __future__ import annotations

from collections.abc import Sequence


def regular_llc(num_params: int) -> float:
    """λ = d/2: a regular model (identifiable, non-degenerate Fisher information) of d
    parameters (Watanabe 2009, §1.4: the BIC's penalty)."""
    return num_params / 2.0


def localized_quadratic_llc(
    hessian_eigenvalues: Sequence[float], nbeta: float, localization: float
) -> float:
    """The exact λ̂ of a quadratic loss under the localised tempered posterior.

    With L_n(w) = L_n(w₀) + ½(w − w₀)ᵀH(w − w₀), the posterior
    exp(−nβL_n − γ/2‖w − w₀‖²) is Gaussian with precision nβH + γI, so
    nβ·E[L_n − L_n(w₀)] = ½ Σᵢ nβhᵢ/(nβhᵢ + γ).
    """
    return 0.5 * sum(nbeta * h / (nbeta * h + localization) for h in hessian_eigenvalues)


def reduced_rank_regression_llc(inputs: int, outputs: int, hidden: int, rank: int) -> float:
    """λ of reduced-rank regression y = BAx (A: hidden × inputs, B: outputs × hidden) at a true
    map of rank ``rank`` ≤ ``hidden`` (Aoyagi & Watanabe 2005, Main Theorem).

    With M = inputs, N = outputs, H = hidden, r = rank:

    * M + H < N + r: λ = (HM − Hr + Nr)/2;
    * N + H < M + r: λ = (HN − Hr + Mr)/2;
    * M + N < H + r: λ = MN/2;
    * otherwise λ = (2(H + r)(M + N) − (M − N)² − (H + r)² + s)/8 with s = 0 if M + H + N + r
      is even, 1 if odd.
    """
    m, n, h, r = inputs, outputs, hidden, rank
    if not 0 <= r <= h or min(m, n, h) < 1:
        raise ValueError(f"need 0 <= rank <= hidden and positive sizes, got {m, n, h, r}")
    if m + h < n + r:
        return (h * m - h * r + n * r) / 2.0
    if n + h < m + r:
        return (h * n - h * r + m * r) / 2.0
    if m + n < h + r:
        return m * n / 2.0
    odd = (m + h + n + r) % 2
    return (2 * (h + r) * (m + n) - (m - n) ** 2 - (h + r) ** 2 + odd) / 8.0
