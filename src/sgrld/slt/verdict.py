"""The verdict on an LLC estimate: has it mixed, is its step stable, is w₀ a minimum.

Small NumPy functions over the ``(chain, draw)`` loss traces (and, where known, the step's
stiffness from the calibration's spectrum, :mod:`sgrld.slt.calibration`): the traces averaged
over blocks of one pass of batches, then stationarity (from where G is frozen), split R̂ (BDA3
§11.4) and ESS (Geyer's initial monotone sequence, as Stan and NumPyro) of the block means, the
step's stability and bias in the quadratic model, whole passes, the sign and batches drawn with
replacement. ``docs/llc.md`` ("The verdict") gives each check, its threshold and why, and the
standard error :func:`judge` returns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

#: R̂ above this says the chains disagree (Vehtari et al. 2021 suggest 1.01 for 4 chains of
#: thousands of draws; the block means are ~100 draws per chain, whose R̂ scatters more;
#: 1.1 under 100 blocks)
MAX_RHAT = 1.05
#: fewest effective draws of the block means for a standard error worth quoting
MIN_ESS = 40.0
#: the stiffest direction's variance inflation above which ε is judged unstable (halfway to
#: the stability edge, the most the calibration allows)
MAX_INFLATION = 0.5
#: the step's bias on λ̂ (quadratic model) above which it is judged too large, relative to λ̂
MAX_STEP_BIAS = 0.05
#: relaxations of the slowest direction over the chain below which it cannot have mixed
MIN_RELAXATIONS = 1.0
#: the drift between the halves of the trace (in λ̂'s units) tolerated below this fraction
DRIFT_FRACTION = 0.05
#: blocks per chain the traces are cut into at the least
MIN_BLOCKS = 20


class LLCWarning(UserWarning):
    """:func:`sgrld.llc`'s estimate failed its verdict (the message lists the problems)."""


@dataclass(frozen=True)
class LLCVerdict:
    """What the traces say about an estimate.

    Attributes:
        ok: no problem found.
        problems: one sentence per problem (empty when ``ok``).
        rhat: split R̂ of the per-chain block means (NaN for one chain and one block).
        ess: their effective sample size over all chains.
        window: steps per block (one pass of batches where the loader has a length).
        first_half: λ̂ from the m whole passes before the last m (burn-in after G's freeze
            included; m: half the passes of the trace from the freeze, at most those after
            burn-in).
        last_half: λ̂ from the last m whole passes (the stationary value's better guess).
        drift_se: the standard error of ``last_half − first_half``.
        inflation: the stiffest direction's variance inflation ε(a₊ + nβ²s²)/4 (NaN if
            unknown: masks, sharded or low-precision parameters, or no double backward).
        step_bias: the step's bias on λ̂ in the quadratic model, ε/8·(tr(nβH) + nβ²tr Σ) in
            the metric's coordinates (NaN if unknown).
        relaxations: how many times the slowest quadratic direction relaxes over the chain,
            εa₋T/2 (NaN if unknown); under 1 is flagged (along a singular model's flat
            directions, held by γ alone, the loss may not change: then λ̂ is still right).
        passes: passes over the loader the trace after burn-in covers (NaN if it has no
            length).
        draw_error: where the loader draws its batches with replacement, nβ times the
            error of L_n(w₀) and of the trace's mean from the batches drawn, which every chain
            shares (0 for whole passes, where both are exact or cancel).
    """

    ok: bool
    problems: tuple[str, ...]
    rhat: float
    ess: float
    window: int
    first_half: float
    last_half: float
    drift_se: float
    inflation: float = math.nan
    step_bias: float = math.nan
    relaxations: float = math.nan
    passes: float = math.nan
    draw_error: float = 0.0

    def __str__(self) -> str:
        return "ok" if self.ok else "; ".join(self.problems)


def block_means(x: np.ndarray, window: int) -> np.ndarray:
    """The means of each ``(chain, draw)`` row's last whole blocks of ``window`` draws."""
    blocks = x.shape[1] // window
    return x[:, x.shape[1] - blocks * window :].reshape(len(x), blocks, window).mean(axis=2)


def split_rhat(draws: np.ndarray) -> float:
    """Split R̂ of ``(chain, draw)`` draws (BDA3 §11.4): each chain cut in halves, the
    between-halves against the within-halves variance. NaN with fewer than 4 draws."""
    x = np.asarray(draws, dtype=np.float64)
    half = x.shape[1] // 2
    if half < 2:
        return math.nan
    halves = np.concatenate([x[:, :half], x[:, x.shape[1] - half :]])
    within = halves.var(axis=1, ddof=1).mean()
    between = half * halves.mean(axis=1).var(ddof=1)
    if within <= 0.0:
        return math.nan
    return float(math.sqrt(((half - 1) / half * within + between / half) / within))


