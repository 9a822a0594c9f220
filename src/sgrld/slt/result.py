"""What :func:`sgrld.llc` returns: the estimate, its traces and the verdict on them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from sgrld.slt.verdict import LLCVerdict, block_means


@dataclass(frozen=True, repr=False)
class LLCEstimate:
    """An LLC estimate and what it was computed from.

    ``print(est)`` shows a one-line summary, ``est.summary()`` a short table, ``est.plot()``
    the traces.

    Attributes:
        mean: λ̂, the mean of the per-chain estimates.
        std_error: its standard error: the larger of std/√K and the one from the traces'
            effective sample size (``docs/llc.md``); NaN for one chain of too few steps.
        std: the per-chain estimates' standard deviation over the chains (devinterp's
            ``llc_std``; NaN for one chain).
        per_chain: ``(K,)`` nβ·(mean of chain k's trace − init_loss).
        trace: ``(K, num_steps)`` the batch loss of every chain at every step, at the
            parameters the step started from (devinterp's ``loss_trace``).
        init_loss: L_n(w₀), the mean loss over the initial batches.
        lr: devinterp's ε used (given, or from :func:`~sgrld.slt.calibrate_lr`).
        calibrated: whether ``lr`` was calibrated.
        nbeta: nβ.
        localization: γ.
        verdict: the diagnostics (:class:`~sgrld.slt.LLCVerdict`): stationarity, R̂, ESS,
            the step's stability, the sign; ``None`` for estimates made before it existed.
        sampler: the metric's registry name.
        burnin: the leading steps of every trace left out of ``mean``.
        training: whether the model ran in ``train()`` mode (dropout on) during the chains.
    """

    mean: float
    std_error: float
    std: float
    per_chain: np.ndarray
    trace: np.ndarray
    init_loss: float
    lr: float
    calibrated: bool
    nbeta: float
    localization: float
    verdict: LLCVerdict | None = None
    sampler: str = ""
    burnin: int = 0
    training: bool | None = None

    @property
    def ok(self) -> bool:
        """Whether the verdict found no problem (``True`` without a verdict)."""
        return self.verdict is None or self.verdict.ok

    def __repr__(self) -> str:
        k, t = self.trace.shape
        verdict = ""
        if self.verdict is not None:
            n = len(self.verdict.problems)
            shown = "ok" if self.verdict.ok else f"NOT OK, {n} problem{'s' * (n > 1)}: .summary()"
            verdict = f", verdict={shown!r}"
        return (
            f"LLCEstimate(mean={self.mean:.4g}, std_error={self.std_error:.2g}, "
            f"sampler={self.sampler!r}, chains={k}, steps={t}, lr={self.lr:.3g}"
            f"{' (calibrated)' if self.calibrated else ''}, nbeta={self.nbeta:.4g}, "
            f"localization={self.localization:g}{verdict})"
        )

    def summary(self) -> str:
        """A short table: the estimate, each chain's, the diagnostics and the verdict."""
        k, t = self.trace.shape
        mode = {None: "", True: ", train mode", False: ", eval mode"}[self.training]
        lines = [
            f"λ̂ = {self.mean:.4g} ± {self.std_error:.2g} (s.e.)   {self.sampler or 'sampler'}, "
            f"{k} chains × {t} steps (burn-in {self.burnin}), ε {self.lr:.3g}"
            f"{' calibrated' if self.calibrated else ''}, nβ {self.nbeta:.4g}, "
            f"γ {self.localization:g}, L_n(w₀) {self.init_loss:.6g}{mode}",
            "  per chain: " + " ".join(f"{v:.4g}" for v in self.per_chain),
        ]
        v = self.verdict
        if v is not None:
            lines += [
                f"  R̂ {v.rhat:.3f}   ESS {v.ess:.0f} (blocks of {v.window} steps)   "
                f"halves {v.first_half:.4g} → {v.last_half:.4g} (± {v.drift_se:.2g})",
                f"  step: biases λ̂ by about {_known(v.step_bias, '+{:.3g}')} (quadratic model), "
                f"stiffest direction inflated {_known(v.inflation, '{:.1%}')}, slowest relaxes "
                f"{_known(v.relaxations, '{:.3g}×')} over the chain",
                *(
                    [f"  batches drawn with replacement: ± {v.draw_error:.3g} in λ̂ from the draws"]
                    if v.draw_error > 0.0
                    else []
                ),
                "  verdict: " + ("ok" if v.ok else "NOT OK\n    - " + "\n    - ".join(v.problems)),
            ]
        return "\n".join(lines)

    def plot(self, ax: Any = None) -> Any:
        """Every chain's trace, nβ·(batch loss − L_n(w₀)) averaged over the verdict's blocks
        (one pass of batches), with λ̂ ± s.e. as a band: flat after a short rise is mixed, still
        rising is too small a step. Needs matplotlib; returns the axes."""
        import matplotlib.pyplot as plt

        if ax is None:
            _, ax = plt.subplots(figsize=(6, 4))
        window = self.verdict.window if self.verdict is not None else 1
        means = block_means(self.trace[:, self.burnin :], window)
        blocks = means.shape[1]
        steps = self.trace.shape[1] - blocks * window + window * (np.arange(blocks) + 1)
        for k, chain in enumerate(means):
            ax.plot(steps, self.nbeta * (chain - self.init_loss), lw=0.8, color=f"C{k % 10}")
        ax.axhspan(self.mean - self.std_error, self.mean + self.std_error, color="0.8", zorder=0)
        ax.axhline(self.mean, color="k", lw=1, label=f"λ̂ {self.mean:.3g} ± {self.std_error:.2g}")
        title = "ok" if self.ok else "not ok: " + (self.verdict.problems[0] if self.verdict else "")
        ax.set(xlabel="step", ylabel="nβ·(batch loss − L_n(w₀))", title=title[:70])
        ax.legend(loc="lower right")
        return ax


def _known(value: float, form: str) -> str:
    """``value`` in ``form`` (a ``str.format`` pattern), or "unknown" where it is NaN."""
    return form.format(value) if math.isfinite(value) else "unknown"
