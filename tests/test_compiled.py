"""``compile=True`` (sgrld.core.compiled): the compiled step is the eager step, to rounding."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch

import sgrld
from conftest import SAMPLERS, check_resume_is_bit_identical
from sgrld.core import compiled as compiled_mod

#: every compilable metric of the registry (:attr:`Metric.compilable`) with its test options,
#: and RMSprop's bias correction
MAKERS: dict[str, Callable[..., sgrld.SGRLDOptimizer]] = {
    **{
        s.name: functools.partial(s.make_optimizer, lr=0.005, num_data=20)
        for s in SAMPLERS
        if sgrld.get_metric(s.name).compilable
    },
    "rmsprop-bc": lambda p, **kw: sgrld.RMSpropSGLD(
        p, lr=0.005, num_data=20, decay=0.9, bias_correction=True, **kw
    ),
}
TOL = {torch.float64: {"rtol": 1e-10, "atol": 1e-12}, torch.float32: {"rtol": 1e-5, "atol": 1e-6}}


def _params(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(6, 5), (5,), (3, 2)]
    return [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=dtype)) for s in shapes]


def _run(opt: sgrld.SGRLDOptimizer, params: list[torch.nn.Parameter], steps: range) -> None:
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.95)  # ℓ changes every step
    for t in steps:
        for i, p in enumerate(params):
            # a smooth potential (contracting map), so that rounding differences do not grow
            p.grad = 0.5 * p.detach() + 0.1 * p.detach() ** 3 + 0.3 * torch.cos(p.detach() + t + i)
        opt.step()
        sched.step()
        if t % 7 == 6 and opt.metric.refresh_per_epoch:
            opt.refresh_metric()
        if t == 15:
            opt.freeze_metric()  # adapt=False from here on


def _graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


@pytest.mark.parametrize("noise", ["torch", "philox"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", list(MAKERS))
def test_compiled_step_equals_eager_step(name: str, dtype: torch.dtype, noise: str) -> None:
    # 25 steps: step 16 is the health watch's (sgrld.health), which a compiled optimizer runs
    # eagerly (its norms are taken outside the fused pass): the same chain, to rounding
    results = []
    for compile in (False, True):
        params = _params(dtype)
        generator = torch.Generator().manual_seed(1)
        opt = MAKERS[name](params, generator=generator, compile=compile, noise=noise)
        before = _graphs()
        _run(opt, params, range(25))
        results.append([p.detach().clone() for p in params])
        if compile:
            assert not opt._chains[0].sampler._compiled.failed
            # adapting and frozen: two graphs (plus at most one once the step counter goes
            # symbolic); the learning-rate schedule must not recompile
            assert _graphs() - before <= 3
    for eager, fused in zip(*results, strict=True):
        torch.testing.assert_close(fused, eager, **TOL[dtype])


def test_compiled_deterministic_descent_chains_and_functional_copies() -> None:
    """τ = 0 (no noise), K chains and ``inplace=False`` through the functional core; copies of
    the state reuse the sampler's compiled step (no re-tracing)."""
    for temperature in (0.0, 1.0):
        out = []
        for compile in (False, True):
            sampler = sgrld.build(
                "rmsprop", lr=0.01, num_data=10, temperature=temperature, compile=compile
            )
            gen = torch.Generator().manual_seed(3)
            state = sampler.init(
                {"w": torch.randn(4, 3, 2, generator=gen, dtype=torch.float64)},
                num_chains=4,
                generator=gen,
            )
            state = sampler.step(state, {"w": state.params["w"] ** 3 - 1.0})
            before = _graphs()
            for _ in range(6):
                state = sampler.step(state, {"w": state.params["w"] ** 3 - 1.0}, inplace=False)
            if compile:
                assert _graphs() - before <= 1  # at most the step counter going symbolic
            out.append(state.params["w"].clone())
        torch.testing.assert_close(out[1], out[0], **TOL[torch.float64])


def test_compiled_resume_is_bit_identical() -> None:
    check_resume_is_bit_identical(
        lambda p, g: MAKERS["rmsprop"](p, generator=g, compile=True),
        _params(torch.float32),
        _run,  # type: ignore[arg-type]
        5,
        12,
    )


def test_compile_must_be_a_bool() -> None:
    p = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match="compile"):
        sgrld.SGLD(p, lr=0.1, num_data=10, compile="no")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="compile"):
        sgrld.build("rmsprop", lr=0.1, num_data=10, compile=1)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "make",
    [
        lambda p: sgrld.MongeSGLD(p, lr=0.1, num_data=10, compile=True),
        lambda p: sgrld.ShampooSGLD(p, lr=0.1, num_data=10, compile=True),
        lambda p: sgrld.build("monge", lr=0.1, num_data=10, compile=True),
    ],
)
def test_compile_refused_where_it_does_not_pay(make: Callable[[Any], object]) -> None:
    with pytest.raises(ValueError, match="compile"):
        make([torch.nn.Parameter(torch.zeros(3, 3))])


def test_compile_failure_warns_and_runs_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(fn: object, **kw: object) -> Callable[..., None]:
        def fail(*args: object) -> None:
            raise RuntimeError("no C++ compiler")

        return fail

    monkeypatch.setattr(compiled_mod.torch, "compile", broken)
    results = []
    for compile in (False, True):
        params = _params(torch.float64)
        opt = MAKERS["rmsprop"](params, generator=torch.Generator().manual_seed(1), compile=compile)
        if compile:
            with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler"):
                _run(opt, params, range(10))
        else:
            _run(opt, params, range(10))
        results.append([p.detach().clone() for p in params])
    # the failed first call drew its noise once and ran eagerly: the same chain, bit for bit
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


@pytest.mark.parametrize("noise", ["philox", "torch"])
def test_counter_based_noise_is_drawn_inside_the_compiled_step(
    monkeypatch: pytest.MonkeyPatch, noise: str
) -> None:
    """``compile=True`` with Philox noise draws ξ in the compiled call (one fused pass over D:
    no separate kernel writes the noise buffer); ``noise="torch"`` draws it eagerly."""
    from sgrld.core.noise import NoiseBuffer

    calls: list[str] = []
    draw = NoiseBuffer.draw
    monkeypatch.setattr(
        NoiseBuffer, "draw", lambda self, *a, **kw: calls.append(a[1]) or draw(self, *a, **kw)
    )
    params = _params(torch.float32)
    opt = MAKERS["rmsprop"](params, noise=noise, compile=True)
    _run(opt, params, range(4))
    assert not opt._chains[0].sampler._compiled.failed
    assert calls == ([] if noise == "philox" else ["torch"] * 4)
