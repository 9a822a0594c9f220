"""Step time, memory and collectives per rank of one chain sharded by FSDP2 over W ranks.

For W = 1 (one process, no process group: the baseline) and W = 2 (FSDP2, gloo on CPU), every
sampler, three models — the MLP 784-400-400-10 (batch 128), the transformer of
``examples/transformer_fsdp.py`` (its last layer and head sampled) and ResNet-20 (batch 32 of
32×32 images), float32 — it measures, side by side in one run:

* the time of a whole training step (forward, backward, ``opt.step()``) and of ``opt.step()``
  alone (median over the timed steps, after warm-up steps that compile the noise kernel),
* the bytes per rank of the sampled parameters and of the sampler's state,
* the collectives per ``opt.step()`` (``torch.distributed`` calls counted while it runs; FSDP2's
  own all-gathers and reduce-scatters happen in forward and backward and are not counted),

then, without processes, Shampoo's factor bytes per rank for W = 1, 2, 3 (the factors of the
blocks of each rank's shard, planned as the sharded run plans them). Markdown tables; ratios
against W = 1.

    python benchmarks/distributed.py [--steps 20] [--warmup 5] [--models mlp,resnet20]
        [--samplers shampoo] [--factors-only]
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import math
import os
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

import sgrld
from sgrld.core.layout import FlatLayout
from sgrld.core.shards import ShardSpec, rows_of
from sgrld.metrics import ShampooMetric

SAMPLERS: dict[str, Callable[..., sgrld.SGRLDOptimizer]] = {
    "sgld": lambda p: sgrld.SGLD(p, lr=1e-3, num_data=60_000, noise="philox"),
    "rmsprop": lambda p: sgrld.RMSpropSGLD(p, lr=1e-3, num_data=60_000, noise="philox"),
    "wenzel": lambda p: sgrld.WenzelSGLD(
        p, lr=1e-3, num_data=60_000, refresh_every=10, noise="philox"
    ),
    "monge": lambda p: sgrld.MongeSGLD(p, lr=1e-3, num_data=60_000, alpha2=1.0, noise="philox"),
    "shampoo": lambda p: sgrld.ShampooSGLD(
        p, lr=1e-3, num_data=60_000, update_interval=10, noise="philox"
    ),
}
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "broadcast", "all_to_all_single")  # fmt: skip


def _example() -> Any:
    path = Path(__file__).resolve().parents[1] / "examples" / "transformer_fsdp.py"
    spec = importlib.util.spec_from_file_location("transformer_fsdp", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def mlp() -> tuple[nn.Module, list[str], Callable[[nn.Module, int, int, int], Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 400), nn.ReLU(), nn.Linear(400, 400), nn.ReLU(),
                          nn.Linear(400, 10))  # fmt: skip

    def loss(net: nn.Module, step: int, rank: int, world: int) -> Tensor:
        data = torch.Generator().manual_seed(step)
        x, y = torch.randn(128, 784, generator=data), torch.randint(10, (128,), generator=data)
        part = slice(rank * 128 // world, (rank + 1) * 128 // world)
        return nn.functional.cross_entropy(net(x[part]), y[part])

    return model, [n for n, _ in model.named_parameters()], loss


def transformer() -> tuple[nn.Module, list[str], Callable[[nn.Module, int, int, int], Tensor]]:
    example = _example()
    model, sampled = example.model_and_sampled()

    def loss(net: nn.Module, step: int, rank: int, world: int) -> Tensor:
        seq = example.tokens(step)
        part = seq[rank * example.BATCH // world : (rank + 1) * example.BATCH // world]
        return nn.functional.cross_entropy(net(part[:, :-1]), part[:, 1:].reshape(-1))

    return model, sampled, loss


def resnet20() -> tuple[nn.Module, list[str], Callable[[nn.Module, int, int, int], Tensor]]:
    from sgrld.models.resnet20 import ResNet20

    torch.manual_seed(0)
    model = ResNet20()

    def loss(net: nn.Module, step: int, rank: int, world: int) -> Tensor:
        data = torch.Generator().manual_seed(step)
        x, y = torch.randn(32, 3, 32, 32, generator=data), torch.randint(10, (32,), generator=data)
        part = slice(rank * 32 // world, (rank + 1) * 32 // world)
        return nn.functional.cross_entropy(net(x[part]), y[part])

    return model, [n for n, _ in model.named_parameters()], loss


MODELS = {"mlp": mlp, "transformer": transformer, "resnet20": resnet20}


def units(model: nn.Module) -> list[nn.Module]:
    """The modules sharded (and all-gathered) one at a time: the transformer's layers, the
    ResNet's blocks; then the root holds the rest."""
    layers, stages = getattr(model, "layers", None), getattr(model, "stages", None)
    if isinstance(layers, nn.ModuleList):
        return list(layers.children())
    if isinstance(stages, nn.Sequential):
        return [block for stage in stages.children() for block in stage.children()]
    return []


