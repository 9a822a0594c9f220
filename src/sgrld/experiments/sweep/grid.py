"""A sweep's grid: seed ranges, TOML configs, expansion, run folders, manifest.

A grid is the union of *blocks*, each mapping run options (:data:`KEYS`) to a value or, for
:data:`AXES`, a list, and contributing the product of its lists. The config file format is in
``docs/experiments.md`` ("Config files").
"""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from sgrld.experiments.base.files import read_file
from sgrld.experiments.run.choices import Names, Table
from sgrld.experiments.run.config import TUNED_FIELDS, samplers_taking
from sgrld.experiments.run.naming import flag_of, run_label, setting_name
from sgrld.experiments.run.options import OPTIONS, RunOption

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 (the tomli dependency has a version marker)
    import tomli as tomllib

#: The options a grid may set: the run options but the machine's, ``seeds`` for ``seed`` (a
#: metric's tuned option, ``alpha2``, read from the registry when used).
KEYS: Mapping[str, RunOption] = Table(
    lambda: {"seeds" if o.name == "seed" else o.name: o for o in OPTIONS.values() if not o.machine}
)
#: Options that take a list in a sweep.
AXES: Sequence[str] = Names(lambda: (key for key, option in KEYS.items() if option.axis))
MANIFEST_FILE = "sweep.json"
MANIFEST_FORMAT = "sgrld-sweep/2"
#: Older manifests still read (they record no machine options, see :data:`CHAIN_OPTIONS`).
OLD_MANIFEST_FORMATS = ("sgrld-sweep/1",)
#: More seeds than this in one grid is a typo (``0-999999999999``), refused before building it.
MAX_SEEDS = 1_000_000
#: Options outside a run's config that still shape its numbers (name → flag): recorded in the
#: manifest, a rerun with other values is refused. ``parallel`` and ``processes`` only under
#: ``--parallel``, so a one-process sweep's manifest is as it always was.
CHAIN_OPTIONS = {
    "chains": "--chains",
    "chain_batch": "--chain-batch",
    "threads": "--threads",
    "device": "--device",
    "graph": "--no-graph",
    "parallel": "--parallel",
    "processes": "--nodes × --tasks-per-node",
}
#: Config fields that name a run's folder: ``<setting>/<sampler>/<label>`` (the metrics' tuned
#: options read from the registry when used).
PATH_FIELDS: Sequence[str] = Names(
    lambda: ("dataset", "model", "width", "prior", "sampler", "lr", *TUNED_FIELDS, "seed")
)


class GridError(ValueError):
    """A grid that cannot be run: bad values, an empty grid, an unknown key, a foreign folder."""


def parse_seeds(text: str | int | Sequence[int | str]) -> list[int]:
    """Seeds from ``"0-9"``, ``"0,3,5"``, ``"0-2,7"``, an int or a list (sorted, unique).

    Raises:
        GridError: a malformed item, a negative seed or a range whose end is below its start.
    """
    if isinstance(text, bool):
        raise GridError(f"seeds must be integers or ranges, got {text!r}")
    items: list[int | str]
    if isinstance(text, int):
        items = [text]
    elif isinstance(text, str):
        items = [part.strip() for part in text.split(",")]
    else:
        items = list(text)
    seeds: set[int] = set()
    count = 0
    for item in items:
        if isinstance(item, int) and not isinstance(item, bool):
            if not 0 <= item < 2**63:
                raise GridError(f"seeds must be >= 0 and below 2**63, got {item}")
            seeds.add(item)
            continue
        if not isinstance(item, str) or not item:
            raise GridError(f"seeds: empty or malformed item in {text!r}")
        start, sep, stop = item.partition("-")
        if not (start.isdigit() and (not sep or stop.isdigit())):
            raise GridError(f"seeds: {item!r} is neither a seed nor a range like 0-9")
        first, last = int(start), int(stop) if sep else int(start)
        if last < first:
            raise GridError(f"seeds: the range {item} is empty (its end is below its start)")
        count += last - first + 1
        if count > MAX_SEEDS or last >= 2**63:
            raise GridError(
                f"seeds: {text!r} asks for {count} seeds up to {last}; a grid takes at most "
                f"{MAX_SEEDS} seeds below 2**63"
            )
        seeds.update(range(first, last + 1))
    if not seeds:
        raise GridError("seeds: no seed given")
    return sorted(seeds)


