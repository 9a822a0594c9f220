"""Capture a whole training step — forward, backward and the sampler step — in a CUDA graph.

A step of the MNIST MLP is launch-bound on a GPU: ~0.3 GFLOP spread over a few hundred kernels
whose launches take longer than their arithmetic. Replaying a captured CUDA graph launches them
all at once. :class:`GraphedStep` follows ``torch.cuda.make_graphed_callables``' recipe (warm-up
on a side stream, static inputs, one capture) for a training step that ends in a ``capturable``
sgrld optimizer's ``step()``; every call, warm-up and capture included, is exactly one step of
the chain on the data in the static inputs, so a loop can use it from its first step:

* the sampler's noise is counter-based (``noise="philox"``: a function of the chain's key and the
  device step count), so every replay draws fresh noise and a resumed run draws what the
  uninterrupted one would;
* ℓ must be a tensor (``lr=torch.tensor(...)``): a scheduler that changes it in place changes
  every later replay (a float would be baked into the graph);
* NaN/Inf checks are deferred (device flags, read by ``opt.check()``);
* what the host schedules stays on the host: a step that makes a refresh due (Shampoo's roots,
  Wenzel's ``refresh_every``: :meth:`~sgrld.SGRLDOptimizer.refreshes_next`) runs eagerly instead
  of replaying (so the chain is exactly the eager one), and the optimizer's host side of a step
  runs after each replay (:meth:`~sgrld.SGRLDOptimizer.after_replay`). A refresh the
  caller runs between replays (Wenzel's ``update_preconditioner()``) writes the statistics in
  place, so the next replay reads it;
* whether the metric adapts is baked into a capture, so the step after the warm-up
  (``adapt_until``, :mod:`sgrld.core.warmup`) or a :meth:`~sgrld.SGRLDOptimizer.freeze_metric`
  captures the step anew (one capture each way).

Example (CUDA only)::

    opt = sgrld.MongeSGLD(model.parameters(), lr=torch.tensor(0.25, device="cuda"),
                          num_data=n, noise="philox", capturable=True)
    x = torch.empty(100, 784, device="cuda"); y = torch.empty(100, dtype=torch.long, device="cuda")

    def train_step():
        opt.zero_grad(set_to_none=False)
        loss = potential(model, x, y, n)
        loss.backward()
        opt.step()
        return loss

    step = GraphedStep(train_step, opt)
    for xb, yb in loader:
        x.copy_(xb); y.copy_(yb)
        loss = step()          # replays the graph (or runs eagerly when a refresh is due)
    opt.check()                # NaN/Inf anywhere in the run → NonFiniteGradientError
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from sgrld.optim import SGRLDOptimizer

__all__ = ["GraphedStep"]


class GraphedStep:
    """Run ``step_fn`` as a replayed CUDA graph; see the module docstring.

    Every call is one training step on the data the caller put in the static inputs: the first
    ``warmup`` calls run eagerly on a side stream (CUDA libraries initialise their workspaces
    there, the optimizer creates its state), the next one captures the step and replays it
    (capturing records the kernels without running them), later ones replay. A call whose step
    makes a scheduled refresh due (Shampoo's roots, a ``refresh_every``) runs eagerly instead,
    at any point. Make a new ``GraphedStep`` after ``optimizer.load_state_dict`` (it replaces
    the state tensors the graph writes).

    Args:
        step_fn: the whole training step (forward, backward, ``optimizer.step()``), reading its
            data from static tensors that the caller refills before each call; returns a tensor
            (e.g. the loss) or ``None``. Its gradients should persist across calls
            (``zero_grad(set_to_none=False)``), so that eager and replayed steps write the same
            tensors.
        optimizer: the ``capturable=True`` sgrld optimizer that ``step_fn`` steps, with tensor
            learning rates.
        warmup: eager calls before the capture (each one a real step of the chain).
    """

    def __init__(
        self,
        step_fn: Callable[[], Tensor | None],
        optimizer: SGRLDOptimizer,
        *,
        warmup: int = 3,
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
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"invalid warmup: {warmup!r} (expected an integer >= 1)")
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

    def _capture(self) -> None:
        """Record the step. Nothing runs on the device, but the step's host side does (the
        optimizer's host step counts advance): undo that, so the replay that follows counts it."""
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
        self.graph = graph
        self._adapts = self._adapting()

    def _adapting(self) -> tuple[bool, ...]:
        opt = self.optimizer
        return tuple(opt.adapts(i) for i in range(len(opt.param_groups)))

    def _replay(self) -> Tensor | None:
        assert self.graph is not None
        self.graph.replay()
        self.replays += 1
        self.optimizer.after_replay()  # the device count advanced inside the graph
        return self.output

    def __call__(self) -> Tensor | None:
        """One training step: eager (warm-up, due refresh), or captured and replayed."""
        if self.optimizer.refreshes_next():
            return self.step_fn()  # an eager step refreshes on schedule itself
        if self.graph is not None and self._adapting() != self._adapts:
            self.graph = None  # the warm-up ended (or the metric was frozen): capture anew
        if self.graph is None:
            if self.warmed < self.warmup:
                return self._warm()
            self._capture()
        return self._replay()
