"""A group's sampler state as ``torch.optim`` keeps state: per parameter, views of the engine's
flat buffers (``"element"`` statistics parameter-shaped, ``"tensor"`` ones 0-d, a PerTensor one
in its parameter, ``"global"`` ones and the noise key and check flags on the first), DTensors of
the global shape under FSDP2 (Shampoo's factors: the rank's own, :func:`shard_key`); loading
validates dicts against a fresh state before copying them in.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from sgrld.core.contract import Metric, PerTensor
from sgrld.core.shards import ShardSpec, is_sharded, local, rows_of
from sgrld.core.state import SamplerState

#: per-parameter entries that are not statistics (the group's own on its first parameter)
STEP, NOISE_KEY, CHECK_FLAGS, GENERATOR = "step", "noise_key", "check_flags", "generator"
#: a low-precision parameter's master copy (:mod:`sgrld.core.precision`)
MASTER = "master"


def publish(metric: Metric, state: SamplerState) -> list[dict[str, Tensor]]:
    """Per-parameter dicts of views of ``state`` (single chain), in the layout order."""
    layout = state.layout
    if layout.batch_shape:
        raise ValueError("optimizer state holds one chain (use sgrld.Chains for many)")
    entries: list[dict[str, Tensor]] = [{STEP: state.device_step.view(())} for _ in layout.names]
    kinds = metric.stat_kinds(layout)
    shards = layout.shards
    for key, value in state.stats.items():
        kind = kinds[key]
        if isinstance(kind, PerTensor):
            stat = kind.stat
            entries[kind.tensor][stat if shards is None else shard_key(stat, shards)] = value
        elif kind == "element":
            for j, (entry, view) in enumerate(zip(entries, layout.views(value), strict=True)):
                if shards is None:
                    entry[key] = view
                elif j in shards.uneven:  # a masked shard: the rank's own (no global view)
                    entry[shard_key(key, shards)] = view
                else:
                    entry[key] = shards.global_view(view, j)
        elif kind == "tensor":
            for j, entry in enumerate(entries):
                entry[key] = value.select(-1, j)
        else:
            entries[0][key] = value
    entries[0][NOISE_KEY] = state.keys
    entries[0][CHECK_FLAGS] = state.flags
    return entries


def shard_key(stat: str, shards: ShardSpec) -> str:
    """The name of a per-tensor statistic of one rank's shard (rank and world size in the name: a
    checkpoint of W ranks loads on W ranks only).
    """
    return f"{stat}#shard{shards.rank}of{shards.world}"


def _shard_of(value: Tensor, target: Tensor) -> Tensor:
    """The part of ``value`` (global view or whole tensor) the sharded ``target`` holds here."""
    if is_sharded(value):
        if tuple(value.placements) == tuple(target.placements):  # type: ignore[attr-defined]
            return local(value)
        value = value.full_tensor()  # type: ignore[attr-defined]
    mesh = target.device_mesh  # type: ignore[attr-defined]
    first, count = rows_of(value.shape[0], mesh.size(), mesh.get_coordinate()[0])
    return value[first : first + count]


def plan_load(
    mine: list[dict[str, Tensor]],
    saved: list[Any],
    names: list[str],
    label: str,
    extra: tuple[str, ...] = (),
    optional: tuple[str, ...] = (),
) -> list[tuple[Tensor, Tensor]]:
    """Validate ``saved`` per-parameter dicts against ``mine`` (:func:`publish` of a fresh state)
    and return the ``(target, value)`` copies that load them; changes nothing.

    ``extra`` keys of the first parameter are allowed and skipped, ``optional`` ones may be missing
    (a master copy, then kept); shapes must match; floating-point values are cast as torch.optim
    does and must be finite; integer entries must be integers.
    """
    copies: list[tuple[Tensor, Tensor]] = []
    for i, (entry, got, name) in enumerate(zip(mine, saved, names, strict=True)):
        where = f"{label}, parameter {name!r}"
        if not isinstance(got, Mapping):
            raise ValueError(f"{where}: no state (expected a dict of tensors)")
        allowed = set(entry) | (set(extra) if i == 0 else set())
        missing = sorted(set(entry) - set(got) - set(optional))
        unknown = sorted(set(got) - allowed)
        if missing or unknown:
            raise ValueError(
                f"{where}: the state does not match this sampler (missing {missing}, "
                f"unknown {unknown})"
            )
        for key, target in entry.items():
            if key not in got:
                continue  # an optional entry
            value = got[key]
            if key == STEP and isinstance(value, (int, float)) and not isinstance(value, bool):
                value = torch.tensor(value)
            if not isinstance(value, Tensor):
                raise ValueError(f"{where}: {key!r} is a {type(value).__name__}, not a tensor")
            if value.is_sparse or value.shape != target.shape:
                raise ValueError(
                    f"{where}: {key!r} has shape {tuple(value.shape)}, expected "
                    f"{tuple(target.shape)}"
                )
            if is_sharded(target):
                target, value = local(target), _shard_of(value, target)
            if target.is_floating_point():
                if not value.is_floating_point():
                    raise ValueError(f"{where}: {key!r} is {value.dtype}, expected floating point")
                if not bool(torch.isfinite(value).all()):
                    raise ValueError(f"{where}: {key!r} holds NaN or Inf (damaged state)")
            else:
                if value.is_floating_point() and not bool((value == value.round()).all()):
                    raise ValueError(f"{where}: {key!r} holds non-integers")
                if key == STEP and int(value) < 0:
                    raise ValueError(f"{where}: step is {int(value)}, expected >= 0")
            copies.append((target, value))
    steps = {int(got[STEP]) for got in saved}
    if len(steps) > 1:
        raise ValueError(f"{label}: the parameters of one group disagree on the step ({steps})")
    return copies


def apply_load(copies: list[tuple[Tensor, Tensor]]) -> None:
    """Copy validated values into place (casting dtype and device; cannot fail)."""
    with torch.no_grad():
        for target, value in copies:
            target.copy_(value.to(device=target.device, dtype=target.dtype))
