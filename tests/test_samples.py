"""sgrld.samples: the thinning schedule and cap of SampleStore, the predictive, the log-density."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest
import torch

import sgrld
from sgrld.models import build_model, potential
from sgrld.samples import SampleStore, log_density, posterior_predictive

REPO = Path(__file__).resolve().parents[1]


class Counter(torch.nn.Module):
    """A model whose only state is the step at which it was observed."""

    def __init__(self) -> None:
        super().__init__()
        self.value = torch.nn.Parameter(torch.zeros(2))
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.value


def _walk(store: SampleStore, steps: int) -> Counter:
    model = Counter()
    for step in range(1, steps + 1):
        with torch.no_grad():
            model.value.fill_(float(step))
            model.seen.fill_(step)
        store.observe(model)
    return model


@pytest.mark.parametrize("on_disk", [False, True])
def test_store_follows_the_runners_schedule(on_disk: bool, tmp_path: Path) -> None:
    from sgrld.experiments.run.config import is_sample_step

    directory = tmp_path / "samples" if on_disk else None
    store = SampleStore(burnin=7, thinning=3, max_samples=100, directory=directory)
    _walk(store, 40)
    expected = [k for k in range(1, 41) if is_sample_step(k, 7, 3)]
    assert store.steps == expected == [9, 12, 15, 18, 21, 24, 27, 30, 33, 36, 39]
    assert [int(s["seen"]) for s in store] == expected  # each is the state after its step
    assert [float(s["value"][0]) for s in store] == [float(k) for k in expected]
    if on_disk:
        assert len(list(directory.iterdir())) == len(expected)  # type: ignore[union-attr]


@pytest.mark.parametrize("on_disk", [False, True])
def test_cap_halves_and_doubles_thinning(on_disk: bool, tmp_path: Path) -> None:
    directory = tmp_path / "samples" if on_disk else None
    store = SampleStore(burnin=0, thinning=1, max_samples=4, directory=directory)
    _walk(store, 20)
    # 1..4 fill it; at 5 thinning 2 keeps 2, 4 (then 6, 8); at 10 thinning 4 keeps 4, 8 (then
    # 12, 16); at 20 thinning 8 keeps 8, 16, and 20 is no multiple of 8.
    assert store.steps == [8, 16] and store.thinning == 8
    assert [int(s["seen"]) for s in store] == [8, 16]
    if on_disk:
        assert len(list(directory.iterdir())) == 2  # type: ignore[union-attr]
    _walk_on = Counter()
    for step in range(21, 25):
        with torch.no_grad():
            _walk_on.seen.fill_(step)
        store.observe(_walk_on)
    assert store.steps == [8, 16, 24] and int(store[-1]["seen"]) == 24


def test_store_refuses_bad_arguments_and_overfilling() -> None:
    for kwargs in ({"thinning": 0}, {"burnin": -1}, {"max_samples": 1}, {"thinning": 1.5}):
        with pytest.raises(ValueError, match="must be an integer"):
            SampleStore(**kwargs)  # type: ignore[arg-type]
    store = SampleStore(max_samples=2)
    store.add({"w": torch.ones(1)})
    store.add({"w": torch.ones(1)})
    with pytest.raises(ValueError, match="max_samples=2"):
        store.add({"w": torch.ones(1)})


def test_samples_are_copies_on_cpu() -> None:
    store = SampleStore()
    model = Counter()
    store.observe(model)
    with torch.no_grad():
        model.value.add_(5.0)
    assert float(store[0]["value"][0]) == 0.0


def test_posterior_predictive_is_the_mean_of_the_samples_probabilities() -> None:
    g = torch.Generator().manual_seed(0)
    model = build_model("fc", width=8, generator=g)
    x = torch.rand(30, 784, generator=g)
    store = SampleStore(max_samples=5)
    expected = torch.zeros(30, 10, dtype=torch.float64)
    for _ in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.3 * torch.randn(p.shape, generator=g))
        expected += torch.softmax(model(x).double(), dim=-1) / 3
        store.add(model.state_dict())
    final = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    probs = posterior_predictive(model, store, x, batch_size=7)
    torch.testing.assert_close(probs, expected)
    assert model.training  # mode and parameters restored
    assert all(torch.equal(final[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="empty"):
        posterior_predictive(model, SampleStore(), x)


def test_log_density_is_minus_n_times_the_potential() -> None:
    g = torch.Generator().manual_seed(1)
    model = build_model("fc", prior="horseshoe", width=8, generator=g)
    x, y = torch.rand(20, 784, generator=g), torch.arange(20) % 10
    value = log_density(model, x, y, num_data=500)
    torch.testing.assert_close(value, -500 * potential(model, x, y, 500))
    manual = -torch.nn.functional.cross_entropy(model(x), y, reduction="sum") * 500 / 20
    torch.testing.assert_close(value, manual + model.log_prior())
    value.backward()  # differentiable in θ
    assert model.net.fc1.weight.grad is not None
    with pytest.raises(TypeError, match="log_prior"):
        log_density(torch.nn.Linear(784, 10), x, y, 500)


def test_top_level_exports() -> None:
    assert sgrld.SampleStore is SampleStore
    assert sgrld.posterior_predictive is posterior_predictive
    assert sgrld.log_density is log_density


def test_documented_example_trains_and_prints_ensemble_accuracy(
    mnist_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    page = (REPO / "docs" / "usage.md").read_text(encoding="utf-8")
    block = re.search(r"<!-- example: samples -->\n```python\n(.*?)```", page, re.S)
    assert block is not None, "docs/usage.md lost its samples example"
    monkeypatch.setenv("SGRLD_DATA_DIR", str(mnist_dir))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block.group(1), "docs/usage.md", "exec"), {})
    printed = out.getvalue()
    match = re.search(r"(\d+) samples, ensemble test accuracy (0\.\d+)", printed)
    assert match is not None, printed
    assert int(match.group(1)) == 10  # steps 220, 240, ..., 400
    assert float(match.group(2)) > 0.9  # 0.938: 400 steps learn most of MNIST
    assert re.search(r"log p\(θ\|D\) \+ const ≈ -?\d+\.\d", printed), printed


def test_readme_own_model_example_learns_and_reports_its_lp() -> None:
    """The README's one example, which Getting started repeats as the first library loop."""
    blocks = [
        re.search(r"<!-- example: own-model -->\n```python\n(.*?)```", text, re.S)
        for text in (
            (REPO / "README.md").read_text(encoding="utf-8"),
            (REPO / "docs" / "getting-started.md").read_text(encoding="utf-8"),
        )
    ]
    block = blocks[0]
    assert block is not None, "README lost its own-model example"
    assert blocks[1] is not None and blocks[1].group(1) == block.group(1), "the copies differ"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block.group(1), "README.md", "exec"), {})
    match = re.search(
        r"(\d+) samples: held-out log predictive density (-\d\.\d+), accuracy (\S+)", out.getvalue()
    )
    assert match is not None, out.getvalue()
    assert float(match.group(2)) > -1.0  # chance is log(1/3) = -1.10
    assert float(match.group(3)) > 0.5  # chance 0.33


def test_log_predictive_density_is_the_mean_log_of_the_averaged_true_class_probability() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    store = SampleStore(burnin=0, thinning=1, max_samples=5)
    for _ in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        store.observe(model)
    x, y = torch.randn(7, 4), torch.randint(0, 3, (7,))
    probs = posterior_predictive(model, store, x)
    expected = probs[torch.arange(7), y].log().mean().item()
    assert sgrld.log_predictive_density(model, store, x, y) == pytest.approx(expected, rel=1e-12)
    with pytest.raises(ValueError, match="targets must have shape"):
        sgrld.log_predictive_density(model, store, x, y[:3])
