"""Multi-chain runs (``sgrld sample --chains K``): each chain is its single run, reported alike."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from sgrld.cli import main
from sgrld.experiments.run.chains import check_chain_configs
from sgrld.experiments.run.checkpoint import load_checkpoint
from sgrld.experiments.run.loop import SamplingRun, run_sampling
from sgrld.experiments.run.naming import chain_label
from test_runner import SAMPLERS, synthetic_splits, tiny_config

SPLITS = synthetic_splits()


def _final_gap(a: dict[str, Any], b: dict[str, Any]) -> float:
    return max(
        abs(a["final"][s][m] - b["final"][s][m])
        for s in ("val", "test")
        for m in ("lp", "accuracy", "ece", "confidence")
    )


def _same_shape(a: Any, b: Any, path: str = "") -> None:
    """Same keys (recursively, dicts) and the same JSON types: the single-run format."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), path
        for key in a:
            _same_shape(a[key], b[key], f"{path}.{key}")
    elif a is not None and b is not None:
        assert type(a) is type(b) or {type(a), type(b)} <= {int, float}, path


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_every_chain_is_its_single_run(sampler: str) -> None:
    """Seeds 0-2 in one process = three single runs: same updates, samples, trace, metrics.

    The metric adapts throughout: frozen after a 5-update warm-up, RMSprop's G⁻¹ from five
    gradients amplifies the float32 differences of vmapped and plain matmuls past these
    tolerances (the warm-up's own equivalence: ``tests/test_warmup.py``)."""
    configs = [
        tiny_config(sampler=sampler, seed=s, lr=0.01, epochs=3, adapt="always") for s in (0, 1, 2)
    ]
    together = SamplingRun(configs, SPLITS).run()
    for config, chain in zip(configs, together, strict=True):
        single = SamplingRun(config, SPLITS).run()[0]
        assert chain["config"] == single["config"]
        assert chain["status"] == single["status"] == "completed"
        assert chain["global_steps"] == single["global_steps"] == 30
        assert chain["num_samples"] == single["num_samples"] > 0
        assert chain["curves"]["num_samples"] == single["curves"]["num_samples"]
        assert _final_gap(chain, single) < 1e-5  # float32: vmapped and plain matmuls differ
        assert set(chain["trace"]["scalars"]) == set(single["trace"]["scalars"]) != set()
        for name, values in single["trace"]["scalars"].items():  # horseshoe scales per sample
            assert chain["trace"]["scalars"][name] == pytest.approx(values, rel=1e-5)
        _same_shape(chain, single)
        assert chain["timing"]["chains_in_process"] == 3
        assert single["timing"]["chains_in_process"] == 1


@pytest.fixture
def float64() -> Any:
    """Models built in float64 (the runner builds in the default dtype) and float64 data."""
    from sgrld.data import Splits

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        fields = ("x_train", "y_train", "x_val", "y_val", "x_test", "y_test")
        tensors = {f: getattr(SPLITS, f) for f in fields}
        yield Splits(**{f: t.double() if t.is_floating_point() else t for f, t in tensors.items()})
    finally:
        torch.set_default_dtype(previous)


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_every_chain_is_its_single_run_in_float64(sampler: str, float64: Any) -> None:
    """The runner's chains against its single runs to 1e-8 relative over 120 updates (Wenzel
    refreshes at each epoch end, Shampoo's roots at update 100): float32's differences are
    rounding, which RMSprop amplifies where second moments are tiny."""
    configs = [tiny_config(sampler=sampler, seed=s, lr=0.05, epochs=12) for s in (0, 1)]
    run = SamplingRun(configs, float64)
    assert next(iter(run.stepper.chains.params.values())).dtype == torch.float64
    results = run.run()
    for k, config in enumerate(configs):
        single = SamplingRun(config, float64)
        (expected,) = single.run()
        pairs = zip(
            run.stepper.chains.module(k).parameters(),
            single.stepper.model.parameters(),
            strict=True,
        )
        for mine, theirs in pairs:
            assert (mine - theirs).abs().max() <= 1e-8 * theirs.abs().max()
        assert _final_gap(results[k], expected) < 1e-8


