"""Choosing a sampler's step size ℓ from its own chains: :func:`tune` (``docs/tuning.md``).

- :mod:`~sgrld.tuning.search`: the probe, the bracket and successive halving, and the budget;
- :mod:`~sgrld.tuning.runs`: one round, every candidate a chain of one :class:`~sgrld.Chains`;
- :mod:`~sgrld.tuning.score`: sample quality of a round's candidates (KSD or validation);
- :mod:`~sgrld.tuning.data`: the user's batches, checked once and shared by the chains;
- :mod:`~sgrld.tuning.result`: what :func:`tune` returns.
"""

from sgrld.tuning.result import Candidate, Round, TuneResult
from sgrld.tuning.search import tune

__all__ = ["Candidate", "Round", "TuneResult", "tune"]
