"""The facade's state is torch's state: ``optimizer.state[p]``, torch's state-dict format,
copies, hooks, ``torch.distributed.checkpoint`` and sgrld's first format, converted."""

from __future__ import annotations

import copy
import io
import pickle
import warnings
from pathlib import Path

import pytest
import torch

import sgrld
from conftest import SamplerSpec, state_tensors
from data.make_optim_state_v1 import make as make_v1
from data.make_optim_state_v1 import set_grads
from sgrld.core.param_state import CHECK_FLAGS, GENERATOR, NOISE_KEY, STEP

N = 100
V1 = Path(__file__).parent / "data" / "optim_state_v1.pt"


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3)
    ).double()


def _optimizer(spec: SamplerSpec, model: torch.nn.Module, seed: int = 1) -> sgrld.SGRLDOptimizer:
    options = {"block_size": 3, "update_interval": 2} if spec.name == "shampoo" else {}
    opt = spec.make_optimizer(
        model.named_parameters(),
        lr=0.01,
        num_data=N,
        generator=torch.Generator().manual_seed(seed),
        **options,
    )
    assert isinstance(opt, sgrld.SGRLDOptimizer)
    return opt


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for t in steps:
        g = torch.Generator().manual_seed(t)
        x = torch.randn(8, 5, generator=g, dtype=torch.float64)
        opt.zero_grad()
        (model(x) ** 2).mean().backward()
        opt.step()


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def test_state_lives_in_optimizer_state_as_views_of_what_the_step_uses(spec: SamplerSpec) -> None:
    model = _model()
    opt = _optimizer(spec, model)
    params = list(model.parameters())
    assert set(opt.state) == set(params)  # from construction: no step needed
    first = opt.state[params[0]]
    assert {STEP, NOISE_KEY, CHECK_FLAGS, GENERATOR} <= set(first)
    _steps(model, opt, range(3))
    for p in params:
        assert int(opt.state[p][STEP]) == 3
    engine = opt.sampler_states[0]
    published = {v.data_ptr() for e in opt.state.values() for v in e.values()}
    for value in engine.stats.values():  # every statistic is visible, no copy per step
        assert any(value.data_ptr() <= ptr for ptr in published)
    sd = opt.state_dict()
    assert sorted(sd["state"]) == list(range(len(params)))
    assert sd["param_groups"][0]["params"] == list(range(len(params)))


def test_copies_continue_as_the_original(spec: SamplerSpec) -> None:
    """deepcopy, pickle and torch.save of the optimizer (with its model) are working copies."""
    model = _model()
    opt = _optimizer(spec, model)
    _steps(model, opt, range(3))
    copies = [copy.deepcopy((model, opt)), pickle.loads(pickle.dumps((model, opt)))]
    buf = io.BytesIO()
    torch.save((model, opt), buf)
    buf.seek(0)
    copies.append(torch.load(buf, weights_only=False))
    _steps(model, opt, range(3, 7))
    for m, o in copies:
        _steps(m, o, range(3, 7))
        assert _same(model, m)
        assert o.num_steps == 7


def test_weights_only_load_of_a_state_dict(spec: SamplerSpec, tmp_path: Path) -> None:
    model = _model()
    opt = _optimizer(spec, model)
    _steps(model, opt, range(3))
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "ck.pt")
    _steps(model, opt, range(3, 6))
    saved = torch.load(tmp_path / "ck.pt", weights_only=True)
    other = _model()
    other.load_state_dict(saved["model"])
    opt2 = _optimizer(spec, other, seed=99)
    opt2.load_state_dict(saved["opt"])
    _steps(other, opt2, range(3, 6))
    assert _same(model, other)


