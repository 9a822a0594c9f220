"""One chain sharded by FSDP2 over W processes (gloo, spawned by the test) is the one-process
chain: every sampler, W = 2 and 3 (uneven shards, and a rank with an empty shard), float64."""

from __future__ import annotations

import contextlib
import os
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import sgrld

NAMES: dict[str, tuple[type[sgrld.SGRLDOptimizer], dict[str, Any]]] = {
    "sgld": (sgrld.SGLD, {}),
    "rmsprop": (sgrld.RMSpropSGLD, {}),
    "wenzel": (sgrld.WenzelSGLD, {"refresh_every": 10}),
    "monge": (sgrld.MongeSGLD, {"alpha2": 0.5}),
    "monge_fallback": (sgrld.MongeSGLD, {"alpha2": 0.5, "fallback_threshold": 0.5}),
    "shampoo": (sgrld.ShampooSGLD, {"block_size": 4, "update_interval": 10}),
    "adam": (sgrld.SGRLDOptimizer, {"metric": sgrld.get_metric("adam")()}),
}
STEPS, BATCH = 100, 12  # 12 rows: an equal slice for each of 1, 2 or 3 ranks
#: relative bound of a W-rank chain against the one-process chain after STEPS steps
BOUND = {name: 1e-10 if name == "shampoo" else 1e-12 for name in NAMES}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_shards_noise_is_the_one_process_noise_at_its_global_indices(dtype: torch.dtype) -> None:
    """Runs of the one-process buffer that start mid-counter, end mid-counter, are empty or are
    one element: each value is the one-process value at its global index, bit for bit."""
    from sgrld.core.noise import NoiseBuffer

    keys, step = torch.tensor([[5, 9]]), torch.tensor(11)
    whole = NoiseBuffer((40,), dtype, torch.device("cpu")).draw(None, "philox", keys, step)
    runs = [(3, 6), (9, 0), (17, 1), (20, 13), (38, 2)]
    shard = NoiseBuffer((22,), dtype, torch.device("cpu"), runs)
    got = shard.draw(None, "philox", keys, step)
    expect = torch.cat([whole[a : a + n] for a, n in runs])
    assert torch.equal(got, expect)


def test_every_registered_metric_is_sampled_sharded() -> None:
    params = [torch.zeros(2, 3, requires_grad=True)]
    tested = {_optimizer(name, params).metric.name for name in NAMES}
    assert tested == set(sgrld.metric_names())


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)
    ).double()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, 5, generator=data, dtype=torch.float64)
    return x, torch.randn(BATCH, 2, generator=data, dtype=torch.float64)


def _optimizer(name: str, params: Any, seed: int = 7, **kw: Any) -> sgrld.SGRLDOptimizer:
    cls, options = NAMES[name]
    generator = torch.Generator().manual_seed(seed)
    return cls(params, lr=0.01, num_data=1000, generator=generator, **options, **kw)


def _loss(
    net: Callable[[torch.Tensor], torch.Tensor], step: int, rank: int, world: int
) -> torch.Tensor:
    x, y = _batch(step)
    if isinstance(net, torch.nn.Module):  # a bfloat16 model gets its batch in bfloat16
        x, y = (t.to(next(net.parameters()).dtype) for t in (x, y))
    part = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    return ((net(x[part]) - y[part]) ** 2).mean()


def one_process_chain(name: str, world: int, steps: int = STEPS) -> dict[str, torch.Tensor]:
    """The one-process chain with Philox noise. Shampoo plans each tensor as its ``world``
    row shards (``row_shards``: each merged with the whole tensor's dims, blocks within a
    shard), so that its blocks are the sharded run's: blocks never cross a shard."""
    model = _model()
    shampoo = {"row_shards": world} if name == "shampoo" else {}
    opt = _optimizer(name, model.named_parameters(), noise="philox", **shampoo)
    for step in range(steps):
        opt.zero_grad()
        _loss(model, step, 0, 1).backward()
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def sharded_chain(name: str, rank: int, world: int) -> dict[str, torch.Tensor]:
    from torch.distributed.fsdp import fully_shard

    model = _model()
    fully_shard(model)
    opt = _optimizer(name, model.named_parameters())
    for step in range(STEPS):
        opt.zero_grad()
        _loss(model, step, rank, world).backward()
        opt.step()
    return {n: p.full_tensor().detach() for n, p in model.named_parameters()}  # type: ignore[attr-defined]


