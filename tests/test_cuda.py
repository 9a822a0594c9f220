"""On a CUDA device: deferred checks without host syncs, captured steps equal eager ones, resume
after replay (skipped without a GPU; run with ``make test-cuda``)."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import pytest
import torch

import sgrld
from conftest import SAMPLERS, SamplerSpec
from sgrld.capture import GraphedStep

pytestmark = pytest.mark.cuda
DEVICE = "cuda"


def _setup(
    spec: SamplerSpec, seed: int = 0, **extra: Any
) -> tuple[torch.nn.Module, sgrld.SGRLDOptimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(20, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)
    ).to(DEVICE)
    options = dict(spec.options)
    if spec.name == "shampoo":
        options["update_interval"] = 7
    opt = spec.make_optimizer(
        model.parameters(),
        lr=torch.tensor(0.01, device=DEVICE),
        num_data=1000,
        noise="philox",
        capturable=True,
        generator=torch.Generator(DEVICE).manual_seed(seed),
        **options,
        **extra,
    )
    return model, opt


def _data(steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(steps, 16, 20, generator=gen), torch.randint(
        0, 4, (steps, 16), generator=gen
    )


def _static_step(
    model: torch.nn.Module, opt: sgrld.SGRLDOptimizer
) -> tuple[torch.Tensor, torch.Tensor, Callable[[], torch.Tensor]]:
    """Static input tensors and the training step that reads them (what a graph captures)."""
    x = torch.empty(16, 20, device=DEVICE)
    y = torch.empty(16, dtype=torch.long, device=DEVICE)

    def train_step() -> torch.Tensor:
        opt.zero_grad(set_to_none=False)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return x, y, train_step


def _run(spec: SamplerSpec, steps: int, graphed: bool, **extra: Any) -> list[torch.Tensor]:
    model, opt = _setup(spec, **extra)
    xs, ys = _data(steps)
    x, y, train_step = _static_step(model, opt)
    step = GraphedStep(train_step, opt) if graphed else train_step
    for t in range(steps):
        x.copy_(xs[t])
        y.copy_(ys[t])
        step()
    opt.check()
    return [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("spec", SAMPLERS, ids=[s.name for s in SAMPLERS])
def test_captured_steps_equal_eager_steps(spec: SamplerSpec) -> None:
    eager = _run(spec, 100, graphed=False)
    graphed = _run(spec, 100, graphed=True)
    for a, b in zip(eager, graphed, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("spec", SAMPLERS[1:], ids=[s.name for s in SAMPLERS[1:]])
def test_captured_steps_freeze_after_the_warmup(spec: SamplerSpec) -> None:
    """The warm-up ends at step 30 inside a replayed run: the step is captured anew (frozen),
    so the chain is the eager one, which freezes G after step 30 too."""
    eager = _run(spec, 100, graphed=False, adapt_until=30)
    graphed = _run(spec, 100, graphed=True, adapt_until=30)
    always = _run(spec, 100, graphed=False, adapt_until=None)
    for a, b in zip(eager, graphed, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert any(not torch.allclose(a, c) for a, c in zip(eager, always, strict=True))


def test_deferred_check_on_cuda_has_no_host_sync() -> None:
    model, opt = _setup(SAMPLERS[3])
    x = torch.randn(16, 20, device=DEVICE)
    y = torch.randint(0, 4, (16,), device=DEVICE)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()  # state created
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    opt.check()


@pytest.mark.parametrize("low_precision", ["master", "stochastic"])
def test_telemetry_and_bfloat16_steps_have_no_host_sync(
    spec: SamplerSpec, low_precision: str
) -> None:
    """Telemetry sums and bfloat16 master copies / stochastic rounding stay on the device."""
    torch.manual_seed(0)
    model = torch.nn.Linear(20, 4).to(DEVICE, torch.bfloat16)
    opt = spec.make_optimizer(
        model.parameters(), lr=0.01, num_data=100, telemetry=True, noise="philox",
        low_precision=low_precision, generator=torch.Generator(DEVICE).manual_seed(0),
    )  # fmt: skip
    x = torch.randn(16, 20, device=DEVICE, dtype=torch.bfloat16)
    model(x).float().square().mean().backward()
    opt.step()  # state created, the first-step checks made
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()  # step 2: no Shampoo refresh due (conftest's interval is 3)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert opt.telemetry()["steps"] == 2.0


def test_resume_after_replay_is_bit_identical() -> None:
    spec = SAMPLERS[3]
    model, opt = _setup(spec)
    xs, ys = _data(40)
    x, y, train_step = _static_step(model, opt)
    step = GraphedStep(train_step, opt)
    buf = io.BytesIO()
    for t in range(40):
        if t == 20:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
        x.copy_(xs[t])
        y.copy_(ys[t])
        step()
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    model2, opt2 = _setup(spec, seed=99)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    for t in range(20, 40):
        opt2.zero_grad(set_to_none=False)
        torch.nn.functional.cross_entropy(model2(xs[t].to(DEVICE)), ys[t].to(DEVICE)).backward()
        opt2.step()
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# --- GraphedStep: every call is one step --------------------------------------------------------


def test_every_graphed_call_is_one_step() -> None:
    """Warm-up calls, the capture call and replays each advance the chain by exactly one step
    (host and device counts agree), and the parameters equal as many eager steps'."""
    spec = SAMPLERS[3]
    model, opt = _setup(spec)
    xs, ys = _data(10)
    x, y, train_step = _static_step(model, opt)
    step = GraphedStep(train_step, opt, warmup=2)
    for t in range(10):
        x.copy_(xs[t])
        y.copy_(ys[t])
        step()
        assert opt.num_steps == t + 1
    state = opt.sampler_states[0]
    assert state is not None and int(state.device_step) == 10
    assert step.warmed == 2 and step.replays == 8  # the capture call replays too
    eager = _run(spec, 10, graphed=False)
    for a, b in zip(eager, model.parameters(), strict=True):
        torch.testing.assert_close(b.detach().cpu(), a, rtol=1e-5, atol=1e-6)