@contextmanager
def counted(counts: Counter[str]) -> Iterator[None]:
    """Count the torch.distributed collectives called inside the block."""
    saved = {name: getattr(dist, name) for name in COLLECTIVES}

    def wrap(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return saved[name](*args, **kwargs)

        return call

    for name in COLLECTIVES:
        setattr(dist, name, wrap(name))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def measure(model_name: str, sampler: str, rank: int, world: int, steps: int,
            warmup: int) -> dict[str, float]:  # fmt: skip
    model, sampled, loss = MODELS[model_name]()
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        for module in units(model):
            fully_shard(module)
        fully_shard(model)
    named = [(n, p) for n, p in model.named_parameters() if n in sampled]
    opt = SAMPLERS[sampler](named)
    total, inner, counts = [], [], Counter[str]()
    for step in range(warmup + steps):
        start = time.perf_counter()
        opt.zero_grad()
        loss(model, step, rank, world).backward()
        middle = time.perf_counter()
        with counted(counts):
            opt.step()
        end = time.perf_counter()
        if step == warmup - 1:
            counts.clear()
        if step >= warmup:
            total.append(end - start)
            inner.append(end - middle)
    local = [p.to_local() if hasattr(p, "to_local") else p for _, p in named]
    return {
        "step_ms": 1e3 * statistics.median(total),
        "opt_ms": 1e3 * statistics.median(inner),
        "param_kb": sum(t.numel() * t.element_size() for t in local) / 1e3,
        "state_kb": sum(opt.state_bytes().values()) / 1e3,
        "collectives": sum(counts.values()) / steps,
    }


def _worker(rank: int, world: int, store: str, out: str, steps: int, warmup: int,
            cases: list[tuple[str, str]]) -> None:  # fmt: skip
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.set_num_threads(1)  # one core per rank: the machine's two cores, one each
    try:
        results = {(m, s): measure(m, s, rank, world, steps, warmup) for m, s in cases}
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def shampoo_factor_bytes(model_name: str, world: int) -> int:
    """Bytes of Shampoo's factors (and roots) on the rank that holds the most, for W ranks:
    each rank's layout carries the :class:`ShardSpec` that FSDP2 gives it (whole shapes, its
    rows), so its shards are planned as in a sharded run (from the whole tensors)."""
    model, sampled, _ = MODELS[model_name]()
    metric = ShampooMetric(update_interval=10)  # the benchmark's: block_size 128
    named = [(n, p) for n, p in model.named_parameters() if n in sampled]
    names, full = tuple(n for n, _ in named), tuple(tuple(p.shape) for _, p in named)
    most = 0
    for rank in range(world):
        rows = [rows_of(shape[0], world, rank) for shape in full]
        shapes = tuple((count, *shape[1:]) for (_, count), shape in zip(rows, full, strict=True))
        offsets = itertools.accumulate((math.prod(s) for s in full), initial=0)
        firsts = [first * math.prod(s[1:]) for (first, _), s in zip(rows, full, strict=True)]
        starts = tuple(o + f for o, f in zip(offsets, firsts, strict=False))  # global indices
        spec = ShardSpec(names, full, starts, rank, world, None, ())  # no mesh: nothing summed
        layout = FlatLayout(names, shapes, (), spec if world > 1 else None)
        stats = metric.init(layout, torch.zeros((), dtype=torch.float32))
        factors = [v for k, v in stats.items() if "@" in k]
        most = max(most, sum(v.numel() * v.element_size() for v in factors))
    return most


def _row(key: tuple[str, str], world: int, row: dict[str, float], one: dict[str, float]) -> str:
    def cell(k: str) -> str:
        return f"{row[k]:.1f}" if world == 1 else f"{row[k]:.1f} ({row[k] / one[k]:.2f}×)"

    cells = " | ".join(cell(k) for k in ("step_ms", "opt_ms", "param_kb", "state_kb"))
    return f"| {key[0]} | {key[1]} | {world} | {cells} | {row['collectives']:.0f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated subset")
    parser.add_argument("--samplers", default=",".join(SAMPLERS), help="comma-separated subset")
    parser.add_argument(
        "--factors-only",
        action="store_true",
        help="only the last table (Shampoo's factors per rank; no processes)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.factors_only:
        factor_table(args.models.split(","))
        return
    cases = [(m, s) for m in args.models.split(",") for s in args.samplers.split(",")]
    alone = {(m, s): measure(m, s, 0, 1, args.steps, args.warmup) for m, s in cases}
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        mp.spawn(_worker, args=(2, store, tmp, args.steps, args.warmup, cases), nprocs=2)
        ranks = [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(2)]
    print("| model | sampler | W | step ms | opt.step ms | sampled params kB/rank | state kB/rank "
          "| collectives/opt.step |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for key, one in alone.items():
        two = {k: max(r[key][k] for r in ranks) for k in one}  # the slower / larger rank
        print(_row(key, 1, one, one))
        print(_row(key, 2, two, one))
    print()
    factor_table(args.models.split(","))


def factor_table(models: list[str]) -> None:
    print("| model | Shampoo factors kB/rank, W=1 | W=2 | W=3 |")
    print("|---|---|---|---|")
    for model_name in models:
        sizes = [shampoo_factor_bytes(model_name, w) / 1e3 for w in (1, 2, 3)]
        cells = " | ".join(f"{s:.0f} ({s / sizes[0]:.2f}×)" for s in sizes[1:])
        print(f"| {model_name} | {sizes[0]:.0f} | {cells} |")


if __name__ == "__main__":
    main()