def _as_list(key: str, value: Any) -> list[Any]:
    if key == "seeds":
        return parse_seeds(value) if value != [] else []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def expand(
    blocks: Sequence[Mapping[str, Any]], tuned: Mapping[str, Sequence[str]]
) -> list[dict[str, Any]]:
    """Every point (option → value, ``seed`` for ``seeds``) of the union of the blocks'
    products, without repeats. A tuned option (``tuned``: name → the samplers that take it)
    multiplies only those samplers' runs; the others take ``None``.

    Raises:
        GridError: no point at all, or a tuned option's values with no run that takes it.
    """
    if not blocks:
        raise GridError("the grid is empty: no block of runs")
    points: dict[str, dict[str, Any]] = {}
    lists_of = set(AXES)
    for block in blocks:
        fixed = {k: v for k, v in block.items() if k not in lists_of}
        axes = {k: _as_list(k, v) for k, v in block.items() if k in lists_of and k not in tuned}
        own = {k: _as_list(k, block[k]) for k in tuned if block.get(k) is not None}
        samplers = axes.get("sampler", [])
        for name in own:
            if samplers and not set(samplers) & set(tuned[name]):
                owner = " or ".join(tuned[name])
                raise GridError(
                    f"{name} is a {owner.title()} option; this block has no {owner} run"
                )
        names = list(axes)
        for values in itertools.product(*(axes[n] for n in names)):
            point = {**fixed, **dict(zip(names, values, strict=True))}
            if "seeds" in point:
                point["seed"] = point.pop("seeds")
            lists = [
                own.get(n, [None]) if point.get("sampler") in tuned[n] else [None] for n in tuned
            ]
            for chosen in itertools.product(*lists):
                full = {**point, **dict(zip(tuned, chosen, strict=True))}
                points.setdefault(json.dumps(full, sort_keys=True), full)
    if not points:
        raise GridError("the grid is empty: a list of values (or its narrowing) is empty")
    return list(points.values())


def narrow(
    block: Mapping[str, Any], typed: Mapping[str, Any], tuned: Collection[str]
) -> dict[str, Any]:
    """A config block under command-line flags: an axis the block sets keeps only the typed
    values, any other option is replaced; a ``tuned`` option leaves blocks without it alone."""
    result = dict(block)
    lists_of = set(AXES)
    for key, value in typed.items():
        if key in lists_of and block.get(key) is not None:
            wanted = _as_list(key, value)
            result[key] = [v for v in _as_list(key, block[key]) if v in wanted]
        elif key not in tuned:
            result[key] = value
    return result


def shipped_configs() -> list[str]:
    """Names of the configs shipped with sgrld, e.g. ``paper/mnist_table1``."""
    root = resources.files("sgrld.configs")
    names = []
    for folder in [root, *(p for p in root.iterdir() if p.is_dir())]:
        prefix = "" if folder == root else f"{folder.name}/"
        names += [prefix + p.name[:-5] for p in folder.iterdir() if p.name.endswith(".toml")]
    return sorted(names)


def read_config(name: str) -> tuple[str, Path | str]:
    """The TOML text of a config file path, or of a shipped config name.

    Raises:
        GridError: neither a file nor a shipped config.
    """
    path = Path(name)
    if path.is_file():
        try:
            return read_file(path).decode("utf-8"), path
        except (OSError, UnicodeDecodeError) as exc:
            raise GridError(f"--config {name}: cannot read it ({exc})") from exc
    shipped = name.removesuffix(".toml")
    resource = resources.files("sgrld.configs").joinpath(*f"{shipped}.toml".split("/"))
    if resource.is_file():
        return resource.read_text(encoding="utf-8"), f"sgrld:configs/{shipped}.toml"
    raise GridError(
        f"--config {name}: no such file, and not a shipped config ({', '.join(shipped_configs())})"
    )


def parse_config(text: str, source: object) -> list[dict[str, Any]]:
    """The blocks of a TOML config, defaults merged in, keys (``burn-in`` or ``burn_in``) and
    values checked (:func:`check_value`).

    Raises:
        GridError: invalid TOML, an unknown section or key, a value of the wrong kind, no
            ``[[grid]]`` block.
    """
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise GridError(f"{source}: not valid TOML ({exc})") from exc
    unknown = set(data) - {"description", "defaults", "grid"}
    if unknown:
        raise GridError(f"{source}: unknown top-level keys {sorted(unknown)}")

    def options(table: Any, where: str) -> dict[str, Any]:
        if not isinstance(table, dict):
            raise GridError(f"{source}: {where} must be a table of options, got {table!r}")
        values = {k.replace("-", "_"): v for k, v in table.items()}
        bad = sorted(set(values) - set(KEYS))
        if bad:
            raise GridError(
                f"{source}: unknown key(s) {bad} in {where}; valid keys: {', '.join(sorted(KEYS))}"
            )
        for key, value in values.items():
            check_value(key, value, f"{source}: {where}")
        return values

    defaults = options(data.get("defaults", {}), "[defaults]")
    blocks = data.get("grid", [])
    if not isinstance(blocks, list) or not blocks:
        raise GridError(f"{source}: no [[grid]] block, so the grid is empty")
    return [{**defaults, **options(b, f"[[grid]] block {i + 1}")} for i, b in enumerate(blocks)]


