"""``compile=True``: a step's metric update, G⁻¹ĝ, G^{-1/2}ξ and move as one compiled call.

Eagerly every operation of an elementwise metric is a pass over the flat buffers
(``docs/performance.md`` counts them per sampler). Here the same library code — the engine's
:func:`~sgrld.core.engine.body`: ``metric.update``, ``metric.inverse``, ``metric.inverse_sqrt``
and :func:`~sgrld.core.integrator.euler_maruyama` — is traced by ``torch.compile`` and inductor
fuses it into a few loops. With ``noise="philox"`` ξ is drawn inside the same call
(:func:`~sgrld.core.noise.philox_normals`: the same numbers as the eager kernel, to the last bits
of log/cos/sin), so no kernel writes and re-reads a noise buffer. Two things keep the traced
graph fusable and stable:

* the metric works on private clones of the gradient and noise buffers, which inductor sees as
  intermediates (in-place writes to graph inputs would each cost a store pass);
* ℓ and σ enter as 0-d tensors, so a learning-rate schedule does not recompile.

A :class:`CompiledMove` belongs to a sampler (``Sampler`` or a param group of an optimizer), not
to a state, so ``inplace=False`` steps reuse it; each has its own code object, so samplers do not
share dynamo's per-function recompile budget. It is traced with ``fullgraph=True``: a graph break
or an exhausted recompile budget fails before anything runs. The first call compiles (a few
seconds; inductor caches on disk); if compiling is not possible (no C++ compiler, an unsupported
backend) it warns once and the eager step runs instead, with the same noise.
"""

from __future__ import annotations

import itertools
import types
import warnings

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
    """The engine's :func:`~sgrld.core.engine.body` of a :class:`~sgrld.core.engine.Move` on
    private clones (fusable intermediates); with ``keys`` ξ is drawn here (Philox at
    ``noise_step``), fused with the step."""
    if keys is not None and noise_step is not None:
        xi = philox_normals((*layout.batch_shape, layout.size), grad.dtype, keys, noise_step)
    elif xi is not None:
        xi = xi.clone()
    body(Move(metric, stats, layout, grad.clone(), xi, *rest))  # type: ignore[arg-type]


def check_compile(compile: bool, metric: Metric) -> None:
    """Refuse a non-bool ``compile`` and ``compile=True`` for a metric that is not compilable."""
    if not isinstance(compile, bool):
        raise ValueError(f"invalid compile: {compile!r} (expected True or False)")
    if compile:
        check_compilable(metric)


def check_compilable(metric: Metric) -> None:
    if not metric.compilable:
        raise ValueError(
            f"compile=True is not offered for the {metric.name} metric: compiling its step "
            "did not make it faster (docs/performance.md); use compile=False"
        )


class CompiledMove:
    """The compiled step body of one sampler (never saved: it holds no state of the chain)."""

    def __init__(self) -> None:
        code = _move.__code__.replace(co_name=f"_sgrld_move_{next(_counter)}")
        with quiet_compile():  # importing inductor touches deprecated torch APIs
            fn = types.FunctionType(code, _move.__globals__, code.co_name)
            self._fn = torch.compile(fn, fullgraph=True)
        self._scalars: dict[tuple[torch.dtype, torch.device], tuple[Tensor, Tensor]] = {}
        self.failed = False

    def _lr_sigma(self, like: Tensor, lr: float, sigma: float) -> tuple[Tensor, Tensor]:
        # float32 (float64 for float64 parameters): a 0-d tensor does not change the result's
        # dtype, and half precision would round ℓ and make σ ≈ 1e-5 subnormal
        dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
        key = (dtype, like.device)
        if key not in self._scalars:
            self._scalars[key] = (
                torch.zeros((), dtype=dtype, device=like.device),
                torch.zeros((), dtype=dtype, device=like.device),
            )
        lr_t, sigma_t = self._scalars[key]
        lr_t.fill_(lr)
        sigma_t.fill_(sigma)
        return lr_t, sigma_t

    def __call__(
        self, move: Move, keys: Tensor | None = None, noise_step: Tensor | None = None
    ) -> bool:
        """Run the step; ``False`` if it cannot be compiled (the caller then runs it eagerly).

        With ``keys`` (and ``move.xi=None``) the Philox noise of ``noise_step`` is drawn inside
        the compiled call, so that an elementwise metric's step is one fused pass over D."""
        if self.failed:
            return False
        if not (isinstance(move.lr, Tensor) and isinstance(move.sigma, Tensor)):
            lr, sigma = self._lr_sigma(move.grad, float(move.lr), float(move.sigma))
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
