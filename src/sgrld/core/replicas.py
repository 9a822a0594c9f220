"""Data-parallel chains: one chain whose replicas on every rank must move identically.

Under ``DistributedDataParallel`` every rank holds the whole model and the gradients are
all-reduced, so each rank's optimizer computes the same move — provided every rank draws the
same noise. Ranks seeded differently would each add their own ξ: the replicas drift apart and
nothing averages them into a correct chain. :func:`check_same_noise` compares, across the
ranks, everything the noise depends on (the groups' keys and the generator's state), once.
Under FSDP2 the ranks hold shards of one chain (:mod:`sgrld.core.shards`), and the same check
makes sure that they draw one chain's noise.
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
    """Refuse, on every rank alike, unless every rank's ``fingerprint`` (an int64 vector of what
    the noise depends on) equals rank 0's. One all-gather; nothing with a single process."""
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
