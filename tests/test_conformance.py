"""Conformance: every sgrld optimizer behaves as the ``torch.optim`` optimizers users know.

Torch's own generic optimizer tests (``TestOptimRenewed`` over ``optim_db``), adapted to samplers:
a seeded generator for determinism, temperature 0 where a test needs a direction, float64 where
it needs bit-identity. Each case runs over the registry in ``tests/optim_db.py``: the cases that
depend on the options (state, resume, copies, checkpoints) over every option set of every
sampler, the others over every sampler with its default options.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import math
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.optim.lr_scheduler import LambdaLR, StepLR
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

import sgrld
from optim_db import (
    CASES,
    LR,
    NEWER_GROUP_KEYS,
    NUM_DATA,
    OPTIMIZERS,
    Net,
    OptimizerInfo,
    case_id,
    loss_at,
    snapshot,
    train,
)

REFUSED = (ValueError, KeyError, RuntimeError, TypeError)
#: state dicts written by sgrld before issue 18 (``tests/data/write_v0_state_dicts.py``)
V0 = Path(__file__).resolve().parent / "data" / "v0_state_dicts.pt"


@pytest.fixture(params=OPTIMIZERS, ids=[i.metric for i in OPTIMIZERS])
def info(request: pytest.FixtureRequest) -> OptimizerInfo:
    return request.param


@pytest.fixture(params=CASES, ids=[case_id(c) for c in CASES])
def case(request: pytest.FixtureRequest) -> tuple[OptimizerInfo, str]:
    return request.param


def fresh(
    info: OptimizerInfo,
    option_set: str = "default",
    *,
    seed: int = 1,
    model_seed: int = 0,
    dtype: torch.dtype = torch.float64,
    named: bool = False,
    **kw: Any,
) -> tuple[Net, sgrld.SGRLDOptimizer]:
    """A model and its optimizer, the noise driven by a generator seeded with ``seed``."""
    model = Net(dtype, model_seed)
    params = model.named_parameters() if named else model.parameters()
    gen = torch.Generator().manual_seed(seed)
    return model, info.make(params, option_set, generator=gen, **kw)


def two_groups(
    info: OptimizerInfo, option_set: str = "default", *, seed: int = 1, **kw: Any
) -> tuple[Net, sgrld.SGRLDOptimizer]:
    """The model's layers as two parameter groups, the second with its own ℓ."""
    model = Net()
    groups = [
        {"params": list(model.fc1.parameters())},
        {"params": list(model.fc2.parameters()), "lr": LR / 4},
    ]
    gen = torch.Generator().manual_seed(seed)
    return model, info.make(groups, option_set, generator=gen, **kw)


