"""`sgrld sample --parallel ddp` under torchrun: one chain over W processes is the 1-process run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sgrld.cli import main
from sgrld.experiments.run.parallel import DataParallel
from sgrld.likelihoods import Gaussian
from sgrld.models import build_model, potential

pytest.importorskip("sklearn")

TINY = ["--width", "16", "--epochs", "6", "--batch-size", "64", "--burn-in", "10"]
TINY += ["--thinning", "2", "--threads", "1", "--no-progress", "--no-plot"]


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
    assert main([*argv, "--parallel", "ddp", "--out", str(tmp_path / "a")]) == 2
    assert "runs under torchrun" in capsys.readouterr().err
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
