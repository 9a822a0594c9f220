"""The cosine-cyclical schedule (cSG-MCMC, issue 14 §3): formula, phases, runner, resume."""

from __future__ import annotations

import io
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import sgrld
from conftest import SamplerSpec
from sgrld.experiments.run.loop import SamplingRun, run_sampling
from sgrld.experiments.run.observers import RunObserver
from sgrld.experiments.run.results import RESULTS_FILE
from test_runner import KillAt, deterministic, synthetic_splits, tiny_config


def _formula(k: int, base: float, total: int, cycles: int) -> float:
    """Zhang et al. 2020 eq. 3, written independently of the library."""
    length = math.ceil(total / cycles)
    return base / 2 * (math.cos(math.pi * ((k - 1) % length) / length) + 1)


@pytest.mark.filterwarnings("ignore:ShampooMetric")  # a vector: Shampoo is SGLD here, as meant
@pytest.mark.parametrize(("total", "cycles", "r"), [(20, 4, 0.25), (23, 3, 0.5), (7, 1, 0.0)])
def test_lr_sequence_and_phases_follow_the_formula(
    spec: SamplerSpec, total: int, cycles: int, r: float
) -> None:
    p = torch.nn.Parameter(torch.linspace(-1, 1, 6, dtype=torch.float64))
    opt = spec.make_optimizer([p], lr=0.2, num_data=50, temperature=0.5)
    sched = sgrld.CyclicalLR(opt, total_steps=total, cycles=cycles, explore_fraction=r)
    length = math.ceil(total / cycles)
    for k in range(1, total + 5):
        group = opt.param_groups[0]
        exploring = ((k - 1) % length) / length < r
        assert group["lr"] == pytest.approx(_formula(k, 0.2, total, cycles), rel=1e-15, abs=0)
        assert sched.exploring == exploring
        assert group["temperature"] == (0.0 if exploring else 0.5)
        p.grad = p.detach() ** 3
        opt.step()
        sched.step()


def test_exploring_steps_draw_no_noise() -> None:
    """τ = 0 in exploration: the move is plain descent and the generator is not advanced."""
    p = torch.nn.Parameter(torch.ones(5, dtype=torch.float64))
    gen = torch.Generator().manual_seed(0)
    opt = sgrld.SGLD([p], lr=0.1, num_data=1, generator=gen)
    sched = sgrld.CyclicalLR(opt, total_steps=10, cycles=2, explore_fraction=0.4)
    for _ in range(2):  # steps 1-2 of 5 explore
        before, state = p.detach().clone(), gen.get_state()
        lr = opt.param_groups[0]["lr"]
        p.grad = before.clone()
        opt.step()
        sched.step()
        assert torch.equal(gen.get_state(), state)
        torch.testing.assert_close(p.detach(), before - lr * before, rtol=0, atol=0)
    state = gen.get_state()
    p.grad = p.detach().clone()
    opt.step()  # step 3 samples
    assert not torch.equal(gen.get_state(), state)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"total_steps": 10, "cycles": 0}, "invalid cycles: 0"),
        ({"total_steps": 10, "cycles": 2.5}, "invalid cycles: 2.5"),
        ({"total_steps": 0, "cycles": 1}, "invalid total_steps: 0"),
        ({"total_steps": 10, "cycles": 2, "explore_fraction": 1.0}, "0 <= r < 1"),
        ({"total_steps": 10, "cycles": 2, "explore_fraction": -0.1}, "0 <= r < 1"),
    ],
)
def test_bad_values_are_refused(kwargs: dict[str, float], message: str) -> None:
    opt = sgrld.SGLD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, num_data=1)
    with pytest.raises(ValueError, match=message):
        sgrld.CyclicalLR(opt, **kwargs)  # type: ignore[arg-type]


def test_state_dict_restores_the_schedule() -> None:
    def make() -> tuple[torch.optim.Optimizer, sgrld.CyclicalLR]:
        opt = sgrld.SGLD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, num_data=1)
        return opt, sgrld.CyclicalLR(opt, total_steps=12, cycles=3, explore_fraction=0.5)

    opt, sched = make()
    for _ in range(5):
        opt.step()
        sched.step()
    buf = io.BytesIO()
    torch.save(sched.state_dict(), buf)
    buf.seek(0)
    opt2, sched2 = make()
    sched2.load_state_dict(torch.load(buf, weights_only=False))
    sched2.step()  # the next step's ℓ and τ are set on the groups
    sched.step()
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert opt2.param_groups[0]["temperature"] == opt.param_groups[0]["temperature"]
    assert sched2.exploring == sched.exploring


# --- in the runner ----------------------------------------------------------------------------


