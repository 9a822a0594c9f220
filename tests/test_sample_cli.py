"""``sgrld sample`` and ``sgrld table``: end to end, bad input, aggregation."""

from __future__ import annotations

import csv
import io
import json
import pickle
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import sgrld.data
from sgrld.cli import main
from sgrld.experiments.report.tables import aggregate, csv_table, markdown_paper_layout

# --- end to end -------------------------------------------------------------------------------


def test_real_mnist_subset_end_to_end(tmp_path: Path, mnist_dir: Path) -> None:
    out = tmp_path / "run"
    argv = ["sample", "--dataset", "mnist", "--model", "fc", "--width", "32"]
    argv += ["--prior", "horseshoe", "--sampler", "monge", "--lr", "0.1", "--alpha2", "0.5"]
    argv += ["--epochs", "2", "--seed", "1", "--subset", "2000", "--eval-subset", "500"]
    argv += ["--burn-in", "10", "--thinning", "5", "--data-dir", str(mnist_dir)]
    argv += ["--out", str(out), "--no-progress", "--threads", "1"]
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["status"] == "completed"
    assert results["config"]["alpha2"] == 0.5 and results["seed"] == 1
    assert results["num_data"] == 2000 and results["steps_per_epoch"] == 20
    assert results["curves"]["num_samples"] == [2, 6]  # samples after updates 15, 20, ..., 40
    assert results["final"]["test"]["accuracy"] > 0.5  # learns something in 40 steps
    assert (out / "curves.png").stat().st_size > 10_000
    assert main(argv) == 2  # the directory holds a run now: refused without --resume


def write_cifar_archive(root: Path, per_batch: int = 24) -> None:
    """Official CIFAR-10 python layout (protocol-2 pickles) in cifar-10-python.tar.gz."""
    rng = np.random.default_rng(0)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for k, name in enumerate(names):
        batch = {
            b"batch_label": b"synthetic",
            b"labels": [(k * per_batch + i) % 10 for i in range(per_batch)],
            b"data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
            b"filenames": [f"{name}_{i}.png".encode() for i in range(per_batch)],
        }
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))
    (folder / "batches.meta").write_bytes(pickle.dumps({b"num_cases_per_batch": per_batch}, 2))
    with tarfile.open(root / "cifar-10-python.tar.gz", "w:gz") as tar:
        tar.add(folder, arcname="cifar-10-batches-py")
    for path in folder.iterdir():
        path.unlink()
    folder.rmdir()


def test_cifar10_resnet20_end_to_end_and_resume(tmp_path: Path) -> None:
    write_cifar_archive(tmp_path / "data" / "cifar10")
    base = ["sample", "--dataset", "cifar10", "--prior", "correlated", "--sampler", "shampoo"]
    base += ["--data-dir", str(tmp_path / "data"), "--no-verify", "--num-val", "20"]
    base += ["--batch-size", "25", "--burn-in", "2", "--thinning", "2", "--no-progress"]
    base += ["--eval-batch-size", "10", "--no-plot"]
    assert main([*base, "--epochs", "2", "--out", str(tmp_path / "a")]) == 0
    a = json.loads((tmp_path / "a" / "results.json").read_text())
    assert a["config"]["model"] == "resnet20" and a["config"]["lr"] == 0.01  # paper's ℓ
    assert a["num_data"] == 100 and a["steps_per_epoch"] == 4
    assert a["num_samples"] == 3
    assert a["final"]["test"]["lp"] < 0.0 and 0.0 <= a["final"]["test"]["accuracy"] <= 1.0
    # Extend to 3 epochs with --resume: identical to a straight 3-epoch run.
    assert main([*base, "--epochs", "3", "--out", str(tmp_path / "a"), "--resume"]) == 0
    assert main([*base, "--epochs", "3", "--out", str(tmp_path / "b")]) == 0
    a, b = (json.loads((tmp_path / d / "results.json").read_text()) for d in "ab")
    assert a["curves"] == b["curves"] and a["final"] == b["final"]
    # The table of real run directories, long layout, with the convergence plot.
    plot = tmp_path / "convergence.png"
    argv = ["table", str(tmp_path / "a"), str(tmp_path / "b"), "--layout", "long"]
    assert main([*argv, "--plot", str(plot)]) == 0
    assert plot.stat().st_size > 10_000
    # Curvature through the eval-mode ResNet (costly: one sample only). The metric adapts
    # throughout: frozen after a 3-update warm-up, Shampoo's roots from three gradients (ε = 1e-8)
    # stretch the step enough to saturate the softmax, whose curvature is then 0.
    argv = [*base, "--epochs", "1", "--burn-in", "3", "--thinning", "4", "--curvature"]
    argv += ["--adapt", "always"]
    assert main([*argv, "--curvature-points", "4", "--out", str(tmp_path / "c")]) == 0
    c = json.loads((tmp_path / "c" / "results.json").read_text())
    assert c["curvature"]["num_samples"] == 1 and c["curvature"]["mean"] > 0


