"""Capture a whole training step (forward, backward and the sampler step) in a CUDA graph.

A step of the MNIST MLP on a GPU is launch-bound; replaying a captured graph launches all its
kernels at once. :class:`GraphedStep` follows ``torch.cuda.make_graphed_callables``' recipe for
a step that ends in a ``capturable`` optimizer's ``step()``; every call is exactly one step of
the chain. Noise is counter-based (every replay draws fresh noise, a resume draws what the
uninterrupted run would); ℓ must be a tensor (a scheduler changes it in place); checks are
deferred (``opt.check()``); a step that makes a host refresh due
(:meth:`~sgrld.SGRLDOptimizer.refreshes_next`) runs eagerly, and the host's part of a replayed
step runs after it (:meth:`~sgrld.SGRLDOptimizer.after_replay`); the end of the warm-up or a
:meth:`~sgrld.SGRLDOptimizer.freeze_metric` captures anew. Example: ``docs/usage.md``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from sgrld.core.contract import check_int
from sgrld.optim import SGRLDOptimizer

__all__ = ["GraphedStep"]


class GraphedStep:
    """Run ``step_fn`` as a replayed CUDA graph; see the module docstring.

    The first ``warmup`` calls run eagerly on a side stream, the next captures and replays, later
    ones replay; a call that makes a refresh due runs eagerly. Make a new ``GraphedStep`` after
    ``optimizer.load_state_dict`` (it replaces the tensors the graph writes).

    Args:
        step_fn: the whole training step (forward, backward, ``optimizer.step()``), reading its
            data from static tensors the caller refills; returns a tensor or ``None``. Its
            gradients should persist across calls (``zero_grad(set_to_none=False)``).
        optimizer: the ``capturable=True`` sgrld optimizer ``step_fn`` steps, with tensor ℓ.
        warmup: eager calls before the capture (each one a real step of the chain).
    """

    def __init__(
        self, step_fn: Callable[[], Tensor | None], optimizer: SGRLDOptimizer, *, warmup: int = 3
    ) -> None:
        if not optimizer.capturable:
            raise ValueError("GraphedStep needs an optimizer built with capturable=True")
        for group in optimizer.param_groups:
            if not isinstance(group["lr"], Tensor):
                raise ValueError(
                    "GraphedStep needs lr as a tensor (lr=torch.tensor(..., device='cuda')): a "
                    "float would be baked into the graph and a scheduler could not change it"
                )
            device = group["params"][0].device
            if device.type != "cuda":
                raise ValueError(f"CUDA graphs need parameters on a CUDA device, not {device}")
        check_int("warmup", warmup, 1)
        self.step_fn, self.optimizer = step_fn, optimizer
        self.warmup = warmup
        self.warmed = 0  # eager warm-up calls so far
        self.graph: torch.cuda.CUDAGraph | None = None
        self.output: Tensor | None = None
        self.replays = 0
        self._side: torch.cuda.Stream | None = None
        self._adapts: tuple[bool, ...] = ()  # whether each group adapted when captured

    def _warm(self) -> Tensor | None:
        """One eager step on a side stream (the recipe of ``make_graphed_callables``)."""
        if self._side is None:
            self._side = torch.cuda.Stream()
        self._side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._side):
            output = self.step_fn()
        torch.cuda.current_stream().wait_stream(self._side)
        self.warmed += 1
        return output

    def _capture(self) -> torch.cuda.CUDAGraph:
        """Record the step; its host side ran (the step counts advanced): undo that for the
        replay.
        """
        opt = self.optimizer
        states = opt.sampler_states
        counts = [state.step for state in states]
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self.output = self.step_fn()
        finally:  # also when the capture fails: no step was taken
            for state, count in zip(states, counts, strict=True):
                state.step = count
        self._adapts = self._adapting()
        return graph

    def _adapting(self) -> tuple[bool, ...]:
        opt = self.optimizer
        return tuple(opt.adapts(i) for i in range(len(opt.param_groups)))

    def __call__(self) -> Tensor | None:
        """One training step: eager (warm-up, due refresh), or captured and replayed."""
        if self.optimizer.refreshes_next():
            return self.step_fn()  # an eager step refreshes on schedule itself
        if self.graph is not None and self._adapting() != self._adapts:
            self.graph = None  # the warm-up ended (or the metric was frozen): capture anew
        if self.graph is None:
            if self.warmed < self.warmup:
                return self._warm()
            self.graph = self._capture()
        self.graph.replay()
        self.replays += 1
        self.optimizer.after_replay()  # the device count advanced inside the graph
        return self.output
