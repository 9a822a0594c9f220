"""Singular learning theory: the local learning coefficient (LLC) with every metric.

:func:`llc` estimates λ̂ = nβ·(E_w[L_n(w)] − L_n(w₀)) over the local tempered posterior
(Lau et al. 2023) with any sampler of the registry and judges it (:class:`LLCVerdict`);
:func:`calibrate_lr` is its step-size rule when no ``lr`` is given. ``docs/llc.md``.
"""

from sgrld.slt.calibration import DoubleBackwardError, calibrate_lr
from sgrld.slt.estimate import against_sgld, devinterp_options, llc
from sgrld.slt.result import LLCEstimate
from sgrld.slt.verdict import LLCVerdict, LLCWarning

__all__ = [
    "DoubleBackwardError",
    "LLCEstimate",
    "LLCVerdict",
    "LLCWarning",
    "against_sgld",
    "calibrate_lr",
    "devinterp_options",
    "llc",
]