def test_per_chain_lr_and_alpha2_match_single_runs() -> None:
    configs = [
        tiny_config(sampler="monge", alpha2=a2, lr=lr, seed=s, epochs=2)
        for a2 in (0.5, 2.0)
        for lr in (0.005, 0.02)
        for s in (3, 4)
    ]
    run = SamplingRun(configs, SPLITS)
    assert len(run.stepper.chains.groups) == 2  # one sampler call per α²
    for config, chain in zip(configs, run.run(), strict=True):
        single = SamplingRun(config, SPLITS).run()[0]
        wanted = (config.lr, config.tuned["alpha2"])
        assert (chain["config"]["lr"], chain["config"]["alpha2"]) == wanted
        assert _final_gap(chain, single) < 1e-5


def test_a_broken_chain_is_closed_as_its_single_run_and_the_others_go_on() -> None:
    configs = [tiny_config(seed=0, lr=0.01), tiny_config(seed=1, lr=1e9), tiny_config(seed=2)]
    results = SamplingRun(configs, SPLITS).run()
    broken = SamplingRun(configs[1], SPLITS).run()[0]
    assert broken["status"] == results[1]["status"] == "broken_down"
    for key in ("epoch", "update", "global_step"):
        assert results[1]["broken_down"][key] == broken["broken_down"][key]
    assert results[1]["global_steps"] == broken["global_steps"]
    assert results[1]["num_samples"] == broken["num_samples"]
    assert results[1]["curves"] == broken["curves"]
    assert results[1]["timing"]["steps_all"] == broken["broken_down"]["global_step"]
    for k in (0, 2):
        single = SamplingRun(configs[k], SPLITS).run()[0]
        assert results[k]["status"] == "completed"
        assert _final_gap(results[k], single) < 1e-5


def _without_timing(results: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in results.items() if k not in ("timing", "seconds_per_epoch")}


def test_resume_is_bit_identical(tmp_path: Path) -> None:
    configs = [tiny_config(sampler="wenzel", seed=s, epochs=3) for s in (0, 1)]
    whole = SamplingRun(configs, SPLITS)
    expected = whole.run()
    first = SamplingRun(configs, SPLITS, out_dir=tmp_path)
    first.run(epochs=1)  # as if killed after the first epoch's checkpoint
    del first

    resumed = run_sampling(configs, SPLITS, tmp_path, resume=True)
    for a, b in zip(resumed, expected, strict=True):
        assert _without_timing(a) == _without_timing(b)
    on_disk = json.loads((tmp_path / chain_label(configs[1]) / "results.json").read_text())
    assert _without_timing(on_disk) == _without_timing(expected[1])


def test_resume_refuses_other_chains(tmp_path: Path) -> None:
    from sgrld.experiments.base.files import CheckpointError

    configs = [tiny_config(seed=s, epochs=2) for s in (0, 1)]
    run_sampling(configs, SPLITS, tmp_path)
    other = [tiny_config(seed=s, epochs=2, lr=0.02) for s in (0, 1)]
    with pytest.raises(CheckpointError, match="lr"):
        run_sampling(other, SPLITS, tmp_path, resume=True)


def test_chain_configs_are_checked() -> None:
    with pytest.raises(ValueError, match="differ only in seed, lr and alpha2"):
        check_chain_configs([tiny_config(seed=0), tiny_config(seed=1, width=16)])
    with pytest.raises(ValueError, match="the same run twice"):
        check_chain_configs([tiny_config(seed=0), tiny_config(seed=0)])
    with pytest.raises(ValueError, match="philox"):
        check_chain_configs([tiny_config(seed=s, noise="torch") for s in (0, 1)])
    with pytest.raises(ValueError, match="no chain"):
        check_chain_configs([])


