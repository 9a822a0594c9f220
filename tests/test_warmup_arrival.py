"""The default warm-up waits for the chain (``DEFAULT_WARMUP``, :mod:`sgrld.core.warmup`).

A chain still travelling from a far start when the last slow window ends gets another slow window
of twice the length (up to 16 × the nominal warm-up); a chain that has arrived freezes where Stan
would. Adam restarts its second moment, and its bias correction, at each slow window's start. The
decision's state is in every state dict (resume is bit-identical across an extension), a state
dict from before keeps the nominal windows, and the facade is the functional core step for step.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

import sgrld
from sgrld.core.warmup import (
    DEFAULT_WARMUP,
    Windows,
    adapting,
    closes_warmup,
    warmup_end,
    warmup_length,
)

#: a 2-D Gaussian, stiff direction variance 1/4 (posteriors' kind of target)
PREC = torch.tensor([[3.0, 1.0], [1.0, 2.0]], dtype=torch.float64)
LR = 0.05


def _grad(x: torch.Tensor) -> torch.Tensor:
    return x @ PREC


def _chain(name: str, start: float, steps: int, chains: int = 4) -> tuple[Any, Any]:
    sampler = sgrld.build(name, lr=LR, num_data=1.0)
    gen = torch.Generator().manual_seed(0)
    x0 = torch.full((chains, 2), start, dtype=torch.float64)
    state = sampler.init({"x": x0}, num_chains=chains, generator=gen)
    for _ in range(steps):
        sampler.step(state, {"x": _grad(state.params["x"])})
    return sampler, state


def test_the_schedule_doubles_its_last_window_up_to_the_cap() -> None:
    w = DEFAULT_WARMUP
    assert w.arrival and w == 1000 and repr(w) == "Windows(1000, arrival=True)"
    assert w.slow_ends(3)[-4:] == (950, 1950, 2950, 3950)
    assert w.slow_starts(1)[-2:] == (450, 950)
    # 15,950 + the terminal 50 is 16 × 1,000: a sixteenth window would pass the cap
    assert [w.can_extend(k) for k in (0, 14, 15)] == [True, True, False]
    assert not Windows(1000).can_extend(0)  # an explicit Windows(N) keeps Stan's N
    _, state = _chain("rmsprop", 0.0, 0)
    arrival = state.warmup
    assert arrival is not None and warmup_end(w, arrival) == 950
    arrival.count.fill_(2)
    assert warmup_end(w, arrival) == 2950 and warmup_length(w, arrival) == 3000
    assert adapting(2949, w, arrival) and not adapting(2950, w, arrival)
    metric = sgrld.ShampooMetric()
    assert closes_warmup(metric, 2950, w, arrival) and not closes_warmup(metric, 2950, w)


def test_a_travelling_chain_waits_and_an_arrived_one_does_not() -> None:
    """From 60 away RMSprop moves ~ℓ a step: still travelling at step 950, so the warm-up gets
    the window to 1,950 (the chain arrives within it, but its first half still travels) and then
    the one to 2,950; from the mode it freezes at 950 as Stan's schedule says."""
    _, far = _chain("rmsprop", 60.0, 2000)
    assert far.warmup.extensions == 2
    _, near = _chain("rmsprop", 0.0, 1000)
    assert near.warmup.extensions == 0
    _, identity = _chain("identity", 60.0, 10)
    assert identity.warmup is None  # G = I: nothing to wait for


def test_adam_restarts_its_moment_and_bias_correction_at_each_slow_window() -> None:
    """After the restart at step 450 the next update's v̂ is that step's g² alone (v/(1 − β₂¹)),
    as at step 1, whatever the journey's gradients before."""
    sampler, state = _chain("adam", 30.0, 450, chains=1)
    assert bool((state.stats["exp_avg_sq"] != 0).all())  # restarted inside the next step
    g = _grad(state.params["x"])
    sampler.step(state, {"x": g})
    metric = sampler.metric
    assert torch.equal(state.stats["exp_avg_sq"], (1.0 - metric.beta2) * g * g)
    scale = (g * g).mean().sqrt()
    expect = (g.abs() + torch.clamp(metric.floor * scale, min=metric.eps)).pow(-0.5)
    torch.testing.assert_close(state.stats["inv_sqrt"], expect, rtol=1e-12, atol=0)
    _, rms = _chain("rmsprop", 30.0, 450, chains=1)  # no bias correction: nothing restarts
    assert bool((rms.stats["square_avg"] != 0).all())


def _saved_and_loaded(sampler: Any, state: Any, sd: dict[str, Any]) -> tuple[Any, Any]:
    """A copy of ``state`` and a fresh state loaded from ``sd`` through ``torch.save``/``load``."""
    buf = io.BytesIO()
    torch.save({"params": state.params["x"], "state": sd}, buf)
    straight = sgrld.core.sampler.clone_state(state)
    chains = state.params["x"].shape[0]
    fresh = sampler.init({"x": torch.zeros(chains, 2, dtype=torch.float64)}, num_chains=chains)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    fresh.params["x"].copy_(saved["params"])
    fresh.load_state_dict(saved["state"])
    return straight, fresh


