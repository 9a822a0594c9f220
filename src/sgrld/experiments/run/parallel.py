"""One chain over several processes: ``torchrun … sgrld sample --parallel ddp|fsdp``
(``docs/experiments.md``, "One chain over several processes").

Each rank takes its contiguous slice of every global minibatch, its potential weighted so that
the ranks' sum is the single run's: u_r = (|B_r| / |B|) · mean_{B_r} nll − log p(θ) / (n · W).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from sgrld.core.runner import sampled
from sgrld.models import BayesianModel, potential

MODES = ("ddp", "fsdp")
T = TypeVar("T")


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """The device of the node's process ``local_rank``: ``cuda:LOCAL_RANK``, or ``cuda:0`` where
    each process sees its own GPU only; a CPU device as it is.

    Raises:
        RuntimeError: fewer GPUs visible than the node's processes need.
    """
    if device.type != "cuda":
        return device
    count = torch.cuda.device_count()
    if count == 1:
        return torch.device("cuda", 0)
    if local_rank >= count:
        raise RuntimeError(
            f"rank {local_rank} of its node needs GPU cuda:{local_rank}, but {count} GPUs are "
            "visible: one process per GPU (a sweep asks for --tasks-per-node GPUs per node)"
        )
    return torch.device("cuda", local_rank)


class DataParallel:
    """This process's place in a ``ddp`` job, ``rank`` of ``world``: every rank holds the whole
    model and sampler state; the gradients are summed in one all-reduce."""

    mode = "ddp"
    collective_state = False  # building the checkpoint takes every rank (gathering shards)

    def __init__(self, rank: int, world: int) -> None:
        self.rank = rank
        self.world = world
        self._model: BayesianModel | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, world={self.world})"

    @staticmethod
    def join(device: torch.device, mode: str = "ddp") -> DataParallel:
        """This process's place for ``mode`` in the default process group, created from
        torchrun's environment if need be (gloo on CPU, NCCL on CUDA, one GPU per process).

        Raises:
            RuntimeError: not started by torchrun, or too few GPUs (:func:`rank_device`).
        """
        import torch.distributed as dist

        if mode not in MODES:
            raise ValueError(f"unknown parallel mode {mode!r} (expected one of {MODES})")
        if not dist.is_initialized():
            if "WORLD_SIZE" not in os.environ:
                raise RuntimeError(
                    f"--parallel {mode} runs under torchrun: torchrun --nproc-per-node W -m "
                    f"sgrld sample … --parallel {mode}"
                )
            if device.type == "cuda":  # one GPU per process
                local_rank = int(os.environ.get("LOCAL_RANK", "0"))
                index = rank_device(device, local_rank) if device.index is None else device
                torch.cuda.set_device(index)
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        kind = FullyShardedData if mode == "fsdp" else DataParallel
        return kind(dist.get_rank(), dist.get_world_size())

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def prepare(self, model: BayesianModel) -> BayesianModel:
        """The model as this job runs it (BatchNorm synchronised)."""
        self._model = self.synchronise_batch_norm(model)
        return self._model

    def parameters(self, model: BayesianModel) -> list[Tensor]:
        """The tensors the sampler moves, in the single run's order (the runner's rule:
        :func:`~sgrld.core.runner.sampled`)."""
        return list(sampled(model).values())

    def within(self, fn: Callable[[BayesianModel], T]) -> T:
        """``fn(model)`` with the whole parameters in the model (a replica has them)."""
        assert self._model is not None
        return fn(self._model)

    def model_state(self, model: BayesianModel) -> dict[str, Tensor]:
        """The model's state dict in the single run's names and shapes."""
        return model.state_dict()

    def load_model_state(self, model: BayesianModel, state: Mapping[str, Tensor]) -> None:
        model.load_state_dict(state)

    def optimizer_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """The optimizer's ``state_dict()`` in the single run's form."""
        return state

    def load_optimizer_state(self, optimizer: Any, state: Mapping[str, Any]) -> None:
        optimizer.load_state_dict(state)

    def shard(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor, float]:
        """This rank's contiguous rows of a global minibatch, and their share |B_r| / |B|."""
        rows = torch.tensor_split(torch.arange(len(y), device=y.device), self.world)[self.rank]
        return x[rows], y[rows], len(rows) / len(y)

    def rows(self, n: int, rank: int | None = None) -> range:
        """This rank's contiguous rows of ``n`` (``tensor_split``'s: the first ``n mod W`` ranks
        one more)."""
        rank = self.rank if rank is None else rank
        size, extra = divmod(n, self.world)
        start = rank * size + min(rank, extra)
        return range(start, start + size + (rank < extra))

    def gather_rows(self, part: Tensor, n: int) -> Tensor:
        """The ``(n, …)`` tensor whose rows :meth:`rows` are ``part`` on each rank, on every
        rank (one all-gather): the evaluation's predictions, computed on a slice each."""
        import torch.distributed as dist

        sizes = [len(self.rows(n, r)) for r in range(self.world)]
        padded = part.new_zeros((max(sizes), *part.shape[1:]))
        padded[: len(part)] = part
        pieces = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(pieces, padded.contiguous())
        return torch.cat([piece[:size] for piece, size in zip(pieces, sizes, strict=True)])

    def potential(self, model: BayesianModel, x: Tensor, y: Tensor, num_data: int) -> Tensor:
        """u_r of the module docstring: summed over the ranks, the global minibatch's u_B."""
        x_r, y_r, share = self.shard(x, y)
        nll = model.likelihood.nll(model(x_r), y_r) if len(y_r) else x.new_zeros(())
        return nll * share - model.log_prior() / (num_data * self.world)

    def synchronise_batch_norm(self, model: BayesianModel) -> BayesianModel:
        """BatchNorm over the global minibatch, as the single run's: ``SyncBatchNorm`` (CUDA).

        Raises:
            ValueError: a BatchNorm model on CPU, where torch has no SyncBatchNorm.
        """
        norms = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
        if not any(isinstance(m, norms) for m in model.modules()):
            return model
        if next(model.parameters()).device.type != "cuda":
            raise ValueError(
                f"--parallel {self.mode} of a model with BatchNorm needs CUDA (SyncBatchNorm): on "
                "CPU each process would normalise by its own slice of the minibatch, which is not "
                "the single run's chain; run it in one process"
            )
        synced = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        assert isinstance(synced, BayesianModel)
        return synced

    def sum(self, value: Tensor) -> Tensor:
        """The sum over the ranks of a 0-d tensor (the potential, for the finiteness check)."""
        import torch.distributed as dist

        total = value.detach().clone()
        dist.all_reduce(total)
        return total

    def sum_gradients(self, params: list[Tensor]) -> None:
        """Σ_r ∇u_r into every rank's ``.grad``, in one all-reduce of a flat buffer."""
        import torch.distributed as dist

        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