def run_defaults() -> dict[str, Any]:
    """The default of every option a grid may set (``sgrld sample``'s; ``seeds`` a list)."""
    defaults = {key: option.default for key, option in KEYS.items()}
    return {**defaults, "seeds": [defaults["seeds"]]}


def tuned_options() -> dict[str, list[str]]:
    """The run options tuned with ℓ (α²), each with the samplers whose metric takes it."""
    return {name: samplers_taking(name) for name in TUNED_FIELDS}


#: An option's kind: the types of its TOML values (a bool only for "bool"), and how to say it.
_KINDS: dict[str, tuple[tuple[type, ...], str]] = {
    "bool": ((bool,), "true or false"),
    "int": ((int,), "an integer"),
    "float": ((int, float), "a number"),
    "str": ((str,), "a string"),
    "table": ((dict,), "a table such as {decay = 0.95}"),
}


def check_value(key: str, value: Any, where: str, *, item: bool = False) -> None:
    """Refuse a config value of the wrong kind for its option, e.g. ``lr = true`` or ``"0.1"``.

    Raises:
        GridError: the value, or an item of an axis' list, is not of the option's kind.
    """
    if key == "seeds":
        return  # parse_seeds checks ranges and integers
    option = KEYS[key]
    if isinstance(value, list):
        if item or not option.axis:
            raise GridError(
                f"{where}: {key} takes one value, got a list {value!r} (only "
                f"{', '.join(a for a in AXES)} take lists)"
            )
        for one in value:
            check_value(key, one, where, item=True)
        return
    if value is None:
        return
    types, expected = _KINDS[option.kind]
    if not isinstance(value, types) or (isinstance(value, bool) and option.kind != "bool"):
        raise GridError(f"{where}: {key} must be {expected}, got {value!r}")
    if option.choices is not None and value not in option.choices:
        raise GridError(f"{where}: {key} must be one of {', '.join(option.choices)}, got {value!r}")


@dataclass(frozen=True)
class PlannedRun:
    """One run of the grid: its full config (``RunConfig.to_dict``) and folder under ``OUT``."""

    config: dict[str, Any]
    path: str

    @property
    def sampler(self) -> str:
        return str(self.config["sampler"])


def place_runs(configs: Sequence[dict[str, Any]]) -> list[PlannedRun]:
    """Give each run its folder ``<setting>/<sampler>/<label>``, unique within the grid (fields
    outside :data:`PATH_FIELDS` that vary in the grid join the setting's name)."""
    in_path = set(PATH_FIELDS)
    varying = [
        name
        for name in (configs[0] if configs else {})
        if name not in in_path and len({json.dumps(c[name]) for c in configs}) > 1
    ]
    runs = [
        PlannedRun(c, f"{setting_name(c, varying)}/{c['sampler']}/{run_label(c)}") for c in configs
    ]
    by_path: dict[str, PlannedRun] = {}
    for run in runs:
        other = by_path.setdefault(run.path, run)
        if other is not run:
            differ = [k for k in run.config if run.config[k] != other.config.get(k)]
            values = ", ".join(f"{k} {other.config[k]!r} and {run.config[k]!r}" for k in differ)
            raise GridError(
                f"two runs of the grid would share the folder {run.path} ({values}): values "
                "that agree in 6 significant digits name one folder; make them differ more"
            )
    return sorted(runs, key=lambda r: r.path)


def read_manifest(path: Path) -> dict[str, Any]:
    """A manifest's contents, checked for shape.

    Raises:
        GridError: unreadable, not JSON, not a sgrld sweep manifest (of a known format).
    """
    try:
        saved = json.loads(read_file(path).decode("utf-8"))
        if not isinstance(saved, dict) or saved.get("format") not in (
            MANIFEST_FORMAT,
            *OLD_MANIFEST_FORMATS,
        ):
            raise ValueError(f"not a sgrld sweep manifest ({MANIFEST_FORMAT})")
        runs = saved["runs"]
        if not isinstance(runs, list) or not all(
            isinstance(r, dict)
            and isinstance(r.get("path"), str)
            and isinstance(r.get("config"), dict)
            for r in runs
        ):
            raise ValueError("its runs are not a list of {path, config}")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise GridError(
            f"cannot read {path}: {exc}; delete it and run the sweep again to rebuild it "
            "from the run folders"
        ) from exc
    return saved


