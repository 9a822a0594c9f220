"""On a CUDA device: deferred checks without host syncs, captured steps equal eager ones, resume
after replay (skipped without a GPU; run with ``make test-cuda``)."""

from __future__ import annotations

import io
from collections.abc import Callable

import pytest
import torch

import sgrld
from conftest import SAMPLERS, SamplerSpec
from sgrld.capture import GraphedStep

pytestmark = pytest.mark.cuda
DEVICE = "cuda"


def _setup(spec: SamplerSpec, seed: int = 0) -> tuple[torch.nn.Module, sgrld.SGRLDOptimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(20, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)
    ).to(DEVICE)
    options = dict(spec.options)
    if spec.name == "shampoo":
        options["update_interval"] = 7
    opt = spec.optimizer(
        model.parameters(),
        lr=torch.tensor(0.01, device=DEVICE),
        num_data=1000,
        noise="philox",
        capturable=True,
        generator=torch.Generator(DEVICE).manual_seed(seed),
        **options,
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


def _run(spec: SamplerSpec, steps: int, graphed: bool) -> list[torch.Tensor]:
    model, opt = _setup(spec)
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