def test_chain_batch_gives_the_same_chains() -> None:
    configs = [tiny_config(sampler="rmsprop", seed=s, epochs=2) for s in range(3)]
    whole = SamplingRun(configs, SPLITS).run()
    split = SamplingRun(configs, SPLITS, chain_batch=2)
    assert len(split.stepper.chains.groups) == 2
    for a, b in zip(split.run(), whole, strict=True):
        assert _final_gap(a, b) < 1e-6


# --- the command line on real MNIST ------------------------------------------------------------


def _argv(mnist_dir: Path, out: Path, *extra: str) -> list[str]:
    return [
        "sample",
        "--dataset", "mnist", "--prior", "horseshoe", "--sampler", "monge",
        "--alpha2", "1.0", "--epochs", "1", "--subset", "2000", "--eval-subset", "1000",
        "--burn-in", "5", "--thinning", "5", "--data-dir", str(mnist_dir),
        "--out", str(out), "--no-plot", "--no-progress", *extra,
    ]  # fmt: skip


def test_cli_chains_match_single_runs_on_real_mnist(tmp_path: Path, mnist_dir: Path) -> None:
    """The issue's acceptance test: ``--chains 3`` = three single runs, final test metrics
    within 1e-4 (float32), each ``results.json`` where ``sgrld table`` finds it."""
    assert main(_argv(mnist_dir, tmp_path / "chains", "--lr", "0.002", "--chains", "3")) == 0
    folders = sorted(p for p in (tmp_path / "chains").iterdir() if p.is_dir())
    assert [p.name[-5:] for p in folders] == ["seed0", "seed1", "seed2"]
    for seed, folder in enumerate(folders):
        single_out = tmp_path / f"single{seed}"
        assert main(_argv(mnist_dir, single_out, "--lr", "0.002", "--seed", str(seed))) == 0
        chain = json.loads((folder / "results.json").read_text())
        single = json.loads((single_out / "results.json").read_text())
        assert chain["config"] == single["config"]
        for metric in ("lp", "accuracy", "ece"):
            assert chain["final"]["test"][metric] == pytest.approx(
                single["final"]["test"][metric], abs=1e-4
            )
    assert main(["table", str(tmp_path / "chains"), "--layout", "long"]) == 0