def test_functional_resume_is_bit_identical_across_an_extension() -> None:
    sampler, state = _chain("adam", 60.0, 1200)
    assert state.warmup.extensions == 1
    sd = state.state_dict()
    straight, fresh = _saved_and_loaded(sampler, state, sd)
    for s in (straight, fresh):
        for _ in range(1000):  # through the decision at 1,950
            sampler.step(s, {"x": _grad(s.params["x"])})
    assert fresh.warmup.extensions == straight.warmup.extensions
    assert torch.equal(fresh.params["x"], straight.params["x"])
    for k, v in straight.stats.items():
        assert torch.equal(fresh.stats[k], v), k


def test_a_state_dict_from_before_keeps_the_nominal_windows() -> None:
    sampler, state = _chain("rmsprop", 60.0, 100)
    sd = state.state_dict()
    del sd["warmup"]  # saved before the warm-up waited
    state.load_state_dict(sd)
    assert state.warmup is None and warmup_end(sampler.adapt_until, state.warmup) == 950


def _facade_and_core(steps: int, adapt_until: Any = DEFAULT_WARMUP) -> tuple[Any, Any, Any]:
    x = torch.full((2,), 60.0, dtype=torch.float64)
    opt = sgrld.SGRLDOptimizer([("x", x)], metric="adam", lr=LR, num_data=1.0,
                               generator=torch.Generator().manual_seed(0),
                               adapt_until=adapt_until)  # fmt: skip
    sampler = sgrld.build("adam", lr=LR, num_data=1.0, adapt_until=adapt_until)
    state = sampler.init({"x": x.clone()}, generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        x.grad = _grad(x)
        opt.step()
        sampler.step(state, {"x": _grad(state.params["x"])})
    return opt, x, state


def test_facade_equals_core_and_resumes_bit_identically() -> None:
    """Saved at step 940, both copies of the facade take the decision at 950 (an extension)."""
    opt, x, state = _facade_and_core(940)
    assert torch.equal(x, state.params["x"])
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    y = x.detach().clone()
    other = sgrld.SGRLDOptimizer([("x", y)], metric="adam", lr=LR, num_data=1.0)
    buf.seek(0)
    other.load_state_dict(torch.load(buf, weights_only=True))
    sampler = sgrld.build("adam", lr=LR, num_data=1.0)
    for _ in range(20):
        for p, o in ((x, opt), (y, other)):
            p.grad = _grad(p)
            o.step()
        sampler.step(state, {"x": _grad(state.params["x"])})
    assert torch.equal(x, y) and torch.equal(x, state.params["x"])
    assert [o.sampler_states[0].warmup.extensions for o in (opt, other)] == [1, 1]
    assert state.warmup.extensions == 1 and opt.adapts() and other.adapts()


def test_an_older_facade_dict_keeps_its_windows() -> None:
    """A checkpoint from before saved ``Windows(1000)`` (no arrival) and no warm-up entries: it
    loads into today's optimizer and freezes at 950 as it would have."""
    opt, _, _ = _facade_and_core(10, adapt_until=Windows(1000))
    sd = opt.state_dict()
    assert not any("warmup" in key for key in sd["state"][0])
    y = torch.zeros(2, dtype=torch.float64)
    other = sgrld.SGRLDOptimizer([("x", y)], metric="adam", lr=LR, num_data=1.0)
    other.load_state_dict(sd)
    assert other.param_groups[0]["adapt_until"] == Windows(1000)
    assert other.sampler_states[0].warmup is None


def test_samples_drawn_in_an_extended_warmup_are_flagged() -> None:
    """A SampleStore after the nominal warm-up still flags the samples of a chain whose warm-up
    waited, and asks for the burn-in the extended warm-up needs."""
    import warnings

    x = torch.full((2,), 60.0, dtype=torch.float64, requires_grad=True)
    model = torch.nn.Module()
    model.x = torch.nn.Parameter(x.detach().clone())
    opt = sgrld.SGRLDOptimizer(model.parameters(), metric="rmsprop", lr=LR, num_data=1.0)
    store = sgrld.SampleStore(burnin=1000, thinning=100, max_samples=50)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(1200):
            model.x.grad = _grad(model.x.detach())
            opt.step()
            store.observe(model)
    said = [str(w.message) for w in caught if "SampleStore" in str(w.message)]
    assert store.adapting == [True, True] and len(said) == 1
    assert "burnin >= 2000" in said[0], said


def test_a_waiting_dict_loads_into_an_optimizer_that_cannot_wait() -> None:
    """A capturable optimizer keeps Stan's fixed windows (no host read at a window's end): a
    checkpoint of a waiting one loads into it, the warm-up's entries skipped."""
    opt, _, _ = _facade_and_core(10)
    y = torch.zeros(2, dtype=torch.float64)
    other = sgrld.SGRLDOptimizer([("x", y)], metric="adam", lr=torch.tensor(LR), num_data=1.0,
                                 noise="philox", capturable=True)  # fmt: skip
    assert other.sampler_states[0].warmup is None
    other.load_state_dict(opt.state_dict())
    assert other.sampler_states[0].warmup is None and other.num_steps == 10


def test_a_dict_saved_where_the_warm_up_could_not_wait_resumes_so() -> None:
    """The reverse: a checkpoint of a capturable (or sharded) optimizer, whose default warm-up
    kept Stan's fixed windows, resumes in one that could wait as it was made, with fixed windows
    (a two-process FSDP run resumed in one process was refused: "missing warmup_sums"); its steps
    then equal the capturable optimizer's own continuation."""

    def make(capturable: bool) -> tuple[Any, torch.Tensor]:
        y = torch.zeros(2, dtype=torch.float64, requires_grad=True)
        opt = sgrld.SGRLDOptimizer([("x", y)], metric="adam", lr=torch.tensor(LR),
                                   num_data=1.0, noise="philox", capturable=capturable)  # fmt: skip
        return opt, y

    (saved, x), (waiting, y) = make(True), make(False)
    assert saved.sampler_states[0].warmup is None and waiting.sampler_states[0].warmup is not None
    for _ in range(10):
        x.grad = _grad(x.detach())
        saved.step()
    waiting.load_state_dict(saved.state_dict())
    with torch.no_grad():
        y.copy_(x)
    assert waiting.sampler_states[0].warmup is None and waiting.num_steps == 10
    for _ in range(300):  # past the first window's end at 75, where a waiting one reads the host
        x.grad, y.grad = _grad(x.detach()), _grad(y.detach())
        saved.step()
        waiting.step()
    assert torch.equal(x, y)


# --- K chains in one state: each freezes when it has arrived ---------------------------------


def _mixed(name: str, steps: int, starts: tuple[float, ...] = (0.0, 60.0)) -> tuple[Any, Any]:
    sampler = sgrld.build(name, lr=LR, num_data=1.0)
    x0 = torch.tensor([[s, s] for s in starts], dtype=torch.float64)
    state = sampler.init({"x": x0}, num_chains=len(starts), generator=torch.Generator())
    state.generator.manual_seed(0)
    for _ in range(steps):
        sampler.step(state, {"x": _grad(state.params["x"])})
    return sampler, state


@pytest.mark.slow
def test_each_chain_freezes_when_it_has_arrived_as_it_would_alone() -> None:
    """One chain at the mode, one 60 away, in one state: the near one freezes at 950 as its
    single-chain run does, the far one waits to 2,950 as its own run does; from its freeze on,
    the near chain's G is never touched again (the far chain's steps adapt only the far one's
    statistics, and Adam's restarts at 950 and 1,950 restart the far one's alone)."""
    for name in ("rmsprop", "adam"):
        _, near = _mixed(name, 960, (0.0,))
        _, far = _mixed(name, 3000, (60.0,))
        alone = near.warmup.freeze_steps() + far.warmup.freeze_steps()
        assert alone == [950, 2950], (name, alone)
        sampler, state = _mixed(name, 950)
        frozen = {k: v[0].clone() for k, v in state.stats.items()}
        for _ in range(2050):
            sampler.step(state, {"x": _grad(state.params["x"])})
        assert state.warmup.freeze_steps() == alone, name
        for k, v in state.stats.items():
            assert torch.equal(v[0], frozen[k]), (name, k)


def test_resume_is_bit_identical_while_some_chains_are_frozen() -> None:
    """Saved at step 1,200 (the near chain frozen since 950, the far one waiting): the loaded
    copy takes the decision at 1,950 and every step as the one that never stopped; a state dict
    from before (no per-chain windows) loads with every chain waiting alike."""
    sampler, state = _mixed("adam", 1200)
    near = {k: v[0].clone() for k, v in state.stats.items()}  # frozen since step 950
    sd = state.state_dict()
    assert sd["warmup"]["chains"].tolist() == [0, 1] and sd["warmup"]["extensions"] == 1
    straight, fresh = _saved_and_loaded(sampler, state, sd)
    for s in (straight, fresh):
        for _ in range(1000):
            sampler.step(s, {"x": _grad(s.params["x"])})
    assert fresh.warmup.count.tolist() == straight.warmup.count.tolist() == [0, 2]
    assert torch.equal(fresh.params["x"], straight.params["x"])
    for k, v in straight.stats.items():
        assert torch.equal(fresh.stats[k], v), k
        assert torch.equal(v[0], near[k]), k  # Adam's restart at 1,950 left it alone
    del sd["warmup"]["chains"]
    fresh.load_state_dict(sd)
    assert fresh.warmup.count.tolist() == [1, 1]
    sd["warmup"]["chains"] = torch.tensor([0, 2])  # more windows than the schedule has
    try:
        fresh.load_state_dict(sd)
    except ValueError as exc:
        assert "per-chain" in str(exc)
    else:
        raise AssertionError("a mismatched per-chain count loaded")
