"""`sgrld sample --parallel ddp|fsdp` under torchrun: one chain over W processes is the 1-process
run (its results, telemetry and checkpoint), and its checkpoint resumes on other W."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sgrld.cli import main
from sgrld.experiments.run.checkpoint import load_checkpoint
from sgrld.experiments.run.parallel import DataParallel, FullyShardedData
from sgrld.likelihoods import Gaussian
from sgrld.models import build_model, potential

pytest.importorskip("sklearn")

TINY = ["--width", "16", "--epochs", "6", "--batch-size", "64", "--burn-in", "10"]
TINY += ["--thinning", "2", "--threads", "1", "--no-progress", "--no-plot"]
#: A sharded chain cannot wait for its arrival (Stan's windows without waiting: docs/posterior.md),
#: so the runs compared with it freeze G at the burn-in's end, as both then do.
FROZEN = ["--adapt", "burnin"]


@pytest.mark.parametrize("world", [2, 3])
def test_the_ranks_potentials_sum_to_the_minibatch_potential(world: int) -> None:
    """Σ_r ∇u_r = ∇u_B, uneven slices included (10 rows over 3 ranks: 4, 3, 3)."""
    torch.manual_seed(0)
    model = build_model("fc", width=8, in_features=5, likelihood=Gaussian(scale=None)).double()
    x, y = torch.randn(10, 5, dtype=torch.float64), torch.randn(10, dtype=torch.float64)
    params = list(model.parameters())
    full = torch.autograd.grad(potential(model, x, y, 300), params)
    total = [torch.zeros_like(p) for p in params]
    for rank in range(world):
        local = DataParallel(rank, world).potential(model, x, y, 300)
        for t, g in zip(total, torch.autograd.grad(local, params), strict=True):
            t += g
    for t, g in zip(total, full, strict=True):
        torch.testing.assert_close(t, g, rtol=1e-12, atol=1e-14)


def test_parallel_outside_torchrun_or_with_chains_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    argv = ["sample", "--dataset", "diabetes", "--sampler", "identity", "--lr", "0.01", *TINY]
    for mode in ("ddp", "fsdp"):
        assert main([*argv, "--parallel", mode, "--out", str(tmp_path / "a")]) == 2
        assert f"--parallel {mode} runs under torchrun" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()  # refused before any file
    assert main([*argv, "--parallel", "ddp", "--chains", "2", "--out", str(tmp_path / "b")]) == 2
    assert "drop --chains" in capsys.readouterr().err
    sweep = ["sweep", "--dataset", "diabetes", "--sampler", "identity", "--lr", "0.01", *TINY]
    assert main([*sweep, "--parallel", "ddp", "--out", str(tmp_path / "c")]) == 2


def _torchrun(world: int, argv: list[str]) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [*command, "-m", "sgrld", *argv], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _final_gap(a: Path, b: Path) -> float:
    ra, rb = (json.loads((p / "results.json").read_text())["final"] for p in (a, b))
    return max(
        abs(ra[s][k] - rb[s][k]) / max(abs(rb[s][k]), 1e-12) for s in ("val", "test") for k in ra[s]
    )


def _telemetry_gap(a: Path, b: Path) -> float:
    """Largest relative gap of the per-epoch telemetry (sums over the whole chain)."""
    ta, tb = (
        json.loads((p / "results.json").read_text())["telemetry"]["per_epoch"] for p in (a, b)
    )
    assert ta.keys() == tb.keys()
    gaps = [
        abs(x - y) / max(abs(y), 1e-12)
        for k in ta
        for x, y in zip(ta[k], tb[k], strict=True)
        if x is not None and y is not None
    ]
    return max(gaps, default=0.0)


def _checkpoint_gap(a: Path, b: Path) -> float:
    """The checkpoints hold the same names, shapes and dtypes; the largest relative gap."""
    ca, cb = (load_checkpoint(p / "checkpoint.pt") for p in (a, b))
    assert ca["model"].keys() == cb["model"].keys()
    pairs = [(ca["model"][k], cb["model"][k], k) for k in cb["model"]]
    sa, sb = ca["optimizer"]["state"], cb["optimizer"]["state"]
    assert sa.keys() == sb.keys()
    for i in sb:
        assert sa[i].keys() == sb[i].keys(), i
        pairs += [(sa[i][k], sb[i][k], f"{i}.{k}") for k in sb[i]]
    gap = 0.0
    for x, y, name in pairs:
        assert x.shape == y.shape and x.dtype == y.dtype, name
        if x.is_floating_point():
            gap = max(gap, float((x - y).abs().max() / y.abs().max().clamp_min(1e-12)))
        else:
            assert torch.equal(x, y), name
    return gap


@pytest.mark.slow
@pytest.mark.parametrize("sampler", ["monge", "shampoo"])
def test_a_two_process_regression_chain_is_the_single_run(tmp_path: Path, sampler: str) -> None:
    argv = ["sample", "--dataset", "diabetes", "--sampler", sampler, "--lr", "0.01", *TINY]
    _torchrun(2, [*argv, "--parallel", "ddp", "--out", str(tmp_path / "ddp")])
    assert main([*argv, "--out", str(tmp_path / "one")]) == 0
    assert _final_gap(tmp_path / "ddp", tmp_path / "one") < 1e-5  # float32 reductions
    assert sorted(p.name for p in (tmp_path / "ddp").iterdir()) == sorted(
        p.name for p in (tmp_path / "one").iterdir()
    )  # rank 0 alone wrote, the same files


@pytest.mark.slow
@pytest.mark.parametrize("sampler", ["identity", "monge"])
def test_a_two_process_mnist_chain_is_the_single_run(
    tmp_path: Path, mnist_dir: Path, sampler: str
) -> None:
    """Measured gap ≤ 1e-8 relative. RMSprop's G frozen from five gradients amplifies the
    float32 order of the gradient sums (test LP 1.7e-5 relative here), as it amplifies the
    vmapped matmuls of ``--chains`` (``tests/test_multichain.py``)."""
    argv = ["sample", "--sampler", sampler, "--lr", "0.05", "--width", "16", "--epochs", "2"]
    argv += ["--subset", "1000", "--eval-subset", "500", "--burn-in", "5", "--thinning", "5"]
    argv += ["--threads", "1", "--no-progress", "--no-plot", "--data-dir", str(mnist_dir)]
    _torchrun(2, [*argv, "--parallel", "ddp", "--out", str(tmp_path / "ddp")])
    assert main([*argv, "--out", str(tmp_path / "one")]) == 0
    assert _final_gap(tmp_path / "ddp", tmp_path / "one") < 1e-5


def test_batch_norm_under_ddp_needs_cuda_for_the_single_runs_statistics() -> None:
    fc = build_model("fc", width=8)
    assert DataParallel(0, 2).synchronise_batch_norm(fc) is fc  # no BatchNorm: as it is
    with pytest.raises(ValueError, match="needs CUDA \\(SyncBatchNorm\\)"):
        DataParallel(0, 2).synchronise_batch_norm(build_model("resnet20", prior="gaussian"))


@pytest.mark.slow
def test_a_resumed_two_process_run_is_the_uninterrupted_single_run(tmp_path: Path) -> None:
    """Rank 0's checkpoint, read by every rank: 3 epochs, then --resume to 6 under torchrun,
    equal to 6 epochs in one process (a killed rank's job resumes the same way: the note of
    ``docs/experiments.md``)."""
    argv = ["sample", "--dataset", "diabetes", "--sampler", "monge", "--lr", "0.01", *TINY]
    short = [a if a != "6" else "3" for a in argv]  # --epochs 3
    _torchrun(2, [*short, "--parallel", "ddp", "--out", str(tmp_path / "ddp")])
    resume = ["sample", "--resume", "--epochs", "6", "--parallel", "ddp", "--threads", "1"]
    _torchrun(2, [*resume, "--no-progress", "--no-plot", "--out", str(tmp_path / "ddp")])
    assert main([*argv, "--out", str(tmp_path / "one")]) == 0
    done = json.loads((tmp_path / "ddp" / "results.json").read_text())
    assert done["status"] == "completed" and done["epochs_completed"] == 6
    assert _final_gap(tmp_path / "ddp", tmp_path / "one") < 1e-5


# --- fsdp -----------------------------------------------------------------------------------


def test_a_two_process_fsdp_chain_is_the_single_run(tmp_path: Path) -> None:
    """Monge with the Gaussian likelihood's learned σ (a 0-d parameter, held by rank 0 as one
    row): results, telemetry (sums over the shards, summed over the ranks) and the checkpoint
    (whole tensors in the single run's names and shapes) are the single run's. Measured:
    results 2.2e-9, checkpoint 6.4e-8 relative (float32). Both freeze G at the burn-in's end:
    sharded, the default warm-up cannot wait for the chain (``docs/posterior.md``)."""
    argv = ["sample", "--dataset", "diabetes", "--sampler", "monge", "--lr", "0.01", *TINY]
    argv += FROZEN
    _torchrun(2, [*argv, "--parallel", "fsdp", "--out", str(tmp_path / "fsdp")])
    assert main([*argv, "--out", str(tmp_path / "one")]) == 0
    assert _final_gap(tmp_path / "fsdp", tmp_path / "one") < 1e-5
    assert _telemetry_gap(tmp_path / "fsdp", tmp_path / "one") < 1e-5
    assert _checkpoint_gap(tmp_path / "fsdp", tmp_path / "one") < 1e-5
    assert sorted(p.name for p in (tmp_path / "fsdp").iterdir()) == sorted(
        p.name for p in (tmp_path / "one").iterdir()
    )


@pytest.mark.slow
@pytest.mark.parametrize("sampler", ["identity", "rmsprop", "wenzel", "adam"])
def test_a_three_process_fsdp_horseshoe_chain_is_the_single_run(
    tmp_path: Path, sampler: str
) -> None:
    """W = 3 (uneven shards; the 0-d horseshoe scales and σ on rank 0, empty elsewhere).
    RMSprop and Adam, whose G is frozen from few gradients, amplify the float32 order of the
    gradient sums: final scores 1.4e-6 / 1.3e-6, telemetry 5.5e-5 / 1.9e-5 (RMSprop under DDP,
    the same run: 8.7e-7 and 3.5e-5); Identity and Wenzel 4.1e-9 / 1.8e-9, telemetry ≤ 8e-8."""
    argv = ["sample", "--dataset", "diabetes", "--sampler", sampler, "--lr", "0.01", *TINY]
    argv += ["--prior", "horseshoe", *FROZEN]
    _torchrun(3, [*argv, "--parallel", "fsdp", "--out", str(tmp_path / "fsdp")])
    assert main([*argv, "--out", str(tmp_path / "one")]) == 0
    assert _final_gap(tmp_path / "fsdp", tmp_path / "one") < 1e-5
    amplified = sampler in ("rmsprop", "adam")
    assert _telemetry_gap(tmp_path / "fsdp", tmp_path / "one") < (1e-4 if amplified else 1e-6)


def _torchrun_fails(world: int, argv: list[str]) -> str:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [*command, "-m", "sgrld", *argv], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode != 0
    return done.stderr


@pytest.mark.slow
def test_fsdp_shampoo_is_the_single_run_with_the_same_row_shards(tmp_path: Path) -> None:
    """A shard's blocks never cross its rows, so W-process Shampoo is the one-process run with
    ``row_shards=W`` (measured 1.1e-8); its factors resume on the same W (bit-identical to
    never stopping) and are refused, with the way out, on another W and in one process."""
    argv = ["sample", "--dataset", "diabetes", "--sampler", "shampoo", "--lr", "0.01", *TINY]
    argv += FROZEN
    _torchrun(2, [*argv, "--parallel", "fsdp", "--out", str(tmp_path / "fsdp")])
    assert main([*argv, "--option", "row_shards=2", "--out", str(tmp_path / "one")]) == 0
    assert _final_gap(tmp_path / "fsdp", tmp_path / "one") < 1e-5
    short = [a if a != "6" else "3" for a in argv]  # --epochs 3
    _torchrun(2, [*short, "--parallel", "fsdp", "--out", str(tmp_path / "short")])
    resume = ["sample", "--resume", "--epochs", "6", "--threads", "1", "--no-progress"]
    resume += ["--no-plot", "--out", str(tmp_path / "short")]
    way_out = "resume it with torchrun --nproc-per-node 2 … --parallel fsdp"
    assert way_out in _torchrun_fails(3, [*resume, "--parallel", "fsdp"])
    assert main(resume) == 2
    _torchrun(2, [*resume, "--parallel", "fsdp"])
    assert _final_gap(tmp_path / "short", tmp_path / "fsdp") == 0.0
    assert _checkpoint_gap(tmp_path / "short", tmp_path / "fsdp") == 0.0  # every tensor


@pytest.mark.slow
def test_an_fsdp_checkpoint_resumes_in_one_process_and_on_three(tmp_path: Path) -> None:
    """3 epochs on 2 processes; the same checkpoint continued to 6 in one process and on 3
    processes: both the uninterrupted single run (the checkpoint holds whole tensors)."""
    argv = ["sample", "--dataset", "diabetes", "--sampler", "monge", "--lr", "0.01", *TINY]
    argv += ["--prior", "horseshoe", *FROZEN]
    short = [a if a != "6" else "3" for a in argv]
    _torchrun(2, [*short, "--parallel", "fsdp", "--out", str(tmp_path / "two")])
    shutil.copytree(tmp_path / "two", tmp_path / "three")
    resume = ["sample", "--resume", "--epochs", "6", "--threads", "1", "--no-progress"]
    resume += ["--no-plot"]
    assert main([*resume, "--out", str(tmp_path / "two")]) == 0
    _torchrun(3, [*resume, "--parallel", "fsdp", "--out", str(tmp_path / "three")])
    assert main([*argv, "--out", str(tmp_path / "one")]) == 0
    for resumed in ("two", "three"):
        assert _final_gap(tmp_path / resumed, tmp_path / "one") < 1e-5


@pytest.mark.slow
def test_a_default_fsdp_checkpoint_resumes_in_one_process_as_it_was_made(tmp_path: Path) -> None:
    """The default warm-up (``wait``) cannot wait when sharded: the checkpoint has Stan's fixed
    windows and no arrival test, and one process resumes it so (it was refused: "missing
    warmup_sums"), the uninterrupted two-process run."""
    argv = ["sample", "--dataset", "diabetes", "--sampler", "rmsprop", "--lr", "0.01", *TINY]
    short = [a if a != "6" else "3" for a in argv]
    _torchrun(2, [*short, "--parallel", "fsdp", "--out", str(tmp_path / "short")])
    resume = ["sample", "--resume", "--epochs", "6", "--threads", "1", "--no-progress"]
    assert main([*resume, "--no-plot", "--out", str(tmp_path / "short")]) == 0
    _torchrun(2, [*argv, "--parallel", "fsdp", "--out", str(tmp_path / "whole")])
    assert _final_gap(tmp_path / "short", tmp_path / "whole") < 1e-5


@pytest.mark.slow
def test_a_two_process_fsdp_mnist_chain_is_the_single_run(tmp_path: Path, mnist_dir: Path) -> None:
    argv = ["sample", "--sampler", "monge", "--lr", "0.05", "--width", "16", "--epochs", "2"]
    argv += ["--subset", "1000", "--eval-subset", "500", "--burn-in", "5", "--thinning", "5"]
    argv += ["--threads", "1", "--no-progress", "--no-plot", "--data-dir", str(mnist_dir)]
    argv += FROZEN
    _torchrun(2, [*argv, "--parallel", "fsdp", "--out", str(tmp_path / "fsdp")])
    assert main([*argv, "--out", str(tmp_path / "one")]) == 0
    assert _final_gap(tmp_path / "fsdp", tmp_path / "one") < 1e-5


def test_curvature_under_fsdp_is_refused_with_the_reason() -> None:
    from sgrld.data import load_dataset
    from sgrld.experiments.run.config import RunConfig
    from sgrld.experiments.run.loop import SamplingRun

    config = RunConfig.from_dict(
        {"dataset": "diabetes", "model": "fc", "prior": "gaussian", "sampler": "identity",
         "lr": 0.01, "epochs": 1, "width": 8, "curvature": True, "num_val": 44,
         "burnin": 1, "thinning": 1}
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"--curvature .*--parallel fsdp"):
        SamplingRun(config, load_dataset("diabetes"), parallel=FullyShardedData(0, 2))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_each_rank_evaluates_tensor_splits_slice_of_the_points(world: int) -> None:
    """The evaluation's slices are the minibatch's (``tensor_split``): contiguous, in rank
    order, covering every point once, empty ones included (n < W)."""
    for n in (0, 1, 2, 5, 44, 88):
        slices = [DataParallel(r, world).rows(n) for r in range(world)]
        expect = [s.tolist() for s in torch.tensor_split(torch.arange(n), world)]
        assert [list(s) for s in slices] == expect
