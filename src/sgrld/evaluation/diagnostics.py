"""MCMC diagnostics over ``(chain, draw, ...)`` arrays: ESS, split R-hat and MCSE.

Small NumPy functions in the style of ``numpyro.diagnostics``: every function takes samples with
the chain axis first and the draw axis second, and returns an array of the trailing (event) shape,
one value per scalar component (a 0-d array for scalar chains). Constant components give NaN.

These are the basic (not rank-normalised) estimators of Gelman et al., *Bayesian Data Analysis*
(3rd ed.), §11.4-11.5, with Geyer's (1992) initial monotone sequence for the autocorrelation sum,
as in Stan. They are used by the statistical tests of the samplers.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["autocorrelation", "effective_sample_size", "mcse_mean", "split_rhat"]


def _chains(samples: npt.ArrayLike, min_draws: int) -> np.ndarray:
    x = np.asarray(samples, dtype=np.float64)
    if x.ndim < 2:
        raise ValueError(f"expected (chain, draw, ...) samples, got shape {x.shape}")
    if x.shape[1] < min_draws:
        raise ValueError(f"need at least {min_draws} draws per chain, got {x.shape[1]}")
    return x


def _autocovariance(x: np.ndarray) -> np.ndarray:
    """Biased (divide-by-n) autocovariance along the draw axis of each chain, via FFT."""
    n = x.shape[1]
    centred = x - x.mean(axis=1, keepdims=True)
    size = 1 << (2 * n - 1).bit_length()  # zero-pad: no circular wrap-around
    spectrum = np.fft.rfft(centred, n=size, axis=1)
    return np.fft.irfft(spectrum * np.conj(spectrum), n=size, axis=1)[:, :n] / n


def _between_within(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Within-chain variance ``W`` and the pooled estimate ``var⁺ = (n-1)/n W + B/n`` (BDA3)."""
    n = x.shape[1]
    within = x.var(axis=1, ddof=1).mean(axis=0)
    between_over_n = x.mean(axis=1).var(axis=0, ddof=1) if x.shape[0] > 1 else 0.0
    return within, (n - 1) / n * within + between_over_n


def autocorrelation(samples: npt.ArrayLike) -> np.ndarray:
    """Combined autocorrelation ``ρ̂_t`` over chains, ``1 − (W − mean_c γ̂_{c,t}) / var⁺``.

    Args:
        samples: ``(chain, draw, ...)`` array, at least 2 draws.

    Returns:
        ``(draw, ...)`` array with ``ρ̂_0 = 1``.

    References:
        BDA3 eq. (11.7); Stan Reference Manual, "Effective sample size".
    """
    x = _chains(samples, min_draws=2)
    within, var_plus = _between_within(x)
    with np.errstate(divide="ignore", invalid="ignore"):
        rho = 1.0 - (within - _autocovariance(x).mean(axis=0)) / var_plus
    rho[0] = 1.0
    return rho


def effective_sample_size(samples: npt.ArrayLike) -> np.ndarray:
    """Effective sample size ``S_eff = m n / τ̂`` with Geyer's initial monotone sequence.

    ``τ̂ = −1 + 2 Σ_k P̂_k`` over the pair sums ``P̂_k = ρ̂_{2k} + ρ̂_{2k+1}``, truncated at the
    first non-positive pair and made monotone non-increasing. For iid draws ``S_eff ≈ m n``; for
    an AR(1) chain with coefficient φ, ``S_eff ≈ m n (1 − φ) / (1 + φ)``.

    Args:
        samples: ``(chain, draw, ...)`` array, at least 4 draws per chain.

    Returns:
        Array of the event shape ``samples.shape[2:]``.

    References:
        Geyer (1992), "Practical Markov chain Monte Carlo", Stat. Sci.; BDA3 §11.5.
    """
    x = _chains(samples, min_draws=4)
    rho = autocorrelation(x)
    num_pairs = rho.shape[0] // 2
    pairs = rho[0 : 2 * num_pairs : 2] + rho[1 : 2 * num_pairs : 2]
    keep = np.cumprod(pairs > 0, axis=0).astype(bool)  # initial positive sequence
    keep[0] = True
    pairs = np.minimum.accumulate(np.where(keep, pairs, 0.0), axis=0)  # initial monotone
    tau = -1.0 + 2.0 * pairs.sum(axis=0)
    return np.asarray(x.shape[0] * x.shape[1] / tau)


def split_rhat(samples: npt.ArrayLike) -> np.ndarray:
    """Split potential scale reduction ``R̂ = sqrt(var⁺ / W)`` over half-chains.

    Each chain is split into its first and last ``n // 2`` draws (the middle draw of an odd
    chain is dropped), so that a drifting chain inflates ``R̂`` too. ``R̂ ≈ 1`` for converged
    chains; values above about 1.01 signal disagreement.

    Args:
        samples: ``(chain, draw, ...)`` array, at least 4 draws per chain.

    Returns:
        Array of the event shape ``samples.shape[2:]``.

    References:
        BDA3 §11.4 (eq. 11.4); Vehtari et al. (2021), §3 (the basic, non-rank-normalised form).
    """
    x = _chains(samples, min_draws=4)
    half = x.shape[1] // 2
    halves = np.concatenate([x[:, :half], x[:, -half:]], axis=0)
    within, var_plus = _between_within(halves)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.asarray(np.sqrt(var_plus / within))


def mcse_mean(samples: npt.ArrayLike) -> np.ndarray:
    """Monte-Carlo standard error of the posterior-mean estimate, ``sd / sqrt(S_eff)``.

    Args:
        samples: ``(chain, draw, ...)`` array, at least 4 draws per chain.

    Returns:
        Array of the event shape ``samples.shape[2:]``; ``sd`` pools all draws (ddof = 1).
    """
    x = _chains(samples, min_draws=4)
    pooled = x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.asarray(pooled.std(axis=0, ddof=1) / np.sqrt(effective_sample_size(x)))
