"""Choosing a sampler's step size ℓ from its own chains: :func:`tune` (``docs/tuning.md``)."""

from sgrld.tuning.result import Candidate, Round, TuneResult
from sgrld.tuning.search import tune

__all__ = ["Candidate", "Round", "TuneResult", "tune"]
