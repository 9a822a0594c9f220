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
    from sgrld.experiments.grid import run_label
    from sgrld.experiments.multichain import chain_label
    from sgrld.experiments.sample import configs_from_args

    args = build_parser().parse_args(
        ["sample", "--sampler", "monge", "--lr", "0.25", "--alpha2", "1.25", "--chains", "2"]
    )
    for config in configs_from_args(args):
        assert chain_label(config).endswith("-" + run_label(config.to_dict()))


def test_summary_of_a_run_shorter_than_the_warm_up_gives_no_rate() -> None:
    from sgrld.experiments.sample import _speed

    timing = {"steps_all": 8, "steps_after_skip": 0, "seconds_per_epoch_basis": "estimated ..."}
    timing["sampling_seconds"] = [1.5, 2.0]
    text = _speed({"timing": timing, "seconds_per_epoch": 12.5})
    assert text.startswith("s/epoch not measured: all 8 updates fall in the first 1000")
    assert text.endswith("sampling took 3.5 s in all")
    timing = {"steps_all": 2000, "steps_after_skip": 1000, "seconds_per_epoch_basis": "mean"}
    assert _speed({"timing": timing, "seconds_per_epoch": 1.25}) == "1.2500 s/epoch"


def test_curves_of_a_run_broken_down_before_its_first_sample_say_so() -> None:
    from sgrld.experiments.plots import run_curves_figure

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
