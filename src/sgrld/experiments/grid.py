"""A sweep's grid: comma lists and seed ranges, TOML configs, expansion, run folders, manifest.

Nothing here imports torch: a grid is planned, checked and listed before any work starts.

A grid is the union of *blocks*; a block maps run options (the ``sgrld sample`` flags, by their
argparse names) to a value or, for the axes in :data:`AXES`, a list of values, and contributes
the product of its lists. Monge's α² multiplies Monge's runs only: the other samplers of a block
run once per ℓ and seed whatever the α² list.

Config files (``--config FILE.toml`` or a shipped name such as ``paper/mnist_table1``)::

    description = "what the grid is for"
    [defaults]              # options shared by every block
    dataset = "mnist"
    epochs = 400
    seeds = "0-9"
    [[grid]]                # one block; as many as needed
    width = [400, 800]
    prior = "gaussian"
    sampler = "identity"
    lr = [0.01, 0.025, 0.05]
"""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 (the tomli dependency has a version marker)
    import tomli as tomllib

#: Options that take a list in a sweep (``seeds`` also takes ranges such as ``0-9``).
AXES = ("sampler", "width", "prior", "lr", "alpha2", "seeds", "adapt")
MANIFEST_FILE = "sweep.json"
MANIFEST_FORMAT = "sgrld-sweep/1"
#: Config fields that name a run's folder: ``<setting>/<sampler>/<label>``.
PATH_FIELDS = ("dataset", "model", "width", "prior", "sampler", "lr", "alpha2", "seed")


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
    for item in items:
        if isinstance(item, int) and not isinstance(item, bool):
            if item < 0:
                raise GridError(f"seeds must be >= 0, got {item}")
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
        seeds.update(range(first, last + 1))
    if not seeds:
        raise GridError("seeds: no seed given")
    return sorted(seeds)


def comma_list(
    item_type: Callable[[str], Any], choices: Iterable[Any] | None = None
) -> Callable[[str], list[Any]]:
    """An argparse ``type`` reading ``a,b,c`` as a list of ``item_type`` values from ``choices``."""
    valid = None if choices is None else tuple(choices)

    def parse(text: str) -> list[Any]:
        values = []
        for part in text.split(","):
            if not part.strip():
                raise ValueError(f"empty item in {text!r}")
            value = item_type(part.strip())
            if valid is not None and value not in valid:
                raise ValueError(f"{value!r} is not one of {', '.join(map(str, valid))}")
            values.append(value)
        return values

    parse.__name__ = f"comma-separated {getattr(item_type, '__name__', 'value')}"
    return parse


