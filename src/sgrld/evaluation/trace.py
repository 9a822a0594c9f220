"""Per-sample summaries of a sampling run, small enough to keep for every posterior sample.

:class:`SampleTrace` keeps per sample the mean test log-likelihood, ``log p(y_j | x_j, θ_s)`` on
a fixed probe of test points and each scalar hyper-parameter (``scale:<param>``), from which
:mod:`~sgrld.evaluation.diagnostics` computes R-hat and ESS within a run and across seeds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from sgrld.likelihoods.categorical import Categorical

__all__ = ["SampleTrace", "diagnostics_of", "inference_data_of"]

NUM_PROBE = 4


class SampleTrace:
    """Per-sample test log-likelihood, probe predictions and scalar hyper-parameters.

    Feed a sample's test logits in consecutive batches with :meth:`add_batch`, then call
    :meth:`commit` with the model (for its scalar hyper-parameters).

    Args:
        num_points: size of the (fixed, unshuffled) test set.
        num_probe: leading test points whose log-probability of the true class is kept.
    """

    def __init__(self, num_points: int, num_probe: int = NUM_PROBE) -> None:
        self.num_points = num_points
        self.num_probe = min(num_probe, num_points)
        self.test_loglik: list[float] = []
        self.probe_logp: list[list[float]] = []
        self.scalars: dict[str, list[float]] = {}
        self._sum = 0.0
        self._probe: list[float] = []

    def __len__(self) -> int:
        return len(self.test_loglik)

    def add_batch(
        self,
        start: int,
        logits: Tensor,
        targets: Tensor,
        log_prob: Callable[[Tensor, Tensor], Tensor] | None = None,
    ) -> None:
        """Add the test outputs of points ``start, start + 1, ...`` of the current sample:
        class logits, or any likelihood's η with its ``log_prob`` (evaluated in float64)."""
        eta = logits.detach().to(torch.float64)
        picked = (log_prob or Categorical().log_prob)(eta, targets.to(eta.device))
        self._sum += float(picked.sum())
        if start < self.num_probe:
            self._probe += picked[: self.num_probe - start].tolist()

    def commit(
        self, model: nn.Module | None = None, *, scalars: Mapping[str, float] | None = None
    ) -> None:
        """Close the current sample: record its values and the scalar hyper-parameters of
        ``model``, or ``scalars`` measured by the caller (a chain of a stacked model)."""
        self.test_loglik.append(self._sum / self.num_points)
        self.probe_logp.append(self._probe)
        if model is not None:
            scalars = scalar_hyperparameters(model)
        for name, value in (scalars or {}).items():
            self.scalars.setdefault(name, []).append(float(value))
        self._sum, self._probe = 0.0, []

    def draws(self) -> dict[str, np.ndarray]:
        """Name → ``(draw, ...)`` array of every traced quantity."""
        out = {
            "test_loglik": np.asarray(self.test_loglik, dtype=np.float64),
            "probe_logp": np.asarray(self.probe_logp, dtype=np.float64).reshape(
                len(self), self.num_probe
            ),
        }
        out |= {name: np.asarray(v, dtype=np.float64) for name, v in self.scalars.items()}
        return out

    def state_dict(self) -> dict[str, Any]:
        """The trace as plain lists (JSON values): also the ``trace`` entry of results.json."""
        return {
            "num_probe": self.num_probe,
            "test_loglik": list(self.test_loglik),
            "probe_logp": [list(p) for p in self.probe_logp],
            "scalars": {k: list(v) for k, v in self.scalars.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`."""
        self.num_probe = int(state["num_probe"])
        self.test_loglik = [float(v) for v in state["test_loglik"]]
        self.probe_logp = [[float(v) for v in p] for p in state["probe_logp"]]
        self.scalars = {k: [float(v) for v in vs] for k, vs in state["scalars"].items()}

    def diagnostics(self) -> dict[str, Any]:
        """Within-run R-hat (split halves) and bulk/tail ESS of every traced quantity."""
        return diagnostics_of([self.state_dict()])


def scalar_hyperparameter_tensors(model: nn.Module) -> dict[str, Tensor]:
    """``scale:<parameter>`` → the effective scale (a 0-d tensor) of each prior that has one
    (horseshoe); also under ``vmap``."""
    named = getattr(model, "named_priors", None)
    if named is None:
        return {}
    out = {}
    for name, prior in named():
        scale = getattr(prior, "effective_scale", None)
        if isinstance(scale, Tensor) and scale.numel() == 1:
            out[f"scale:{name}"] = scale.reshape(())
    return out


def scalar_hyperparameters(model: nn.Module) -> dict[str, float]:
    """``scale:<parameter>`` → the effective scale of each prior that has one (horseshoe)."""
    return {k: float(v.detach()) for k, v in scalar_hyperparameter_tensors(model).items()}


def _stacked(traces: Sequence[Mapping[str, Any]]) -> dict[str, np.ndarray]:
    """Traces (state dicts) as ``(chain, draw, ...)`` arrays, cut to the shortest."""
    length = min(len(t["test_loglik"]) for t in traces)
    probe = min(int(t["num_probe"]) for t in traces)
    names = sorted(set.intersection(*(set(t["scalars"]) for t in traces)))

    def probes(t: Mapping[str, Any]) -> np.ndarray:
        return np.asarray(t["probe_logp"], dtype=np.float64).reshape(-1, t["num_probe"])

    columns = {
        "test_loglik": [np.asarray(t["test_loglik"], dtype=np.float64) for t in traces],
        "probe_logp": [probes(t)[:, :probe] for t in traces],
    }
    columns |= {n: [np.asarray(t["scalars"][n], dtype=np.float64) for t in traces] for n in names}
    return {name: np.stack([c[:length] for c in chains]) for name, chains in columns.items()}


def diagnostics_of(traces: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """R-hat and bulk/tail ESS of traced quantities: one trace split in halves, or runs as chains.

    Args:
        traces: :meth:`SampleTrace.state_dict` of each run (e.g. each seed of a configuration);
            longer traces are cut to the shortest.

    Returns:
        ``{"available": True, "chains", "draws_per_chain", "reliable", "variables": {name: {rhat,
        ess_bulk, ess_tail}}, "worst": {"rhat": max, "ess_bulk": min, "ess_tail": min}}``
        (``reliable``: at least ``MIN_RELIABLE_DRAWS`` draws per chain); or
        ``{"available": False, "reason": ...}`` without ArviZ or samples.
    """
    from sgrld.evaluation import diagnostics

    if not traces or min(len(t["test_loglik"]) for t in traces) == 0:
        return {"available": False, "reason": "no sample yet"}
    try:
        diagnostics.import_arviz()
    except ImportError as exc:
        return {"available": False, "reason": str(exc)}
    draws = _stacked(traces)
    within = len(traces) == 1
    if within:
        draws = {k: diagnostics.split_chain(v[0]) for k, v in draws.items()}
    stats = diagnostics.summarize(draws)
    worst: dict[str, float] = {}
    for key, pick in (("rhat", np.nanmax), ("ess_bulk", np.nanmin), ("ess_tail", np.nanmin)):
        values = np.concatenate(
            [np.ravel(np.asarray(s[key], dtype=np.float64)) for s in stats.values()]
        )
        finite = values[np.isfinite(values)]
        worst[key] = float(pick(finite)) if finite.size else math.nan
    first = next(iter(stats.values()))
    return {
        "available": True,
        "chains": "two halves of this run (split R-hat)" if within else len(traces),
        "draws_per_chain": first["draws"],
        "reliable": first["draws"] >= diagnostics.MIN_RELIABLE_DRAWS,
        "variables": {
            k: {m: s[m] for m in ("rhat", "ess_bulk", "ess_tail")} for k, s in stats.items()
        },
        "worst": worst,
    }


def inference_data_of(
    traces: Sequence[Mapping[str, Any]], attrs: Mapping[str, Any] | None = None
) -> Any:
    """Traces of one or several runs (seeds as chains) as ArviZ ``InferenceData``/``DataTree``.

    Args:
        traces: the ``trace`` entries of runs' ``results.json`` (or
            :meth:`SampleTrace.state_dict`); longer ones are cut to the shortest.
        attrs: stored on the groups, e.g. the runs' config.

    Returns:
        ``posterior``: ``test_loglik``, ``probe_logp`` and every scalar hyper-parameter.

    Raises:
        ImportError: ArviZ is not installed.
        ValueError: no trace, or a trace without samples.
    """
    from sgrld.evaluation.diagnostics import to_inference_data

    if not traces or min(len(t["test_loglik"]) for t in traces) == 0:
        raise ValueError("no traced samples to export")
    return to_inference_data(_stacked(traces), attrs=attrs)