def test_wenzel_refresh_between_replays_reaches_the_graph() -> None:
    """update_preconditioner() between replays writes the statistics in place, and a
    refresh_every step runs eagerly: the captured chain equals the eager one."""
    spec = next(s for s in SAMPLERS if s.name == "wenzel")

    def run(graphed: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model, opt = _setup(spec)
        assert isinstance(opt, sgrld.WenzelSGLD)
        opt.refresh_every = 7
        xs, ys = _data(40)
        x, y, train_step = _static_step(model, opt)
        step = GraphedStep(train_step, opt) if graphed else train_step
        for t in range(40):
            x.copy_(xs[t])
            y.copy_(ys[t])
            step()
            if t % 10 == 9:
                opt.update_preconditioner()
        opt.check()
        return [p.detach().cpu() for p in model.parameters()]

    for a, b in zip(run(False), run(True), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


# --- the runner's captured loop -----------------------------------------------------------------


def _runner_splits() -> Any:
    from test_runner import synthetic_splits

    return synthetic_splits(num_train=195)


def _runner_config(sampler: str, **overrides: Any) -> Any:
    from test_runner_graph import config

    return config(sampler, **overrides)


@pytest.mark.parametrize("sampler", ["identity", "wenzel", "rmsprop", "monge", "shampoo"])
def test_runner_graph_equals_eager_loop(sampler: str) -> None:
    """120 updates (a short last batch each epoch, Shampoo's refresh at update 100, Wenzel's at
    each epoch end): the captured loop gives the eager loop's results within float32 rounding
    and the uncaptured deferred loop's to the same kernels."""
    from sgrld.experiments.run.loop import SamplingRun
    from test_runner_graph import counts, gap

    c = _runner_config(sampler)
    runs = {
        mode: SamplingRun(c, _runner_splits(), device=DEVICE, step_mode=mode)
        for mode in ("eager", "deferred", "graph")
    }
    results = {mode: run.run()[0] for mode, run in runs.items()}
    assert (
        SamplingRun(c, _runner_splits(), device=DEVICE).stepper.step_mode == "graph"
    )  # the default
    graphed = runs["graph"]._graphed
    assert graphed is not None and graphed.replays > 90
    assert results["graph"]["timing"]["step_mode"] == "graph"
    for mode in ("eager", "deferred"):
        assert counts(results[mode]) == counts(results["graph"])
        assert gap(results[mode], results["graph"]) < 1e-6


def test_runner_graph_has_no_host_sync_between_samples() -> None:
    """Between two samples a captured step reads nothing on the host: torch's sync debug mode
    set to "error" for updates 16-19 (samples at 15 and 20; no refresh due) raises on any."""
    from sgrld.experiments.run.loop import SamplingRun
    from sgrld.experiments.run.observers import RunObserver
    from test_runner import synthetic_splits, tiny_config

    class NoSync(RunObserver):
        def __init__(self) -> None:
            self.checked: list[int] = []

        def on_step(self, run: SamplingRun) -> None:
            if run.global_step == 15:  # after the sample's evaluation
                torch.cuda.set_sync_debug_mode("error")
            elif 15 < run.global_step < 20:
                self.checked.append(run.global_step)
                if run.global_step == 19:  # before update 20's sample reads the flags
                    torch.cuda.set_sync_debug_mode("default")

    for sampler in ("identity", "wenzel", "rmsprop", "monge", "shampoo"):
        observer = NoSync()
        config = tiny_config(sampler=sampler, epochs=3)  # 10 updates per epoch, no short batch
        run = SamplingRun(
            config, synthetic_splits(), device=DEVICE, observer=observer, step_mode="graph"
        )
        try:
            (results,) = run.run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert observer.checked == [16, 17, 18, 19], sampler
        assert results["status"] == "completed"
        assert run.stepper._graphed is not None and run.stepper._graphed.replays >= 26


def test_runner_graph_breakdown_and_resume(tmp_path: Any) -> None:
    """A breakdown while replaying is recorded at its update, as by the eager loop; a run killed
    mid-epoch resumes (capturing again) to the uninterrupted run's results."""
    from sgrld.experiments.run.loop import run_sampling
    from test_runner import KillAt
    from test_runner_graph import PoisonAfter, counts, failing_update, gap

    c = _runner_config("monge")
    broken = {
        mode: run_sampling(
            c,
            _runner_splits(),
            tmp_path / mode,
            device=DEVICE,
            observer=PoisonAfter(2, 1),
            step_mode=mode,
        )[0]
        for mode in ("eager", "graph")
    }
    assert counts(broken["eager"]) == counts(broken["graph"])
    assert broken["graph"]["broken_down"]["update"] == failing_update(2, 1)

    straight = run_sampling(c, _runner_splits(), tmp_path / "straight", device=DEVICE)[0]
    killed = tmp_path / "killed"
    with pytest.raises(KeyboardInterrupt):
        run_sampling(c, _runner_splits(), killed, device=DEVICE, observer=KillAt(47))
    resumed = run_sampling(c, _runner_splits(), killed, device=DEVICE, resume=True)[0]
    assert resumed["timing"]["step_mode"] == "graph"
    assert counts(resumed) == counts(straight)
    # the resumed run's warm-up steps run eagerly on a side stream where the straight run
    # replays: the same kernels, compared within float32 rounding in case cuBLAS picks others
    assert gap(resumed, straight) < 1e-6


def test_runner_nan_gradient_under_a_finite_potential_on_cuda(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """A NaN gradient whose potential is finite: every loop on CUDA records the breakdown at its
    update (the eager loop refuses the step at once, the deferred and captured loops read the
    device flags before the next sample) and writes its checkpoint."""
    from sgrld.experiments.run.checkpoint import load_checkpoint
    from sgrld.experiments.run.config import CHECKPOINT_FILE
    from sgrld.experiments.run.loop import run_sampling
    from test_runner_graph import MarkAfter, counts, failing_update, patch_potential

    patch_potential(monkeypatch)
    results = {
        mode: run_sampling(
            _runner_config("identity"),
            _runner_splits(),
            tmp_path / mode,
            device=DEVICE,
            observer=MarkAfter(2, 1),
            step_mode=mode,
        )[0]
        for mode in ("eager", "deferred", "graph")
    }
    update = failing_update(2, 1)
    assert results["eager"]["broken_down"]["update"] == update
    for mode in results:
        checkpoint = load_checkpoint(tmp_path / mode / CHECKPOINT_FILE)
        assert checkpoint["status"] == "broken_down" and checkpoint["global_step"] == update - 1
    assert counts(results["eager"]) == counts(results["deferred"]) == counts(results["graph"])