class OneProcess(DataParallel):
    """A run in one process: the job of one rank, whose collectives are the identity and whose
    potential is the single run's u_B, so that one chain's step has one path."""

    mode = "none"

    def __init__(self) -> None:
        super().__init__(0, 1)

    def prepare(self, model: BayesianModel) -> BayesianModel:
        self._model = model
        return model

    def gather_rows(self, part: Tensor, n: int) -> Tensor:
        return part

    def potential(self, model: BayesianModel, x: Tensor, y: Tensor, num_data: int) -> Tensor:
        return potential(model, x, y, num_data)

    def sum(self, value: Tensor) -> Tensor:
        return value

    def sum_gradients(self, params: list[Tensor]) -> None:
        pass


class _Scalar(nn.Module):
    """A 0-d parameter kept as one row, which FSDP2 can shard (it refuses 0-d tensors)."""

    def forward(self, row: Tensor) -> Tensor:
        return row.reshape(())

    def right_inverse(self, value: Tensor) -> Tensor:
        return value.reshape(1)


class _Potential(nn.Module):
    """The rank's potential u_r as one forward of one FSDP2 unit, so that every parameter the
    likelihood and the prior read (outside the net's forward) is gathered for it."""

    def __init__(self, model: BayesianModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor, y: Tensor, share: float, prior_weight: float) -> Tensor:
        nll = self.model.likelihood.nll(self.model(x), y) * share if len(y) else x.new_zeros(())
        return nll - self.model.log_prior() * prior_weight

    def within(self, fn: Callable[[BayesianModel], T]) -> T:
        """``fn(model)``; registered as a forward, so that FSDP2 gathers the parameters."""
        return fn(self.model)


