"""Evaluation: streaming ensemble predictive, calibration, curvature, MCMC diagnostics.

- :mod:`~sgrld.evaluation.ensemble`: cumulative-ensemble LP, accuracy, ECE and confidence
  from a float64 running log-sum-exp.
- :mod:`~sgrld.likelihoods.calibration`: 30-bin top-label ECE with the reference's binning.
- :mod:`~sgrld.evaluation.curvature`: the input-Hessian curvature ``C(θ)``.
- :mod:`~sgrld.evaluation.diagnostics`: R-hat, bulk/tail ESS and InferenceData from ArviZ
  (optional extra ``sgrld[diagnostics]``).
- :mod:`~sgrld.evaluation.trace`: per-sample test log-likelihood, probe predictions and scalar
  hyper-parameters of a run, and their diagnostics within a run and across seeds.
- :mod:`~sgrld.evaluation.equal_time`: the equal-computation-time re-analysis.
"""

from sgrld.evaluation.curvature import CurvatureStats, curvature_per_example, measure_curvature
from sgrld.evaluation.diagnostics import split_chain, summarize, to_inference_data
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
from sgrld.evaluation.trace import SampleTrace, diagnostics_of, inference_data_of
from sgrld.likelihoods.calibration import (
    ReliabilityBins,
    expected_calibration_error,
    reliability_bins,
    top_label,
)

__all__ = [
    "CurvatureStats",
    "EnsemblePredictive",
    "EqualTimeEntry",
    "ReliabilityBins",
    "SampleTrace",
    "SamplerCurves",
    "curvature_per_example",
    "diagnostics_of",
    "epoch_end_times",
    "equal_time_table",
    "expected_calibration_error",
    "inference_data_of",
    "interpolate_at_time",
    "mean_std_over_runs",
    "measure_curvature",
    "reliability_bins",
    "select_at_time",
    "split_chain",
    "summarize",
    "to_inference_data",
    "top_label",
]