def test_runner_applies_schedule_and_skips_samples_in_exploration() -> None:
    # 10 steps per epoch, 4 epochs, 2 cycles of 20 steps, r = 0.5: steps 1-10 and 21-30 explore.
    config = tiny_config(
        sampler="monge", schedule="cyclical", cycles=2, explore_fraction=0.5, burnin=0, thinning=5
    )
    seen: list[tuple[float, float]] = []  # (ℓ, τ) the groups hold for the next step

    class Record(RunObserver):
        def on_start(self, run: SamplingRun) -> None:
            self.on_step(run)

        def on_step(self, run: SamplingRun) -> None:
            group = run.stepper.optimizer.param_groups[0]
            seen.append((group["lr"], group["temperature"]))

    results = SamplingRun(config, synthetic_splits(), observer=Record()).run()[0]
    seen.pop()  # set for a 41st step
    assert [lr for lr, _ in seen] == pytest.approx(
        [_formula(k, 0.05, 40, 2) for k in range(1, 41)], rel=1e-15
    )
    assert [t for _, t in seen] == [0.0] * 10 + [1.0] * 10 + [0.0] * 10 + [1.0] * 10
    # samples at 15, 20 and 35, 40 only
    assert results["curves"]["num_samples"] == [0, 2, 2, 4]
    assert results["schedule"]["cycle_length"] == 20
    assert results["config"]["schedule"] == "cyclical"


@pytest.mark.parametrize("sampler", ["identity", "monge", "shampoo"])
def test_cyclical_run_resumes_bit_identically(tmp_path: Path, sampler: str) -> None:
    config = tiny_config(sampler=sampler, schedule="cyclical", cycles=3, explore_fraction=0.3)
    splits = synthetic_splits()
    straight = run_sampling(config, splits, tmp_path / "straight")[0]
    killed = tmp_path / "killed"
    with pytest.raises(KeyboardInterrupt):
        run_sampling(config, splits, killed, observer=KillAt(27))
    resumed = run_sampling(config, splits, killed, resume=True)[0]
    assert deterministic(resumed) == deterministic(straight)
    on_disk = json.loads((killed / RESULTS_FILE).read_text())
    assert on_disk["schedule"] == straight["schedule"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"schedule": "cyclical", "cycles": 0}, "invalid cycles"),
        ({"schedule": "cyclical", "explore_fraction": 1.0}, "0 <= r < 1"),
        ({"cycles": 3}, "need schedule 'cyclical'"),
        ({"schedule": "linear"}, "unknown schedule"),
        ({"alpha2_rule": "normalized"}, "alpha2_rule is a Monge option"),
        ({"sampler": "monge", "alpha2": 0.0, "alpha2_rule": "normalized"}, "c = alpha2 > 0"),
    ],
)
def test_run_config_refuses_bad_values(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tiny_config(**overrides)


# --- command line -----------------------------------------------------------------------------

GOOD_CLI = ["sample", "--prior", "horseshoe", "--sampler", "monge", "--lr", "0.1", "--epochs", "1"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--schedule", "cyclical", "--cycles", "0"], "invalid --cycles: 0"),
        (["--schedule", "cyclical", "--explore-fraction", "1"], "invalid --explore-fraction"),
        (["--cycles", "4"], "--cycles and --explore-fraction need --schedule cyclical"),
        (["--alpha2-rule", "normalized", "--alpha2", "0"], "c = alpha2 > 0"),
        (["--sampler", "identity", "--alpha2-rule", "normalized"], "a Monge option"),
    ],
)
def test_cli_refuses_bad_values(
    extra: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from sgrld.cli import main

    out = tmp_path / "out"
    argv = [*GOOD_CLI, "--data-dir", str(tmp_path), "--out", str(out), *extra]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_cli_records_rule_and_schedule(tmp_path: Path, mnist_dir: Path) -> None:
    from sgrld.cli import main

    out = tmp_path / "run"
    argv = [*GOOD_CLI[:-1], "2", "--width", "16", "--subset", "400", "--eval-subset", "100"]
    argv += ["--alpha2-rule", "normalized", "--alpha2", "0.5", "--schedule", "cyclical"]
    argv += ["--cycles", "2", "--explore-fraction", "0.5", "--burn-in", "0", "--thinning", "2"]
    argv += ["--data-dir", str(mnist_dir), "--out", str(out), "--no-progress", "--no-plot"]
    assert main([*argv, "--threads", "1"]) == 0
    results = json.loads((out / "results.json").read_text())
    config = results["config"]
    assert (config["alpha2_rule"], config["alpha2"], config["schedule"]) == (
        "normalized",
        0.5,
        "cyclical",
    )
    assert results["schedule"]["cycle_length"] == 4  # 8 steps, 2 cycles
    assert results["curves"]["num_samples"] == [1, 2]  # 2, 6 explore; 4, 8 sample


def test_a_cyclical_run_cannot_be_extended(tmp_path: Path) -> None:
    """The cycles span all epochs: more epochs would change every step's ℓ."""
    config = tiny_config(epochs=1, schedule="cyclical", cycles=2)
    run_sampling(config, synthetic_splits(), tmp_path)
    with pytest.raises(ValueError, match="epochs: 1 vs 2"):
        run_sampling(replace(config, epochs=2), synthetic_splits(), tmp_path, resume=True)