def factor_world(optimizer_state: Mapping[str, Any]) -> int | None:
    """W of a state's per-rank statistics (Shampoo's factors under fsdp, ``…#shardRofW``)."""
    for entry in optimizer_state["state"].values():
        for key in entry:
            if "#shard" in key:
                return int(key.rsplit("of", 1)[1])
    return None


def factor_mismatch(saved: Mapping[str, Any], fresh: Mapping[str, Any]) -> str | None:
    """Why a checkpoint's optimizer state cannot continue this run's: per-rank factors made for
    another number of processes (Shampoo's blocks under fsdp depend on it)."""
    had, has = factor_world(saved), factor_world(fresh)  # the configs, so samplers, agree
    if had == has:
        return None

    def where(world: int | None) -> str:
        return "one process" if world is None else f"{world} processes under --parallel fsdp"

    how = (
        "in one process (or under --parallel ddp)"
        if had is None
        else f"with torchrun --nproc-per-node {had} … --parallel fsdp"
    )
    return (
        f"its Shampoo factors belong to the blocks of {where(had)}, this run's to those of "
        f"{where(has)} (a shard's blocks depend on the number of processes); resume it {how}"
    )


def _whole_tensors(model: nn.Module) -> dict[str, Tensor]:
    """Copies of the parameters and buffers ``model`` holds (in an FSDP2 forward: whole)."""
    held = dict(model.named_parameters()) | dict(model.named_buffers())
    return {name: t.detach().clone() for name, t in held.items()}


