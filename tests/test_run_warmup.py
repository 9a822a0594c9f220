"""The runner's default warm-up waits for the chain (``--adapt wait``): a chain still travelling
at the burn-in's end adapts on, its records say until when, and a resume in the middle of it is
bit-identical; a config that says ``burnin`` (every run made before ``wait``) keeps its freeze at
the burn-in's end, and one without ``adapt`` adapts throughout."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import state_tensors
from sgrld.core.warmup import Windows
from sgrld.experiments.run.checkpoint import load_checkpoint
from sgrld.experiments.run.config import CHECKPOINT_FILE, RunConfig, is_sample_step
from sgrld.experiments.run.launch import print_summary
from sgrld.experiments.run.loop import SamplingRun, run_sampling
from sgrld.experiments.run.results import RESULTS_FILE
from test_runner import KillAt, deterministic, synthetic_splits, tiny_config

SPLITS = synthetic_splits()

#: RMSprop on the tiny network, 10 updates an epoch, 120 in all: Windows(40) has one slow window,
#: updates 7..36, then a terminal window; the windows added for a travelling chain end at updates
#: 96 and 156. The chains are judged on 248 tracked coordinates, arrived when 90 % (224) have:
#: ARRIVES (ℓ 0.03) has 208 at update 36 and 242 at update 96, so it freezes there; TRAVELS
#: (ℓ 0.003) has 184 and 196, so it adapts to the end of the run. Margins of 15 coordinates and
#: more: a verdict does not hang on float rounding.
WAITS = {"sampler": "rmsprop", "burnin": 40, "thinning": 5, "epochs": 12}
ARRIVES, TRAVELS = {"seed": 7, "lr": 0.03}, {"seed": 1, "lr": 0.003}


def wait_config(chain: dict[str, Any], **overrides: Any) -> RunConfig:
    return tiny_config(**{**WAITS, **chain, **overrides})


def adapting_samples(config: RunConfig, end: int) -> int:
    """The samples of ``config``'s run drawn at an update that adapted (≤ ``end``)."""
    updates = min(end, config.epochs * 10)  # 10 updates an epoch (200 points, batches of 20)
    return sum(is_sample_step(t, config.burnin, config.thinning) for t in range(1, updates + 1))


def check_warmup_record(config: RunConfig, warmup: dict[str, Any]) -> None:
    """A waiting warm-up's record agrees with its schedule: the last update that adapted is the
    end of the last slow window it waited for, and the samples drawn up to it are counted."""
    assert isinstance(warmup["adapt_until"], int) and not isinstance(warmup["adapt_until"], Windows)
    schedule = Windows(config.burnin, arrival=True)
    assert warmup["adapt_until"] == schedule.slow_ends(warmup["windows_added"])[-1]
    assert warmup["samples_adapting"] == adapting_samples(config, warmup["adapt_until"])


# --- the config ---------------------------------------------------------------------------------


def test_default_adapt_waits_and_old_configs_keep_their_protocol() -> None:
    config = wait_config(ARRIVES)
    assert config.adapt == "wait"
    assert repr(config.adapt_until) == "Windows(40, arrival=True)"
    assert config.to_dict()["adapt"] == "wait"
    assert RunConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    # a run made when "burnin" was the default: its stored config keeps the integer freeze
    old = RunConfig.from_dict({**config.to_dict(), "adapt": "burnin"})
    assert old.adapt == "burnin" and type(old.adapt_until) is int and old.adapt_until == 40
    # written before the warm-up existed: the metric adapted at every update
    legacy = {k: v for k, v in config.to_dict().items() if k != "adapt"}
    assert RunConfig.from_dict(legacy).adapt == "always"
    assert RunConfig.from_dict(legacy).adapt_until is None
    explicit = replace(config, adapt=7).adapt_until
    assert type(explicit) is int and explicit == 7
    with pytest.raises(ValueError, match="'wait' \\(the default"):
        replace(config, adapt="sometimes")


def test_cli_offers_wait_as_the_default() -> None:
    from sgrld.experiments.commands import sample, sweep

    parser = argparse.ArgumentParser()
    sample.add_arguments(parser)
    base = ["--sampler", "rmsprop"]
    assert parser.parse_args(base).adapt == "wait"
    assert parser.parse_args([*base, "--adapt", "wait"]).adapt == "wait"
    assert parser.parse_args([*base, "--adapt", "burnin"]).adapt == "burnin"
    assert "{wait,burnin,always,N}" in parser.format_help()
    swept = argparse.ArgumentParser()
    sweep.add_arguments(swept)
    assert "wait (a warm-up over" in " ".join(swept.format_help().split())
    args = swept.parse_args([*base, "--out", "x", "--adapt", "wait,burnin,5"])
    assert args.adapt == ["wait", "burnin", 5]


# --- the runner -----------------------------------------------------------------------------------


