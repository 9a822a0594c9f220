"""Shared fixtures: every sampler of the registry with its test case (cf. torch's optim_db)."""

from __future__ import annotations

import io
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import sgrld
from metric_cases import CASES, MetricCase

REPO = Path(__file__).resolve().parents[1]

# Tests run many tiny ops: one intra-op thread keeps them fast and immune to a busy machine
# (OpenMP workers stall badly when the cores are oversubscribed). Benchmarks use both cores.
torch.set_num_threads(1)


@dataclass(frozen=True)
class SamplerSpec:
    """How to build one registered sampler through the facade and through the functional core."""

    name: str  # the registry name
    case: MetricCase

    @property
    def options(self) -> dict[str, Any]:  # facade kwargs == metric kwargs
        return self.case.options

    def make_optimizer(self, params: Any, **kw: Any) -> sgrld.SGRLDOptimizer:
        kw = {**self.options, **kw}
        if self.case.facade is None:
            return sgrld.SGRLDOptimizer(params, metric=self.name, **kw)
        return self.case.facade(params, **kw)

    def make_sampler(self, **kw: Any) -> sgrld.Sampler:
        return sgrld.build(self.name, **{**self.options, **kw})


#: every metric of the registry, with its test case (``tests/metric_cases.py``)
SAMPLERS = [SamplerSpec(name, CASES[name]) for name in sgrld.metric_names()]


@pytest.fixture(params=SAMPLERS, ids=[s.name for s in SAMPLERS])
def spec(request: pytest.FixtureRequest) -> SamplerSpec:
    return request.param


def mnist_path() -> Path:
    """Where the tests find real MNIST: in ``$SGRLD_DATA_DIR`` (the CLI's ``--data-dir``
    default), in it or in its ``mnist/``; ``$SGRLD_MNIST_DIR`` (the MNIST folder itself) is its
    deprecated older name; else ``../shared/data/mnist`` beside the checkout."""
    data = os.environ.get("SGRLD_DATA_DIR")
    if data:
        root = Path(data)
        return root if (root / MNIST_FILE).exists() else root / "mnist"
    return Path(os.environ.get("SGRLD_MNIST_DIR", REPO.parent / "shared" / "data" / "mnist"))


MNIST_FILE = "train-images-idx3-ubyte.gz"
# one variable for the tests that still read the deprecated name (golden outputs, data)
if os.environ.get("SGRLD_DATA_DIR") and not os.environ.get("SGRLD_MNIST_DIR"):
    os.environ["SGRLD_MNIST_DIR"] = str(mnist_path())


@pytest.fixture
def mnist_dir() -> Path:
    path = mnist_path()
    if not (path / MNIST_FILE).exists():
        pytest.skip(f"real MNIST not found in {path} (set SGRLD_DATA_DIR)")
    return path


def quadratic_problem(
    dtype: torch.dtype = torch.float64, seed: int = 0
) -> tuple[dict[str, torch.Tensor], Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]]:
    """Small parameters of several ranks and a non-isotropic quartic-plus-quadratic gradient."""
    g = torch.Generator().manual_seed(seed)
    params = {
        "w": torch.randn(5, 6, generator=g, dtype=dtype),
        "b": torch.randn(6, generator=g, dtype=dtype),
        "c": torch.randn(2, 3, 2, generator=g, dtype=dtype),
    }
    scales = {k: torch.rand(v.shape, generator=g, dtype=dtype) + 0.5 for k, v in params.items()}

    def grad(p: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: scales[k] * v + 0.1 * v**3 for k, v in p.items()}

    return params, grad


Params = list[torch.nn.Parameter]


def check_resume_is_bit_identical(
    make_opt: Callable[[Params, torch.Generator], torch.optim.Optimizer],
    params: Params,
    run: Callable[[torch.optim.Optimizer, Params, range], None],
    split: int,
    total: int,
) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    """Run to ``split``, save, run to ``total``; a fresh optimizer (other generator seed) loaded
    from the save and run from ``split`` to ``total`` must end bit-identical."""
    opt = make_opt(params, torch.Generator().manual_seed(1))
    run(opt, params, range(split))
    buf = io.BytesIO()
    torch.save({"params": [p.detach().clone() for p in params], "opt": opt.state_dict()}, buf)
    run(opt, params, range(split, total))
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    params2 = [torch.nn.Parameter(p) for p in saved["params"]]
    opt2 = make_opt(params2, torch.Generator().manual_seed(99))
    opt2.load_state_dict(saved["opt"])
    run(opt2, params2, range(split, total))
    assert all(torch.equal(a, b) for a, b in zip(params, params2, strict=True))
    return opt, opt2


def state_tensors(state_dict: dict) -> dict[str, torch.Tensor]:
    """Copies of every tensor of an optimizer state dict's per-parameter state, keyed
    ``"<param id>.<entry>"`` (state dicts hold the optimizer's live tensors, as torch's do)."""
    return {
        f"{pid}.{key}": value.clone()
        for pid, entry in state_dict["state"].items()
        for key, value in entry.items()
        if isinstance(value, torch.Tensor)
    }


def statistics(state_dict: dict) -> dict[str, torch.Tensor]:
    """The floating-point entries of :func:`state_tensors`: the metric's statistics."""
    return {k: v for k, v in state_tensors(state_dict).items() if v.is_floating_point()}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` are skipped on a machine without a CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def unflatten_chains(flat: torch.Tensor, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """``(K, D)`` chains as named ``(K, *shape)`` parameters (copies), in ``shapes``' order."""
    sizes = [math.prod(s) for s in shapes.values()]
    parts = flat.split(sizes, dim=-1)
    return {
        n: v.reshape(*flat.shape[:-1], *s).clone()
        for (n, s), v in zip(shapes.items(), parts, strict=True)
    }


def flatten_chains(params: dict[str, torch.Tensor]) -> torch.Tensor:
    """Inverse of :func:`unflatten_chains`: named ``(K, *shape)`` tensors as one ``(K, D)``."""
    return torch.cat([v.reshape(v.shape[0], -1) for v in params.values()], dim=-1)
