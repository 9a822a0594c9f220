"""Closed-form learning coefficients, the references the LLC estimates are tested against."""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction


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


def deep_linear_network_llc(widths: Sequence[int], rank: int) -> float:
    """λ of a deep linear network x ↦ W_L⋯W₁x without biases (W_j: H_{j+1} × H_j) at a true
    map of rank ``rank`` (Aoyagi 2024, Theorem 1; reduced-rank regression is L = 2).

    With widths H₁ (inputs), …, H_{L+1} (outputs), r = rank and M_j = H_j − r: let 𝓜 be the
    ℓ + 1 smallest M_j (ℓ ≥ 1) such that

        max_{𝓜} M_j < min_{not 𝓜} M_j,   Σ_{𝓜} M_j ≥ ℓ·max_{𝓜} M_j,   Σ_{𝓜} M_j < ℓ·min_{not 𝓜} M_j

    (the conditions on the rest vacuous when 𝓜 is all of them); with S = Σ_{𝓜} M_j,
    M̄ = ⌈S/ℓ⌉ and a = S − (M̄ − 1)ℓ ∈ (0, ℓ]:

        λ = (−r² + r(H₁ + H_{L+1}))/2 + a(ℓ − a)/(4ℓ) − ℓ(ℓ − 1)/4·(S/ℓ)² + ½Σ_{i<j∈𝓜} M_i M_j.

    Args:
        widths: H₁, …, H_{L+1}, at least two (one layer: a regular linear map, λ = H₁H₂/2).
        rank: r, 0 ≤ r ≤ min(widths).

    Raises:
        ValueError: widths that are not positive, fewer than two, or a rank out of range.
    """
    h = [int(w) for w in widths]
    if len(h) < 2 or min(h) < 1 or not 0 <= rank <= min(h):
        raise ValueError(f"need >= 2 positive widths and 0 <= rank <= min(widths), got {h}, {rank}")
    m = sorted(w - rank for w in h)
    for size in range(2, len(m) + 1):
        chosen, rest, ell = m[:size], m[size:], size - 1
        total = sum(chosen)
        if rest and not (chosen[-1] < rest[0] and total < ell * rest[0]):
            continue
        if total >= ell * chosen[-1]:
            break
    else:  # pragma: no cover - Aoyagi's Lemma: such a set always exists
        raise AssertionError(f"no subset satisfies Aoyagi's conditions for {h}, rank {rank}")
    upper = -(-total // ell)  # ⌈S/ℓ⌉
    a = total - (upper - 1) * ell
    pairs = sum(chosen[i] * chosen[j] for i in range(size) for j in range(i + 1, size))
    value = (  # exact in rationals: ℓ(ℓ − 1)/4·(S/ℓ)² = (ℓ − 1)S²/(4ℓ)
        Fraction(-(rank**2) + rank * (h[0] + h[-1]), 2)
        + Fraction(a * (ell - a), 4 * ell)
        - Fraction((ell - 1) * total**2, 4 * ell)
        + Fraction(pairs, 2)
    )
    return float(value)