def test_distributed_checkpoint_round_trip_without_a_hidden_step(
    spec: SamplerSpec, tmp_path: Path
) -> None:
    """torch.distributed.checkpoint (one process): reading the state takes no step, the saved
    state is complete, and a fresh optimizer loaded from it continues bit-identically."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model = _model()
    opt = _optimizer(spec, model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    seed_state = opt.generator.get_state()
    osd = get_optimizer_state_dict(model, opt)
    assert opt.num_steps == 0 and torch.equal(opt.generator.get_state(), seed_state)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert any(GENERATOR in entry for entry in osd["state"].values())
    _steps(model, opt, range(3))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.save(
            {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
            checkpoint_id=tmp_path,
        )
        _steps(model, opt, range(3, 6))
        other = _model()
        opt2 = _optimizer(spec, other, seed=7)
        sd = {"model": get_model_state_dict(other), "optim": get_optimizer_state_dict(other, opt2)}
        dcp.load(sd, checkpoint_id=tmp_path)
    set_model_state_dict(other, sd["model"])
    set_optimizer_state_dict(other, opt2, sd["optim"])
    assert opt2.num_steps == 3
    _steps(other, opt2, range(3, 6))
    assert _same(model, other)


@pytest.mark.parametrize("name", ["sgld", "rmsprop", "wenzel", "monge", "shampoo"])
def test_first_format_state_dicts_load_and_continue(name: str) -> None:
    """A state dict written by sgrld's first format (main at 3b5f9eb) loads into today's
    optimizer, converted, and continues exactly as the optimizer that wrote it did."""
    saved = torch.load(V1, weights_only=True)[name]
    assert "sgrld" in saved["optimizer"]
    params = [p.clone() for p in saved["params"]]
    opt = make_v1(name, params)
    opt.load_state_dict(saved["optimizer"])
    for t in range(3, 6):
        set_grads(params, t)
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(params, saved["after"], strict=True))
    assert opt.num_steps == 6
    assert "sgrld" not in opt.state_dict()


def test_hooks_see_and_replace_the_whole_dict(spec: SamplerSpec) -> None:
    model = _model()
    opt = _optimizer(spec, model)
    _steps(model, opt, range(2))
    seen: dict[str, object] = {}

    def post(optimizer: torch.optim.Optimizer, sd: dict) -> dict:
        seen["generator"] = GENERATOR in sd["state"][0]
        return {**sd, "marked": True}

    opt.register_state_dict_post_hook(post)
    sd = opt.state_dict()
    assert seen["generator"] and sd["marked"]

    other_model = _model()
    other = _optimizer(spec, other_model)
    _steps(other_model, other, range(5))
    replacement = copy.deepcopy(other.state_dict())  # five steps, its own generator

    def pre(optimizer: torch.optim.Optimizer, incoming: dict) -> dict:
        seen["incoming"] = incoming.get("marked")
        return replacement

    def after(optimizer: torch.optim.Optimizer) -> None:
        assert isinstance(optimizer, sgrld.SGRLDOptimizer)
        seen["steps"] = optimizer.num_steps
        seen["generator_restored"] = torch.equal(
            optimizer.generator.get_state(), replacement["state"][0][GENERATOR]
        )

    target = _optimizer(spec, _model())
    target.register_load_state_dict_pre_hook(pre)
    target.register_load_state_dict_post_hook(after)
    target.load_state_dict(sd)
    assert seen["incoming"] is True
    assert seen["steps"] == 5 and seen["generator_restored"]  # all of the replacement
    assert all(
        torch.equal(v, state_tensors(replacement)[k])
        for k, v in state_tensors(target.state_dict()).items()
    )


def test_missing_newer_group_options_take_their_defaults() -> None:
    model = _model()
    opt = sgrld.MongeSGLD(model.parameters(), lr=0.01, num_data=N, alpha2=0.5)
    _steps(model, opt, range(2))
    sd = copy.deepcopy(opt.state_dict())
    for key in ("adapt_metric", "alpha2_rule", "scope", "fallback_threshold"):
        del sd["param_groups"][0][key]
    target = sgrld.MongeSGLD(
        _model().parameters(), lr=0.01, num_data=N, alpha2=0.5, alpha2_rule="normalized"
    )
    target.load_state_dict(sd)
    group = target.param_groups[0]
    assert group["adapt_metric"] is True and group["alpha2_rule"] == "fixed"  # as before they
    assert group["scope"] == "global" and group["fallback_threshold"] is None  # existed


def test_state_is_cast_to_the_parameters_dtype(spec: SamplerSpec) -> None:
    """As torch.optim: floating-point state follows the parameters' dtype on load."""
    model = _model()
    opt = _optimizer(spec, model)
    _steps(model, opt, range(3))
    small = _model().float()
    opt32 = _optimizer(spec, small)
    opt32.load_state_dict(opt.state_dict())
    for entry in opt32.state.values():
        for value in entry.values():
            assert not value.is_floating_point() or value.dtype == torch.float32
    _steps_float(small, opt32)