class FullyShardedData(DataParallel):
    """``--parallel fsdp``: parameters and sampler state sharded over the ranks (FSDP2; each
    rank steps its rows, :mod:`sgrld.core.shards`). The model is one FSDP2 unit whose forward is
    the potential, so the backward reduce-scatters the summed gradient; 0-d parameters are
    one-row tensors (:class:`_Scalar`), so the single run's order, flat buffer and noise are
    kept. Checkpoints hold whole tensors in the single run's names and shapes."""

    mode = "fsdp"
    collective_state = True

    def __init__(self, rank: int, world: int) -> None:
        super().__init__(rank, world)
        self._root: nn.Module | None = None
        #: per sampled tensor, in the model's order: (single-run name, module, attribute, 0-d)
        self._sites: list[tuple[str, nn.Module, str, bool]] = []

    def prepare(self, model: BayesianModel) -> BayesianModel:
        from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
        from torch.nn.utils import parametrize

        model = self.synchronise_batch_norm(model)
        self._model = model
        self._sites, seen = [], set()
        for prefix, module in model.named_modules():  # ``model.parameters()``'s order
            for name, p in list(module._parameters.items()):
                if p is not None and id(p) not in seen:  # a tied tensor once, as there
                    seen.add(id(p))
                    full = f"{prefix}.{name}" if prefix else name
                    self._sites.append((full, module, name, p.dim() == 0))
        for _, module, name, scalar in self._sites:
            if scalar:
                parametrize.register_parametrization(module, name, _Scalar())
        root = _Potential(model)
        fully_shard(root)
        register_fsdp_forward_method(root, "within")
        # the ranks' gradients summed, not averaged (their potentials add up to u_B); a plain
        # sum on the wire (gloo has no pre-multiplied sum)
        root.set_gradient_divide_factor(1.0)  # type: ignore[operator]
        root.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
        self._root = root
        return model

    def parameters(self, model: BayesianModel) -> list[Tensor]:
        return [self._held(module, name, scalar) for _, module, name, scalar in self._sites]

    @staticmethod
    def _held(module: nn.Module, name: str, scalar: bool) -> Tensor:
        if scalar:
            return module.parametrizations[name].original  # type: ignore[index,union-attr]
        return module._parameters[name]  # type: ignore[return-value]

    def potential(self, model: BayesianModel, x: Tensor, y: Tensor, num_data: int) -> Tensor:
        assert self._root is not None
        x_r, y_r, share = self.shard(x, y)
        return self._root(x_r, y_r, share, 1.0 / (num_data * self.world))

    def sum_gradients(self, params: list[Tensor]) -> None:
        """Nothing: FSDP2's backward summed them (reduce-scatter)."""

    def within(self, fn: Callable[[BayesianModel], T]) -> T:
        """``fn(model)`` as a forward of the FSDP2 unit (collective): parameters gathered."""
        assert self._root is not None
        try:
            return self._root.within(fn)  # type: ignore[operator]
        finally:
            self._root.reshard()  # type: ignore[operator]

    def model_state(self, model: BayesianModel) -> dict[str, Tensor]:
        """The model's state dict in the single run's names and shapes (collective)."""
        whole = self.within(_whole_tensors)
        state = {name: whole[name] for name in model.state_dict()}  # its keys and order
        for full, _, name, scalar in self._sites:
            if scalar:
                prefix = full[: len(full) - len(name)]
                state[full] = state.pop(f"{prefix}parametrizations.{name}.original").reshape(())
        return state

    def load_model_state(self, model: BayesianModel, state: Mapping[str, Tensor]) -> None:
        """Load a state dict of :meth:`model_state`'s form: each rank copies its rows."""
        from sgrld.core.shards import local, rows_of

        with torch.no_grad():
            for full, module, name, scalar in self._sites:
                p = self._held(module, name, scalar)
                value = state[full].reshape(1) if scalar else state[full]
                first, count = rows_of(value.shape[0], self.world, self.rank)
                local(p).copy_(value[first : first + count])
            for name, buffer in model.named_buffers():
                buffer.copy_(state[name])

    def optimizer_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """The optimizer's ``state_dict()`` in the single run's shapes (collective); Shampoo's
        per-rank factors collected from every rank."""
        import torch.distributed as dist

        from sgrld.core.shards import is_sharded

        scalars = {i for i, site in enumerate(self._sites) if site[3]}
        own: dict[int, dict[str, Tensor]] = {}
        gathered: dict[int, dict[str, Any]] = {}
        for index, entry in state["state"].items():
            gathered[index] = {}  # new dicts: ``state_dict()`` shares the live ones
            for key, value in entry.items():
                if is_sharded(value):
                    value = value.full_tensor()
                    value = value.reshape(()) if index in scalars else value
                elif "#shard" in key:
                    own.setdefault(index, {})[key] = value.cpu()
                gathered[index][key] = value
        everyone: list[Any] = [None] * self.world
        dist.all_gather_object(everyone, own)
        for part in everyone:
            for index, entries in part.items():
                gathered[index].update(entries)
        return {**state, "state": gathered}

    def load_optimizer_state(self, optimizer: Any, state: Mapping[str, Any]) -> None:
        """Load :meth:`optimizer_state`'s form; of Shampoo's per-rank factors only this rank's."""
        mine = optimizer.state_dict()["state"]
        scalars = {i for i, site in enumerate(self._sites) if site[3]}
        restored = {}
        for index, entry in state["state"].items():
            fresh = mine.get(index, {})
            kept = {}
            for key, value in entry.items():
                if "#shard" in key and key not in fresh:
                    continue  # another rank's blocks
                if index in scalars and key in fresh and isinstance(value, Tensor):
                    value = value.reshape(fresh[key].shape)  # its one row
                kept[key] = value
            restored[index] = kept
        optimizer.load_state_dict({**state, "state": restored})
