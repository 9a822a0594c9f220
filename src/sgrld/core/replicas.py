"""Data-parallel chains: under DDP (or FSDP2's shards of one chain) every rank must draw the same
noise, else the replicas drift apart; :func:`check_same_noise` compares it once.
"""

from __future__ import annotations

import torch
from torch import Tensor


def world() -> tuple[int, int]:
    """(rank, world size) of the default process group, or (0, 1) without one."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def check_same_noise(fingerprint: Tensor) -> None:
    """Refuse, on every rank alike, unless every rank's ``fingerprint`` (int64, what the noise
    depends on) equals rank 0's: one all-gather; nothing with a single process."""
    import torch.distributed as dist

    _, size = world()
    if size == 1:
        return
    gathered = [torch.empty_like(fingerprint) for _ in range(size)]
    dist.all_gather(gathered, fingerprint)
    differ = [r for r in range(1, size) if not torch.equal(gathered[r], gathered[0])]
    if differ:
        raise ValueError(
            f"the sampler's noise on rank(s) {differ} differs from rank 0's: the replicas of a "
            "data-parallel chain must draw the same noise, else they drift apart and no "
            "average of them is a correct chain; give every rank the same generator seed "
            "(generator=torch.Generator().manual_seed(seed), or torch.manual_seed(seed) before "
            "building the optimizer); ranks that run independent chains on purpose build their "
            "optimizers with data_parallel=False"
        )
