"""One chain over several processes: ``torchrun … sgrld sample --parallel ddp``.

Data parallel, as DistributedDataParallel: every rank holds the whole model and the sampler's
whole state; each takes its contiguous slice of every global minibatch, the gradients are summed
over the ranks in one all-reduce, and every rank's sampler then takes the same step (the same
seeds on every rank give the same noise; the library checks that at the first step). The local
potential is weighted so that the sum over ranks is the single run's per-datum potential
u_B = mean_B nll − log p(θ)/n exactly (up to the order of float additions):
u_r = (|B_r| / |B|) · mean_{B_r} nll − log p(θ) / (n · W). Every rank evaluates every sample (the
ensemble is the single run's); rank 0 alone writes results, checkpoints and progress.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from sgrld.models import BayesianModel


@dataclass(frozen=True)
class DataParallel:
    """This process's place in the job: ``rank`` of ``world`` processes."""

    rank: int
    world: int

    @classmethod
    def join(cls, device: torch.device) -> DataParallel:
        """The default process group, created from torchrun's environment if need be (gloo on
        CPU, NCCL on CUDA).

        Raises:
            RuntimeError: not started by torchrun (no ``WORLD_SIZE`` in the environment).
        """
        import torch.distributed as dist

        if not dist.is_initialized():
            if "WORLD_SIZE" not in os.environ:
                raise RuntimeError(
                    "--parallel ddp runs under torchrun: torchrun --nproc-per-node W -m sgrld "
                    "sample … --parallel ddp"
                )
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        return cls(dist.get_rank(), dist.get_world_size())

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor, float]:
        """This rank's contiguous rows of a global minibatch, and their share |B_r| / |B|."""
        rows = torch.tensor_split(torch.arange(len(y), device=y.device), self.world)[self.rank]
        return x[rows], y[rows], len(rows) / len(y)

    def potential(self, model: BayesianModel, x: Tensor, y: Tensor, num_data: int) -> Tensor:
        """u_r of the module docstring: summed over the ranks, the global minibatch's u_B."""
        x_r, y_r, share = self.shard(x, y)
        nll = model.likelihood.nll(model(x_r), y_r) if len(y_r) else x.new_zeros(())
        return nll * share - model.log_prior() / (num_data * self.world)

    def synchronise_batch_norm(self, model: BayesianModel) -> BayesianModel:
        """BatchNorm over the global minibatch, as the single run's: ``SyncBatchNorm`` (CUDA).

        Raises:
            ValueError: a BatchNorm model on CPU, where torch has no SyncBatchNorm: each rank
                would normalise by its own slice's statistics, another chain.
        """
        norms = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
        if not any(isinstance(m, norms) for m in model.modules()):
            return model
        if next(model.parameters()).device.type != "cuda":
            raise ValueError(
                "--parallel ddp of a model with BatchNorm needs CUDA (SyncBatchNorm): on CPU "
                "each process would normalise by its own slice of the minibatch, which is not "
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
