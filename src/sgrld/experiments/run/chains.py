"""K sampling runs in one process (``--chains K``): one :class:`sgrld.Chains` steps K configs
that differ only in seed, ℓ and the tuned options. Chain k is *the* single run of its config,
whatever K and its position: its init, minibatches and Philox keys come from its own seeds; a
chain that breaks down is frozen by the engine's device flags (``docs/experiments.md``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

import sgrld
from sgrld.chains import Chains
from sgrld.core.noise import keys_from_generator
from sgrld.core.runner import VectorizedChains, bind, poisoned
from sgrld.core.warmup import Arrival
from sgrld.data import Splits
from sgrld.evaluation.trace import scalar_hyperparameter_tensors
from sgrld.experiments.run.build import build_metric, build_run_model
from sgrld.experiments.run.choices import Names
from sgrld.experiments.run.config import GRAD_MAX, TUNED_FIELDS, RunConfig
from sgrld.experiments.run.naming import chain_label
from sgrld.experiments.run.record import deferred_breakdown_reason
from sgrld.experiments.run.single import deferred_refusal
from sgrld.models import potential
from sgrld.schedules import CyclicalLR

__all__ = [
    "VmappedChains",
    "check_chain_configs",
    "plan_chain_batch",
]

#: The fields in which the chains of one process may differ.
PER_CHAIN_FIELDS: Sequence[str] = Names(lambda: ("seed", "lr", *TUNED_FIELDS))


def check_chain_configs(configs: Sequence[RunConfig]) -> None:
    """Refuse configs that cannot share one stacked model.

    Raises:
        ValueError: no config, duplicates, configs that differ in more than
            :data:`PER_CHAIN_FIELDS`, or options the deferred loop cannot run.
    """
    if not configs:
        raise ValueError("no chain to run")
    base = configs[0]
    for c in configs[1:]:
        mine, theirs = c.flat(), base.flat()
        differences = [
            f"{n}: {mine[n]!r} vs {theirs[n]!r}"
            for n in mine
            if n not in PER_CHAIN_FIELDS and mine[n] != theirs[n]
        ]
        if differences:
            raise ValueError(
                f"the chains of one process may differ only in {', '.join(PER_CHAIN_FIELDS[:-1])} "
                f"and {PER_CHAIN_FIELDS[-1]}; "
                f"{c.label()} differs from {base.label()} in {', '.join(differences)}"
            )
    labels = [chain_label(c) for c in configs]
    twice = sorted({x for x in labels if labels.count(x) > 1})
    if twice:
        raise ValueError(f"the same run twice: {', '.join(twice)}")
    refusal = deferred_refusal(base)  # the chains' loop reads no host value in a step
    if refusal is not None:
        raise ValueError(
            f"--chains runs the deferred loop, which cannot run this config: {refusal}"
        )


def _philox_seed(generator: torch.Generator) -> int:
    """The Philox key the single run's optimizer draws from ``generator``, as a seed (its two
    words are the seed's halves: :func:`sgrld.core.noise.keys_from_seeds`)."""
    low, high = keys_from_generator((), generator, torch.device("cpu")).tolist()
    return int(low) | (int(high) << 32)


