"""Many steps per call for long runs of tiny problems: the engine's step, compiled B at a time.

:class:`BlockRunner` unrolls the engine's :func:`~sgrld.core.engine.body` ``block`` times into
one ``torch.compile``d function (an eager funnel step is 40-170 µs of overhead), the gradient
computed inside from pre-drawn gradient noise: the fast path of
:meth:`sgrld.core.sampler.Sampler.run` for single-tensor states. Unlike ``sampler.step`` in a
loop, ``noise="block"`` draws a chunk's ξ in one call (the same law, not the same numbers;
``"exact"`` and Philox draw the eager stream), a non-finite iterate is caught per chunk, and
every iterate is kept. Beside the chain runner's loop (one Python step per batch, which a
compiled block would lose), it keeps the runner's rules: an :class:`~sgrld.core.runner.Account`
is charged, a breakdown is the runner's message.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
from torch import Tensor

from sgrld.core._compile import failure_reason, quiet_compile
from sgrld.core.contract import check_choice, check_int
from sgrld.core.engine import Move, body, refresh_due
from sgrld.core.integrator import noise_scale
from sgrld.core.noise import philox_normal_, values_per_counter
from sgrld.core.runner import Account, stopped
from sgrld.core.sampler import Sampler
from sgrld.core.state import SamplerState

__all__ = ["BlockRunner", "GradFn"]

#: inductor option sets tried in turn by default: the C++ wrapper, then the Python one. Never
#: ``cpp.vec_isa_ok=False``: it leaves inductor's per-process SIMD state inconsistent, and the
#: next default compile in the process (the Philox kernel) built garbage (tests/test_noise.py).
_ATTEMPTS: tuple[dict[str, Any], ...] = ({"cpp_wrapper": True}, {})

#: ``grad_fn(theta, grad_noise) -> ĝ``: the potential gradient at ``theta`` (shape ``(K, D)``)
#: given a pre-drawn standard normal ``grad_noise`` of the same shape.
GradFn = Callable[[Tensor, Tensor], Tensor]


class BlockRunner:
    """Advance ``state`` by blocks of ``block`` steps, keeping every iterate.

    Args:
        sampler: the configured sampler (its metric, ℓ, n and τ are used as is).
        state: a state from ``sampler.init`` with exactly one parameter tensor of shape
            ``(K, D)`` (``num_chains=K``); updated in place.
        grad_fn: the stochastic potential gradient, see :data:`GradFn`.
        grad_generator: the generator of the gradient noise (kept apart from the sampler's).
        block: steps per compiled call (unrolled, so compile time grows with it).
        compile: use ``torch.compile`` (inductor); ``False`` runs the same code eagerly.
        inductor_options: the inductor options to compile with. By default the C++ wrapper is
            tried first (it halves the per-step cost), then the Python one; if both fail the
            runner says so on stderr and runs eagerly (``compile_error`` holds the reason).
        noise: ``"block"`` (one draw per chunk) or ``"exact"`` (the eager step's stream).
        chunk: steps whose noise is drawn at once (rounded down to a multiple of ``block``).
        adapt: update the metric at every step (the sampler needs ``adapt_until=None``) or
            never (``False``: a frozen G).
    """

    def __init__(
        self,
        sampler: Sampler,
        state: SamplerState,
        grad_fn: GradFn,
        *,
        grad_generator: torch.Generator,
        block: int = 10,
        compile: bool = True,
        noise: Literal["block", "exact"] = "block",
        chunk: int = 10_000,
        inductor_options: dict[str, Any] | None = None,
        adapt: bool = True,
    ) -> None:
        if len(state.params) != 1:
            raise ValueError("BlockRunner supports states with exactly one parameter tensor")
        check_int("block", block, 1)
        check_choice("noise", noise, ("block", "exact"))
        (self.theta,) = state.params.values()
        layout = state.layout
        if len(layout.shapes[0]) != 1 or self.theta.shape != (*layout.batch_shape, layout.size):
            raise ValueError("BlockRunner needs a vector parameter, shape (D,) or (K, D)")
        self.sampler, self.state, self.grad_fn = sampler, state, grad_fn
        self.grad_generator = grad_generator
        self.block, self.noise = block, noise
        if isinstance(sampler.lr, torch.Tensor) or sampler.capturable or sampler.localization:
            raise ValueError(
                "BlockRunner needs a sampler with a float lr, capturable=False and no "
                "localization (a localised step runs eagerly: Sampler.run)"
            )
        if adapt and sampler.adapt_until is not None:
            raise ValueError(
                f"BlockRunner adapts the metric at every step or never, not for a warm-up of "
                f"{sampler.adapt_until} steps: build the sampler with adapt_until=None, or pass "
                "adapt=False"
            )
        self.adapt = adapt
        self.sigma = float(noise_scale(sampler.lr, sampler.num_data, sampler.temperature))
        self.compile_seconds = 0.0
        self.compile_error: str | None = None
        self._compiled_fn: Callable[..., None] | None = None
        attempts = list(_ATTEMPTS) if inductor_options is None else [dict(inductor_options)]
        self._attempts: list[dict[str, Any]] = attempts if compile else []
        self.chunk = block * max(1, chunk // block)
        self._calls = 0
        self.inductor_options: dict[str, Any] | None = None  # the set that compiled
        # the chunk's gradient noise, ξ and iterates
        shape = (self.chunk, *self.theta.shape)
        self._grad_noise, self._xi, self._out = (self.theta.new_empty(shape) for _ in range(3))

    def _steps(
        self,
        theta: Tensor,
        stats: dict[str, Tensor],
        grad_noise: Tensor,
        xi: Tensor,
        out: Tensor,
        step0: int,
        count: int,
    ) -> None:
        """``count`` steps of the engine's body on pre-drawn noise."""
        metric, layout = self.sampler.metric, self.state.layout
        lr, sigma = self.sampler.lr, self.sigma
        for b in range(count):
            # grad_fn returns a fresh flat buffer, which the metric may overwrite (as in the core)
            grad = self.grad_fn(theta, grad_noise[b])
            step = step0 + b + 1
            noise = xi[b].clone() if sigma > 0.0 else None
            due = self.adapt and refresh_due(metric, step)
            body(
                Move(metric, stats, layout, grad, noise, [theta], step, lr, sigma, self.adapt), due
            )
            out[b].copy_(theta)

    def _compile_and_call(self, *args: Any) -> None:
        """First block: compile with each option set in turn; eagerly if all of them fail."""
        errors = []
        for options in self._attempts:
            fn = torch.compile(self._steps, fullgraph=True, dynamic=None, options=options or None)
            try:
                with _compiling(), _dynamic_step():
                    fn(*args)
            except Exception as exc:  # nothing ran: try the next option set
                errors.append(failure_reason(exc))
                continue
            self._compiled_fn = fn
            self.inductor_options = options
            return
        self.compile_error = "; ".join(errors)
        print(
            f"sgrld: torch.compile failed for the {self.sampler.metric.name} step "
            f"({self.compile_error}); running eagerly, which is much slower",
            file=sys.stderr,
            flush=True,
        )
        self._attempts = []
        self._steps(*args)

    def _draw(self, count: int) -> None:
        """Fill the first ``count`` rows of the noise buffers (gradient noise, then ξ)."""
        self._grad_noise[:count].normal_(generator=self.grad_generator)
        if self.sigma <= 0.0:
            return
        if self.sampler.noise == "philox":  # counter-based: step t's ξ is the eager step's
            keys, step0 = self.state.keys.reshape(-1, 2), self.state.step
            width, size = values_per_counter(self._xi.dtype), self.state.layout.size
            if size % width:
                raise ValueError(
                    f"noise='philox' in BlockRunner needs D divisible by {width} (D = {size})"
                )
            for b in range(count):  # each (*batch, D) row as (chains, rows, width) Philox blocks
                rows = self._xi[b].view(-1, size // width, width)
                philox_normal_(rows, keys, torch.tensor(step0 + b, dtype=torch.int64))
            return
        if self.noise == "block":
            self._xi[:count].normal_(generator=self.state.generator)
        else:  # the eager step's stream: one normal_ on a (*batch, D) buffer per step
            for b in range(count):
                self._xi[b].normal_(generator=self.state.generator)

    def run(
        self,
        steps: int,
        on_chunk: Callable[[int, Tensor], None],
        *,
        account: Account | None = None,
    ) -> None:
        """Take ``steps`` steps; after each chunk call ``on_chunk(first_step_index, iterates)``.

        ``iterates`` ``(count, K, D)`` is overwritten by the next chunk: copy what you keep. The
        first two blocks compile (timed in ``compile_seconds``); a final partial block runs
        eagerly. ``account``: charged K gradient evaluations a step. A non-finite iterate ends
        the run with its chunk: :class:`~sgrld.NonFiniteGradientError` (the runner's message).
        """
        done = 0
        while done < steps:
            count = min(self.chunk, steps - done)
            if account is not None:
                account.spend(count * self.theta[..., 0].numel())
            self._draw(count)
            with torch.no_grad():
                self._run_chunk(count)
            iterates = self._out[:count]
            bad = ~torch.isfinite(iterates).reshape(count, -1, self.theta.shape[-1]).all(-1)
            if bool(bad.any()):  # chain -> its first bad step (argmax: the first True)
                first = self.state.step - count + 1 + bad.byte().argmax(0)
                raise stopped({k: int(first[k]) for k in bad.any(0).nonzero()[:, 0].tolist()},
                              went_on=False)  # fmt: skip
            on_chunk(done, iterates)
            done += count

    def _run_chunk(self, count: int) -> None:
        theta, stats, block = self.theta, self.state.stats, self.block
        grad_noise, xi, out = self._grad_noise, self._xi, self._out
        for start in range(0, count, block):
            n = min(block, count - start)
            stop = start + n
            args = (theta, stats, grad_noise[start:stop], xi[start:stop], out[start:stop])
            fn = self._compiled_fn
            if fn is not None and n == block and self._calls >= 2:
                fn(*args, self.state.step, n)
            elif self._attempts and n == block:
                # Timed as compilation: the first call compiles; the second recompiles where
                # `step0` could not be made symbolic up front (older torch).
                t0 = time.perf_counter()
                if fn is None:
                    self._compile_and_call(*args, self.state.step, n)
                else:
                    with _compiling():
                        fn(*args, self.state.step, n)
                self.compile_seconds += time.perf_counter() - t0
                self._calls += 1
            else:
                self._steps(*args, self.state.step, n)
            self.state.step += n
            self.state.device_step.add_(n)


@contextlib.contextmanager
def _compiling() -> Iterator[None]:
    """:func:`~sgrld.core._compile.quiet_compile`, and inductor's eigh C-shim note dropped."""
    logger = logging.getLogger("torch._inductor.ir")
    logger.addFilter(_drop_cshim_note)
    try:
        with quiet_compile():
            yield
    finally:
        logger.removeFilter(_drop_cshim_note)


def _drop_cshim_note(record: logging.LogRecord) -> bool:
    """Drop inductor's note that ``eigh`` has no C shim (a correct fallback)."""
    return "missing a c-shim implementation" not in record.getMessage()


def _dynamic_step() -> contextlib.AbstractContextManager[None]:
    """Compile with ``step0`` symbolic from the start, where torch can (one graph)."""
    config = getattr(torch.compiler, "config", None)
    if config is not None and hasattr(config, "dynamic_sources"):
        patch: contextlib.AbstractContextManager[None] = config.patch(dynamic_sources="L['step0']")
        return patch
    return contextlib.nullcontext()
