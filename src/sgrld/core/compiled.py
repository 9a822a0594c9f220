"""``compile=True``: a step's metric update, G⁻¹ĝ, G^{-1/2}ξ and move as one compiled call.

The engine's :func:`~sgrld.core.engine.body`, on private clones and with 0-d ℓ and σ (no
recompile as ℓ changes), with Philox ξ drawn inside, fused by inductor (``docs/performance.md``).
Each :class:`CompiledMove` has its own code object (its own recompile budget); if compiling
fails it warns once and the eager step runs, with the same noise.
"""

from __future__ import annotations

import itertools
import types
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from sgrld.core._compile import failure_reason, quiet_compile
from sgrld.core.contract import Metric, Stats
from sgrld.core.engine import Move, body
from sgrld.core.layout import FlatLayout
from sgrld.core.noise import philox_normals

_counter = itertools.count()


def _move(
    keys: Tensor | None,
    noise_step: Tensor | None,
    metric: Metric,
    stats: Stats,
    layout: FlatLayout,
    grad: Tensor,
    xi: Tensor | None,
    *rest: object,
) -> None:
    """:func:`~sgrld.core.engine.body` on private clones; with ``keys`` ξ is drawn here (Philox)."""
    if keys is not None and noise_step is not None:
        xi = philox_normals((*layout.batch_shape, layout.size), grad.dtype, keys, noise_step)
    elif xi is not None:
        xi = xi.clone()
    body(Move(metric, stats, layout, grad.clone(), xi, *rest))  # type: ignore[arg-type]


def check_compilable(metric: Metric) -> None:
    if not metric.compilable:
        raise ValueError(
            f"compile=True is not offered for the {metric.name} metric: compiling its step "
            "did not make it faster (docs/performance.md); use compile=False"
        )


class CompiledMove:
    """The compiled step body of one sampler, made at its first call (never saved: it holds no
    state of the chain)."""

    def __init__(self) -> None:
        self._fn: Callable[..., None] | None = None
        self._scalars: dict[tuple[torch.dtype, torch.device], tuple[Tensor, Tensor]] = {}
        self.failed = False

    def __call__(
        self, move: Move, keys: Tensor | None = None, noise_step: Tensor | None = None
    ) -> bool:
        """Run the step; ``False`` if it cannot be compiled (the caller then runs it eagerly). With
        ``keys`` (and ``move.xi=None``) the Philox noise of ``noise_step`` is drawn inside the call.
        """
        if self.failed:
            return False
        if self._fn is None:
            code = _move.__code__.replace(co_name=f"_sgrld_move_{next(_counter)}")
            with quiet_compile():  # importing inductor touches deprecated torch APIs
                fn = types.FunctionType(code, _move.__globals__, code.co_name)
                self._fn = torch.compile(fn, fullgraph=True)
        if not (isinstance(move.lr, Tensor) and isinstance(move.sigma, Tensor)):
            # 0-d float32 (float64 for float64 parameters) scalars: they do not change the
            # result's dtype, and half precision would round ℓ and make σ ≈ 1e-5 subnormal
            like = move.grad
            dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
            key = (dtype, like.device)
            if key not in self._scalars:
                zero = torch.zeros((), dtype=dtype, device=like.device)
                self._scalars[key] = (zero, zero.clone())
            lr, sigma = self._scalars[key]
            lr.fill_(float(move.lr))
            sigma.fill_(float(move.sigma))
            move = move._replace(lr=lr, sigma=sigma)
        try:
            with quiet_compile():
                self._fn(keys, noise_step, *move._replace(params=list(move.params)))
        except Exception as exc:  # fullgraph: tracing or compiling failed before anything ran
            self.failed = True
            warnings.warn(
                f"sgrld: compiling the {move.metric.name} step failed ({failure_reason(exc)}); "
                "running it eagerly",
                RuntimeWarning,
                stacklevel=4,
            )
            return False
        return True