def _worker(rank: int, world: int, store: str, out: str, case: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    result: dict[str, Any] = {}
    try:
        result = CASES[case](rank, world, Path(out))
    except Exception:
        result = {"crash": traceback.format_exc()}
    finally:
        torch.save(result, Path(out) / f"rank{rank}.pt")
        # no rank tears the group down while another still talks on it (under load, a rank
        # that left first aborted its peer once: "terminate called without an active exception")
        with contextlib.suppress(Exception):
            dist.barrier()
        dist.destroy_process_group()


def _same(rank: int, world: int, out: Path) -> dict[str, Any]:
    return {name: sharded_chain(name, rank, world) for name in NAMES}


def _nan(rank: int, world: int, out: Path) -> dict[str, Any]:
    """A NaN in rank 1's shard of one gradient at step 3: every rank refuses that step."""
    from torch.distributed.fsdp import fully_shard

    model = _model()
    fully_shard(model)
    opt = _optimizer("monge", model.named_parameters())
    for step in range(3):
        opt.zero_grad()
        _loss(model, step, rank, world).backward()
        if step == 2 and rank == 1:
            model[2].weight.grad.to_local()[0, 3] = float("nan")  # type: ignore[index]
        before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}  # type: ignore[attr-defined]
        try:
            opt.step()
        except sgrld.NonFiniteGradientError as exc:
            after = {n: p.full_tensor() for n, p in model.named_parameters()}  # type: ignore[attr-defined]
            unchanged = all(torch.equal(before[n], after[n]) for n in before)
            return {"step": step, "error": str(exc), "unchanged": unchanged}
    return {"step": None}


def _seeds(rank: int, world: int, out: Path) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    model = _model()
    fully_shard(model)
    opt = _optimizer("sgld", model.parameters(), seed=7 + rank)
    _loss(model, 0, rank, world).backward()
    try:
        opt.step()
    except ValueError as exc:
        return {"error": str(exc)}
    return {"error": None}


#: samplers checkpointed: per-element (RMSprop, Monge), per-tensor (Wenzel), per-block (Shampoo)
SAVED = ("rmsprop", "wenzel", "monge", "shampoo")
HALF = 5  # steps before the checkpoint, and after it


def _sharded(name: str, dtype: torch.dtype = torch.float64) -> tuple[torch.nn.Module, Any]:
    from torch.distributed.fsdp import fully_shard

    model = _model().to(dtype)
    fully_shard(model)
    return model, _optimizer(name, model.named_parameters())


def _run(model: torch.nn.Module, opt: Any, steps: range, rank: int, world: int) -> None:
    for step in steps:
        opt.zero_grad()
        _loss(model, step, rank, world).backward()
        opt.step()


def _full_state(model: torch.nn.Module, opt: sgrld.SGRLDOptimizer) -> dict[str, torch.Tensor]:
    """Every parameter and every optimizer entry that has a global view, gathered whole."""
    out = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}  # type: ignore[attr-defined]
    for n, p in model.named_parameters():
        for key, v in opt.state[p].items():
            if isinstance(v, torch.Tensor) and "#shard" not in key:
                whole = v.full_tensor() if hasattr(v, "full_tensor") else v
                out[f"{n}/{key}"] = whole.clone()
    return out


