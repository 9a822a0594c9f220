"""One restart mechanism for every step (:mod:`sgrld.core.warmup`): a bias-corrected metric's
statistics restart at the schedule's slow-window starts (``restart_steps``), decided inside the
step from its count (``since_restart``), on the device for a captured step's device count; so an
eager chain, a captured one (device count, ``capturable=True``) and a traced one
(``torch.compile`` of the capturable step, what a CUDA graph records) are one chain across the
restarts. K chains in one state, some frozen and some waiting, step compiled as they step eagerly.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import sgrld
from sgrld.core.warmup import DEFAULT_WARMUP, Windows, restart_steps, since_restart

#: a 2-D Gaussian, stiff direction variance 1/4 (posteriors' kind of target)
PREC = torch.tensor([[3.0, 1.0], [1.0, 2.0]], dtype=torch.float64)
LR = 0.05


def test_restarts_come_from_the_schedule_and_a_device_count_gets_the_host_answers() -> None:
    """The default's slow windows start after 75, 100, 150, 250 and 450 steps (and 950, ... in
    the windows an arrival adds); an explicit ``Windows(N)`` or N keeps its statistics across the
    warm-up (as checkpoints saved before the restarts did), and so does a metric that does not
    restart. For every count the device answers (origin, restart now) are the host's."""
    adam, rms = sgrld.get_metric("adam")(), sgrld.get_metric("rmsprop")()
    starts = restart_steps(adam, DEFAULT_WARMUP)
    assert starts == (75, 100, 150, 250, 450)
    assert restart_steps(adam, Windows(1000)) == restart_steps(adam, 1000) == ()
    assert restart_steps(rms, DEFAULT_WARMUP) == ()  # no bias correction: G ≈ ε after a restart
    assert (
        restart_steps(sgrld.get_metric("rmsprop")(bias_correction=True), DEFAULT_WARMUP) == starts
    )
    assert restart_steps(adam, DEFAULT_WARMUP)[-1] < DEFAULT_WARMUP.slow_starts(1)[-1] == 950
    counts = torch.arange(1, 1001)
    host = [since_restart(starts, int(c)) for c in counts]
    device = [since_restart(starts, c) for c in counts]
    assert [o for o, _ in host] == [int(o) for o, _ in device]
    assert [n for _, n in host] == [bool(n) for _, n in device]
    assert [int(c) for c, (_, n) in zip(counts, host, strict=True) if n] == [s + 1 for s in starts]


def _functional(steps: int, **options: Any) -> list[torch.Tensor]:
    # τ = 0: no ξ (the Philox kernel's first compilation, ~10 s on a CPU, is the slow test's);
    # G, its restarts and the bias correction's count act on the drift alone
    sampler = sgrld.build("adam", lr=LR, num_data=1.0, noise="philox", temperature=0.0, **options)
    x0 = torch.full((3, 2), 30.0, dtype=torch.float64)
    state = sampler.init({"x": x0}, num_chains=3, seeds=[1, 2, 3])
    path = []
    for _ in range(steps):
        sampler.step(state, {"x": state.params["x"] @ PREC})
        path.append(state.params["x"].clone())
    return path


def test_a_captured_step_restarts_where_the_eager_one_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """A capturable sampler stepped as in a CUDA graph's capture (checks deferred, the restarts
    decided on the device's count, no arrival: it cannot wait) and the default eager one (host
    count, an arrival) are the same chain bit for bit over 160 steps, across the restarts after
    steps 75, 100 and 150 (before, the captured chain never restarted and the two parted at
    step 76)."""
    eager = _functional(160)
    monkeypatch.setattr(sgrld.core.engine, "in_graph", lambda: True)  # as under capture
    captured = _functional(160, capturable=True)
    for t, (a, b) in enumerate(zip(eager, captured, strict=True), start=1):
        assert torch.equal(a, b), t


def _graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


