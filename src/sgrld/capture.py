"""Capture a whole training step — forward, backward and the sampler step — in a CUDA graph.

A step of the MNIST MLP is launch-bound on a GPU: ~0.3 GFLOP spread over a few hundred kernels
whose launches take longer than their arithmetic. Replaying a captured CUDA graph launches them
all at once. :class:`GraphedStep` follows ``torch.cuda.make_graphed_callables``' recipe (warm-up
on a side stream, static inputs, one capture) for a training step that ends in a ``capturable``
sgrld optimizer's ``step()``:

* the sampler's noise is counter-based (``noise="philox"``: a function of the chain's key and the
  device step count), so every replay draws fresh noise and a resumed run draws what the
  uninterrupted one would;
* ℓ must be a tensor (``lr=torch.tensor(...)``): a scheduler that changes it in place changes
  every later replay (a float would be baked into the graph);
* NaN/Inf checks are deferred (device flags, read by ``opt.check()``);
* what the host schedules stays on the host: a step that makes Shampoo's root refresh due runs
  eagerly instead of replaying (so the chain is exactly the eager one), and the optimizer's host
  step counter and Wenzel's refresh schedule are advanced after each replay.

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

from sgrld.core.engine import refresh_due
from sgrld.optim import SGRLDOptimizer

__all__ = ["GraphedStep"]


class GraphedStep:
    """Run ``step_fn`` as a replayed CUDA graph; see the module docstring.

    Args:
        step_fn: the whole training step (forward, backward, ``optimizer.step()``), reading its
            data from static tensors that the caller refills before each call; returns a tensor
            (e.g. the loss) or ``None``.
        optimizer: the ``capturable=True`` sgrld optimizer that ``step_fn`` steps, with tensor
            learning rates.
        warmup: eager steps on a side stream before capture (they advance the chain as any
            step does; CUDA libraries initialise their workspaces here).
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
        if not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"invalid warmup: {warmup!r} (expected an integer >= 1)")
        self.step_fn, self.optimizer = step_fn, optimizer
        self.warmup = warmup
        self.graph: torch.cuda.CUDAGraph | None = None
        self.output: Tensor | None = None
        self.replays = 0

    def _refresh_next(self) -> bool:
        """Whether the coming step makes a scheduled refresh due in some group."""
        opt = self.optimizer
        for index, state in enumerate(opt._group_states):
            metric = opt._group_metrics[index]
            if state is not None and metric is not None and refresh_due(metric, state.step + 1):
                return True
        return False

    def _eager(self) -> Tensor | None:
        return self.step_fn()  # an eager step refreshes on schedule itself

    def _capture(self) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(self.warmup):
                self._eager()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        # the captured step runs once while capturing: its host-side effects (the step count)
        # happen here, exactly as for an eager step
        with torch.cuda.graph(self.graph):
            self.output = self.step_fn()

    def __call__(self) -> Tensor | None:
        """One training step: replay, or eagerly when a refresh is due or before capture."""
        if self.graph is None:
            if self._refresh_next():
                return self._eager()
            self._capture()
            return self.output
        if self._refresh_next():
            return self._eager()
        self.graph.replay()
        self.replays += 1
        opt = self.optimizer
        for state in opt._group_states:
            if state is not None:
                state.step += 1  # the device count advanced inside the graph
        opt._after_step()
        return self.output