def test_a_travelling_chain_adapts_past_the_burnin_and_the_record_says_until_when(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A chain still travelling at the burn-in's end adapts on, to update 96 where it has
    arrived, not 40: its run equals one frozen after exactly that update (RMSprop restarts
    nothing at a window) and differs from the run frozen at the burn-in; one that never arrives
    adapts throughout (its last window would end at 156)."""
    chains = {"arrives": ARRIVES, "travels": TRAVELS}
    runs = {n: SamplingRun(wait_config(c), SPLITS).run()[0] for n, c in chains.items()}
    assert runs["arrives"]["warmup"] == {
        "adapt_until": 96,
        "windows_added": 1,
        "samples_adapting": 11,
    }
    assert runs["travels"]["warmup"] == {
        "adapt_until": 156,
        "windows_added": 2,
        "samples_adapting": 16,
    }
    for chain, r in zip((ARRIVES, TRAVELS), runs.values(), strict=True):
        check_warmup_record(wait_config(chain), r["warmup"])
        assert json.loads(json.dumps(r["warmup"])) == r["warmup"]
    frozen = {
        n: SamplingRun(wait_config(ARRIVES, adapt=n), SPLITS).run()[0] for n in (96, "burnin")
    }

    def chain(r: dict[str, Any]) -> dict[str, Any]:  # the waiting state's bytes aside
        kept = {k: v for k, v in deterministic(r).items() if k not in ("config", "warmup")}
        return kept | {"telemetry": kept["telemetry"]["per_epoch"]}

    assert chain(runs["arrives"]) == chain(frozen[96])
    assert chain(runs["arrives"])["trace"] != chain(frozen["burnin"])["trace"]
    assert frozen[96]["warmup"] == {"adapt_until": 96, "samples_adapting": 11}
    assert frozen["burnin"]["warmup"] == {"adapt_until": 40, "samples_adapting": 0}
    print_summary([wait_config(ARRIVES)], [runs["arrives"]], tmp_path)
    said = " ".join(capsys.readouterr().out.split())
    assert "11 of 16 samples were drawn while the metric adapted (until update 96)" in said
    assert "still travelling at the burn-in's end: a longer --burn-in" in said


@pytest.mark.slow
def test_k_chains_each_wait_for_their_own_chain() -> None:
    """In one process (vmapped :class:`sgrld.Chains`) each chain's record has its own verdict."""
    results = SamplingRun([wait_config(ARRIVES), wait_config(TRAVELS)], SPLITS).run()
    assert [r["warmup"]["windows_added"] for r in results] == [1, 2]
    for chain, r in zip((ARRIVES, TRAVELS), results, strict=True):
        check_warmup_record(wait_config(chain), r["warmup"])


# --- resume -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kill",
    [pytest.param(27, marks=pytest.mark.slow, id="in-the-window"), pytest.param(57, id="added")],
)
def test_resume_in_the_waiting_warmup_is_bit_identical(tmp_path: Path, kill: int) -> None:
    """Killed after the checkpoint of update 20 (the window's sums half made) or 50 (a window
    added, its sums begun): the checkpoint holds the warm-up's state, the resumed run is the
    uninterrupted one."""
    config = wait_config(ARRIVES)
    straight = run_sampling(config, SPLITS, tmp_path / "straight")[0]
    killed = tmp_path / "killed"
    with pytest.raises(KeyboardInterrupt):
        run_sampling(config, SPLITS, killed, observer=KillAt(kill))
    saved = load_checkpoint(killed / CHECKPOINT_FILE)
    (first, *_) = saved["optimizer"]["state"].values()
    assert first["warmup_extensions"].item() == (0 if kill < 36 else 1)
    assert first["warmup_sums"].abs().sum() > 0  # the window's sums so far
    resumed = run_sampling(config, SPLITS, killed, resume=True)[0]
    assert deterministic(resumed) == deterministic(straight)
    a, b = (load_checkpoint(d / CHECKPOINT_FILE) for d in (tmp_path / "straight", killed))
    sa, sb = (state_tensors(ck["optimizer"]) for ck in (a, b))
    assert sa.keys() == sb.keys() and all(torch.equal(v, sb[k]) for k, v in sa.items())


@pytest.mark.slow
def test_k_chains_resume_in_the_waiting_warmup_is_bit_identical(tmp_path: Path) -> None:
    """Killed after the checkpoint of update 100: one chain frozen at 96, the other in its
    second added window; each chain's windows are in the checkpoint."""
    configs = [wait_config(ARRIVES), wait_config(TRAVELS)]
    straight = run_sampling(configs, SPLITS, tmp_path / "straight")
    killed = tmp_path / "killed"
    with pytest.raises(KeyboardInterrupt):
        run_sampling(configs, SPLITS, killed, observer=KillAt(107))
    saved = load_checkpoint(killed / CHECKPOINT_FILE, chains=True)
    (sampler,) = saved["chains"]["samplers"]
    assert sampler["warmup"]["chains"].tolist() == [1, 2]
    resumed = run_sampling(configs, SPLITS, killed, resume=True)
    assert [deterministic(r) for r in resumed] == [deterministic(r) for r in straight]


def test_an_old_burnin_checkpoint_resumes_as_an_integer_freeze(tmp_path: Path) -> None:
    """A run made when ``burnin`` was the default (its config and checkpoint say so) resumes
    frozen at the burn-in's end, as it was, bit-identically, and records no waiting."""
    config = wait_config(ARRIVES, adapt="burnin")
    straight = run_sampling(config, SPLITS, tmp_path / "straight")[0]
    killed = tmp_path / "killed"
    with pytest.raises(KeyboardInterrupt):
        run_sampling(config, SPLITS, killed, observer=KillAt(27))
    saved = load_checkpoint(killed / CHECKPOINT_FILE)
    assert saved["config"]["adapt"] == "burnin"
    assert type(saved["optimizer"]["param_groups"][0]["adapt_until"]) is int
    restored = RunConfig.from_dict(saved["config"])
    resumed = run_sampling(restored, SPLITS, killed, resume=True)[0]
    assert deterministic(resumed) == deterministic(straight)
    assert resumed["warmup"] == {"adapt_until": 40, "samples_adapting": 0}
    on_disk = json.loads((killed / RESULTS_FILE).read_text())
    assert on_disk["config"]["adapt"] == "burnin"