def _save(rank: int, world: int, out: Path, dtype: torch.dtype = torch.float64) -> dict[str, Any]:
    """HALF steps, a DCP checkpoint of model and optimizer, HALF more steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    result: dict[str, Any] = {}
    for name in SAVED:
        model, opt = _sharded(name, dtype)
        _run(model, opt, range(HALF), rank, world)
        state = {
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, opt),
        }
        dcp.save(state, checkpoint_id=out / f"ckpt-{name}")
        saved = _full_state(model, opt)
        _run(model, opt, range(HALF, 2 * HALF), rank, world)
        result[name] = {"saved": saved, "end": _full_state(model, opt)}
    return result


def _load(rank: int, world: int, out: Path, dtype: torch.dtype = torch.float64) -> dict[str, Any]:
    """The checkpoint loaded on ``world`` ranks, then the last HALF steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    result: dict[str, Any] = {}
    for name in SAVED:
        model, opt = _sharded(name, dtype)
        state = {
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, opt),
        }
        try:
            dcp.load(state, checkpoint_id=out / f"ckpt-{name}")
        except CheckpointException as exc:  # Shampoo's factors on another number of ranks
            result[name] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        set_model_state_dict(model, state["model"])  # type: ignore[arg-type]
        set_optimizer_state_dict(model, opt, state["optim"])  # type: ignore[arg-type]
        loaded = _full_state(model, opt)
        _run(model, opt, range(HALF, 2 * HALF), rank, world)
        result[name] = {"loaded": loaded, "end": _full_state(model, opt)}
    return result


#: the ResNet-20 case: elementwise, per-tensor, global-sum and blocked metrics
RESNET = ("sgld", "wenzel", "monge", "shampoo")
RESNET_STEPS = 20


def _resnet() -> torch.nn.Module:
    """A narrow ResNet-20 (widths 4, 6, 5: uneven shards of its filters at W = 2 and 3), float64,
    its BatchNorm in eval mode: a norm without batch statistics, so each rank's slice of a
    batch gives its share of the batch's gradient (the runner uses SyncBatchNorm on CUDA)."""
    from sgrld.models.resnet20 import ResNet20

    torch.manual_seed(0)
    net = ResNet20(num_classes=3, widths=(4, 6, 5)).double()
    with torch.no_grad():  # running statistics away from the initial (0, 1)
        for m in net.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    return net.eval()


def _resnet_loss(net: torch.nn.Module, step: int, rank: int, world: int) -> torch.Tensor:
    data = torch.Generator().manual_seed(2000 + step)
    x = torch.randn(BATCH, 3, 8, 8, generator=data, dtype=torch.float64)
    y = torch.randint(0, 3, (BATCH,), generator=data)
    part = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    return torch.nn.functional.cross_entropy(net(x[part]), y[part])


def resnet_chain(name: str, rank: int, world: int, sharded: bool) -> dict[str, torch.Tensor]:
    """RESNET_STEPS steps; ``sharded``: every BasicBlock and the whole net FSDP2 units."""
    from torch.distributed.fsdp import fully_shard

    net = _resnet()
    if sharded:
        for module in net.modules():
            if type(module).__name__ == "BasicBlock":
                fully_shard(module)
        fully_shard(net)
    options: dict[str, Any] = {"noise": "philox"}
    if name == "shampoo":  # the default ridge (1e-8) lets the first gradients' G⁻¹ blow this
        options["eps"] = 1e-4  # net up in one process too (NaN by step 20); not sharding's
        if not sharded:
            options["row_shards"] = world
    opt = _optimizer(name, net.named_parameters(), **options)
    for step in range(RESNET_STEPS):
        opt.zero_grad()
        _resnet_loss(net, step, rank if sharded else 0, world if sharded else 1).backward()
        opt.step()
    full = {n: p.full_tensor() if sharded else p for n, p in net.named_parameters()}  # type: ignore[operator]
    return {n: p.detach().clone() for n, p in full.items()}


def _resnet_case(rank: int, world: int, out: Path) -> dict[str, Any]:
    return {name: resnet_chain(name, rank, world, sharded=True) for name in RESNET}


