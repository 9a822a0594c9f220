"""Contract tests run over every sampler in the registry (conftest.SAMPLERS)."""

from __future__ import annotations

import pytest
import torch

import sgrld
from conftest import (
    SAMPLERS,
    SamplerSpec,
    check_resume_is_bit_identical,
    quadratic_problem,
    state_tensors,
    statistics,
)
from sgrld.metrics import ALIASES

N = 50


def _params(dtype: torch.dtype = torch.float64, seed: int = 0) -> list[torch.nn.Parameter]:
    p, _ = quadratic_problem(dtype, seed)
    return [torch.nn.Parameter(v.clone()) for v in p.values()]


def _set_grads(params: list[torch.nn.Parameter], t: int) -> None:
    # Deterministic, state-dependent gradients that differ per step (a cheap stand-in for a
    # minibatch): 0.5 θ + 0.1 θ³ + a step-dependent offset.
    for i, p in enumerate(params):
        g = torch.Generator().manual_seed(1000 * t + i)
        p.grad = 0.5 * p.detach() + 0.1 * p.detach() ** 3
        p.grad += 0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype)


def _run(opt: sgrld.SGRLDOptimizer, params: list[torch.nn.Parameter], steps: range) -> None:
    for t in steps:
        _set_grads(params, t)
        opt.step()
        if opt.metric.refresh_per_epoch and t % 4 == 3:  # Wenzel's epoch end
            opt.refresh_metric()