@pytest.mark.slow
def test_the_traced_capturable_step_restarts_as_the_eager_one() -> None:
    """``torch.compile(opt.step, fullgraph=True)`` of a capturable optimizer (the step a CUDA
    graph records: no host value read) is the eager optimizer's chain bit for bit across the
    restarts after steps 75, 100 and 150, with no graph made after the third step (the restarts
    are decided on the device, not baked into the graph)."""
    from sgrld.core._compile import quiet_compile

    def make(capturable: bool) -> tuple[torch.nn.Parameter, sgrld.SGRLDOptimizer]:
        x = torch.nn.Parameter(torch.full((2,), 30.0, dtype=torch.float64))
        lr = torch.tensor(LR, dtype=torch.float64)
        opt = sgrld.SGRLDOptimizer([("x", x)], metric="adam", lr=lr, num_data=1.0,
                                   noise="philox", capturable=capturable,
                                   generator=torch.Generator().manual_seed(0))  # fmt: skip
        return x, opt

    torch._dynamo.reset()
    (xa, eager), (xb, captured) = make(False), make(True)
    traced = torch.compile(captured.step, fullgraph=True)
    graphs = 0
    with quiet_compile():
        for t in range(160):
            for x, step in ((xa, eager.step), (xb, traced if t else captured.step)):
                x.grad = x.detach() @ PREC
                step()
            captured.refresh_if_due()
            assert torch.equal(xa, xb), t + 1
            if t == 3:
                graphs = _graphs()
    assert _graphs() == graphs


@pytest.mark.slow
def test_compiled_step_with_frozen_and_waiting_chains_is_the_eager_step() -> None:
    """Two chains in one state under a waiting ``Windows(200, arrival=True)``: the one at the mode
    freezes at 150, the one 10 away waits to 350 (two more windows, Adam restarting it alone after
    150 and 250). ``compile=True`` takes the same decisions, its chain is the eager one to
    rounding, and the frozen chain's statistics are never touched after its freeze."""
    windows = Windows(200, arrival=True)
    runs = []
    for compile_ in (False, True):
        sampler = sgrld.build("adam", lr=LR, num_data=1.0, adapt_until=windows, compile=compile_)
        x0 = torch.tensor([[0.0, 0.0], [10.0, 10.0]], dtype=torch.float64)
        state = sampler.init({"x": x0}, num_chains=2, generator=torch.Generator().manual_seed(0))
        frozen: dict[str, torch.Tensor] = {}
        for _ in range(400):
            sampler.step(state, {"x": state.params["x"] @ PREC})
            if state.step == 150:
                frozen = {k: v[0].clone() for k, v in state.stats.items()}
        assert state.warmup is not None and state.warmup.freeze_steps() == [150, 350], compile_
        for k, v in state.stats.items():
            assert torch.equal(v[0], frozen[k]), (compile_, k)
        runs.append(state)
    eager, compiled = runs
    tol = {"rtol": 1e-10, "atol": 1e-12}  # test_compiled's float64 tolerance (rsqrt vs pow)
    torch.testing.assert_close(compiled.params["x"], eager.params["x"], **tol)
    for k, v in eager.stats.items():
        torch.testing.assert_close(compiled.stats[k], v, **tol)


def test_a_state_dict_saved_at_a_restart_by_the_host_schedule_resumes_as_it_did() -> None:
    """Before, the restart ran on the host after the window's last step, so a state saved after
    step 450 held a zeroed second moment; now the step after it restarts. Loaded either way (the
    moment as saved now, or zeroed as then), the chain goes on as the one that never stopped."""
    sampler = sgrld.build("adam", lr=LR, num_data=1.0)
    state = sampler.init({"x": torch.full((2, 2), 30.0, dtype=torch.float64)}, num_chains=2,
                         generator=torch.Generator().manual_seed(0))  # fmt: skip
    for _ in range(450):
        sampler.step(state, {"x": state.params["x"] @ PREC})
    then = state.state_dict()
    then["stats"]["exp_avg_sq"].zero_()  # what the host's restart had left
    copies = [sgrld.core.sampler.clone_state(state) for _ in range(2)]
    copies[1].load_state_dict(then)
    for s in (state, *copies):
        for _ in range(30):
            sampler.step(s, {"x": s.params["x"] @ PREC})
    for s in copies:
        assert torch.equal(s.params["x"], state.params["x"])
        for k, v in state.stats.items():
            assert torch.equal(s.stats[k], v), k