def roundtrip(obj: Any) -> Any:
    """``obj`` through ``torch.save`` / ``torch.load(weights_only=True)``: a frozen deep copy, and
    proof that the dict loads without unpickling arbitrary objects."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def same(a: Any, b: Any) -> bool:
    """Exact equality of nested dicts, lists and tensors (dtype and shape included)."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return (
            isinstance(a, Tensor)
            and isinstance(b, Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(torch.equal(a, b))
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return set(a) == set(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def moved(before: list[Tensor], model: nn.Module) -> list[bool]:
    return [not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True)]


# --- the registry -------------------------------------------------------------------------------


def test_registry_covers_every_metric() -> None:
    assert sorted(i.metric for i in OPTIMIZERS) == sgrld.metric_names()
    for info in OPTIMIZERS:
        assert {"default", "philox", "capturable"} <= set(info.option_sets)


def test_named_facade_equals_the_generic_optimizer(info: OptimizerInfo) -> None:
    """A metric without a facade class runs through ``SGRLDOptimizer(metric=...)``: for those
    with one, both make the same chain (the registry's fallback is the same sampler)."""
    fields = {f.name for f in dataclasses.fields(sgrld.get_metric(info.metric))}  # type: ignore[arg-type]
    options = {k: v for k, v in info.option_sets["default"].items() if k in fields}
    runs = []
    for make in (info.facade, info.generic):
        model = Net()
        gen = torch.Generator().manual_seed(1)
        opt = make(model.parameters(), lr=LR, num_data=NUM_DATA, generator=gen, **options)
        train(opt, model, range(3))
        runs.append(snapshot(model))
    assert same(runs[0], runs[1])


def test_optimizer_can_be_printed(info: OptimizerInfo) -> None:
    _, opt = fresh(info)
    assert type(opt).__name__ in repr(opt)


# --- constructor errors -------------------------------------------------------------------------


@pytest.mark.parametrize("lr", [-1e-3, -1.0])
def test_negative_lr_refused(info: OptimizerInfo, lr: float) -> None:
    with pytest.raises(ValueError, match="lr"):
        fresh(info, lr=lr)
    with pytest.raises(ValueError, match="lr"):
        fresh(info, lr=torch.tensor(lr))


def test_tensor_lr_of_several_elements_refused(info: OptimizerInfo) -> None:
    with pytest.raises(ValueError, match="lr"):
        fresh(info, lr=torch.tensor([LR, LR]))


def test_empty_parameter_list_refused(info: OptimizerInfo) -> None:
    with pytest.raises(ValueError, match="empty"):
        info.make([])


def test_single_tensor_as_params_refused(info: OptimizerInfo) -> None:
    with pytest.raises(TypeError):
        info.make(Net().fc1.weight)


def test_non_leaf_parameter_refused(info: OptimizerInfo) -> None:
    with pytest.raises(ValueError, match="leaf"):
        info.make([Net().fc1.weight * 2])


def test_parameter_in_two_groups_refused(info: OptimizerInfo) -> None:
    model = Net()
    with pytest.raises(ValueError, match="more than one"):
        info.make([{"params": [model.fc1.weight]}, {"params": [model.fc1.weight]}])


def test_duplicate_parameter_in_one_group_refused(info: OptimizerInfo) -> None:
    """torch warns (a future error); a sampler refuses: it would move the parameter twice."""
    model = Net()
    with pytest.raises(ValueError, match=r"^duplicate parameter: .* is listed twice in one group"):
        info.make([model.fc1.weight, model.fc1.weight])


def test_capturable_alone_constructs_and_steps(info: OptimizerInfo) -> None:
    """As ``torch.optim.Adam(capturable=True)``: the noise a captured step needs is chosen for
    the user; two optimizers with the same generator seed make the same chain."""
    runs = []
    for _ in range(2):
        model, opt = fresh(info, capturable=True)
        before = snapshot(model)
        train(opt, model, range(3))
        assert all(moved(before, model))
        assert all(torch.isfinite(p).all() for p in model.parameters())
        runs.append(snapshot(model))
    assert same(runs[0], runs[1])


def test_capturable_with_an_explicit_untraceable_noise_refused(info: OptimizerInfo) -> None:
    with pytest.raises(ValueError, match="capturable"):
        fresh(info, capturable=True, noise="torch")


# --- parameter groups ---------------------------------------------------------------------------


def test_param_groups_equal_separate_optimizers(info: OptimizerInfo) -> None:
    """Each group is its own metric with its own ℓ: at temperature 0, two groups step exactly as
    two optimizers over those groups."""
    model, opt = two_groups(info, temperature=0.0)
    twin = Net()
    opt1 = info.make(list(twin.fc1.parameters()), temperature=0.0)
    opt2 = info.make(list(twin.fc2.parameters()), lr=LR / 4, temperature=0.0)
    for t in range(5):
        for o in (opt, opt1, opt2):
            o.zero_grad()
        loss_at(model, t).backward()
        loss_at(twin, t).backward()
        opt.step()
        opt1.step()
        opt2.step()
    assert same(snapshot(model), snapshot(twin))


def test_add_param_group(info: OptimizerInfo) -> None:
    """A group added later takes the defaults it does not set and steps as if given at first."""
    model = Net()
    opt = info.make(list(model.fc1.parameters()), temperature=0.0)
    opt.add_param_group({"params": list(model.fc2.parameters()), "lr": LR / 4})
    assert opt.param_groups[1]["lr"] == LR / 4
    assert set(opt.param_groups[1]) == set(opt.param_groups[0])
    for key in opt.defaults:
        if key != "lr":
            assert opt.param_groups[1][key] == opt.param_groups[0][key], key
    twin, opt2 = two_groups(info, temperature=0.0)
    train(opt, model, range(4))
    train(opt2, twin, range(4))
    assert same(snapshot(model), snapshot(twin))


def test_add_param_group_with_a_known_parameter_refused(info: OptimizerInfo) -> None:
    model = Net()
    opt = info.make(list(model.fc1.parameters()))
    with pytest.raises(ValueError, match="more than one"):
        opt.add_param_group({"params": [model.fc1.bias]})


# --- ℓ: zero, schedulers, tensors ---------------------------------------------------------------


def test_lr_zero_is_a_valid_step_that_moves_nothing(case: tuple[OptimizerInfo, str]) -> None:
    """ℓ = 0: no move and no noise (h = 0), at construction and as a group's value later."""
    info, option_set = case
    model, opt = fresh(info, option_set, lr=0.0)
    before = snapshot(model)
    train(opt, model, range(3))
    assert same(snapshot(model), before)
    for group in opt.param_groups:
        group["lr"] = LR
    train(opt, model, range(3, 5))
    assert all(moved(before, model))


def test_warmup_from_zero_with_lambda_lr(info: OptimizerInfo) -> None:
    """``LambdaLR(opt, lambda s: min(1, s / k))``: the first step has ℓ = 0."""
    model, opt = fresh(info)
    sched = LambdaLR(opt, lambda s: min(1.0, s / 3))
    assert opt.param_groups[0]["lr"] == 0.0
    before = snapshot(model)
    train(opt, model, [0])
    sched.step()
    assert same(snapshot(model), before)
    for t in range(1, 5):
        train(opt, model, [t])
        sched.step()
    assert all(moved(before, model))
    assert opt.param_groups[0]["lr"] == LR


def test_step_lr_changes_the_step_as_a_manual_lr_would(info: OptimizerInfo) -> None:
    model, opt = fresh(info)
    sched = StepLR(opt, step_size=2, gamma=0.5)
    twin, opt2 = fresh(info)
    for t in range(6):
        train(opt, model, [t])
        sched.step()
        train(opt2, twin, [t])
        opt2.param_groups[0]["lr"] = LR * 0.5 ** ((t + 1) // 2)
    assert opt.param_groups[0]["lr"] == pytest.approx(LR / 8)
    assert same(snapshot(model), snapshot(twin))


@pytest.mark.parametrize("shape", [(), (1,), (1, 1)], ids=["0d", "1", "1x1"])
def test_tensor_lr_of_any_one_element_shape(info: OptimizerInfo, shape: tuple[int, ...]) -> None:
    """A one-element tensor ℓ steps as the float ℓ does (same generator seed)."""
    model, opt = fresh(info, lr=torch.full(shape, LR, dtype=torch.float64))
    twin, opt2 = fresh(info)
    train(opt, model, range(4))
    train(opt2, twin, range(4))
    for a, b in zip(snapshot(model), snapshot(twin), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_scheduler_changes_a_tensor_lr_in_place(info: OptimizerInfo) -> None:
    lr = torch.tensor(LR, dtype=torch.float64)
    model, opt = fresh(info, lr=lr)
    sched = StepLR(opt, step_size=1, gamma=0.5)
    twin, opt2 = fresh(info)
    for t in range(3):
        train(opt, model, [t])
        sched.step()
        train(opt2, twin, [t])
        opt2.param_groups[0]["lr"] = LR * 0.5 ** (t + 1)
    assert isinstance(opt.param_groups[0]["lr"], Tensor)
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(LR / 8)
    for a, b in zip(snapshot(model), snapshot(twin), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


# --- gradients: zero_grad, missing grads, closures, direction -------------------------------------


def test_zero_grad(info: OptimizerInfo) -> None:
    model, opt = fresh(info)
    loss_at(model, 0).backward()
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_step_without_any_gradient_moves_nothing(info: OptimizerInfo) -> None:
    model, opt = fresh(info)
    before = snapshot(model)
    opt.step()
    assert same(snapshot(model), before)


def test_parameter_without_gradient_is_skipped(info: OptimizerInfo) -> None:
    model, opt = fresh(info)
    before = snapshot(model)
    for t in range(3):
        opt.zero_grad()
        loss_at(model, t).backward()
        model.fc2.bias.grad = None
        opt.step()
    assert moved(before, model) == [True, True, True, False]
    train(opt, model, range(3, 5))  # it gets a gradient again: it moves
    assert all(moved(before, model))


def test_frozen_parameter_is_not_moved(info: OptimizerInfo) -> None:
    model = Net()
    model.fc1.bias.requires_grad_(False)
    opt = info.make(model.parameters(), generator=torch.Generator().manual_seed(1))
    before = snapshot(model)
    train(opt, model, range(3))
    assert moved(before, model) == [True, False, True, True]


def test_closure(info: OptimizerInfo) -> None:
    """``step(closure)`` calls it once with gradients enabled and returns its loss; the chain is
    the one of a manual backward and step."""
    model, opt = fresh(info)
    twin, opt2 = fresh(info)
    calls = []

    def closure() -> Tensor:
        calls.append(torch.is_grad_enabled())
        opt.zero_grad()
        loss = loss_at(model, len(calls))
        loss.backward()
        return loss

    for t in range(1, 4):
        loss = opt.step(closure)
        assert isinstance(loss, Tensor)
        train(opt2, twin, [t])
    assert calls == [True] * 3
    assert same(snapshot(model), snapshot(twin))


def test_temperature_zero_descends(case: tuple[OptimizerInfo, str]) -> None:
    """Temperature 0 is preconditioned gradient descent: the loss of a fixed batch goes down, and
    the chain is a function of the gradients only."""
    info, option_set = case
    runs = []
    for seed in (1, 2):
        model, opt = fresh(info, option_set, seed=seed, temperature=0.0, lr=0.02)
        start = loss_at(model, 0).item()
        train(opt, model, [0] * 10)
        assert loss_at(model, 0).item() < start
        runs.append(snapshot(model))
    assert same(runs[0], runs[1])


def test_sparse_gradient_refused_naming_the_parameter(info: OptimizerInfo) -> None:
    model, opt = fresh(info, named=True)
    before = snapshot(model)
    loss_at(model, 0).backward()
    model.fc1.weight.grad = model.fc1.weight.grad.to_sparse()
    with pytest.raises(REFUSED, match=r"fc1\.weight"):
        opt.step()
    assert same(snapshot(model), before)


def test_grad_scaler(info: OptimizerInfo) -> None:
    """``scaler.step(opt)`` unscales and steps: with a power-of-two scale the chain is the
    unscaled one, bit for bit."""
    model, opt = fresh(info)
    twin, opt2 = fresh(info)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for t in range(4):
        opt.zero_grad()
        scaler.scale(loss_at(model, t)).backward()
        scaler.step(opt)
        scaler.update()
        train(opt2, twin, [t])
    assert same(snapshot(model), snapshot(twin))


# --- the state dict: torch's format, complete -----------------------------------------------------


def test_state_dict_has_torchs_format(case: tuple[OptimizerInfo, str]) -> None:
    """``state`` keyed by parameter index holding tensors, ``param_groups`` with index lists,
    nothing else; ``optimizer.state[p]`` is the same state."""
    info, option_set = case
    model, opt = two_groups(info, option_set)
    train(opt, model, range(3))
    sd = opt.state_dict()
    assert set(sd) == {"state", "param_groups"}
    params = list(model.parameters())
    assert [i for g in sd["param_groups"] for i in g["params"]] == list(range(len(params)))
    assert sorted(sd["state"]) == list(range(len(params)))
    for i, p in enumerate(params):
        entry = sd["state"][i]
        assert entry and all(isinstance(v, Tensor) for v in entry.values()), entry
        assert same(entry, dict(opt.state[p]))


def test_optimizer_state_is_keyed_by_parameter(case: tuple[OptimizerInfo, str]) -> None:
    """Tools that walk ``optimizer.state`` (DCP, FSDP, Lightning) see every stepped parameter."""
    info, option_set = case
    model, opt = fresh(info, option_set)
    train(opt, model, range(2))
    assert set(opt.state) == set(model.parameters())


def test_resume_is_bit_identical(case: tuple[OptimizerInfo, str]) -> None:
    """state_dict → save → ``torch.load(weights_only=True)`` → a new optimizer (other seed) →
    continue: the same chain as never stopping, and the same state."""
    info, option_set = case
    model, opt = fresh(info, option_set, seed=1)
    train(opt, model, range(4))
    saved = roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
    train(opt, model, range(4, 9))
    model2, opt2 = fresh(info, option_set, seed=99, model_seed=7)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    train(opt2, model2, range(4, 9))
    assert same(snapshot(model), snapshot(model2))
    assert same(opt.state_dict(), opt2.state_dict())


def test_named_parameters(info: OptimizerInfo) -> None:
    """``model.named_parameters()`` as torch ≥ 2.6 takes them: the names are in the group and
    its state dict, and such a dict resumes the chain."""
    model, opt = fresh(info, named=True)
    names = [n for n, _ in model.named_parameters()]
    assert opt.param_groups[0]["param_names"] == names
    train(opt, model, range(3))
    saved = roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
    assert saved["opt"]["param_groups"][0]["param_names"] == names
    train(opt, model, range(3, 6))
    model2, opt2 = fresh(info, seed=99, named=True)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    train(opt2, model2, range(3, 6))
    assert same(snapshot(model), snapshot(model2))


def test_resume_with_two_groups_into_a_used_optimizer(info: OptimizerInfo) -> None:
    """Loading replaces whatever state the optimizer had (here from other steps)."""
    model, opt = two_groups(info, seed=1)
    train(opt, model, range(3))
    saved = roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
    train(opt, model, range(3, 7))
    model2, opt2 = two_groups(info, seed=5)
    train(opt2, model2, range(100, 104))
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    train(opt2, model2, range(3, 7))
    assert same(snapshot(model), snapshot(model2))


def _before_it_existed(opt: torch.optim.Optimizer, key: str) -> object:
    """The value a group option had before it existed: the loader's (Monge's α² rule was fixed),
    else the metric field's default."""
    from sgrld.optim.loading import BEFORE_IT_EXISTED

    if key in BEFORE_IT_EXISTED:
        return BEFORE_IT_EXISTED[key]
    field = next(f for f in dataclasses.fields(opt.metric) if f.name == key)  # type: ignore[attr-defined, arg-type]
    return field.default


def test_state_dict_without_newer_group_keys_loads_with_defaults(
    case: tuple[OptimizerInfo, str],
) -> None:
    """A dict written before a group option existed: the missing keys take the value the
    option had before it existed (as torch's ``setdefault`` in ``__setstate__``), and where
    those are the values the dict's chain ran with, the chain goes on."""
    info, option_set = case
    model, opt = fresh(info, option_set)
    train(opt, model, range(3))
    saved = roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
    removed = [k for k in NEWER_GROUP_KEYS if k in saved["opt"]["param_groups"][0]]
    assert removed
    before = {k: _before_it_existed(opt, k) for k in removed}
    for group in saved["opt"]["param_groups"]:
        for k in removed:
            del group[k]
    train(opt, model, range(3, 6))
    model2, opt2 = fresh(info, option_set, seed=99)
    model2.load_state_dict(saved["model"])
    try:
        opt2.load_state_dict(saved["opt"])
    except ValueError as exc:  # an option that shaped the state (tiling) cannot be guessed
        assert any(opt.param_groups[0][k] != v for k, v in before.items()), exc
        return
    for k, v in before.items():
        assert opt2.param_groups[0][k] == v, k
    if all(opt.param_groups[0][k] == v for k, v in before.items()):
        train(opt2, model2, range(3, 6))
        assert same(snapshot(model), snapshot(model2))


@pytest.mark.parametrize("metric", sorted(torch.load(V0, weights_only=True)["samplers"]))
def test_state_dict_of_the_previous_format_loads(metric: str) -> None:
    """A dict of the format before the sampler state moved into ``optimizer.state`` (the
    ``"sgrld"`` entry) still loads, converted: at temperature 0 the chain goes on as it did."""
    v0 = torch.load(V0, weights_only=True)
    saved = v0["samplers"][metric]
    info = next(i for i in OPTIMIZERS if i.metric == metric)
    model, opt = fresh(info, seed=99, model_seed=3, temperature=0.0)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    train(opt, model, range(v0["split"], v0["total"]))
    for a, b in zip(snapshot(model), saved["after"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def _floating_entry(sd: dict[str, Any], min_dim: int = 1) -> tuple[int, str] | None:
    """An (index, key) of a floating-point state tensor with at least ``min_dim`` dimensions."""
    for i, entry in sorted(sd["state"].items()):
        for k, v in sorted(entry.items()):
            if isinstance(v, Tensor) and v.is_floating_point() and v.dim() >= min_dim:
                return i, k
    return None


def _wrong_shape(sd: dict[str, Any]) -> None:
    found = _floating_entry(sd) or next(
        ((i, k) for i, e in sorted(sd["state"].items()) for k, v in e.items() if v.dim() >= 1),
        None,
    )
    if found is None:
        pytest.skip("no state tensor with a shape")
    i, k = found
    v = sd["state"][i][k]
    sd["state"][i][k] = torch.zeros((v.shape[0] + 1, *v.shape[1:]), dtype=v.dtype)


def _missing_key(sd: dict[str, Any]) -> None:
    assert sd["state"], "the state dict holds no per-parameter state"
    entry = sd["state"][0]
    del entry[sorted(entry)[0]]


def _nan_statistic(sd: dict[str, Any]) -> None:
    found = _floating_entry(sd)
    if found is None:
        pytest.skip("no floating-point statistics")
    i, k = found
    sd["state"][i][k] = torch.full_like(sd["state"][i][k], math.nan)


def _one_group_fewer(sd: dict[str, Any]) -> None:
    dropped = sd["param_groups"].pop()
    for i in dropped["params"]:
        sd["state"].pop(i, None)


def _one_parameter_fewer(sd: dict[str, Any]) -> None:
    i = sd["param_groups"][0]["params"].pop()
    sd["state"].pop(i, None)


CORRUPTIONS = {
    "wrong_shape": _wrong_shape,
    "missing_state_key": _missing_key,
    "nan_statistic": _nan_statistic,
    "wrong_num_groups": _one_group_fewer,
    "wrong_num_params": _one_parameter_fewer,
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_refused_state_dict_leaves_the_optimizer_as_it_was(
    info: OptimizerInfo, corruption: str
) -> None:
    """A refused dict changes nothing: the same state dict after, and the same next steps as a
    twin that was never offered it."""
    model, opt = two_groups(info)
    twin, opt2 = two_groups(info)
    train(opt, model, range(3))
    train(opt2, twin, range(3))
    bad = roundtrip(opt.state_dict())
    CORRUPTIONS[corruption](bad)
    before = roundtrip(opt.state_dict())
    with pytest.raises(REFUSED):
        opt.load_state_dict(bad)
    assert same(roundtrip(opt.state_dict()), before)
    train(opt, model, range(3, 6))
    train(opt2, twin, range(3, 6))
    assert same(snapshot(model), snapshot(twin))


def test_load_into_parameters_of_another_dtype(info: OptimizerInfo) -> None:
    """float64 state into float32 parameters: cast as torch does (the chain goes on), or refused
    with a message naming both dtypes."""
    model, opt = fresh(info)
    train(opt, model, range(3))
    saved = roundtrip(opt.state_dict())
    model32, opt32 = fresh(info, dtype=torch.float32)
    try:
        opt32.load_state_dict(saved)
    except ValueError as exc:
        assert "float64" in str(exc) and "float32" in str(exc), exc
        return
    train(opt32, model32, range(3, 6))
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in model32.parameters())


# --- copies -------------------------------------------------------------------------------------


def _continues_like(copied: tuple[Net, Any], model: Net, opt: Any) -> None:
    model2, opt2 = copied
    assert type(opt2) is type(opt)
    train(opt, model, range(3, 7))
    train(opt2, model2, range(3, 7))
    assert same(snapshot(model), snapshot(model2))


def test_deepcopy(case: tuple[OptimizerInfo, str]) -> None:
    """``copy.deepcopy`` keeps every public attribute and gives the same next steps."""
    info, option_set = case
    model, opt = fresh(info, option_set)
    train(opt, model, range(3))
    model2, opt2 = copy.deepcopy((model, opt))
    public = {k for k in vars(opt) if not k.startswith("_")}
    assert public == {k for k in vars(opt2) if not k.startswith("_")}
    _continues_like((model2, opt2), model, opt)


def test_pickle(case: tuple[OptimizerInfo, str]) -> None:
    info, option_set = case
    model, opt = fresh(info, option_set)
    train(opt, model, range(3))
    _continues_like(pickle.loads(pickle.dumps((model, opt))), model, opt)


def test_torch_save_of_the_optimizer(case: tuple[OptimizerInfo, str]) -> None:
    """``torch.save(opt)`` / ``torch.load(weights_only=False)``, as Lightning's and many users'
    checkpoints of whole objects."""
    info, option_set = case
    model, opt = fresh(info, option_set)
    train(opt, model, range(3))
    buf = io.BytesIO()
    torch.save((model, opt), buf)
    buf.seek(0)
    _continues_like(torch.load(buf, weights_only=False), model, opt)


# --- hooks --------------------------------------------------------------------------------------


def test_state_dict_hooks_see_and_may_replace_the_whole_dict(info: OptimizerInfo) -> None:
    model, opt = fresh(info)
    train(opt, model, range(3))
    expected = roundtrip(opt.state_dict())
    calls: list[str] = []
    seen: list[dict[str, Any]] = []

    def pre(optimizer: torch.optim.Optimizer) -> None:
        assert optimizer is opt
        calls.append("pre")

    def post(optimizer: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
        calls.append("post")
        seen.append(roundtrip(sd))
        return {**sd, "marker": torch.tensor(1)}

    handles = [opt.register_state_dict_pre_hook(pre), opt.register_state_dict_post_hook(post)]
    sd = opt.state_dict()
    assert calls == ["pre", "post"]
    assert same(seen[0], expected)  # the post-hook saw the complete dict
    assert same(sd["marker"], torch.tensor(1))  # and its replacement is what state_dict returns
    for h in handles:
        h.remove()
    assert "marker" not in opt.state_dict()


def test_load_state_dict_pre_hook_sees_the_whole_dict_and_its_replacement_is_used(
    info: OptimizerInfo,
) -> None:
    """A pre-hook gets the incoming dict as given; a dict it returns is loaded in full (here an
    earlier checkpoint of the same chain: the continuation is that checkpoint's)."""
    model, opt = fresh(info)
    train(opt, model, range(2))
    early = roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
    train(opt, model, range(2, 5))
    late = roundtrip(opt.state_dict())
    seen: list[dict[str, Any]] = []

    def pre(optimizer: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
        seen.append(roundtrip(sd))
        return copy.deepcopy(early["opt"])

    model2, opt2 = fresh(info, seed=99)
    model2.load_state_dict(early["model"])
    opt2.register_load_state_dict_pre_hook(pre)
    opt2.load_state_dict(late)
    assert same(seen[0], late)
    train(opt2, model2, range(2, 5))
    assert same(snapshot(model), snapshot(model2))
    assert same(opt.state_dict(), opt2.state_dict())


def test_load_state_dict_post_hook_runs_after_everything_is_restored(
    info: OptimizerInfo,
) -> None:
    model, opt = fresh(info)
    train(opt, model, range(3))
    saved = roundtrip(opt.state_dict())
    seen: list[dict[str, Any]] = []

    def post(optimizer: torch.optim.Optimizer) -> None:
        seen.append(roundtrip(optimizer.state_dict()))

    _, opt2 = fresh(info, seed=99)
    opt2.register_load_state_dict_post_hook(post)
    opt2.load_state_dict(saved)
    assert len(seen) == 1
    assert same(seen[0], saved)


def test_step_hooks(info: OptimizerInfo) -> None:
    model, opt = fresh(info)
    before = snapshot(model)
    log: list[tuple[str, bool]] = []

    def pre(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        log.append(("pre", any(moved(before, model))))

    def post(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        log.append(("post", all(moved(before, model))))

    handles = [opt.register_step_pre_hook(pre), opt.register_step_post_hook(post)]
    glob = [
        register_optimizer_step_pre_hook(lambda o, a, k: log.append(("global pre", o is opt))),
        register_optimizer_step_post_hook(lambda o, a, k: log.append(("global post", o is opt))),
    ]
    try:
        train(opt, model, [0])
    finally:
        for h in glob:
            h.remove()
    assert log == [("global pre", True), ("pre", False), ("post", True), ("global post", True)]
    for h in handles:
        h.remove()
    train(opt, model, [1])
    assert len(log) == 4


# --- torch.distributed.checkpoint (single process) ------------------------------------------------


def test_dcp_get_optimizer_state_dict_runs_no_hidden_step(case: tuple[OptimizerInfo, str]) -> None:
    """``get_optimizer_state_dict`` (FSDP's, Lightning's path) reads ``optimizer.state``: with
    the sampler's state there it must not step (params, step count and noise state unchanged),
    and its output holds that state for every parameter."""
    info, option_set = case
    model, opt = fresh(info, option_set)
    train(opt, model, range(3))
    opt.zero_grad()
    params, before = snapshot(model), roundtrip(opt.state_dict())
    osd = get_optimizer_state_dict(model, opt)
    assert same(snapshot(model), params)
    assert same(roundtrip(opt.state_dict()), before)
    names = dict(model.named_parameters())
    assert set(osd["state"]) == set(names)
    for name, p in names.items():
        assert same(osd["state"][name], dict(opt.state[p])), name


def test_dcp_set_optimizer_state_dict_resumes_bit_identically(
    case: tuple[OptimizerInfo, str],
) -> None:
    info, option_set = case
    model, opt = fresh(info, option_set)
    train(opt, model, range(3))
    opt.zero_grad()
    saved = roundtrip({"model": model.state_dict(), "opt": get_optimizer_state_dict(model, opt)})
    train(opt, model, range(3, 7))
    model2, opt2 = fresh(info, option_set, seed=99, model_seed=3)
    model2.load_state_dict(saved["model"])
    set_optimizer_state_dict(model2, opt2, saved["opt"])
    train(opt2, model2, range(3, 7))
    assert same(snapshot(model), snapshot(model2))
    assert same(opt.state_dict(), opt2.state_dict())


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_dcp_save_and_load_resume_bit_identically(info: OptimizerInfo, tmp_path: Path) -> None:
    """``dcp.save`` / ``dcp.load`` to a directory, no process group: the loaded optimizer goes on
    as the saved one."""
    model, opt = fresh(info)
    train(opt, model, range(3))
    opt.zero_grad()
    dcp.save(
        {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)},
        checkpoint_id=tmp_path,
    )
    train(opt, model, range(3, 6))
    model2, opt2 = fresh(info, seed=99, model_seed=3)
    target = {"model": model2.state_dict(), "optim": get_optimizer_state_dict(model2, opt2)}
    dcp.load(target, checkpoint_id=tmp_path)
    model2.load_state_dict(target["model"])
    set_optimizer_state_dict(model2, opt2, target["optim"])
    train(opt2, model2, range(3, 6))
    assert same(snapshot(model), snapshot(model2))