def _snapshot(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    return [p.detach().clone() for p in params]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


BAD_COMMON = [
    ("lr", -1.0),
    ("num_data", 0),
    ("num_data", 0.5),
    ("num_data", -5),
    ("temperature", -0.1),
]


@pytest.mark.parametrize(("arg", "value"), BAD_COMMON)
def test_bad_common_arguments(spec: SamplerSpec, arg: str, value: float) -> None:
    kw = {"lr": 0.1, "num_data": N, arg: value}
    with pytest.raises(ValueError, match=arg):
        spec.make_optimizer(_params(), **kw)
    with pytest.raises(ValueError, match=arg):
        spec.make_sampler(**kw)


BAD_SPECIFIC = [(s.name, arg, value) for s in SAMPLERS for arg, value in s.case.bad_options]


@pytest.mark.parametrize(("name", "arg", "value"), BAD_SPECIFIC)
def test_bad_metric_arguments(name: str, arg: str, value: float) -> None:
    spec = next(s for s in SAMPLERS if s.name == name)
    with pytest.raises(ValueError, match=arg):
        spec.make_optimizer(_params(), lr=0.1, num_data=N, **{arg: value})


def test_nonfinite_gradient_refused_and_nothing_changed(spec: SamplerSpec) -> None:
    params = _params()
    opt = spec.make_optimizer(
        params, lr=0.05, num_data=N, generator=torch.Generator().manual_seed(0)
    )
    _run(opt, params, range(4))
    before_p, before_s = _snapshot(params), state_tensors(opt.state_dict())
    for bad in (float("nan"), float("inf")):
        _set_grads(params, 99)
        params[1].grad[2] = bad
        with pytest.raises(sgrld.NonFiniteGradientError, match="param1"):
            opt.step()
        assert _equal(_snapshot(params), before_p)
        after = state_tensors(opt.state_dict())
        assert after.keys() == before_s.keys()
        for k, v in before_s.items():
            assert torch.equal(after[k], v), k


def test_none_grad_is_skipped(spec: SamplerSpec) -> None:
    """A parameter without grad is untouched; the others move exactly as if it were absent."""
    full, sub = _params(), _params()[:2]
    opt_full = spec.make_optimizer(
        full, lr=0.05, num_data=N, generator=torch.Generator().manual_seed(3)
    )
    opt_sub = spec.make_optimizer(
        sub, lr=0.05, num_data=N, generator=torch.Generator().manual_seed(3)
    )
    frozen = full[2].detach().clone()
    for t in range(7):
        _set_grads(full, t)
        _set_grads(sub, t)
        full[2].grad = None
        opt_full.step()
        opt_sub.step()
    assert torch.equal(full[2].detach(), frozen)
    assert _equal(_snapshot(full[:2]), _snapshot(sub))


def test_resume_is_bit_identical(spec: SamplerSpec) -> None:
    opt, opt2 = check_resume_is_bit_identical(
        lambda p, g: spec.make_optimizer(p, lr=0.05, num_data=N, generator=g),
        _params(),
        _run,  # type: ignore[arg-type]
        5,
        13,
    )
    assert isinstance(opt, sgrld.SGRLDOptimizer) and isinstance(opt2, sgrld.SGRLDOptimizer)
    assert opt2.num_steps == opt.num_steps == 13


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dtypes(spec: SamplerSpec, dtype: torch.dtype) -> None:
    params = _params(dtype)
    opt = spec.make_optimizer(params, lr=0.05, num_data=N)
    _run(opt, params, range(8))
    for p in params:
        assert p.dtype == dtype and bool(torch.isfinite(p).all())
    for v in statistics(opt.state_dict()).values():
        assert v.dtype == dtype


def test_temperature_zero_is_deterministic(spec: SamplerSpec) -> None:
    runs = []
    for seed in (0, 1):
        params = _params()
        gen = torch.Generator().manual_seed(seed)
        state = gen.get_state()
        opt = spec.make_optimizer(params, lr=0.05, num_data=N, temperature=0.0, generator=gen)
        _run(opt, params, range(6))
        assert torch.equal(gen.get_state(), state), "no noise may be drawn at temperature 0"
        runs.append(_snapshot(params))
    assert _equal(*runs)


def test_facade_equals_functional_core(spec: SamplerSpec) -> None:
    params = _params()
    names = ["w", "b", "c"]
    opt = spec.make_optimizer(
        params, lr=0.05, num_data=N, generator=torch.Generator().manual_seed(4)
    )
    sampler = spec.make_sampler(lr=0.05, num_data=N)
    state = sampler.init(
        dict(zip(names, [p.detach().clone() for p in params], strict=True)),
        generator=torch.Generator().manual_seed(4),
    )
    for t in range(7):
        _set_grads(params, t)
        opt.step()
        # both see the same gradients because (by induction) they sit at the same point
        state = sampler.step(state, {n: p.grad for n, p in zip(names, params, strict=True)})
        assert _equal(_snapshot(params), [state.params[n] for n in names])
        if spec.name == "wenzel" and t == 3:
            opt.update_preconditioner()
            sampler.refresh(state)


def test_chains_equal_separate_runs(spec: SamplerSpec) -> None:
    """K chains in one call equal K single-chain runs (τ = 0 makes both deterministic)."""
    k = 3
    inits = [quadratic_problem(torch.float64, seed)[0] for seed in range(k)]
    _, grad_fn = quadratic_problem()
    sampler = spec.make_sampler(lr=0.05, num_data=N, temperature=0.0)
    batched = sampler.init({n: torch.stack([p[n] for p in inits]) for n in inits[0]}, num_chains=k)
    singles = [sampler.init({n: v.clone() for n, v in p.items()}) for p in inits]
    for t in range(8):
        batched = sampler.step(batched, grad_fn(batched.params))
        singles = [sampler.step(s, grad_fn(s.params)) for s in singles]
        if t == 3:
            sampler.refresh(batched)
            for s in singles:
                sampler.refresh(s)
    for i, s in enumerate(singles):
        for n in s.params:
            torch.testing.assert_close(batched.params[n][i], s.params[n], rtol=1e-12, atol=1e-14)


def test_functional_inplace_false_leaves_input_untouched(spec: SamplerSpec) -> None:
    sampler = spec.make_sampler(lr=0.05, num_data=N)
    params, grad_fn = quadratic_problem()
    state = sampler.init({k: v.clone() for k, v in params.items()})
    new = sampler.step(state, grad_fn(state.params), inplace=False)
    assert state.step == 0 and new.step == 1
    for k in params:
        assert torch.equal(state.params[k], params[k])
        assert not torch.equal(new.params[k], params[k])


def test_lr_scheduler_drives_the_step(spec: SamplerSpec) -> None:
    a, b = _params(), _params()
    opt_a = spec.make_optimizer(a, lr=0.08, num_data=N, generator=torch.Generator().manual_seed(2))
    opt_b = spec.make_optimizer(b, lr=0.08, num_data=N, generator=torch.Generator().manual_seed(2))
    sched = torch.optim.lr_scheduler.StepLR(opt_a, step_size=2, gamma=0.5)
    for t in range(6):
        _set_grads(a, t)
        _set_grads(b, t)
        opt_a.step()
        sched.step()
        opt_b.step()
        for group in opt_b.param_groups:
            group["lr"] = 0.08 * 0.5 ** ((t + 1) // 2)
    assert _equal(_snapshot(a), _snapshot(b))


def test_param_groups_have_their_own_lr(spec: SamplerSpec) -> None:
    params = _params()
    opt = spec.make_optimizer(
        [{"params": params[:2]}, {"params": params[2:], "lr": 0.0001}],
        lr=0.05,
        num_data=N,
        temperature=0.0,
    )
    c0 = params[2].detach().clone()
    _run(opt, params, range(3))
    moved_c = (params[2].detach() - c0).abs().max()
    assert 0 < moved_c < 0.01


def test_monge_alpha2_zero_is_bit_identical_to_sgld() -> None:
    a, b = _params(torch.float32), _params(torch.float32)
    sgld = sgrld.SGLD(a, lr=0.05, num_data=N, generator=torch.Generator().manual_seed(5))
    monge = sgrld.MongeSGLD(
        b, lr=0.05, num_data=N, alpha2=0.0, alpha2_rule="fixed",
        generator=torch.Generator().manual_seed(5),
    )  # fmt: skip
    _run(sgld, a, range(20))
    _run(monge, b, range(20))
    assert _equal(_snapshot(a), _snapshot(b))


def test_freeze_metric_keeps_statistics(spec: SamplerSpec) -> None:
    params = _params()
    opt = spec.make_optimizer(params, lr=0.05, num_data=N)
    _run(opt, params, range(3))
    opt.freeze_metric()
    stats = statistics(opt.state_dict())
    for t in range(3, 9):  # no explicit Wenzel refresh here: that is the user's call
        _set_grads(params, t)
        opt.step()
    assert not _equal(_snapshot(params), _params())
    for k, v in statistics(opt.state_dict()).items():
        assert torch.equal(v, stats[k]), k


def test_registry_names() -> None:
    assert [s.name for s in SAMPLERS] == sgrld.metric_names()
    for name in sgrld.metric_names():
        assert sgrld.get_metric(name).name == name
    for alias, name in ALIASES.items():
        assert sgrld.build(alias.upper(), lr=0.1, num_data=1).metric == sgrld.get_metric(name)()
    with pytest.raises(ValueError, match="unknown sampler"):
        sgrld.build("nosuchsampler", lr=0.1, num_data=1)


def test_a_step_allocates_no_parameter_sized_memory(spec: SamplerSpec) -> None:
    """After the first step, a step allocates only 0-d temporaries (no O(D) buffers).

    The check (issue: "no avoidable allocation inside a step") uses the profiler's allocation
    records; D = 2,530 here, so one parameter-sized float64 buffer would be ≥ 20 kB. Shampoo's
    root refresh (every ``update_interval`` steps, not profiled here) does allocate.
    """
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(0)
    params = [
        torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64))
        for s in [(40, 60), (60,), (2, 35)]
    ]
    opt = spec.make_optimizer(params, lr=0.01, num_data=N, generator=gen)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
    for _ in range(3):  # the buffers are made at step 1; Shampoo's roots (update_interval 3) at 3
        opt.step()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        opt.step()
    allocated = sum(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0)
    assert allocated < 1024, f"{allocated} bytes allocated in one step"