def effective_sample_size(draws: np.ndarray) -> float:
    """ESS of the mean of ``(chain, draw)`` draws: Geyer's initial monotone sequence over the
    chains' pooled autocorrelation (Stan's estimator, without rank normalisation)."""
    x = np.asarray(draws, dtype=np.float64)
    chains, n = x.shape
    if n < 4:
        return math.nan
    centred = x - x.mean(axis=1, keepdims=True)
    size = 2 ** math.ceil(math.log2(2 * n))
    spectrum = np.fft.rfft(centred, size, axis=1)
    acov = np.fft.irfft(spectrum * np.conj(spectrum), size, axis=1)[:, :n] / n
    within = acov[:, 0].mean() * n / (n - 1)
    var_plus = within * (n - 1) / n
    if chains > 1:
        var_plus += x.mean(axis=1).var(ddof=1)
    if var_plus <= 0.0:
        return math.nan
    rho = 1.0 - (within - acov.mean(axis=0)) / var_plus
    rho[0] = 1.0
    # Geyer: sums of adjacent pairs, positive and monotone
    pairs = rho[: n - n % 2].reshape(-1, 2).sum(axis=1)
    total, last = 0.0, math.inf
    for p in pairs:
        if p <= 0.0:
            break
        last = min(last, p)
        total += last
    tau = -1.0 + 2.0 * total
    return float(chains * n / max(tau, 1.0 / math.log10(chains * n + 10)))


