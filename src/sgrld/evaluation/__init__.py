"""Evaluation: streaming ensemble predictive, calibration, curvature, MCMC diagnostics, the
equal-computation-time re-analysis.
"""

from sgrld.evaluation.chain_ensemble import ChainEnsemble, evaluate_chains
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
    "ChainEnsemble",
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
    "evaluate_chains",
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