def _config_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> tuple[list[str], bool]:
    """The fields (as flags) in which a run's saved config differs from the planned one, other
    than a grown ``epochs``; and whether ``epochs`` grew."""
    grown = False
    changed = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if a == b:
            continue
        growable = key == "epochs" and new.get("schedule") != "cyclical"
        if growable and isinstance(a, int) and isinstance(b, int) and b > a:
            grown = True
            continue
        changed.append(f"{flag_of(key)} {a!r} there, {b!r} here")
    return changed, grown


def check_out_folder(out: Path, runs: Sequence[PlannedRun], options: Mapping[str, Any]) -> str:
    """How ``out`` stands to this grid, before any work.

    Returns:
        ``"new"`` (no manifest, or a lost one rebuilt from its runs), ``"same"`` or ``"grown"``
        (this grid with a larger ``--epochs``: finished runs are extended).

    Raises:
        GridError: ``out`` holds another grid, this grid with other options, runs of no
            manifest that are not this grid's, or an unreadable manifest.
    """
    path = out / MANIFEST_FILE
    if out.exists() and not out.is_dir():
        raise GridError(f"--out {out} exists and is not a directory")
    if not path.exists() and not path.is_symlink():
        _check_orphan_runs(out, runs)
        return "new"
    saved = read_manifest(path)
    mismatched = [
        f"{flag} {saved['options'].get(name)!r} there, {options.get(name)!r} here"
        for name, flag in CHAIN_OPTIONS.items()
        if "options" in saved and saved["options"].get(name) != options.get(name)
    ]
    if mismatched:
        raise GridError(
            f"--out {out} was swept with other options that shape its chains ("
            + "; ".join(mismatched)
            + "): give the same values, or choose another --out"
        )
    theirs = {r["path"]: r["config"] for r in saved["runs"]}
    ours = {r.path: r.config for r in runs}
    if set(theirs) != set(ours):
        raise GridError(
            f"--out {out} holds another grid (from {saved.get('source')}): "
            f"{len(set(theirs) - set(ours))} of its {len(theirs)} runs are not in this grid and "
            f"{len(set(ours) - set(theirs))} of this grid's {len(ours)} runs are not in it; "
            "choose another --out (sgrld report reads several folders)"
        )
    any_grown = False
    for run_path in sorted(ours):
        changed, grown = _config_changes(theirs[run_path], ours[run_path])
        if changed:
            raise GridError(
                f"--out {out} holds this grid's runs made with other options ({run_path}: "
                + "; ".join(changed)
                + "): give the same values (--epochs may only grow), or choose another --out"
            )
        any_grown |= grown
    return "grown" if any_grown else "same"


def _check_orphan_runs(out: Path, runs: Sequence[PlannedRun]) -> None:
    """Runs in ``out`` without a manifest must be this grid's own (a lost manifest is rebuilt)."""
    if not out.is_dir():
        return
    ours = {r.path: r.config for r in runs}
    for results in sorted(out.rglob("results.json")):
        where = results.parent.relative_to(out).as_posix()
        if where.split("/")[0] == ".packs":
            continue
        try:
            config = json.loads(read_file(results).decode("utf-8"))["config"]
        except (OSError, ValueError, KeyError, TypeError):
            config = None
        if where not in ours or (config is not None and _config_changes(config, ours[where])[0]):
            raise GridError(
                f"--out {out} holds runs that no sweep manifest ({MANIFEST_FILE}) describes and "
                f"that are not runs of this grid (e.g. {where}); choose an empty or new folder, "
                f"or, if its {MANIFEST_FILE} was lost, run the sweep with the grid (flags or "
                "--config) that made these runs: it rebuilds the manifest from them"
            )


def write_manifest(
    out: Path, runs: Sequence[PlannedRun], source: str, options: Mapping[str, Any]
) -> None:
    """Write ``out/sweep.json``, which pins ``out`` to one grid and its :data:`CHAIN_OPTIONS`.

    Raises:
        OSError: it cannot be written (e.g. a read-only ``out``).
    """
    from sgrld.experiments.base.files import write_atomic

    manifest = {
        "format": MANIFEST_FORMAT,
        "source": source,
        "options": dict(options),
        "num_runs": len(runs),
        "runs": [{"path": r.path, "config": r.config} for r in runs],
    }
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / MANIFEST_FILE, json.dumps(manifest, indent=1) + "\n")