@pytest.mark.parametrize("num_chains", [None, 3])
def test_stat_kinds_declare_every_statistic(spec: SamplerSpec, num_chains: int | None) -> None:
    """``stat_kinds(layout)`` gives exactly the keys ``init(layout)`` makes, each with a kind
    whose shape fits (what a subset step restricts and the optimizer state publishes), and a
    per-tensor statistic's kind names its key and a tensor of the layout."""
    from sgrld.core.contract import PerTensor
    from sgrld.core.layout import FlatLayout

    params, _ = quadratic_problem()
    batch = () if num_chains is None else (num_chains,)
    tensors = [v.expand(*batch, *v.shape) for v in params.values()]
    layout = FlatLayout.from_tensors(list(params), tensors, num_chains)
    metric = spec.make_sampler(lr=0.01, num_data=N).metric
    stats = metric.init(layout, tensors[0])
    kinds = metric.stat_kinds(layout)
    assert set(kinds) == set(stats)
    for key, kind in kinds.items():
        if isinstance(kind, PerTensor):
            assert kind.key == key and 0 <= kind.tensor < len(layout.names)
        elif kind == "element":
            assert stats[key].shape == (*batch, layout.size)
        elif kind == "tensor":
            assert stats[key].shape[-1] == len(layout.names)
        else:
            assert kind == "global"


def test_undeclared_statistic_refused_when_the_state_is_built() -> None:
    """A metric whose ``stat_kinds`` misses a statistic ``init`` makes is refused at once, by the
    facade and the functional sampler alike, naming the key and the kinds to declare."""
    from dataclasses import dataclass

    from sgrld.metrics.rmsprop import RMSpropMetric

    @dataclass(frozen=True, kw_only=True)
    class Undeclared(RMSpropMetric):
        def stat_kinds(self, layout):  # type: ignore[no-untyped-def]
            return {}

    params = _params()
    with pytest.raises(TypeError, match=r"does not declare \[.*'square_avg'.*PerTensor"):
        sgrld.SGRLDOptimizer(params, lr=0.1, num_data=N, metric=Undeclared).step()
    with pytest.raises(TypeError, match="does not declare"):
        sgrld.build(Undeclared(), lr=0.1, num_data=N).init({"w": torch.zeros(3)})
