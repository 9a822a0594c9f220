"""What a new user meets first: names, help texts, the version, messages for common slips."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

import sgrld
from sgrld.cli import build_parser, main


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _default_shown(action: argparse.Action) -> bool:
    text = action.help or ""
    default = action.default
    forms = {str(default)}
    if isinstance(default, (int, float)):
        forms |= {f"{default:g}", f"{default:,}"}
    return "default" in text or any(form in text for form in forms)


@pytest.mark.parametrize("command", sorted(_subparsers()))
def test_every_option_with_a_default_shows_it_in_help(command: str) -> None:
    missing = []
    for action in _subparsers()[command]._actions:
        default = action.default
        if not action.option_strings or action.help == argparse.SUPPRESS:
            continue
        if default is None or isinstance(default, bool) or default == argparse.SUPPRESS:
            continue
        if isinstance(action, argparse._StoreConstAction):
            continue
        if not _default_shown(action):
            missing.append(f"{action.option_strings[0]} (default {default!r})")
    assert not missing, f"sgrld {command}: help hides the default of " + ", ".join(missing)


@pytest.mark.parametrize(
    ("alias", "name"),
    [("sgld", "identity"), ("SGLD", "identity"), ("pSGLD", "rmsprop"), ("MongeSGLD", "monge")],
)
def test_sampler_aliases_in_build_and_on_the_command_line(alias: str, name: str) -> None:
    assert sgrld.build(alias, lr=0.1, num_data=10).metric.name == name
    args = build_parser().parse_args(["sample", "--sampler", alias])
    assert args.sampler == name


def test_unknown_sampler_suggests_the_closest_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="did you mean 'monge'"):
        sgrld.build("mong", lr=0.1, num_data=10)
    with pytest.raises(SystemExit) as exit_info:
        main(["sample", "--sampler", "mnoge"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --sampler" in err and "did you mean 'monge'" in err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"sgrld {sgrld.__version__} (torch ")


def test_device_gpu_is_one_line_that_names_cuda(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["sample", "--sampler", "sgld", "--device", "gpu", "--data-dir", str(tmp_path)]
    assert main([*argv, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "sgrld sample: error: --device 'gpu' is not a device: give cpu, cuda or cuda:K "
        "(a GPU is cuda here)"
    )


def test_single_and_chained_runs_label_folders_as_a_sweep_does() -> None:
    from sgrld.experiments.commands.options import configs_from_args
    from sgrld.experiments.run.naming import chain_label, run_label

    args = build_parser().parse_args(
        ["sample", "--sampler", "monge", "--lr", "0.25", "--alpha2", "1.25", "--chains", "2"]
    )
    for config in configs_from_args(args):
        assert chain_label(config).endswith("-" + run_label(config.to_dict()))


def test_summary_of_a_run_shorter_than_the_warm_up_gives_no_rate() -> None:
    from sgrld.experiments.run.launch import speed_text

    timing = {"steps_all": 8, "steps_after_skip": 0, "seconds_per_epoch_basis": "estimated ..."}
    timing["sampling_seconds"] = [1.5, 2.0]
    text = speed_text({"timing": timing, "seconds_per_epoch": 12.5})
    assert text.startswith("s/epoch not measured: all 8 updates fall in the first 1000")
    assert text.endswith("sampling took 3.5 s in all")
    timing = {"steps_all": 2000, "steps_after_skip": 1000, "seconds_per_epoch_basis": "mean"}
    assert speed_text({"timing": timing, "seconds_per_epoch": 1.25}) == "1.2500 s/epoch"


def test_curves_of_a_run_broken_down_before_its_first_sample_say_so() -> None:
    from sgrld.experiments.run.plots import run_curves_figure

    nan = float("nan")
    curves = {f"{s}_{m}": [nan] for s in ("val", "test") for m in ("lp", "accuracy", "ece")}
    results = {
        "curves": {"epoch": [0], **curves},
        "timing": {"sampling_seconds": [0.1]},
        "config": {"dataset": "mnist", "model": "fc", "prior": "gaussian", "sampler": "identity"}
        | {"lr": 1.0, "seed": 0},
        "status": "broken_down",
        "num_samples": 0,
        "broken_down": {"update": 8, "epoch": 0, "reason": "non-finite potential"},
    }
    fig = run_curves_figure(results)
    texts = [ax.texts[0].get_text() for ax in fig.axes[:3]]
    assert all("broke down\nat update 8" in t for t in texts)


# --- resume reads the run's options ----------------------------------------------------------


def _small_run(mnist_dir: Path, out: Path, *extra: str) -> list[str]:
    argv = ["sample", "--prior", "horseshoe", "--sampler", "monge", "--lr", "0.1", "--alpha2"]
    argv += ["0.5", "--width", "8", "--subset", "300", "--eval-subset", "50", "--burn-in", "0"]
    argv += ["--thinning", "1", "--data-dir", str(mnist_dir), "--out", str(out), "--no-progress"]
    argv += ["--no-verify"]
    if "--chains" not in extra:
        argv += ["--noise", "torch"]  # no kernel to compile; chains need philox
    return [*argv, "--no-plot", "--threads", "1", *extra]


def test_resume_reads_the_runs_options_and_refuses_other_flags_by_name(
    mnist_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    out = tmp_path / "run"
    assert main(_small_run(mnist_dir, out, "--epochs", "1")) == 0
    capsys.readouterr()
    # Only --resume, --out and a larger --epochs: every other option comes from the checkpoint.
    base = ["sample", "--resume", "--out", str(out), "--data-dir", str(mnist_dir)]
    quiet = ["--no-progress", "--no-plot", "--threads", "1", "--no-verify"]
    assert main([*base, "--epochs", "2", *quiet]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["epochs_completed"] == 2 and results["config"]["prior"] == "horseshoe"
    assert results["config"]["max_train"] == 300 and results["config"]["alpha2"] == 0.5
    capsys.readouterr()
    # Flags that disagree are named as flags, with the fix.
    assert main([*base, "--prior", "gaussian", "--subset", "200", "--lr", "0.2", *quiet]) == 2
    err = capsys.readouterr().err
    assert "--prior gaussian (the run has --prior horseshoe)" in err
    assert "--subset 200 (the run has --subset 300)" in err
    assert "--lr 0.2 (the run has --lr 0.1)" in err
    assert "drop these flags, or choose another --out" in err
    assert "max_train" not in err and "burnin" not in err
    # Flags that agree are fine.
    assert main([*base, "--sampler", "monge", "--prior", "horseshoe", *quiet]) == 0


def test_held_out_dir_advice_fits_the_runs_state(
    mnist_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    done = tmp_path / "done"
    assert main(_small_run(mnist_dir, done, "--epochs", "1")) == 0
    capsys.readouterr()
    assert main(_small_run(mnist_dir, done, "--epochs", "1")) == 2
    assert "holds a completed run; pass --resume with a larger --epochs" in capsys.readouterr().err
    broken = tmp_path / "broken"
    argv = _small_run(mnist_dir, broken, "--epochs", "1")
    argv[argv.index("0.1")] = "1e9"
    assert main(argv) == 3
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "holds a run that broke down" in err and "cannot be continued" in err
    assert "pass --resume" not in err


def test_sample_without_sampler_says_what_is_missing(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sample", "--dataset", "mnist"]) == 2
    assert "--sampler is required" in capsys.readouterr().err


@pytest.mark.slow
def test_the_documented_first_run_learns(
    mnist_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json
    import re
    import shlex

    docs = (Path(__file__).resolve().parents[1] / "docs" / "experiments.md").read_text("utf-8")
    block = re.search(r"## A first run\n.*?```bash\n(.*?)```", docs, re.S)
    assert block is not None, "docs/experiments.md lost its first run"
    argv = shlex.split(block.group(1).replace("\\\n", " "))
    assert argv[:2] == ["sgrld", "sample"]
    argv = [str(mnist_dir) if a == "DIR" else a for a in argv[1:]]
    argv[argv.index("runs/first")] = str(tmp_path / "first")
    assert main([*argv, "--no-progress", "--no-plot"]) == 0
    results = json.loads((tmp_path / "first" / "results.json").read_text())
    assert results["num_samples"] == 10
    assert results["final"]["test"]["accuracy"] > 0.94  # 0.957 measured


@pytest.mark.slow
def test_resume_of_a_multi_chain_run_reads_its_chains(
    mnist_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    out = tmp_path / "chains"
    argv = _small_run(mnist_dir, out, "--epochs", "1", "--chains", "2")
    argv[argv.index("0.1")] = "0.1,0.2"
    assert main(argv) == 0
    capsys.readouterr()
    base = ["sample", "--resume", "--out", str(out), "--data-dir", str(mnist_dir), "--no-plot"]
    assert main([*base, "--epochs", "2", "--no-progress", "--threads", "1"]) == 0
    folders = sorted(p for p in out.iterdir() if p.is_dir())
    assert len(folders) == 4
    for folder in folders:
        assert json.loads((folder / "results.json").read_text())["epochs_completed"] == 2
    assert main([*base, "--chains", "3", "--no-progress"]) == 2
    assert "--chains 3 (the run has --chains 2)" in capsys.readouterr().err


@pytest.mark.parametrize("command", sorted(_subparsers()))
def test_every_option_is_described_in_words(command: str) -> None:
    """Not by one word (``--adapt`` once read "adapt")."""
    terse = [
        action.option_strings[0]
        for action in _subparsers()[command]._actions
        if action.option_strings
        and action.help != argparse.SUPPRESS
        and len((action.help or "").split()) < 2
    ]
    assert not terse, f"sgrld {command}: options without a description: {terse}"
    epochs = next((a for a in _subparsers()[command]._actions if a.dest == "epochs"), None)
    if epochs is not None and command == "sample":
        assert epochs.help is not None and "default 400" in epochs.help


@pytest.mark.parametrize(
    ("command", "hint"),
    [("sweep", "rerun the same command to resume"), ("sample", "sgrld sample --resume --out")],
)
def test_ctrl_c_says_how_to_resume(
    command: str, hint: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib

    def interrupted(args: argparse.Namespace) -> int:
        raise KeyboardInterrupt

    module = importlib.import_module(f"sgrld.experiments.commands.{command}")
    monkeypatch.setattr(module, "run", interrupted)
    assert main([command, "--out", "x", "--sampler", "identity"]) == 130
    err = capsys.readouterr().err.strip()
    assert err.startswith("interrupted; ") and hint in err
