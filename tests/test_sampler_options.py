"""Every option of every registered metric is settable from a run's config, the command line and
a sweep, and the metric itself validates it (no per-metric code in experiments/)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

import sgrld
from metric_cases import CASES as METRIC_CASES
from sgrld.experiments.commands import sample, sweep
from sgrld.experiments.commands.options import config_from_args
from sgrld.experiments.run.build import make_sampler, option_names
from sgrld.experiments.run.config import METRIC_FIELDS, TUNED_FIELDS, RunConfig
from sgrld.experiments.run.naming import default_out_dir
from sgrld.metrics import get_metric, metric_names


def config(sampler: str, **options: Any) -> RunConfig:
    tuned = {"alpha2": 1.0} if sampler == "monge" else {}
    return RunConfig(
        dataset="mnist", model="fc", prior="gaussian", sampler=sampler, lr=0.1, epochs=3,
        tuned=tuned, sampler_options=options,
    )  # fmt: skip


def _json(value: Any) -> Any:
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value


CASES = [
    (name, option)
    for name in metric_names()
    for option in option_names(name)
    if option not in (*METRIC_FIELDS, *TUNED_FIELDS)  # fields and tuned options of their own
]


@pytest.mark.parametrize(("name", "option"), CASES, ids=[f"{n}-{o}" for n, o in CASES])
def test_every_metric_option_reaches_the_sampler(name: str, option: str) -> None:
    default = {f.name: f.default for f in dataclasses.fields(get_metric(name))}[option]  # type: ignore[arg-type]
    cfg = config(name, **{option: _json(default)})
    assert cfg.to_dict()["sampler_options"] == {option: _json(default)}
    assert RunConfig.from_dict(cfg.to_dict()) == cfg
    opt = make_sampler(cfg, [torch.zeros(16, 16)], 10, torch.Generator())
    assert getattr(opt.metric, option) == default


def test_a_changed_option_changes_the_metric_and_the_run_folder() -> None:
    cfg = config("rmsprop", decay=0.95)
    opt = make_sampler(cfg, [torch.zeros(3)], 10, torch.Generator())
    assert opt.metric.decay == 0.95  # type: ignore[attr-defined]
    assert default_out_dir(cfg).name.endswith("-lr0.1-decay0.95-seed0")
    shampoo = make_sampler(
        config("shampoo", block_size=2), [torch.zeros(4, 4)], 10, torch.Generator()
    )
    assert shampoo.metric.block_size == 2  # type: ignore[attr-defined]


def test_no_options_read_as_before_they_existed() -> None:
    cfg = config("rmsprop")
    assert "sampler_options" not in cfg.to_dict()
    assert RunConfig.from_dict(cfg.to_dict()).sampler_options == {}
    assert default_out_dir(cfg).name.endswith("-lr0.1-seed0")


@pytest.mark.parametrize(
    ("sampler", "options", "message"),
    [
        (
            "rmsprop",
            {"block_size": 4},
            "rmsprop has no option 'block_size'; the options of RMSpropMetric: decay",
        ),
        ("rmsprop", {"decai": 0.9}, "rmsprop has no option 'decai' \\(did you mean 'decay'\\?\\)"),
        (
            "identity",
            {"decay": 0.9},
            "identity has no option 'decay'; the options of IdentityMetric: none",
        ),
        ("rmsprop", {"decay": 1.5}, "invalid decay: 1.5"),
        ("wenzel", {"min_scale": -0.1}, "invalid min_scale: -0.1"),
        ("monge", {"alpha2": 2.0}, "give alpha2 as its own option"),
        ("shampoo", {"root_dtype": "float65"}, "expected a torch dtype name"),
        ("rmsprop", {"decay": [0.9]}, "invalid sampler option decay=[0.9]"),
    ],
)
def test_the_metric_refuses_bad_options(
    sampler: str, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        config(sampler, **options)


def _sample_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sample.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_command_line_options_are_json_values_or_words() -> None:
    args = _sample_args(
        "--sampler", "shampoo", "--lr", "0.1", "--option", "decay=0.95", "--option",
        "root-method=newton", "--option", "precondition_vectors=true", "--option", "block_size=64",
    )  # fmt: skip
    cfg = config_from_args(args)
    assert cfg.sampler_options == {
        "decay": 0.95,
        "root_method": "newton",
        "precondition_vectors": True,
        "block_size": 64,
    }
    with pytest.raises(sample.UsageError, match="rmsprop has no option 'x'"):
        config_from_args(_sample_args("--sampler", "rmsprop", "--lr", "0.1", "--option", "x=1"))
    with pytest.raises(SystemExit):
        _sample_args("--option", "decay")


def test_a_sweep_takes_options_as_a_table_or_an_axis_of_tables(tmp_path: Path) -> None:
    path = tmp_path / "grid.toml"
    path.write_text(
        '[[grid]]\nsampler = "rmsprop"\nlr = 0.1\nepochs = 3\n'
        "sampler_options = [{decay = 0.9}, {decay = 0.99, eps = 1e-6}]\n"
    )
    parser = argparse.ArgumentParser()
    sweep.add_arguments(parser)
    runs, _ = sweep.plan(parser.parse_args(["--config", str(path), "--out", "unused"]))
    by_path = {r.path.rpartition("/")[2]: r.config["sampler_options"] for r in runs}
    assert by_path == {
        "lr0.1-decay0.9-seed0": {"decay": 0.9},
        "lr0.1-decay0.99-eps1e-06-seed0": {"decay": 0.99, "eps": 1e-6},
    }
    path.write_text('[[grid]]\nsampler = "rmsprop"\nlr = 0.1\nsampler_options = 3\n')
    with pytest.raises(sweep.GridError, match="sampler_options must be a table"):
        sweep.plan(parser.parse_args(["--config", str(path), "--out", "unused"]))


def test_a_sweep_command_line_takes_one_table_of_options() -> None:
    parser = argparse.ArgumentParser()
    sweep.add_arguments(parser)
    argv = ["--dataset", "diabetes", "--sampler", "adam", "--lr", "0.01,0.02", "--epochs", "60"]
    argv += ["--burn-in", "10", "--option", "beta2=0.99", "--option", "eps=1e-6"]
    runs, _ = sweep.plan(parser.parse_args([*argv, "--out", "unused"]))
    assert [r.config["sampler_options"] for r in runs] == [{"beta2": 0.99, "eps": 1e-6}] * 2
    assert sorted(r.path.rpartition("/")[2] for r in runs) == [
        "lr0.01-beta20.99-eps1e-06-seed0",
        "lr0.02-beta20.99-eps1e-06-seed0",
    ]


PRESETS = [(name, case.facade) for name, case in METRIC_CASES.items() if case.facade]


@pytest.mark.parametrize(("name", "preset"), PRESETS, ids=[n for n, _ in PRESETS])
def test_a_preset_takes_every_option_of_its_metric(name: str, preset: type) -> None:
    """A preset is the base with its metric fixed: each of the metric's option sets (the
    oracle's, away from the defaults) reaches the metric as it does through the registry."""
    for options in METRIC_CASES[name].oracle_options:
        opt = preset([torch.nn.Parameter(torch.zeros(4, 4))], lr=0.1, num_data=10, **options)
        generic = sgrld.SGRLDOptimizer(
            [torch.nn.Parameter(torch.zeros(4, 4))], lr=0.1, num_data=10, metric=name, **options
        )
        assert {k: getattr(opt.metric, k) for k in options} == options
        assert all(opt.param_groups[0][k] == v for k, v in options.items())
        assert generic.metric == opt.metric
    with pytest.raises(TypeError, match="takes no metric="):
        preset([torch.zeros(3)], lr=0.1, num_data=10, metric=name)
    with pytest.raises(TypeError, match="needs metric="):
        sgrld.SGRLDOptimizer([torch.zeros(3)], lr=0.1, num_data=10)
    with pytest.raises(TypeError, match="not 3"):
        sgrld.SGRLDOptimizer([torch.zeros(3)], lr=0.1, num_data=10, metric=3)  # type: ignore[arg-type]