def test_cli_lr_list_resume_and_refusals(
    tmp_path: Path, mnist_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "grid"
    grid = ("--lr", "0.001,0.002", "--alpha2", "0.5,1", "--seed", "7")
    assert main(_argv(mnist_dir, out, *grid)) == 0
    labels = sorted(p.name for p in out.iterdir() if p.is_dir())
    assert len(labels) == 4 and all(label.endswith("seed7") for label in labels)
    first = {p: (out / p / "results.json").read_bytes() for p in labels}
    assert main(_argv(mnist_dir, out, *grid)) == 2  # holds a run: needs --resume
    assert "already holds a run" in capsys.readouterr().err
    # --resume reads the chains from the checkpoint: other ℓ are refused by flag name.
    assert main(_argv(mnist_dir, out, "--lr", "0.003", "--resume")) == 2
    assert "--lr 0.003 (the run has --lr 0.001,0.002)" in capsys.readouterr().err
    assert main(_argv(mnist_dir, out, "--lr", "0.003,0.002", "--resume")) == 2
    assert "--lr 0.003,0.002 (the run has --lr 0.001,0.002)" in capsys.readouterr().err
    assert main(_argv(mnist_dir, out, *grid, "--resume")) == 0  # completed: unchanged results
    for p in labels:
        again = json.loads((out / p / "results.json").read_bytes())
        assert _without_timing(again) == _without_timing(json.loads(first[p]))
    assert main(_argv(mnist_dir, tmp_path / "t", "--chains", "2", "--noise", "torch")) == 2
    assert "philox" in capsys.readouterr().err
    assert main(_argv(mnist_dir, tmp_path / "z", "--chains", "0")) == 2
    assert "--chains must be >= 1" in capsys.readouterr().err


def test_cli_resume_of_a_killed_run_is_bit_identical(tmp_path: Path, mnist_dir: Path) -> None:
    args = ("--lr", "0.002", "--chains", "2", "--subset", "1000")
    assert main(_argv(mnist_dir, tmp_path / "whole", *args, "--epochs", "2")) == 0
    assert main(_argv(mnist_dir, tmp_path / "cut", *args, "--epochs", "1")) == 0  # "killed"
    assert main(_argv(mnist_dir, tmp_path / "cut", *args, "--epochs", "2", "--resume")) == 0
    for folder in sorted((tmp_path / "whole").iterdir()):
        if folder.is_dir():
            a = json.loads((folder / "results.json").read_text())
            b = json.loads((tmp_path / "cut" / folder.name / "results.json").read_text())
            assert _without_timing(a) == _without_timing(b)
            assert a["epochs_completed"] == 2
    whole = load_checkpoint(tmp_path / "whole" / "checkpoint.pt", chains=True)["chains"]
    cut = load_checkpoint(tmp_path / "cut" / "checkpoint.pt", chains=True)["chains"]
    for kind in ("params", "buffers"):
        for name, value in whole[kind].items():
            assert torch.equal(value, cut[kind][name]), name
    for a, b in zip(whole["samplers"], cut["samplers"], strict=True):
        for name, value in a["stats"].items():
            assert torch.equal(value, b["stats"][name]), name


def test_chain_batch_plan_fits_the_state_and_one_call() -> None:
    from sgrld.experiments.run.chains import plan_chain_batch

    mib = 2**20
    # 100 chains of 10 MiB state leave 1000 MiB; 70 % of it over 50 MiB per chain's step: 14
    assert plan_chain_batch(100, 2000 * mib, 10 * mib, 50 * mib) == 14
    assert plan_chain_batch(4, 2000 * mib, 10 * mib, 1 * mib) == 4  # all fit in one call
    with pytest.raises(MemoryError, match="need 1000 MiB of state"):
        plan_chain_batch(100, 900 * mib, 10 * mib, 1 * mib)
    with pytest.raises(MemoryError, match="one chain's step needs"):
        plan_chain_batch(1, 100 * mib, 10 * mib, 500 * mib)


def test_resume_keeps_the_call_groups_of_the_checkpoint(tmp_path: Path) -> None:
    from sgrld.experiments.base.files import CheckpointError

    configs = [tiny_config(seed=s, epochs=2) for s in range(3)]
    run_sampling(configs, SPLITS, tmp_path, chain_batch=2)
    more = [tiny_config(seed=s, epochs=3) for s in range(3)]
    resumed = run_sampling(more, SPLITS, tmp_path, resume=True)  # no --chain-batch: the saved one
    assert all(r["epochs_completed"] == 3 for r in resumed)
    with pytest.raises(CheckpointError, match="chain_batch 2, not 3"):
        run_sampling(more, SPLITS, tmp_path, resume=True, chain_batch=3)


@pytest.mark.cuda
def test_chain_batch_is_planned_from_measured_memory_on_cuda() -> None:
    configs = [tiny_config(seed=s) for s in range(4)]
    run = SamplingRun(configs, SPLITS, device="cuda")
    assert run.stepper.chain_batch == 4  # tiny chains: all in one call
    assert run.run()[0]["status"] == "completed"


def test_progress_shows_every_chain() -> None:
    import io

    from sgrld.experiments.run.observers import ProgressBar

    stream = io.StringIO()
    configs = [tiny_config(seed=0, epochs=2), tiny_config(seed=1, lr=1e9, epochs=2)]
    SamplingRun(configs, SPLITS, observer=ProgressBar(stream)).run()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2  # one per epoch (not a terminal: no bar)
    assert lines[-1].startswith("epoch 2/2 step 20 | 2 chains: 0 running, 1 completed, 1 broken")
    assert "val LP median [min, max]" in lines[-1] and "s/epoch (all chains)" in lines[-1]