def _steps_float(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.randn(8, 5)
    opt.zero_grad()
    (model(x) ** 2).mean().backward()
    opt.step()
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_zero_lr_moves_nothing_and_warm_up_from_zero_works(spec: SamplerSpec) -> None:
    model = _model()
    opt = _optimizer(spec, model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 3))
    before = [p.detach().clone() for p in model.parameters()]
    _steps(model, opt, range(1))  # ℓ = 0
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    for t in range(1, 4):
        sched.step()
        _steps(model, opt, range(t, t + 1))
    assert not _same(model, _model())


@pytest.mark.parametrize("shape", [(), (1,), (1, 1)])
def test_any_one_element_tensor_lr(spec: SamplerSpec, shape: tuple[int, ...]) -> None:
    model, ref = _model(), _model()
    opt = _optimizer(spec, model)
    opt.param_groups[0]["lr"] = torch.full(shape, 0.01, dtype=torch.float64)
    reference = _optimizer(spec, ref)
    _steps(model, opt, range(3))
    _steps(ref, reference, range(3))
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        spec.make_optimizer(_model().parameters(), lr=torch.ones(2), num_data=N)


def test_sparse_gradients_are_refused_naming_the_parameter(spec: SamplerSpec) -> None:
    emb = torch.nn.Embedding(10, 3, sparse=True)
    opt = spec.make_optimizer(emb.named_parameters(), lr=0.01, num_data=N)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match=r"'weight'.*sparse"):
        opt.step()


@pytest.mark.parametrize(
    "module", ["sgrld.metrics", "sgrld.core", "sgrld.core.engine", "sgrld.metrics.shampoo"]
)
def test_every_room_imports_on_its_own(module: str) -> None:
    """No import circle: each module imports first in a fresh interpreter."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", f"import {module}"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-500:]


def test_the_host_side_of_a_step_is_public() -> None:
    """What a CUDA graph's caller needs, with no private name: whether the coming step
    refreshes G on the host (then run eagerly), and the host's part of a replayed step — the
    counters advance and a ``refresh_every`` refresh runs as after an eager step."""
    matrix = torch.nn.Parameter(torch.zeros(4, 3))
    shampoo = sgrld.ShampooSGLD(
        [matrix], lr=0.01, num_data=N, update_interval=2, adapt_until=5, precondition_vectors=True
    )
    due = []
    for t in range(8):
        due.append(shampoo.refreshes_next())
        matrix.grad = torch.full((4, 3), t + 1.0)
        shampoo.step()
    # roots at steps 2 and 4, the warm-up's last step 5; frozen after it
    assert due == [False, True, False, True, True, False, False, False]

    def wenzel() -> sgrld.WenzelSGLD:
        opt = sgrld.WenzelSGLD(params, lr=0.01, num_data=N, refresh_every=3)
        for _ in range(2):
            params[0].grad, params[1].grad = torch.full((4,), 3.0), torch.ones(2)
            opt.step()
        return opt

    params = [torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(2))]
    replayed, reference = wenzel(), wenzel()
    assert replayed.refreshes_next()
    replayed.after_replay()  # the graph's device work is not replayed here: V is as it was
    reference.refresh_metric()
    assert replayed.num_steps == 3 and not replayed.refreshes_next()
    scales = [opt.sampler_states[0].stats["scale"] for opt in (replayed, reference)]
    assert not torch.equal(scales[0], torch.ones(2))  # refreshed by after_replay
    assert torch.equal(scales[0], scales[1])
    assert replayed.group_metrics == [replayed.metric]