#: low-precision modes stepped sharded (bfloat16 parameters, float32 arithmetic)
LOW = ("master", "stochastic")
#: relative bound of a W-rank bfloat16 chain (parameters and float32 masters) against the one-
#: process chain after STEPS steps; measured: 0 with stochastic rounding, ≤ 1.3e-7 with masters
#: (a master's last float32 bits: the ranks' sums add in another order, and a shard's flat buffer
#: is split into vector lanes and a tail elsewhere than the whole one)
LOW_BOUND = 1e-6


def _bf16_grads(full: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    """The gradient at the whole bfloat16 parameters ``full``, computed in float64 from the
    whole batch and rounded to bfloat16: the same on every rank and in one process, so that the
    comparison is of the optimizer's steps, not of two reductions of a bfloat16 gradient."""
    values = {n: v.detach().double().requires_grad_() for n, v in full.items()}
    x, y = _batch(step)
    loss = ((torch.func.functional_call(_model(), values, (x,)) - y) ** 2).mean()
    grads = torch.autograd.grad(loss, list(values.values()))
    return {n: g.to(torch.bfloat16) for n, g in zip(values, grads, strict=True)}


def _masks(params: dict[str, torch.Tensor]) -> dict[torch.Tensor, torch.Tensor]:
    """Half the elements of every weight, drawn once (a bias unmasked beside them)."""
    draw = torch.Generator().manual_seed(3)
    return {
        p: torch.rand(p.shape, generator=draw) < 0.5 for n, p in params.items() if "weight" in n
    }


def bf16_chain(
    name: str, mode: str, world: int, sharded: bool, masked: bool = False, localization: float = 0.0
) -> dict[str, torch.Tensor]:
    """STEPS steps of a bfloat16 model with float32 masters (``mode``), its weights ``masked``
    or not, ``localization`` c: its parameters and masters, whole."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from sgrld.core.shards import rows_of

    model = _model().to(torch.bfloat16)
    if sharded:
        fully_shard(model)
    shampoo = {"row_shards": world} if name == "shampoo" and not sharded else {}
    params = dict(model.named_parameters())
    masks = _masks(params) if masked else None
    opt = _optimizer(
        name,
        model.named_parameters(),
        noise="philox",
        low_precision=mode,
        masks=masks,
        localization=localization,
        **shampoo,
    )
    for step in range(STEPS):
        full = {n: p.full_tensor() if sharded else p for n, p in params.items()}  # type: ignore[operator]
        for n, g in _bf16_grads(full, step).items():
            p = params[n]
            if sharded:
                mesh = p.device_mesh  # type: ignore[attr-defined]
                first, count = rows_of(g.shape[0], world, mesh.get_coordinate()[0])
                shard = g[first : first + count]
                g = DTensor.from_local(shard, mesh, p.placements, shape=g.shape, stride=g.stride())  # type: ignore[attr-defined]
            p.grad = g
        opt.step()
    out = {}
    for n, p in params.items():
        out[n] = (p.full_tensor() if sharded else p).detach().clone()  # type: ignore[operator]
        if sharded and masks is not None and p in masks and mode == "master":  # the rank's own
            assert f"master#shard{dist.get_rank()}of{world}" in opt.state[p], list(opt.state[p])
        master = opt.state[p].get("master")
        if master is not None:
            out[f"{n}/master"] = (master.full_tensor() if sharded else master).clone()
    return out


def _bf16(rank: int, world: int, out: Path) -> dict[str, Any]:
    return {(name, mode): bf16_chain(name, mode, world, True) for name in NAMES for mode in LOW}


def _masked(rank: int, world: int, out: Path) -> dict[str, Any]:
    return {name: bf16_chain(name, "master", world, True, masked=True) for name in NAMES}


#: the localisation of the localised case: c(θ − θ₀) rivals the loss's gradient within the run
PULL = 2.0


def _localised(rank: int, world: int, out: Path) -> dict[str, Any]:
    return {
        name: bf16_chain(name, "master", world, True, masked=True, localization=PULL)
        for name in NAMES
    }


#: relative bound on the LLC case's traces and estimates, sharded against one process
LLC_BOUND = 1e-6
#: the samplers of the LLC case: elementwise, and summing over the ranks
LLC_SAMPLERS = ("identity", "rmsprop", "monge")


def _mse(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def llc_estimates(world: int, sharded: bool) -> dict[str, Any]:
    """``sgrld.llc`` of the bfloat16 MLP (FSDP2-sharded or whole), half of every weight's
    elements sampled, every rank on the whole batches (FSDP2's mean of equal gradients is the
    gradient): per sampler the estimate's trace and per-chain values."""
    from torch.distributed.fsdp import fully_shard

    model = _model().to(torch.bfloat16)
    if sharded:
        fully_shard(model)
    masks_params = list(model.parameters())  # FSDP2's sharded ones: its root stays unsharded
    masks = _masks(dict(model.named_parameters()))  # after a forward without gradients
    loader = [tuple(t.to(torch.bfloat16) for t in _batch(step)) for step in range(4)]
    out: dict[str, Any] = {}
    for name in LLC_SAMPLERS:
        settings = dict(nbeta=100.0, localization=10.0, num_chains=2, num_steps=30, lr=1e-3)
        est = sgrld.llc(model, _mse, loader, num_data=1000, sampler=name, masks=masks, **settings)
        out[name] = {"trace": est.trace, "per_chain": est.per_chain}
    params = dict(zip(dict(model.named_parameters()), masks_params, strict=True))
    full = {n: p.full_tensor() if sharded else p for n, p in params.items()}  # type: ignore[operator]
    out["after"] = {n: p.detach().clone() for n, p in full.items()}
    return out


def _llc(rank: int, world: int, out: Path) -> dict[str, Any]:
    return llc_estimates(world, sharded=True)


def _save_bf16(rank: int, world: int, out: Path) -> dict[str, Any]:
    return _save(rank, world, out, torch.bfloat16)


def _load_bf16(rank: int, world: int, out: Path) -> dict[str, Any]:
    return _load(rank, world, out, torch.bfloat16)


def _watch(rank: int, world: int, out: Path) -> dict[str, Any]:
    """512 steps: the health watch closes its first window, over the whole chain."""
    model, opt = _sharded("rmsprop")
    _run(model, opt, range(512), rank, world)
    return {"windows": opt._watch.windows, "health": str(opt.health())}


CASES = {
    "same": _same,
    "save_bf16": _save_bf16,
    "load_bf16": _load_bf16,
    "llc": _llc,
    "localised": _localised,
    "masked": _masked,
    "bf16": _bf16,
    "watch": _watch,
    "nan": _nan,
    "seeds": _seeds,
    "save": _save,
    "load": _load,
    "resnet": _resnet_case,
}


def spawn(tmp_path: Path, world: int, case: str) -> list[dict[str, Any]]:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = tmp_path / f"store-{case}-{world}"
    mp.spawn(_worker, args=(world, str(store), str(tmp_path), case), nprocs=world)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for r in results:
        assert "crash" not in r, r.get("crash")
    return results


def relative_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """max |a − b| / max |b| over every tensor (0 when equal)."""
    diff = max(float((a[n] - b[n]).detach().abs().max()) for n in b)
    return diff / max(float(b[n].detach().abs().max()) for n in b)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_sharded_chain_is_the_one_process_chain(tmp_path: Path, world: int) -> None:
    """FSDP2 over W ranks, 100 steps of every sampler: every rank holds the same chain, and it
    is the one-process chain up to the order of the sums over the ranks (the bounds)."""
    ranks = spawn(tmp_path, world, "same")
    for name in NAMES:
        for other in ranks[1:]:
            assert all(torch.equal(other[name][n], ranks[0][name][n]) for n in ranks[0][name])
        alone = one_process_chain(name, world)
        error = relative_error(ranks[0][name], alone)
        assert error <= BOUND[name], (name, world, error)
        moved = relative_error(alone, {n: p.detach() for n, p in _model().named_parameters()})
        assert moved > 1e-3, name  # the chain moved: the comparison is not of two starts


@pytest.mark.slow
def test_a_nan_on_one_rank_stops_every_rank_at_the_same_step(tmp_path: Path) -> None:
    ranks = spawn(tmp_path, 2, "nan")
    assert [r["step"] for r in ranks] == [2, 2]
    assert ranks[0]["error"] == ranks[1]["error"]
    assert "'2.weight' contains NaN or Inf" in ranks[0]["error"]
    assert all(r["unchanged"] for r in ranks)


@pytest.mark.slow
def test_every_rank_watches_the_whole_chain(tmp_path: Path) -> None:
    """The health watch sums over the mesh (every rank reaches the same verdict: a rank that
    alone saw a breakdown would stop and leave the others hanging), as the one-process chain."""
    ranks = spawn(tmp_path, 2, "watch")
    assert ranks[0] == ranks[1] and len(ranks[0]["windows"]) == 1
    model = _model()
    opt = _optimizer("rmsprop", model.named_parameters(), noise="philox")
    for step in range(512):
        opt.zero_grad()
        _loss(model, step, 0, 1).backward()
        opt.step()
    (alone,) = opt._watch.windows
    for key, value in ranks[0]["windows"][0].items():
        assert value == pytest.approx(alone[key], rel=1e-9), key


@pytest.mark.slow
def test_shards_seeded_differently_are_refused_on_every_rank(tmp_path: Path) -> None:
    ranks = spawn(tmp_path, 2, "seeds")
    messages = [r["error"] for r in ranks]
    assert messages[0] is not None and "rank(s) [1] differs from rank 0's" in messages[0]
    assert messages[0] == messages[1]


@pytest.mark.slow
def test_dcp_checkpoint_of_two_ranks_continues_on_one_two_and_three(tmp_path: Path) -> None:
    """Saved with torch.distributed.checkpoint on W = 2 ranks, loaded on W′ = 2, 3 and 1
    (resharded): the loaded state is the saved one bit for bit; the continuation is the
    never-stopped chain bit for bit on W′ = W, and within the sampler's bound of the W-rank
    chain on W′ ≠ W (the sums over the ranks add in another order). Shampoo's factors belong to
    the blocks of one split into W shards: on W′ ≠ W the load is refused."""
    saved = spawn(tmp_path, 2, "save")
    for world in (2, 3, 1):
        loaded = spawn(tmp_path, world, "load")
        for name in SAVED:
            mine, before = loaded[0][name], saved[0][name]
            if name == "shampoo" and world != 2:
                assert all("#shard" in r[name]["error"] for r in loaded), loaded[0][name]
                continue
            assert "error" not in mine, (name, world, mine)
            for key, value in before["saved"].items():
                assert torch.equal(mine["loaded"][key], value), (name, world, key)
            if world == 2:
                ends = before["end"]
                assert all(torch.equal(mine["end"][k], v) for k, v in ends.items()), name
            else:
                params = [n for n, _ in _model().named_parameters()]
                ends = {n: before["end"][n] for n in params}
                error = relative_error({n: mine["end"][n] for n in params}, ends)
                assert error <= BOUND[name], (name, world, error)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_a_sharded_resnet20_chain_is_the_one_process_chain(tmp_path: Path, world: int) -> None:
    """A narrow ResNet-20, each BasicBlock its own FSDP2 unit (convolutions sharded along their
    filters, uneven), 20 steps: the one-process chain within the bounds (Shampoo: with the same
    ``row_shards``)."""
    ranks = spawn(tmp_path, world, "resnet")
    for name in RESNET:
        for other in ranks[1:]:
            assert all(torch.equal(other[name][n], ranks[0][name][n]) for n in ranks[0][name])
        alone = resnet_chain(name, 0, world, sharded=False)
        error = relative_error(ranks[0][name], alone)
        assert error <= BOUND[name], (name, world, error)
        start = {n: p.detach() for n, p in _resnet().named_parameters()}
        assert relative_error(alone, start) > 1e-4, name  # the chain moved


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_a_sharded_bfloat16_chain_with_float32_masters_is_the_one_process_chain(
    tmp_path: Path, world: int
) -> None:
    """bfloat16 parameters sharded by FSDP2, float32 masters (``"master"``) or stochastic
    rounding at global indices (``"stochastic"``), every sampler, the same gradients: the one-
    process bfloat16 chain within ``LOW_BOUND``; every rank holds the same chain; the masters
    are DTensors of the parameters' layout (``full_tensor`` gathers them)."""
    ranks = spawn(tmp_path, world, "bf16")
    for (name, mode), chain in ranks[0].items():
        for other in ranks[1:]:
            assert all(torch.equal(other[name, mode][n], chain[n]) for n in chain)
        alone = bf16_chain(name, mode, world, sharded=False)
        assert set(chain) == set(alone), (name, mode)
        assert any(k.endswith("/master") for k in alone) == (mode == "master")
        error = relative_error({k: v.double() for k, v in chain.items()},
                               {k: v.double() for k, v in alone.items()})  # fmt: skip
        assert error <= LOW_BOUND, (name, mode, world, error)
        start = {n: p.detach().double() for n, p in _model().named_parameters()}
        moved = {n: alone[n].double() for n in start}
        assert relative_error(moved, start) > 1e-3, name  # the chain moved


@pytest.mark.slow
def test_a_sharded_localised_chain_is_the_one_process_localised_chain(tmp_path: Path) -> None:
    """The masked bfloat16 chain with masters, localised (c = PULL), over W = 2 ranks: every
    sampler's chain is the one-process localised chain within ``LOW_BOUND``, and the pull acts
    (another chain than the unlocalised one)."""
    world = 2
    ranks = spawn(tmp_path, world, "localised")
    start = [n for n, _ in _model().named_parameters()]
    for name, chain in ranks[0].items():
        params = {n: chain[n].double() for n in start}
        for other in ranks[1:]:
            assert all(torch.equal(other[name][n], chain[n]) for n in start)
        with warnings.catch_warnings():  # Shampoo's on the masked vectors: G = I (test above)
            warnings.simplefilter("ignore", UserWarning)
            alone = bf16_chain(name, "master", world, False, masked=True, localization=PULL)
            free = bf16_chain(name, "master", world, False, masked=True)
        error = relative_error(params, {n: alone[n].double() for n in start})
        assert error <= LOW_BOUND, (name, error)
        assert relative_error(params, {n: free[n].double() for n in start}) > 1e-2, name


@pytest.mark.slow
def test_a_sharded_masked_bfloat16_chain_is_the_one_process_masked_chain(tmp_path: Path) -> None:
    """Half of every weight's elements masked (a weight-restricted chain), bfloat16 with float32
    masters, sharded over W = 3 ranks (uneven: each rank's selected elements are a run of the
    one-process stand-in, another length on every rank): every sampler's chain is the one-process
    masked chain within ``LOW_BOUND`` (measured: 0), and the unselected elements never move.
    Shampoo steps a masked weight's selected elements as a vector, so without
    ``precondition_vectors`` its G is I there on one process and sharded alike."""
    world = 3
    ranks = spawn(tmp_path, world, "masked")
    start = {n: p.detach().to(torch.bfloat16) for n, p in _model().named_parameters()}
    drawn = _masks(start)
    masks = {n: drawn[p] for n, p in start.items() if "weight" in n}
    for name, chain in ranks[0].items():
        params = {n: chain[n] for n in start}
        for other in ranks[1:]:
            assert all(torch.equal(other[name][n], v) for n, v in params.items())
        if name == "shampoo":
            with pytest.warns(UserWarning, match="merged rank <= 1"):
                alone = bf16_chain(name, "master", world, sharded=False, masked=True)
        else:
            alone = bf16_chain(name, "master", world, sharded=False, masked=True)
        error = relative_error(
            {n: v.double() for n, v in params.items()}, {n: alone[n].double() for n in start}
        )
        assert error <= LOW_BOUND, (name, error)
        for n, m in masks.items():
            assert torch.equal(params[n][~m], start[n][~m]), (name, n)
            assert not torch.equal(params[n][m], start[n][m]), (name, n)  # the selected moved


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::sgrld.slt.LLCWarning")  # 30-step chains fail the verdict
def test_llc_of_a_sharded_bfloat16_model_with_masks(tmp_path: Path) -> None:
    """``sgrld.llc`` on a bfloat16 model sharded by FSDP2 over W = 2 ranks, with masks (a
    weight-restricted LLC) and float32 master copies: every rank gets the estimate of the
    one-process bfloat16 run (traces within ``LLC_BOUND``), and the model is w₀ again after."""
    ranks = spawn(tmp_path, 2, "llc")
    alone = llc_estimates(2, sharded=False)
    start = {n: p.detach().to(torch.bfloat16) for n, p in _model().named_parameters()}
    for rank in ranks:
        assert all(torch.equal(rank["after"][n], start[n]) for n in start)
        for name in LLC_SAMPLERS:
            mine, theirs = rank[name], alone[name]
            np.testing.assert_allclose(mine["trace"], theirs["trace"], rtol=LLC_BOUND, atol=0)
            np.testing.assert_allclose(mine["per_chain"], theirs["per_chain"], rtol=LLC_BOUND)


@pytest.mark.slow
def test_dcp_checkpoint_of_bfloat16_masters(tmp_path: Path) -> None:
    """A bfloat16 model's float32 masters (DTensors) saved with torch.distributed.checkpoint on
    W = 2 ranks: loaded on W′ = 2 and 3, the masters and statistics are the saved ones bit for
    bit; on W′ = 2 the continuation is the never-stopped chain bit for bit (Shampoo on W′ = 3:
    refused, as in float64)."""
    saved = spawn(tmp_path, 2, "save_bf16")
    for world in (2, 3):
        loaded = spawn(tmp_path, world, "load_bf16")
        for name in SAVED:
            mine, before = loaded[0][name], saved[0][name]
            if name == "shampoo" and world != 2:
                assert "#shard" in mine["error"]
                continue
            assert any(key.endswith("/master") for key in before["saved"]), name
            for key, value in before["saved"].items():
                assert torch.equal(mine["loaded"][key], value), (name, world, key)
            if world == 2:
                assert all(torch.equal(mine["end"][k], v) for k, v in before["end"].items())


@pytest.mark.parametrize("name", ["rmsprop", "adam"])
def test_the_floor_is_summed_ahead_with_the_check(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RMSprop's and Adam's floor takes its Σ V by name from the engine's one all-reduce
    (``sums_ahead``), exactly the sum its update would send: no collective of its own."""
    from sgrld.core.layout import FlatLayout
    from sgrld.core.shards import SumsAhead

    metric = sgrld.get_metric(name)()
    assert isinstance(metric, SumsAhead)
    layout = FlatLayout(("a", "b"), ((3, 4), (5,)))
    stats = metric.init(layout, torch.empty(layout.size, dtype=torch.float64))
    grad = torch.randn(layout.size, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    metric.update(stats, layout, grad, 1)
    ahead = metric.sums_ahead(stats, layout, grad, None, True)
    sent: list[tuple[str | None, torch.Tensor]] = []

    def sum_(self: FlatLayout, partial: torch.Tensor, name: str | None = None) -> torch.Tensor:
        sent.append((name, partial.clone()))
        return partial

    monkeypatch.setattr(FlatLayout, "sum_", sum_)
    metric.update(stats, layout, grad, 2)
    assert [(n, torch.equal(p, ahead[n])) for n, p in sent] == [("scale", True)]
    assert metric.sums_ahead(stats, layout, grad, None, False) == {}  # frozen: no update
