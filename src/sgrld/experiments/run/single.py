"""One chain through the optimizer facade (``docs/experiments.md``): ``"eager"`` reads the
potential's finiteness every step; ``"deferred"`` never syncs inside a step (static minibatch
buffers, a ``capturable`` optimizer's device flags read by the loop); ``"graph"`` (CUDA)
captures the deferred step. Under ``parallel`` (DDP or FSDP) the step is the eager one."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from sgrld.capture import GraphedStep
from sgrld.core import NonFiniteGradientError
from sgrld.core.runner import OptimizerChain, first_failures
from sgrld.core.warmup import Arrival
from sgrld.data import Splits
from sgrld.evaluation.trace import scalar_hyperparameters
from sgrld.experiments.run.build import build_run_model, make_sampler
from sgrld.experiments.run.checkpoint import tensor_mismatches
from sgrld.experiments.run.config import GRAD_MAX, RunConfig
from sgrld.experiments.run.parallel import DataParallel, OneProcess, factor_mismatch
from sgrld.experiments.run.record import deferred_breakdown_reason
from sgrld.schedules import CyclicalLR

__all__ = ["STEP_MODES", "OneChain", "resolve_step_mode"]

STEP_MODES = ("auto", "eager", "deferred", "graph")


def deferred_refusal(config: RunConfig) -> str | None:
    """Why the deferred loop cannot honour ``config`` (``None``: it can)."""
    if config.noise != "philox":
        return "noise 'torch' draws from a generator on the host; use noise 'philox'"
    if config.schedule != "constant":
        return "the cyclical schedule sets ℓ and τ on the host every step"
    if config.compile:
        return "compile fuses a step of its own; drop it"
    return None


def resolve_step_mode(step_mode: str, config: RunConfig, device: torch.device) -> str:
    """The loop a run uses: ``"auto"`` is ``"graph"`` on CUDA when the config allows, else
    ``"eager"``.

    Raises:
        ValueError: an unknown mode, one the config cannot run, or ``"graph"`` off CUDA.
    """
    if step_mode not in STEP_MODES:
        raise ValueError(f"unknown step_mode {step_mode!r}; valid: {', '.join(STEP_MODES)}")
    refusal = deferred_refusal(config)
    if step_mode == "auto":
        return "graph" if device.type == "cuda" and refusal is None else "eager"
    if step_mode != "eager" and refusal is not None:
        raise ValueError(f"step_mode {step_mode!r} cannot run this config: {refusal}")
    if step_mode == "graph" and device.type != "cuda":
        raise ValueError(
            f"step_mode 'graph' needs a CUDA device, not {device}; 'deferred' runs the same "
            "loop without capture"
        )
    return step_mode


class OneChain:
    """One chain's model and optimizer (and cyclical schedule), stepped eagerly, deferred or
    captured, in one process or over the ranks of ``parallel`` (one process is the job of one
    rank, :class:`~.run.parallel.OneProcess`: one path for both).

    Raises:
        ValueError: a step mode the config or device cannot run (:func:`resolve_step_mode`),
            one other than eager under ``parallel``, ``--curvature`` under fsdp.
    """

    def __init__(
        self,
        config: RunConfig,
        splits: Splits,
        seeds: Mapping[str, int],
        device: torch.device,
        step_mode: str = "auto",
        parallel: DataParallel | None = None,
    ) -> None:
        if parallel is not None:  # the data-parallel step is the eager loop's
            if step_mode not in ("auto", "eager"):
                raise ValueError(
                    f"--parallel {parallel.mode} runs the eager loop, not step_mode {step_mode!r}"
                )
            step_mode = "eager"
            if parallel.mode == "fsdp" and config.curvature:
                raise ValueError(
                    "--curvature differentiates through the model outside the potential's "
                    "forward, which the sharded parameters (--parallel fsdp) do not allow; "
                    "use --parallel ddp or measure it in one process"
                )
        self._job = OneProcess() if parallel is None else parallel
        self.is_main, self.collective_state = self._job.is_main, self._job.collective_state
        self.step_mode = resolve_step_mode(step_mode, config, device)
        self.config, self.splits = config, splits
        self.num_data = splits.num_train
        init_generator = torch.Generator().manual_seed(seeds["init"])
        self.model = self._job.prepare(build_run_model(config, splits, init_generator).to(device))
        self.model.train()
        params = self._job.parameters(self.model)
        generator = torch.Generator(device).manual_seed(seeds["chain"])
        deferred = self.step_mode != "eager"
        self.optimizer = make_sampler(config, params, self.num_data, generator, capturable=deferred)
        self.watch = self.optimizer
        self.state_bytes: int | None = sum(self.optimizer.state_bytes().values())
        self.schedule: CyclicalLR | None = None
        if config.schedule == "cyclical":
            total = config.epochs * math.ceil(self.num_data / config.batch_size)
            self.schedule = CyclicalLR(
                self.optimizer, total, config.cycles, config.explore_fraction
            )
        # the step is the runner's chain through the optimizer: eager, the ranks' potential read
        # at once; deferred, a non-finite potential poisons its gradient (no host read) and the
        # minibatch goes into static buffers (by batch size) that a captured step replays
        self._lr = self.optimizer.param_groups[0]["lr"]
        self._chain = OptimizerChain(
            self.model,
            lambda _, xy: self._job.potential(self.model, xy[0], xy[1], self.num_data),
            self.optimizer,
            grad_clip=GRAD_MAX,
            keep_grads=deferred,
            ranks=None if deferred else self._job,
        )
        self._batches: dict[int, tuple[Tensor, Tensor]] = {}
        self._graphed: GraphedStep | None = None
        self._failure: str | None = None  # the eager step's, until read

    def step(self, index: Tensor) -> bool:
        (rows,) = index  # one chain
        exploring = self.schedule is not None and self.schedule.exploring  # τ = 0, no sample
        try:  # eager: a non-finite potential or gradient is refused at once, on every rank
            self._step(rows)
        except NonFiniteGradientError as exc:
            self._failure = str(exc)
            return False
        if self.schedule is not None:
            self.schedule.step()
        return not exploring

    def _step(self, index: Tensor) -> None:
        """The step on the rows ``index``; deferred, gathered into static buffers (replayed in
        ``"graph"`` mode, except for a batch of another size: the short last one)."""
        x, y = self.splits.x_train, self.splits.y_train
        if self.step_mode == "eager":
            self._chain.step((x[index], y[index]))
            return
        size = len(index)
        if size not in self._batches:
            self._batches[size] = (x.new_empty((size, *x.shape[1:])), y.new_empty((size,)))
        bx, by = self._batches[size]
        torch.index_select(x, 0, index, out=bx)
        torch.index_select(y, 0, index, out=by)
        if self.step_mode != "graph" or size != min(self.config.batch_size, self.num_data):
            self._chain.step((bx, by))
            return
        if self._graphed is None:
            self._graphed = GraphedStep(
                functools.partial(self._chain.step, (bx, by)), self.optimizer
            )
        self._graphed()

    def failures(self, last: int) -> dict[int, tuple[int, str]]:
        if self._failure is not None:  # the eager step just taken
            reason, self._failure = self._failure, None
            return {0: (last, reason)}
        if self.step_mode == "eager":
            return {}
        (state,) = self.optimizer.sampler_states  # one group (make_sampler)
        failure = first_failures([state.flags]).get(0)  # one host read
        if failure is None:
            return {}
        update, tensor = failure
        # the engine froze the chain there, only the step counters ran on: set them back to the
        # last good update, so that the checkpoint holds the eager loop's state
        state.flags.zero_()
        state.step = update - 1
        state.device_step.fill_(update - 1)
        name = [n for n, _ in self.model.named_parameters()][tensor]
        return {0: (update, deferred_breakdown_reason(update, name))}

    def refresh(self) -> bool:
        """Wenzel's refresh in place, so that later replays of a captured step see it."""
        refreshes = self.optimizer.metric.refresh_per_epoch
        if refreshes:
            self.optimizer.refresh_metric()
        return refreshes

    def telemetry(self) -> list[Mapping[str, float]] | None:
        return [self.optimizer.telemetry()] if self.optimizer.telemetry_enabled else None

    def train(self, mode: bool) -> None:
        self.model.train(mode)

    def predict(
        self, inputs: Mapping[str, Tensor], batch: int, add: Callable[[int, str, int, Tensor], None]
    ) -> list[dict[str, float]]:
        """Each rank predicts its slice of the points, then all have them all (under fsdp with
        the parameters gathered)."""

        def fold(model: nn.Module) -> dict[str, float]:
            for split, x in inputs.items():
                rows = self._job.rows(len(x))
                parts = [  # at least one call: an empty slice gives the predictions' shape
                    model(x[start : min(start + batch, rows.stop)])
                    for start in range(rows.start, max(rows.stop, rows.start + 1), batch)
                ]
                add(0, split, 0, self._job.gather_rows(torch.cat(parts), len(x)))
            return scalar_hyperparameters(model)

        with torch.no_grad():
            return [self._job.within(fold)]

    def module(self, chain: int) -> nn.Module:
        return self.model

    def arrival(self, chain: int) -> tuple[Arrival | None, int]:
        return self.optimizer.sampler_states[0].warmup, 0  # one group (make_sampler)

    @torch.no_grad()
    def theta_norms(self) -> list[float] | None:
        if self.collective_state:  # fsdp: each rank's shard; the telemetry judges
            return None
        params = [p.detach().double().square().sum() for p in self.model.parameters()]
        return [float(torch.stack(params).sum().sqrt())] if params else None

    def state_dict(self) -> dict[str, Any]:
        """The model (under fsdp gathered: every rank takes part), the optimizer (ℓ as a float,
        so that any step mode continues it) and the schedule."""
        optimizer = self._job.optimizer_state(self.optimizer.state_dict())
        for group in optimizer["param_groups"]:
            if isinstance(group["lr"], Tensor):
                group["lr"] = float(group["lr"])
        return {
            "model": self._job.model_state(self.model),
            "optimizer": optimizer,
            "schedule": None if self.schedule is None else self.schedule.state_dict(),
        }

    def mismatches(self, state: Mapping[str, Any]) -> list[str]:
        wrong = tensor_mismatches(state["model"], self._job.model_state(self.model), "model")
        factors = factor_mismatch(state["optimizer"], self.optimizer.state_dict())
        return wrong + ([] if factors is None else [factors])

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._job.load_model_state(self.model, state["model"])
        self._job.load_optimizer_state(self.optimizer, state["optimizer"])
        if self.step_mode != "eager":  # ℓ is the config's (constant), as a device tensor
            for group in self.optimizer.param_groups:
                group["lr"] = self._lr
        self._graphed = None  # the optimizer's state tensors are new: capture again
        if self.schedule is not None:  # same epochs (config_differences), same cycles
            self.schedule.load_state_dict(state["schedule"])
