"""Evaluation: streaming ensemble predictive, calibration, curvature, MCMC diagnostics (spec §4).

- :mod:`~sgrld.evaluation.ensemble`: cumulative-ensemble LP, accuracy, ECE and confidence
  from a float64 running log-sum-exp (spec §4.4, §4.7, §10.8).
- :mod:`~sgrld.evaluation.calibration`: 30-bin top-label ECE with the reference's binning.
- :mod:`~sgrld.evaluation.curvature`: the input-Hessian curvature ``C(θ)`` (spec §4.5).
- :mod:`~sgrld.evaluation.diagnostics`: ESS, split R-hat and MCSE over ``(chain, draw, ...)``.
- :mod:`~sgrld.evaluation.equal_time`: the equal-computation-time re-analysis (spec §7.3).
"""

from sgrld.evaluation.calibration import (
    ReliabilityBins,
    expected_calibration_error,
    reliability_bins,
    top_label,
)
from sgrld.evaluation.curvature import CurvatureStats, curvature_per_example, measure_curvature
from sgrld.evaluation.diagnostics import (
    autocorrelation,
    effective_sample_size,
    mcse_mean,
    split_rhat,
)
from sgrld.evaluation.ensemble import EnsemblePredictive
from sgrld.evaluation.equal_time import (
    EqualTimeEntry,
    SamplerCurves,
    epoch_end_times,
    equal_time_table,
    interpolate_at_time,
    mean_std_over_runs,
    select_at_time,
)

__all__ = [
    "CurvatureStats",
    "EnsemblePredictive",
    "EqualTimeEntry",
    "ReliabilityBins",
    "SamplerCurves",
    "autocorrelation",
    "curvature_per_example",
    "effective_sample_size",
    "epoch_end_times",
    "equal_time_table",
    "expected_calibration_error",
    "interpolate_at_time",
    "mcse_mean",
    "mean_std_over_runs",
    "measure_curvature",
    "reliability_bins",
    "select_at_time",
    "split_rhat",
    "top_label",
]