def _as_list(key: str, value: Any) -> list[Any]:
    if key == "seeds":
        return parse_seeds(value) if value != [] else []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def expand(blocks: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Every point of the union of the blocks' products (α² for Monge only), without repeats.

    Each point maps option names to one value, with ``seed`` for ``seeds``.

    Raises:
        GridError: no point at all, or α² values with no Monge run in a block.
    """
    if not blocks:
        raise GridError("the grid is empty: no block of runs")
    points: dict[str, dict[str, Any]] = {}
    for block in blocks:
        fixed = {k: v for k, v in block.items() if k not in AXES}
        axes = {k: _as_list(k, v) for k, v in block.items() if k in AXES and k != "alpha2"}
        alpha2 = _as_list("alpha2", block["alpha2"]) if block.get("alpha2") is not None else None
        samplers = axes.get("sampler", [])
        if alpha2 is not None and samplers and "monge" not in samplers:
            raise GridError("alpha2 is a Monge option, and this block has no monge run")
        names = list(axes)
        for values in itertools.product(*(axes[n] for n in names)):
            point = {**fixed, **dict(zip(names, values, strict=True))}
            if "seeds" in point:
                point["seed"] = point.pop("seeds")
            monge = point.get("sampler") == "monge"
            for a2 in alpha2 if (monge and alpha2 is not None) else [None]:
                full = {**point, "alpha2": a2}
                points.setdefault(json.dumps(full, sort_keys=True), full)
    if not points:
        raise GridError("the grid is empty: a list of values (or its narrowing) is empty")
    return list(points.values())


def narrow(block: Mapping[str, Any], typed: Mapping[str, Any]) -> dict[str, Any]:
    """A config block under command-line flags: an axis the block sets keeps only the typed
    values (``--width 400`` runs a config's width-400 part), any other option is replaced.

    Typed α² values leave blocks without α² (the other samplers) alone.
    """
    result = dict(block)
    for key, value in typed.items():
        if key in AXES and block.get(key) is not None:
            wanted = _as_list(key, value)
            result[key] = [v for v in _as_list(key, block[key]) if v in wanted]
        elif key != "alpha2":
            result[key] = value
    return result


# --- config files -----------------------------------------------------------------------------


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
        return path.read_text(encoding="utf-8"), path
    shipped = name.removesuffix(".toml")
    resource = resources.files("sgrld.configs").joinpath(*f"{shipped}.toml".split("/"))
    if resource.is_file():
        return resource.read_text(encoding="utf-8"), f"sgrld:configs/{shipped}.toml"
    raise GridError(
        f"--config {name}: no such file, and not a shipped config ({', '.join(shipped_configs())})"
    )


def parse_config(text: str, source: object, known: Iterable[str]) -> list[dict[str, Any]]:
    """The blocks of a TOML config, defaults merged in; keys checked against ``known``.

    Option names may use ``-`` or ``_`` (``burn-in`` or ``burn_in``).

    Raises:
        GridError: invalid TOML, an unknown section or key, no ``[[grid]]`` block.
    """
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise GridError(f"{source}: not valid TOML ({exc})") from exc
    unknown = set(data) - {"description", "defaults", "grid"}
    if unknown:
        raise GridError(f"{source}: unknown top-level keys {sorted(unknown)}")
    allowed = set(known)

    def options(table: Mapping[str, Any], where: str) -> dict[str, Any]:
        values = {k.replace("-", "_"): v for k, v in table.items()}
        bad = sorted(set(values) - allowed)
        if bad:
            raise GridError(
                f"{source}: unknown key(s) {bad} in {where}; "
                f"valid keys: {', '.join(sorted(allowed))}"
            )
        return values

    defaults = options(data.get("defaults", {}), "[defaults]")
    blocks = data.get("grid", [])
    if not isinstance(blocks, list) or not blocks:
        raise GridError(f"{source}: no [[grid]] block, so the grid is empty")
    return [{**defaults, **options(b, f"[[grid]] block {i + 1}")} for i, b in enumerate(blocks)]


# --- run folders and the manifest -------------------------------------------------------------


def setting_name(config: Mapping[str, Any], varying: Iterable[str] = ()) -> str:
    """``mnist-fc400-horseshoe``, plus ``-<field><value>`` for other fields the grid varies."""
    model = f"fc{config['width']}" if config["model"] == "fc" else config["model"]
    extra = "".join(f"-{name}{config[name]}" for name in sorted(varying))
    return f"{config['dataset']}-{model}-{config['prior']}{extra}"


def run_label(config: Mapping[str, Any]) -> str:
    """``lr0.25-alpha1.25-seed0`` (the α² part only for Monge)."""
    alpha = f"-alpha{config['alpha2']:g}" if config.get("alpha2") is not None else ""
    return f"lr{config['lr']:g}{alpha}-seed{config['seed']}"


@dataclass(frozen=True)
class PlannedRun:
    """One run of the grid: its full config (``RunConfig.to_dict``) and folder under ``OUT``."""

    config: dict[str, Any]
    path: str

    @property
    def sampler(self) -> str:
        return str(self.config["sampler"])


def place_runs(configs: Sequence[dict[str, Any]]) -> list[PlannedRun]:
    """Give each run its folder ``<setting>/<sampler>/<label>``, unique within the grid.

    Config fields outside :data:`PATH_FIELDS` that take several values in the grid (e.g.
    ``epochs``) are added to the setting's name, so that no two runs share a folder.
    """
    varying = [
        name
        for name in (configs[0] if configs else {})
        if name not in PATH_FIELDS and len({json.dumps(c[name]) for c in configs}) > 1
    ]
    runs = [
        PlannedRun(c, f"{setting_name(c, varying)}/{c['sampler']}/{run_label(c)}") for c in configs
    ]
    return sorted(runs, key=lambda r: r.path)


def manifest(runs: Sequence[PlannedRun], source: str) -> dict[str, Any]:
    """The JSON manifest that pins a folder to one grid."""
    return {
        "format": MANIFEST_FORMAT,
        "source": source,
        "num_runs": len(runs),
        "runs": [{"path": r.path, "config": r.config} for r in runs],
    }


def check_out_folder(out: Path, runs: Sequence[PlannedRun]) -> bool:
    """Whether ``out`` already holds this grid's manifest (``False``: a new or empty folder).

    Raises:
        GridError: ``out`` holds another grid's manifest, or runs without a manifest.
    """
    path = out / MANIFEST_FILE
    if out.exists() and not out.is_dir():
        raise GridError(f"--out {out} exists and is not a directory")
    if not path.is_file():
        if out.is_dir() and next(out.rglob("results.json"), None) is not None:
            raise GridError(
                f"--out {out} holds runs that no sweep manifest ({MANIFEST_FILE}) describes; "
                "choose an empty or new folder"
            )
        return False
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
        if saved.get("format") != MANIFEST_FORMAT:
            raise ValueError("not a sgrld sweep manifest")
        theirs = {json.dumps(r, sort_keys=True) for r in saved["runs"]}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise GridError(f"cannot read {path}: {exc}") from exc
    ours = {json.dumps({"path": r.path, "config": r.config}, sort_keys=True) for r in runs}
    if theirs != ours:
        raise GridError(
            f"--out {out} holds another grid (from {saved.get('source')}): "
            f"{len(theirs - ours)} of its {len(theirs)} runs are not in this grid and "
            f"{len(ours - theirs)} of this grid's {len(ours)} runs are not in it; "
            "choose another --out (sgrld report reads several folders)"
        )
    return True


def write_manifest(out: Path, runs: Sequence[PlannedRun], source: str) -> None:
    """Write ``out/sweep.json`` atomically."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (MANIFEST_FILE + ".tmp")
    tmp.write_text(json.dumps(manifest(runs, source), indent=1) + "\n", encoding="utf-8")
    tmp.replace(out / MANIFEST_FILE)