def test_wenzel_preset_floors_its_scales_at_min_scale() -> None:
    """``min_scale`` (a WenzelMetric option) through the preset: after a refresh no M_p is
    below it, while without it the tensor of large gradients gets a smaller scale."""
    scales = []
    for floor in (0.0, 0.5):
        params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))]
        opt = sgrld.WenzelSGLD(params, lr=0.01, num_data=10, min_scale=floor, refresh_every=2)
        for _ in range(2):
            params[0].grad, params[1].grad = torch.full((3,), 100.0), torch.ones(3)
            opt.step()
        scales.append(opt.sampler_states[0].stats["scale"])
    assert float(scales[0][0]) < 0.5 and float(scales[1][0]) == 0.5
    assert float(scales[0][1]) == float(scales[1][1]) == 1.0


def test_a_refresh_schedule_needs_a_metric_refreshed_per_epoch() -> None:
    p = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match="no per-epoch refresh"):
        sgrld.SGLD(p, lr=0.1, num_data=10, refresh_every=3)
    with pytest.raises(ValueError, match="no per-epoch refresh"):
        sgrld.SGRLDOptimizer(p, lr=0.1, num_data=10, metric="rmsprop", batch_size=5)
    assert (
        sgrld.SGRLDOptimizer(p, lr=0.1, num_data=10, metric="wenzel", batch_size=3).refresh_every
        == 4
    )
