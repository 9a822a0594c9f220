"""The run options are declared once (``run/options.py``): the parsers of sample, sweep and tune,
a sweep config's keys and the flag of a config field all come from that table."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from sgrld.experiments.commands import sample, sweep, tune
from sgrld.experiments.commands.options import configs_from_args, given_options
from sgrld.experiments.run.config import TUNED_FIELDS, RunConfig
from sgrld.experiments.run.naming import cli_names, flag_of
from sgrld.experiments.run.options import MACHINE_OPTIONS, OPTIONS, by_field
from sgrld.experiments.sweep import grid

ROOT = Path(__file__).resolve().parents[1]


def _parser(command: object) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sgrld")
    command.add_arguments(parser)  # type: ignore[attr-defined]
    return parser


def test_every_config_field_is_set_by_one_option() -> None:
    names = {f.name for f in dataclasses.fields(RunConfig)} - {"tuned"} | set(TUNED_FIELDS)
    assert set(by_field()) == names  # each tuned option (α²) its own flag, from the metrics
    flags = [flag for option in OPTIONS.values() for flag in option.flags]
    assert len(flags) == len(set(flags))
    assert flag_of("burnin") == "--burn-in" and flag_of("max_train") == "--subset"
    assert flag_of("sampler_options") == "--option" and flag_of("lr") == "--lr"
    assert cli_names("max_eval must be >= 1, got 0") == "--eval-subset must be >= 1, got 0"


def test_each_command_parses_the_declared_defaults() -> None:
    defaults = vars(_parser(sample).parse_args([]))
    assert defaults == {name: option.default for name, option in OPTIONS.items()}
    swept = vars(_parser(sweep).parse_args(["--out", "x"]))
    assert {n for n in OPTIONS if n in swept} == MACHINE_OPTIONS  # the grid's: not given
    assert swept["no_plot"] is True and "seeds" not in swept
    tuned = vars(_parser(tune).parse_args(["--out", "x", "--sampler", "sgld,monge"]))
    assert tuned["sampler"] == ["identity", "monge"] and tuned["out"] == Path("x")
    assert tuned["width"] == OPTIONS["width"].default


def test_each_option_s_help_is_its_declaration() -> None:
    """What ``--help`` shows is the table's text, for sample (sweep's axes have their own)."""
    parser = argparse.ArgumentParser(
        formatter_class=lambda prog: argparse.HelpFormatter(prog, width=9999)
    )
    sample.add_arguments(parser)
    shown = parser.format_help()
    for option in OPTIONS.values():
        assert option.help in shown, option.name


def test_comma_lists_where_the_command_takes_them() -> None:
    args = _parser(sample).parse_args(["--lr", "0.1,0.25", "--alpha2", "1"])
    assert args.lr == [0.1, 0.25] and args.alpha2 == [1.0]
    args = _parser(sweep).parse_args(["--out", "x", "--width", "16,32", "--seeds", "0-2"])
    assert args.width == [16, 32] and args.seeds == [0, 1, 2]
    with pytest.raises(SystemExit):
        _parser(sample).parse_args(["--width", "16,32"])


def test_given_options_read_prefixes_as_argparse_does() -> None:
    argv = ["--lr", "0.1", "--burn", "5", "--no", "--seed=3", "--epochs", "--subset", "x"]
    assert given_options(argv) == {"lr", "burn_in", "seed", "epochs", "subset"}


def test_a_sweep_point_and_a_command_line_give_the_same_config() -> None:
    """One builder of RunConfigs: a sweep's point (a mapping of option names) and sample's
    parsed command line."""
    argv = ["--sampler", "monge", "--lr", "0.1", "--prior", "horseshoe", "--burn-in", "5"]
    args = _parser(sample).parse_args(argv)
    point = {**grid.run_defaults(), "sampler": "monge", "lr": 0.1, "prior": "horseshoe"}
    point |= {"burn_in": 5, "seed": 0}
    del point["seeds"]
    assert configs_from_args(point) == configs_from_args(args)
    assert configs_from_args(point)[0].tuned == {"alpha2": 1.25}  # the paper's α² for the setting


def test_the_sweep_grid_keys_are_the_options() -> None:
    assert set(grid.KEYS) == {"seeds" if n == "seed" else n for n in OPTIONS} - MACHINE_OPTIONS
    assert set(grid.AXES) == {"sampler", "width", "prior", "lr", "alpha2", "seeds", "adapt"} | {
        "sampler_options"
    }
    with pytest.raises(grid.GridError, match="dataset takes one value"):
        grid.check_value("dataset", ["mnist"], "here")
    with pytest.raises(grid.GridError, match="width must be an integer"):
        grid.check_value("width", [400, 1.5], "here")


def test_nothing_below_the_commands_parses_arguments() -> None:
    rooms = ROOT / "src" / "sgrld" / "experiments"
    found = [
        path.relative_to(rooms).as_posix()
        for path in rooms.rglob("*.py")
        if path.parent.name != "commands"
        and re.search(r"^\s*(import|from) argparse\b", path.read_text(), re.MULTILINE)
    ]
    assert found == [], found
    assert "_actions" not in "".join(p.read_text() for p in rooms.parent.rglob("*.py"))
