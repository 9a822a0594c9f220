"""MCMC diagnostics from ArviZ: rank-normalised split R-hat, bulk and tail ESS, InferenceData.

ArviZ is optional (``pip install "sgrld[diagnostics]"``); 0.x and 1.x both work (only the
export's container differs). Draws are ``(chain, draw, ...)`` arrays keyed by variable name.

References:
    Vehtari, Gelman, Simpson, Carpenter, Bürkner (2021), "Rank-normalization, folding, and
    localization: an improved R-hat for assessing convergence of MCMC", Bayesian Analysis.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "MIN_DRAWS",
    "MIN_RELIABLE_DRAWS",
    "arviz_available",
    "import_arviz",
    "split_chain",
    "summarize",
    "to_inference_data",
]

#: Fewest draws per chain ArviZ accepts for R-hat and ESS.
MIN_DRAWS = 4
#: Fewest draws per chain for which tables show R-hat and ESS (from fewer they are noise): "–".
MIN_RELIABLE_DRAWS = 20
INSTALL_HINT = 'install the optional extra: pip install "sgrld[diagnostics]"'


def import_arviz() -> ModuleType:
    """ArviZ, imported without its once-a-day refactor announcement (a ``FutureWarning``).

    Raises:
        ImportError: ArviZ is not installed; the message says how to install it.
    """
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"\s*ArviZ is undergoing", category=Warning)
            return importlib.import_module("arviz")
    except ImportError as exc:
        raise ImportError(f"MCMC diagnostics need ArviZ ({exc}); {INSTALL_HINT}") from exc


def arviz_available() -> bool:
    """Whether :func:`import_arviz` succeeds."""
    try:
        import_arviz()
    except ImportError:
        return False
    return True


def _dataset(draws: Mapping[str, npt.ArrayLike]) -> Any:
    import xarray as xr  # an ArviZ dependency

    variables = {}
    for name, values in draws.items():
        x = np.asarray(values, dtype=np.float64)
        if x.ndim < 2:
            raise ValueError(f"{name}: expected (chain, draw, ...) draws, got shape {x.shape}")
        dims = ("chain", "draw", *(f"{name}_dim_{i}" for i in range(x.ndim - 2)))
        variables[name] = (dims, x)
    return xr.Dataset(variables)


def split_chain(draws: npt.ArrayLike) -> np.ndarray:
    """One chain's ``(draw, ...)`` draws as ``(2, draw // 2, ...)``: its two halves.

    The middle draw of an odd count is dropped; a chain still drifting then shows R̂ > 1.
    """
    x = np.asarray(draws, dtype=np.float64)
    half = x.shape[0] // 2
    return np.stack([x[:half], x[x.shape[0] - half :]])


def summarize(draws: Mapping[str, npt.ArrayLike]) -> dict[str, dict[str, Any]]:
    """R-hat (rank-normalised, split), bulk ESS and tail ESS of every variable.

    Args:
        draws: name → ``(chain, draw, ...)`` array. R-hat needs two chains or more (use
            :func:`split_chain` for one run) and every statistic at least :data:`MIN_DRAWS`
            draws per chain; with fewer, the values are NaN.

    Returns:
        name → ``{"rhat", "ess_bulk", "ess_tail"}``, each a float for a scalar variable or a
        nested list of the event shape, plus ``"chains"`` and ``"draws"``. Constant draws give
        NaN (ArviZ's convention).

    Raises:
        ImportError: ArviZ is not installed.
    """
    az = import_arviz()
    data = _dataset(draws)
    chains, num_draws = data.sizes["chain"], data.sizes["draw"]
    out: dict[str, dict[str, Any]] = {
        str(name): {"chains": int(chains), "draws": int(num_draws)} for name in data.data_vars
    }
    with warnings.catch_warnings(), np.errstate(invalid="ignore", divide="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)  # constant draws: NaN, as documented
        for key, method in (("rhat", None), ("ess_bulk", "bulk"), ("ess_tail", "tail")):
            if num_draws < MIN_DRAWS or (method is None and chains < 2):
                for name, entry in out.items():
                    entry[key] = np.full(data[name].shape[2:], np.nan).tolist()
                continue
            result = az.rhat(data) if method is None else az.ess(data, method=method)
            for name, entry in out.items():
                entry[key] = np.asarray(result[name], dtype=np.float64).tolist()
    return out


def to_inference_data(
    posterior: Mapping[str, npt.ArrayLike],
    *,
    log_likelihood: Mapping[str, npt.ArrayLike] | None = None,
    attrs: Mapping[str, Any] | None = None,
) -> Any:
    """Draws as ArviZ's container: ``InferenceData`` (ArviZ 0.x) or ``xarray.DataTree`` (1.x).

    Args:
        posterior: name → ``(chain, draw, ...)`` draws of the ``posterior`` group.
        log_likelihood: name → ``(chain, draw, ...)`` pointwise log-likelihoods.
        attrs: attributes stored on every group (e.g. the run's config).

    Returns:
        An object every ArviZ function accepts (``az.summary``, ``az.plot_trace``, ...).

    Raises:
        ImportError: ArviZ is not installed.
    """
    az = import_arviz()
    groups = {"posterior": _dataset(posterior)}
    if log_likelihood:
        groups["log_likelihood"] = _dataset(log_likelihood)
    for dataset in groups.values():
        dataset.attrs.update({k: str(v) for k, v in (attrs or {}).items()})
    if int(az.__version__.split(".")[0]) >= 1:
        import xarray as xr

        return xr.DataTree.from_dict(groups)
    return az.InferenceData(**groups)