def plan_chain_batch(
    num_chains: int, free_bytes: int, state_bytes: int, step_bytes: int, headroom: float = 0.7
) -> int:
    """Chains per vectorised call so that K chains fit in ``free_bytes`` of device memory: every
    chain's state (``state_bytes``) for the whole run, a step's transient memory (``step_bytes``
    per chain) for one call's chains, within ``headroom`` of what the state leaves.

    Raises:
        MemoryError: the K chains' state alone does not fit, or not even one chain's step.
    """
    left = free_bytes - num_chains * state_bytes
    mib = 2**20
    if left <= 0:
        raise MemoryError(
            f"{num_chains} chains need {num_chains * state_bytes / mib:.0f} MiB of state, "
            f"{free_bytes / mib:.0f} MiB are free: run fewer chains per process"
        )
    batch = int(left * headroom // max(step_bytes, 1))
    if batch < 1:
        raise MemoryError(
            f"one chain's step needs {step_bytes / mib:.0f} MiB, {left / mib:.0f} MiB are left "
            "beside the chains' state: run fewer chains per process"
        )
    return min(batch, num_chains)


def _probe_chain_memory(
    make: Any, sampler: sgrld.Sampler, seed: int, loss: Any, x: Tensor, y: Tensor
) -> tuple[int, int]:
    """``(state_bytes, step_bytes)`` of one chain on a CUDA device, measured."""
    device = x.device
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    probe = Chains(make, sampler, seeds=[seed], device=device)
    state = torch.cuda.memory_allocated(device) - base
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    probe.grads(poisoned(bind(loss, tuple)), x[None], y[None], grad_clip=GRAD_MAX)  # its buffers
    step = torch.cuda.max_memory_allocated(device) - before
    del probe
    torch.cuda.empty_cache()
    return state, step


class VmappedChains:
    """K chains of one setting as one :class:`sgrld.Chains` (a :class:`~.run.loop.Stepper`).

    Args:
        configs: the chains' runs (:func:`check_chain_configs`).
        splits: the run's data (restricted, on ``device``).
        seeds: each chain's seed streams (:attr:`~.run.record.RunRecord.seeds`).
        device: where the stacked model lives.
        chain_batch: at most this many chains per vmapped call; ``None``: all on a CPU, on CUDA
            as many as fit (:func:`plan_chain_batch`).
    """

    step_mode = "deferred"  # the flags are read at samples and epoch ends
    schedule: CyclicalLR | None = None
    is_main = True
    collective_state = False
    watch = None  # telemetry is always on

    def __init__(
        self,
        configs: Sequence[RunConfig],
        splits: Splits,
        seeds: Sequence[Mapping[str, int]],
        device: torch.device,
        chain_batch: int | None = None,
    ) -> None:
        base = configs[0]
        self.splits = splits
        num_data = splits.num_train

        def model(seed: int) -> torch.nn.Module:
            return build_run_model(base, splits, torch.Generator().manual_seed(seed))

        sampler = sgrld.build(
            build_metric(base.sampler, base.metric_options, paper=base.adapt == "always"),
            lr=base.lr,
            num_data=num_data,
            temperature=base.temperature,
            noise="philox",
            adapt_until=base.adapt_until,
        )

        def loss(model: Any, batch: tuple[Tensor, Tensor]) -> Tensor:
            return potential(model, *batch, num_data)

        if chain_batch is None and device.type == "cuda":
            rows = min(base.batch_size, num_data)
            x, y = splits.x_train[:rows], splits.y_train[:rows]
            probe = _probe_chain_memory(model, sampler, seeds[0]["init"], loss, x, y)
            free, _ = torch.cuda.mem_get_info(device)
            chain_batch = plan_chain_batch(len(configs), free, *probe)
        self.chain_batch = chain_batch
        tuned: dict[str, Any] = {n: [c.tuned[n] for c in configs] for n in sampler.metric.tuned}
        noise_seeds = [_philox_seed(torch.Generator(device).manual_seed(s["chain"])) for s in seeds]
        self.chains = Chains(
            model,
            sampler,
            seeds=[s["init"] for s in seeds],
            lr=[c.lr for c in configs],
            **tuned,
            noise_seeds=noise_seeds,
            chain_batch=chain_batch,
            device=device,
            telemetry=True,
        )
        self.chains.train()
        self.state_bytes: int | None = self.chains.state_bytes()
        self._scalar_names = list(scalar_hyperparameter_tensors(self.chains.model))
        self._refreshes = sampler.metric.refresh_per_epoch  # as the single run refreshes
        # the runner's vmapped chains, each on its own minibatch (rows ``index[k]``)
        self._stepper = VectorizedChains(
            self.chains, loss, refresh=self._refreshes, per_chain=True, grad_clip=GRAD_MAX
        )

    def step(self, index: Tensor) -> bool:
        self._stepper.step((self.splits.x_train[index], self.splits.y_train[index]))
        return True

    def failures(self, last: int) -> dict[int, tuple[int, str]]:
        found = self.chains.failure_details().items()
        return {k: (update, deferred_breakdown_reason(update, name)) for k, (update, name) in found}

    def refresh(self) -> bool:
        self._stepper.end_pass()  # Wenzel: refresh at each epoch end
        return self._refreshes

    def telemetry(self) -> list[Mapping[str, float]] | None:
        return list(self.chains.telemetry())

    def train(self, mode: bool) -> None:
        self.chains.train(mode)

    @torch.no_grad()
    def predict(
        self, inputs: Mapping[str, Tensor], batch: int, add: Callable[[int, str, int, Tensor], None]
    ) -> list[dict[str, float]]:
        for split, x in inputs.items():
            for start in range(0, len(x), batch):
                logits = self.chains(x[start : start + batch], shared=True)  # (K, B, C)
                for k in range(len(logits)):
                    add(k, split, start, logits[k])
        if not self._scalar_names:  # each chain's prior scales (horseshoe), on the host
            return [{} for _ in range(self.chains.num_chains)]

        def scales(model: torch.nn.Module) -> Tensor:
            return torch.stack(list(scalar_hyperparameter_tensors(model).values()))

        values = self.chains.map(scales, shared=True).cpu()  # (K, S)
        return [{n: float(v[j]) for j, n in enumerate(self._scalar_names)} for v in values]

    def module(self, chain: int) -> torch.nn.Module:
        return self.chains.module(chain)

    def arrival(self, chain: int) -> tuple[Arrival | None, int]:
        for group in self.chains.groups:  # the chains sharing one sampler state
            if group.start <= chain < group.stop:
                return group.state.warmup, chain - group.start
        return None, 0

    @torch.no_grad()
    def theta_norms(self) -> list[float] | None:
        stacked = self.chains.params.values()  # (K, ...) each
        sums = [t.detach().reshape(t.shape[0], -1).double().square().sum(-1) for t in stacked]
        norms: list[float] = torch.stack(sums).sum(0).sqrt().tolist()
        return norms

    def state_dict(self) -> dict[str, Any]:
        return {"chain_batch": self.chain_batch, "chains": self.chains.state_dict()}

    def mismatches(self, state: Mapping[str, Any]) -> list[str]:
        return []  # Chains.load_state_dict refuses other chains before restoring anything

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.chains.load_state_dict(state["chains"])
