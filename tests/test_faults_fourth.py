"""Faults of the fourth round (issue 42, and issue 44's items 10-12): one parametrised test per
class. Every breakdown rule at τ = 0 and τ > 0 from the first step; every numeric argument of
the samplers and of ``sgrld.health`` → a ``ValueError`` naming it; every hand-edited ``tune.json``
→ one line in every reader; a ``tuned:DIR`` of another setting refused naming the fields.
(Files, links and locks of every command: ``tests/test_run_folders.py``.)"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import sgrld
from sgrld.experiments.base import exits
from sgrld.experiments.run.loop import GROWTH_CHECK_EVERY, SamplingRun
from test_faults import code_of, one_line_error
from test_run_folders import DIABETES, TUNE
from test_runner import synthetic_splits, tiny_config

# --- item 1, issue 44 item 11: every breakdown rule, at τ = 0 and τ > 0, from the first step ---

TEMPERATURES = (0.0, 0.01, 1.0)
#: rule → (config overrides, what the reason says); 100 steps an epoch (batch 2 of 200 points)
RULES: dict[str, tuple[dict[str, Any], str]] = {
    "|theta| grew from its start (a finite blow-up)": ({"lr": 3.0}, "times its start"),
    "a non-finite potential at the first step": ({"lr": 0.05}, "potential is nan"),
}


def _config(tau: float, **overrides: Any) -> Any:
    values = {"temperature": tau, "batch_size": 2, "epochs": 2, "burnin": 0, "thinning": 1}
    return tiny_config(prior="gaussian", **{**values, **overrides})


@pytest.mark.parametrize("tau", TEMPERATURES)
@pytest.mark.parametrize("rule", sorted(RULES))
def test_every_breakdown_rule_stops_the_chain_mid_epoch_at_any_temperature(
    rule: str, tau: float
) -> None:
    overrides, said = RULES[rule]
    splits = synthetic_splits()
    if "potential" in said:
        splits.x_train[:] = float("nan")
    run = SamplingRun(_config(tau, **overrides), splits)
    (results,) = run.run()
    assert results["status"] == "broken_down", results["broken_down"]
    broken = results["broken_down"]
    assert said in broken["reason"], broken
    # stopped at once: within a check interval, in the first epoch, not after the epoch's 100
    assert broken["epoch"] == 0 and broken["update"] <= GROWTH_CHECK_EVERY, broken
    if "potential" in said:  # the data, not ℓ: no hint to lower ℓ
        assert broken["update"] == 1 and broken["hint"] is None
    else:
        assert broken["hint"].startswith("ℓ too large: try lr <= 0.3, or sgrld tune"), broken


@pytest.mark.parametrize(
    "tau", [pytest.param(t, marks=[pytest.mark.slow] if t else []) for t in TEMPERATURES]
)
def test_a_healthy_chain_is_not_stopped_and_one_of_k_chains_stops_alone(tau: float) -> None:
    configs = [_config(tau, lr=3.0, seed=0, epochs=1), _config(tau, lr=0.05, seed=1, epochs=1)]
    run = SamplingRun(configs, synthetic_splits())
    broken, healthy = run.run()
    assert (
        broken["status"] == "broken_down" and "times its start" in broken["broken_down"]["reason"]
    )
    assert healthy["status"] == "completed" and healthy["broken_down"] is None


def test_the_growth_reference_is_the_seeds_start_also_after_a_resume() -> None:
    # measured as the chain is built from its seed, before a checkpoint is loaded: no
    # checkpoint field, and a resumed run judges as the run it continues
    config = _config(0.0, epochs=1)
    run = SamplingRun(config, synthetic_splits())
    start = run.records[0].theta_start
    run.run()
    state = run.state_dict()
    resumed = SamplingRun(_config(0.0, epochs=2), synthetic_splits())
    resumed.load_state_dict(state)
    assert start is not None and resumed.records[0].theta_start == start
    assert "theta_start" not in state


def test_a_cold_diverging_run_exits_3_with_the_hint_and_no_nan_scores(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the case: diabetes, identity, ℓ = 30, τ = 0 had exited 0 "completed"
    argv = ["sample", *DIABETES, "--width", "16", "--batch-size", "64", "--sampler", "identity"]
    argv += ["--lr", "30", "--temperature", "0", "--no-plot", "--out", str(tmp_path / "t0")]
    assert code_of(argv) == exits.BROKEN_DOWN
    captured = capsys.readouterr()
    assert "times its start" in captured.err and "hint: ℓ too large: try lr <= 3" in captured.err
    assert "nan" not in captured.out and "no scores" in captured.out
    assert code_of(["table", str(tmp_path / "t0")]) == exits.OK
    assert "broke down (1/1 runs)" in capsys.readouterr().out


# --- item 9, 13: every numeric argument of the samplers -> a ValueError naming it -------------

BAD_NUMBERS: dict[str, Any] = {
    "nan": math.nan, "inf": math.inf, "-inf": -math.inf, "negative": -1.0, "huge": 1e308,
    "a bool": True, "text": "0.1",
}  # fmt: skip


def _sgld(**kw: Any) -> Any:
    return sgrld.SGLD([torch.nn.Parameter(torch.zeros(3))], **{"lr": 0.1, "num_data": 10, **kw})


def _build(**kw: Any) -> Any:
    return sgrld.build("identity", **{"lr": 0.1, "num_data": 10, **kw})


#: name → (the call, the argument); "huge" is valid only where a bound is not the float32 step
ARGUMENTS: dict[str, tuple[Callable[..., Any], str]] = {
    "SGLD lr": (_sgld, "lr"),
    "SGLD num_data": (_sgld, "num_data"),
    "SGLD temperature": (_sgld, "temperature"),
    "build lr": (_build, "lr"),
    "build num_data": (_build, "num_data"),
    "build temperature": (_build, "temperature"),
    "build localization": (_build, "localization"),
}
VALID_HUGE = {"SGLD num_data", "build num_data", "build localization"}


@pytest.mark.parametrize("bad", sorted(BAD_NUMBERS))
@pytest.mark.parametrize("name", sorted(ARGUMENTS))
def test_every_numeric_argument_is_refused_naming_it(name: str, bad: str) -> None:
    make, argument = ARGUMENTS[name]
    value = BAD_NUMBERS[bad]
    if bad == "huge" and name in VALID_HUGE:
        make(**{argument: value})  # a large n or pull is a valid, finite step
        return
    with pytest.raises(ValueError, match=rf"invalid {argument}: "):
        make(**{argument: value})


@pytest.mark.parametrize("value", [-0.1, math.nan, math.inf, 1e300])
@pytest.mark.parametrize("key", ["lr", "temperature", "num_data"])
def test_a_group_hyperparameter_set_after_construction_is_refused_at_the_step(
    key: str, value: float
) -> None:
    if key == "num_data" and value == 1e300:
        value = 0.5  # below 1
    param = torch.nn.Parameter(torch.ones(3))
    opt = sgrld.SGLD([param], lr=0.1, num_data=10)
    opt.param_groups[0][key] = value
    param.grad = torch.ones(3)
    with pytest.raises(ValueError, match=rf"param_groups\[0\]: invalid {key}: "):
        opt.step()
    assert torch.equal(param.detach(), torch.ones(3))  # refused before any move


@pytest.mark.parametrize(
    ("figures", "verdict"),
    [
        ({"temperature": math.nan}, "invalid temperature nan"),
        ({"temperature": -1.0}, "invalid temperature -1.0"),
        ({"temperature": math.inf}, "invalid temperature inf"),
        ({"noise_rms": math.nan}, "broken_down"),
        ({"noise_rms": math.inf}, "broken_down"),
    ],
)
def test_health_refuses_an_impossible_temperature_and_calls_a_nan_noise_broken(
    figures: dict[str, float], verdict: str
) -> None:
    base = {"steps": 500, "drift_rms": 0.1, "noise_rms": 1.0, "theta_norm": 3.0}
    if verdict == "broken_down":
        health = sgrld.health({**base, **figures})
        assert not isinstance(health, list) and health.broken_down
        return
    with pytest.raises(ValueError, match=verdict):
        sgrld.health({**base, **figures})


def test_sample_refuses_an_lr_beyond_a_float32_step_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["sample", *DIABETES, "--sampler", "identity", "--lr", "1e300", "--no-plot"]
    assert code_of([*argv, "--out", str(tmp_path / "out")]) == exits.USAGE
    one_line_error(capsys.readouterr().err, "invalid lr: 1e+300", "largest float32")


# --- items 3, 5, 6, 9, 14: tune.json in every reader -----------------------------------------


def _edited(edit: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    data = json.loads(json.dumps(TUNE))
    edit(data)
    return data


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    *parents, last = path.split(".")

    def edit(data: dict[str, Any]) -> None:
        for key in parents:
            data = data[key]
        if value is _DELETE:
            del data[last]
        else:
            data[last] = value

    return edit


_DELETE = object()
#: edit → the words of the one line every reader says
EDITS: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "lr true": (_set("samplers.identity.options.lr", True), "options.lr is True"),
    "lr NaN": (_set("samplers.identity.options.lr", math.nan), "options.lr is nan"),
    "lr negative": (_set("samplers.identity.options.lr", -0.1), "not a finite number > 0"),
    "a sampler that is an integer": (_set("samplers.identity", 3), "samplers.identity is 3"),
    "options a list": (_set("samplers.identity.options", [0.1]), "options is [0.1]"),
    "no config": (_set("config", _DELETE), "no config object"),
    "width as text": (_set("config.width", "4"), "config.width is '4'"),
}
READERS: dict[str, Callable[[Path], list[str]]] = {
    "sample": lambda tmp: ["sample", *DIABETES, "--sampler", "identity", "--lr",
                           f"tuned:{tmp / 'tune'}", "--no-plot", "--out", str(tmp / "out")],
    "sweep": lambda tmp: ["sweep", *DIABETES, "--sampler", "identity", "--lr",
                          f"tuned:{tmp / 'tune'}", "--dry-run", "--out", str(tmp / "out")],
    "report --tuned": lambda tmp: ["report", str(tmp / "runs"), "--no-figures", "--tuned",
                                   str(tmp / "tune"), "--out", str(tmp / "out")],
}  # fmt: skip


@pytest.mark.parametrize("reader", sorted(READERS))
@pytest.mark.parametrize("edit", sorted(EDITS))
def test_a_hand_edited_tune_json_is_refused_in_one_line_by_every_reader(
    edit: str, reader: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from test_run_folders import _runs

    change, said = EDITS[edit]
    _runs(tmp_path)
    (tmp_path / "tune").mkdir()
    (tmp_path / "tune" / "tune.json").write_text(json.dumps(_edited(change)))
    assert code_of(READERS[reader](tmp_path)) == exits.USAGE
    one_line_error(capsys.readouterr().err, "tune.json", said)


@pytest.mark.parametrize(
    ("field", "value", "refused"),
    [
        ("config.width", 400, "width 400 (this run: 4)"),
        ("config.dataset", "mnist", "dataset 'mnist' (this run: 'diabetes')"),
        ("config.num_train", 100, "num_train 100 (this run: 310)"),
        ("config.batch_size", 32, "batch_size 32 (this run: 100)"),
        ("samplers.identity.options.temperature", 0.001, "temperature 0.001 (this run: 1.0)"),
        ("config.epochs", 400, None),  # harmless: a warning, ℓ kept
        ("config.seed", 7, None),
    ],
)
def test_a_tuned_lr_is_taken_only_for_the_setting_it_was_tuned_for(
    field: str, value: Any, refused: str | None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "tune").mkdir()
    (tmp_path / "tune" / "tune.json").write_text(json.dumps(_edited(_set(field, value))))
    code = code_of(READERS["sweep"](tmp_path))
    err = capsys.readouterr().err
    if refused is not None:
        assert code == exits.USAGE
        one_line_error(err, "was tuned for another setting", refused, "run sgrld tune")
        return
    assert code == exits.OK, err
    if field == "config.epochs":
        assert "tuned with epochs = 400, this run has 1 (harmless" in err
    else:
        assert "warning" not in err


# --- item 14: a killed resource tracker ------------------------------------------------------

TRACKER = """
import gc, multiprocessing, os, signal, time
from multiprocessing import resource_tracker
from sgrld.experiments.base.process import silence_resource_tracker
silence_resource_tracker()
locks = [multiprocessing.get_context("spawn").Lock() for _ in range(3)]
os.kill(resource_tracker._resource_tracker._pid, signal.SIGKILL)
time.sleep(0.3)
del locks
gc.collect()
time.sleep(0.3)
"""


def test_a_killed_resource_tracker_prints_no_traceback() -> None:
    done = subprocess.run(
        [sys.executable, "-c", TRACKER], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "KeyError" not in done.stderr, done.stderr


# --- every numeric option of the run commands -> one line naming it ---------------------------


def _numeric_options() -> list[str]:
    from sgrld.experiments.run.options import OPTIONS

    return sorted(n for n, o in OPTIONS.items() if o.kind in ("int", "float"))


CLI_VALUES = ("0", "-1", "nan", "inf", "-inf", "1e400", "99999999999999999999", "abc")
FAST_VALUES = ("nan", "99999999999999999999")  # the rest in the slow suite (~25 s in all)


@pytest.mark.parametrize(
    "value",
    [pytest.param(v, marks=[] if v in FAST_VALUES else [pytest.mark.slow]) for v in CLI_VALUES],
)
@pytest.mark.parametrize("name", _numeric_options())
def test_every_numeric_run_option_is_taken_or_refused_in_one_line_naming_it(
    name: str, value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # sweep --dry-run checks every run as sample does, without running one
    flag = "--seeds" if name == "seed" else f"--{name.replace('_', '-')}"
    argv = ["sweep", *DIABETES, "--sampler", "monge", "--lr", "0.01", "--dry-run"]
    argv += ["--out", str(tmp_path / "out"), f"{flag}={value}"]
    code = code_of(argv)
    err = capsys.readouterr().err
    assert code in (exits.OK, exits.USAGE), (code, err)
    assert "Traceback" not in err, err
    if code == exits.USAGE:
        (line,) = [line for line in err.splitlines() if "error:" in line]
        assert flag in line or name in line or value in line, line