def judge(
    trace: np.ndarray,
    *,
    init_loss: float,
    nbeta: float,
    burnin: int,
    window: int,
    pass_length: int | None = None,
    inflation: float = math.nan,
    step_bias: float = math.nan,
    relaxations: float = math.nan,
    adapting: int = 0,
    batch_spread: float = 0.0,
    frozen_from: int = 0,
) -> tuple[LLCVerdict, float]:
    """The verdict on the ``(K, T)`` loss traces and the standard error that reflects it.

    Args:
        trace: the batch loss of every chain at every step.
        init_loss: L_n(w₀).
        nbeta: nβ.
        burnin: the leading steps left out of the estimate.
        window: steps per block (one pass of batches); fewer where the trace after burn-in
            has fewer than :data:`MIN_BLOCKS` of them.
        pass_length: batches per pass over the loader, where it has a length.
        inflation, step_bias, relaxations: the step's figures (:class:`LLCVerdict`), where known.
        adapting: steps after burn-in during which the metric was still adapting.
        frozen_from: the step from which the metric's G is fixed (the stationarity check
            looks no earlier); 0 where it never adapts.
        batch_spread: nβ times the standard deviation of one batch's loss at w₀ where the
            loader draws with replacement (0 where it makes whole passes).

    Returns:
        ``(verdict, std_error)``.
    """
    whole = np.asarray(trace, dtype=np.float64)
    init_batches = window  # L_n(w₀)'s batches (one pass where the loader has a length)
    x = whole[:, burnin:]
    chains, steps = x.shape
    period = pass_length or window  # the batches repeat (for every chain alike) every period
    per_chain = nbeta * (x.mean(axis=1) - init_loss)
    mean = float(per_chain.mean())
    # R̂, ESS and the spread: the chains' own parts, the batches' effect (common to every
    # chain, cancelling over whole passes) taken out with the mean over the chains per step
    own = x - x.mean(axis=0, keepdims=True) + x.mean() if chains > 1 else x
    window = max(1, min(period, steps // MIN_BLOCKS))
    means = block_means(own, window)
    blocks = means.shape[1]
    rhat = split_rhat(means) if chains * blocks >= 4 else math.nan
    ess = effective_sample_size(means)
    spread = float(per_chain.std(ddof=1)) / math.sqrt(chains) if chains > 1 else 0.0
    by_ess = nbeta * float(means.std(ddof=1)) / math.sqrt(ess) if ess > 0 else math.nan
    std_error = max(spread, by_ess) if math.isfinite(by_ess) else spread or math.nan
    # batches drawn with replacement, shared by every chain: L_n(w₀) from init_batches of them
    # and the trace's mean from ``steps`` carry their draws' error, which no chain averages
    draw_error = batch_spread * math.sqrt(1.0 / init_batches + 1.0 / steps)
    if draw_error > 0.0:
        std_error = math.hypot(std_error, draw_error)
    problems = []
    if not math.isfinite(mean):
        problems.append("λ̂ is not finite: a chain diverged (lower lr)")
    elif x.size and float(np.ptp(x)) == 0.0:  # R̂, ESS and the spread are then all undefined
        problems.append(
            "the loss is the same at every kept step of every chain: the chains did not move it "
            "and λ̂ = 0 has no error to give; a larger lr, or w₀'s loss is flat to its dtype's "
            "precision"
        )
    if blocks < 4:
        problems.append(f"too short to judge: {steps} steps after burn-in; raise num_steps")
    # stationarity: the last m whole periods against the m before them (burn-in included), so
    # that both see every batch equally often; m = half the periods, at most those kept
    # (after ``frozen_from``: a chain whose G still adapted is another chain, not an earlier
    # part of this one)
    m = min(max(1, steps // period), (whole.shape[1] - frozen_from) // (2 * period))
    if m >= 1:
        late = whole[:, whole.shape[1] - m * period :]
        early = whole[:, whole.shape[1] - 2 * m * period : whole.shape[1] - m * period]
        first = nbeta * (early.mean(axis=1) - init_loss)
        last = nbeta * (late.mean(axis=1) - init_loss)
        diff = last - first
        drift = float(diff.mean())
        # each segment's mean has about the kept trace's variance times steps/(m·period)
        drift_se = math.sqrt(2.0) * by_ess * math.sqrt(steps / (m * period))
        if chains > 1:  # few chains give a noisy spread of the differences: the larger
            drift_se = max(drift_se, float(diff.std(ddof=1)) / math.sqrt(chains))
    else:
        first = last = per_chain
        drift, drift_se = math.nan, math.nan
        problems.append(
            f"too short to judge stationarity: {whole.shape[1]} steps, under two passes of "
            f"{period} batches"
        )
    if abs(drift) > 3.0 * drift_se and abs(drift) > DRIFT_FRACTION * abs(float(last.mean())):
        way = "rising" if drift > 0 else "falling"
        problems.append(
            f"not stationary: the traces are still {way} (λ̂ {float(first.mean()):.3g} over "
            f"{m * period} steps, {float(last.mean()):.3g} over the last {m * period}); more "
            f"steps or a larger lr"
        )
    # R̂ of fewer blocks scatters more (Vats & Knudson 2021): a looser bound below 100
    max_rhat = MAX_RHAT if blocks >= 100 else 2 * MAX_RHAT - 1
    if rhat > max_rhat:
        problems.append(f"the chains disagree (R̂ {rhat:.3f} > {max_rhat:g}); more steps")
    if ess < MIN_ESS:
        problems.append(f"{ess:.0f} effective draws (< {MIN_ESS:.0f}); more steps")
    if inflation > MAX_INFLATION:
        problems.append(
            f"unstable step: the stiffest direction's variance is inflated by {inflation:.0%} "
            f"(> {MAX_INFLATION:.0%}); lower lr"
        )
    if step_bias > MAX_STEP_BIAS * abs(mean):
        problems.append(
            f"step too large: it biases λ̂ by about +{step_bias:.3g} ({step_bias / abs(mean):.1%}"
            f" > {MAX_STEP_BIAS:.0%}); lower lr and raise num_steps"
        )
    if relaxations < MIN_RELAXATIONS:
        problems.append(
            f"not mixed: the slowest direction relaxes {relaxations:.2g} times over the chain "
            f"(< {MIN_RELAXATIONS:g}); where the loss depends on it λ̂ is low; more steps"
        )
    if adapting > 0:
        problems.append(
            f"the metric adapted during {adapting} of the {steps} steps kept: a chain whose G "
            f"still moves samples no fixed posterior; set burnin >= adapt_until"
        )
    passes = steps / pass_length if pass_length else math.nan
    if passes < 1.0:
        problems.append(
            f"the trace after burn-in covers {passes:.2g} of a pass over the batches: their "
            f"spread biases λ̂; raise num_steps - burnin to whole passes ({pass_length} steps)"
        )
    if mean + 3.0 * std_error < 0.0:
        problems.append(
            "λ̂ < 0: the loss falls below L_n(w₀), so w₀ is no local minimum (train further)"
        )
    if draw_error > 0.0:
        problems.append(
            f"the loader draws its batches with replacement: L_n(w₀) and the trace's mean are "
            f"samples every chain shares, ± {draw_error:.3g} in λ̂; use whole passes "
            f"(DataLoader(shuffle=True), or a list of batches)"
        )
    verdict = LLCVerdict(
        ok=not problems,
        problems=tuple(problems),
        rhat=rhat,
        ess=ess,
        window=window,
        first_half=float(first.mean()),
        last_half=float(last.mean()),
        drift_se=drift_se,
        inflation=inflation,
        step_bias=step_bias,
        relaxations=relaxations,
        passes=passes,
        draw_error=draw_error,
    )
    return verdict, std_error