# --- bad input --------------------------------------------------------------------------------

GOOD = ["sample", "--dataset", "mnist", "--prior", "horseshoe", "--sampler", "identity"]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--lr", "0"], "--lr must be a finite number > 0"),
        (["--lr", "-0.5"], "--lr must be"),
        (["--width", "0"], "--width must be an integer >= 1"),
        (["--epochs", "0"], "--epochs must be an integer >= 1"),
        (["--seed", "-1"], "--seed must be"),
        (["--subset", "0"], "--subset must be"),
        (["--alpha2", "1.0"], "--alpha2 is a Monge option"),
        (["--model", "resnet20"], "does not fit dataset"),
        (["--threads", "0"], "--threads must be >= 1"),
        (["--device", "tpu9"], "--device"),
        (["--data-dir", "/nonexistent/sgrld-data"], "data directory /nonexistent"),
    ],
)
def test_bad_input_exits_before_any_work(
    extra: list[str],
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def no_work(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("data were loaded")

    monkeypatch.setattr(sgrld.data, "load_dataset", no_work)
    monkeypatch.setenv("SGRLD_DATA_DIR", str(tmp_path))
    out = tmp_path / "out"
    assert main([*GOOD, "--out", str(out), *extra]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["sample", "--sampler", "sgdl"],
        ["sample", "--sampler", "identity", "--dataset", "imagenet"],
        ["sample", "--sampler", "identity", "--prior", "laplace"],
        ["sample", "--sampler", "identity", "--lr", "fast"],
        ["sample", "--sampler", "identity", "--width", "1.5"],
        ["sample", "--sampler", "identity", "--noise", "numpy"],
    ],
)
def test_unknown_names_are_argparse_errors(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_missing_data_dir_and_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("SGRLD_DATA_DIR", raising=False)
    assert main([*GOOD, "--out", str(tmp_path / "o")]) == 2
    assert "give --data-dir or set SGRLD_DATA_DIR" in capsys.readouterr().err
    # An existing but empty directory: the data module's message says what to put where.
    assert main([*GOOD, "--out", str(tmp_path / "o"), "--data-dir", str(tmp_path)]) == 2
    assert "train-images-idx3-ubyte.gz" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_monge_without_paper_lr_needs_one(capsys: pytest.CaptureFixture[str]) -> None:
    # Gaussian N = 400: the paper found α² = 0 (Identity) optimal, so there is no Monge ℓ.
    argv = ["sample", "--prior", "gaussian", "--sampler", "monge", "--data-dir", "."]
    assert main(argv) == 2
    assert "give --lr" in capsys.readouterr().err


def test_resume_with_other_options_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    from sgrld.data import Splits
    from sgrld.experiments.run.config import RunConfig
    from sgrld.experiments.run.loop import run_sampling

    x, y = torch.rand(100, 784), torch.arange(100) % 10
    splits = Splits(x_train=x, y_train=y, x_val=x, y_val=y, x_test=x, y_test=y)
    config = RunConfig(
        dataset="mnist",
        model="fc",
        prior="horseshoe",
        sampler="identity",
        lr=0.05,
        epochs=1,
        width=8,
        burnin=0,  # a run must collect a sample
        thinning=1,
    )
    run_sampling(config, splits, tmp_path / "run")
    argv = ["sample", "--sampler", "identity", "--prior", "horseshoe", "--width", "8"]
    argv += ["--lr", "0.1", "--epochs", "3", "--data-dir", str(tmp_path)]
    argv += ["--out", str(tmp_path / "run"), "--resume"]
    assert main(argv) == 2
    assert "cannot resume" in capsys.readouterr().err


# --- table ------------------------------------------------------------------------------------


def fake_results(
    prior: str, sampler: str, lr: float, seed: int, test_lp: float, val_lp: float, **kw: Any
) -> dict[str, Any]:
    config = {
        "dataset": "mnist",
        "model": "fc",
        "prior": prior,
        "sampler": sampler,
        "lr": lr,
        "epochs": 10,
        "seed": seed,
        "width": 400,
        "alpha2": 1.25 if sampler == "monge" else None,
    }
    metrics = {"lp": test_lp, "accuracy": 0.98 + 0.001 * seed, "ece": 0.01, "confidence": 0.9}
    return {
        "format": "sgrld-sample-results/1",
        "config": config,
        "seed": seed,
        "status": kw.get("status", "completed"),
        "final": {"val": {**metrics, "lp": val_lp}, "test": metrics},
        "seconds_per_epoch": 4.0 + seed,
        "curvature": None,
        "num_samples": 40,
    }


def write_runs(root: Path, runs: list[dict[str, Any]]) -> None:
    for i, results in enumerate(runs):
        (root / f"run{i}").mkdir(parents=True)
        (root / f"run{i}" / "results.json").write_text(json.dumps(results))


def test_table_mean_std_ddof0_selection_and_failures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = [
        fake_results("horseshoe", "identity", 0.25, s, lp, -0.08)
        for s, lp in enumerate([-0.07, -0.08, -0.09])
    ]
    # Two ℓ for Monge: 0.5 has the better validation LP and is selected.
    runs += [fake_results("horseshoe", "monge", 0.25, s, -0.06, -0.075) for s in range(2)]
    runs += [fake_results("horseshoe", "monge", 0.5, s, -0.065, -0.07) for s in range(2)]
    # Shampoo's better validation ℓ has a broken run: never selected.
    runs += [fake_results("horseshoe", "shampoo", 0.005, 0, -0.05, -0.05)]
    runs += [fake_results("horseshoe", "shampoo", 0.005, 1, -0.05, -0.05, status="broken_down")]
    runs += [fake_results("horseshoe", "shampoo", 0.0025, 0, -0.062, -0.09)]
    runs += [fake_results("gaussian", "identity", 0.05, 0, -0.13, -0.13)]
    runs += [fake_results("gaussian", "rmsprop", 0.00025, 0, -0.12, -0.12, status="broken_down")]
    runs += [fake_results("gaussian", "rmsprop", 0.00025, 1, -0.11, -0.12, status="running")]
    write_runs(tmp_path / "runs", runs)

    csv_path, md_path = tmp_path / "t.csv", tmp_path / "t.md"
    argv = ["table", str(tmp_path / "runs"), "--csv", str(csv_path), "--markdown", str(md_path)]
    assert main([*argv, "--paper"]) == 0
    captured = capsys.readouterr()
    assert "skipping unfinished run" in captured.err
    markdown = captured.out
    assert md_path.read_text() == markdown

    rows = list(csv.DictReader(io.StringIO(csv_path.read_text())))
    identity = next(r for r in rows if r["sampler"] == "identity" and r["prior"] == "horseshoe")
    assert identity["runs"] == "3" and identity["seeds"] == "0 1 2"
    assert float(identity["test_lp_mean"]) == pytest.approx(-0.08)
    assert float(identity["test_lp_std"]) == pytest.approx(np.std([-0.07, -0.08, -0.09]))
    assert float(identity["test_lp_std"]) == pytest.approx(np.sqrt(2 / 3) * 0.01)  # ddof = 0
    assert float(identity["seconds_per_epoch_mean"]) == pytest.approx(5.0)

    lines = {line.split("|")[1].strip(): line for line in markdown.splitlines() if "|" in line}
    monge_cells = [c.strip() for c in lines["Monge"].split("|")[1:-1]]
    assert "0.5, α² 1.25" in monge_cells  # the better validation LP
    assert "-0.0650 (0.0000)" in monge_cells
    shampoo_cells = [c.strip() for c in lines["Shampoo"].split("|")[1:-1]]
    assert "0.0025" in shampoo_cells
    rmsprop_cells = [c.strip() for c in lines["RMSprop"].split("|")[1:-1]]
    assert "broke down (1/1 runs)" in rmsprop_cells
    assert "**-0.0620**" in shampoo_cells  # best test LP among HS selections; one run: no spread
    assert "-0.0629" in lines["Monge"]  # --paper: Table 1's value beside ours


def test_table_functions_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    groups = aggregate(
        [fake_results("gaussian", "wenzel", 0.075, s, -0.1 - s, -0.1) for s in (0, 1)]
    )
    assert len(groups) == 1 and groups[0].stat("test_lp") == pytest.approx((-0.6, 0.5))
    assert "Wenzel" in markdown_paper_layout(groups)
    assert csv_table(groups).splitlines()[1].startswith("mnist,fc,gaussian,wenzel,0.075,10,400,")
    assert main(["table", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["table", str(tmp_path / "empty")]) == 2
    assert "no results.json" in capsys.readouterr().err
