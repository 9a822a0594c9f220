"""Data-parallel chains on torch.distributed (gloo, processes spawned by the test); sharded
chains (FSDP2): ``test_fsdp.py``."""

from __future__ import annotations

import os
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

import sgrld

NAMES = {
    "sgld": (sgrld.SGLD, {}),
    "rmsprop": (sgrld.RMSpropSGLD, {}),
    "wenzel": (sgrld.WenzelSGLD, {"refresh_every": 10}),
    "monge": (sgrld.MongeSGLD, {"alpha2": 0.5}),
    "shampoo": (sgrld.ShampooSGLD, {"block_size": 4, "update_interval": 10}),
}
STEPS, BATCH = 50, 16


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)
    ).double()


def _chain(name: str, rank: int, world: int, seed: int) -> list[torch.Tensor]:
    """STEPS steps of one chain; each rank takes its slice of every global batch."""
    model = _model()
    net = DistributedDataParallel(model) if world > 1 else model
    cls, options = NAMES[name]
    opt = cls(model.parameters(), lr=0.01, num_data=1000,
              generator=torch.Generator().manual_seed(seed), **options)  # fmt: skip
    data = torch.Generator().manual_seed(123)
    for _ in range(STEPS):
        x = torch.randn(BATCH, 5, generator=data, dtype=torch.float64)
        y = torch.randn(BATCH, 2, generator=data, dtype=torch.float64)
        part = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        opt.zero_grad()
        ((net(x[part]) - y[part]) ** 2).mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _worker(rank: int, world: int, store: str, out: str, case: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    result: dict[str, object] = {}
    try:
        if case == "same":
            result = {name: _chain(name, rank, world, seed=7) for name in NAMES}
        else:  # each rank seeded differently: refused on every rank
            try:
                _chain("sgld", rank, world, seed=7 + rank)
                result = {"error": None}
            except ValueError as exc:
                result = {"error": str(exc)}
            model = _model()  # independent chains per rank, on purpose: allowed
            opt = sgrld.SGLD(model.parameters(), lr=0.01, num_data=10, data_parallel=False,
                             generator=torch.Generator().manual_seed(rank))  # fmt: skip
            model(torch.randn(2, 5, dtype=torch.float64)).sum().backward()
            opt.step()
    except Exception:
        result = {"crash": traceback.format_exc()}
    finally:
        torch.save(result, Path(out) / f"rank{rank}.pt")
        dist.destroy_process_group()


def _spawn(tmp_path: Path, world: int, case: str) -> list[dict]:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(_worker, args=(world, str(tmp_path / "store"), str(tmp_path), case), nprocs=world)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for r in results:
        assert "crash" not in r, r.get("crash")
    return results


@pytest.mark.slow
def test_ddp_replicas_are_the_one_process_chain(tmp_path: Path) -> None:
    """Two ranks under DDP: identical replicas after 50 steps, equal to the one-process chain
    of the whole batches (float64, up to the order of the all-reduce's additions)."""
    ranks = _spawn(tmp_path, 2, "same")
    for name in NAMES:
        alone = _chain(name, 0, 1, seed=7)
        for a, b, c in zip(ranks[0][name], ranks[1][name], alone, strict=True):
            assert torch.equal(a, b), name
            torch.testing.assert_close(a, c, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.slow
def test_ranks_seeded_differently_are_refused_on_every_rank(tmp_path: Path) -> None:
    ranks = _spawn(tmp_path, 2, "mismatch")
    messages = [r["error"] for r in ranks]
    assert all(m is not None and "rank(s) [1] differs from rank 0's" in m for m in messages)
    assert messages[0] == messages[1]
