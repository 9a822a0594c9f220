"""Loading an optimizer state dict, validated completely before anything is applied: torch.optim's
format, or sgrld's first (a flat sampler state per group under ``"sgrld"``), converted
(:func:`from_first_format`); group options a dict predates take their values from before.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from sgrld.core.contract import Metric
from sgrld.core.noise import keys_from_generator, keys_from_seeds
from sgrld.core.param_state import GENERATOR, MASTER, apply_load, plan_load
from sgrld.core.state import check_generator_state
from sgrld.optim.groups import (
    WARMUP_COUNT,
    WARMUP_SUMS,
    GroupChain,
    Recipe,
    group_metric,
    publish_group,
    validate_group,
)
from sgrld.optim.watch import WATCH_KEY, first_window

#: the value each facade option had before it existed (what an older state dict ran with): it
#: adapted throughout; RMSprop's and Adam's ε was absolute (no floor); Monge's α² was fixed
BEFORE_IT_EXISTED: dict[str, Any] = {
    "adapt_metric": True,
    "adapt_until": None,
    "floor": 0.0,
    "alpha2_rule": "fixed",
}


def new_key(noise: str, generator: torch.Generator, device: torch.device) -> Tensor:
    """A new group's noise key: Philox's drawn from ``generator``; a ``noise="torch"`` group's (a
    traced step's) from the generator's seed."""
    if noise == "philox":
        return keys_from_generator((), generator, device)
    return keys_from_seeds([generator.initial_seed() % 2**64], device)[0]


@dataclasses.dataclass(frozen=True)
class Load:
    """A validated load, which cannot fail: the groups, their fresh chains, the health watch's
    reference, the generator's state and the copies into the fresh states."""

    groups: list[dict[str, Any]]
    fresh: list[GroupChain]
    watch_first: dict[str, float] | None
    generator_state: Tensor
    copies: list[Any]

    def copy(self) -> None:
        """The state dict's tensors into the fresh states, their step counters from them."""
        apply_load(self.copies)
        for chain in self.fresh:
            chain.state.step = int(chain.state.device_step.item())


def plan(
    recipe: Recipe,
    param_groups: list[dict[str, Any]],
    generator: torch.Generator,
    state_dict: dict[str, Any],
) -> Load:
    """Validate ``state_dict`` for the optimizer of ``param_groups`` made by ``recipe`` (its
    generator ``generator``) completely; what applying it takes (:class:`Load`)."""
    saved_groups = state_dict.get("param_groups")
    if not isinstance(saved_groups, list) or len(saved_groups) != len(param_groups):
        have = len(saved_groups) if isinstance(saved_groups, list) else 0
        raise ValueError(
            f"the state dict has {have} parameter groups, this optimizer {len(param_groups)}"
        )
    saved_state = state_dict.get("state")
    if not isinstance(saved_state, dict):
        raise ValueError("not an optimizer state dict (no 'state' entry)")
    pairs = enumerate(zip(param_groups, saved_groups, strict=True))
    loaded = [load_group(recipe, mine, index, saved) for index, (mine, saved) in pairs]
    groups, metrics = [group for group, _ in loaded], [metric for _, metric in loaded]
    if "sgrld" in state_dict:
        saved_state = from_first_format(
            recipe, generator, state_dict["sgrld"], saved_groups, groups, metrics
        )
    watch_first = first_window(state_dict.get(WATCH_KEY))
    first = saved_state.get(saved_groups[0]["params"][0])
    generator_state = first.get(GENERATOR) if isinstance(first, dict) else None
    if generator_state is None:
        raise ValueError("param group 0: the state dict has no generator state")
    check_generator_state(generator, generator_state, "the state dict")
    fresh, copies = [], []
    for index, (saved, metric) in enumerate(zip(saved_groups, metrics, strict=True)):
        chain = recipe.chain(groups[index], index, generator, metric)
        entries = [saved_state.get(pid) for pid in saved["params"]]
        # saved where the warm-up could not wait (sharded, captured): it resumes so
        saved_first = entries[0] if isinstance(entries[0], dict) else {}  # else refused below
        if chain.state.warmup is not None and saved_first and WARMUP_SUMS not in saved_first:
            chain.state.warmup = None
        mine = publish_group(metric, chain.state, chain.standins)
        # a waiting warm-up's entries load where the group waits, are skipped where it cannot
        # (a capturable optimizer keeps Stan's fixed windows: core.warmup)
        extra = (GENERATOR, WARMUP_SUMS, WARMUP_COUNT) if index == 0 else ()
        copies += plan_load(mine, entries, chain.names, f"param group {index}", extra, (MASTER,))
        fresh.append(chain)
    return Load(groups, fresh, watch_first, generator_state, copies)


def load_group(
    recipe: Recipe, mine: dict[str, Any], index: int, saved: Any
) -> tuple[dict[str, Any], Metric]:
    """Group ``index`` (now ``mine``) as it will be after loading ``saved`` (validated, options
    missing from an older dict filled in) and its metric."""
    label = f"param group {index}"
    if not isinstance(saved, dict) or not isinstance(saved.get("params"), list):
        raise ValueError(f"{label}: not a parameter group")
    if len(saved["params"]) != len(mine["params"]):
        raise ValueError(
            f"{label}: the state dict has {len(saved['params'])} parameters, this optimizer "
            f"{len(mine['params'])}"
        )
    group = {k: v for k, v in saved.items() if k != "params"}
    defaults = {f.name: f.default for f in dataclasses.fields(recipe.metric)}  # type: ignore[arg-type]
    defaults.update(BEFORE_IT_EXISTED)
    for key in mine:
        if key not in group and key != "params":
            default = defaults.get(key, dataclasses.MISSING)
            group[key] = mine[key] if default is dataclasses.MISSING else default
    group["params"] = mine["params"]
    if "param_names" in mine:
        group["param_names"] = mine["param_names"]
    try:
        validate_group(group["lr"], group["num_data"], group["temperature"], group["adapt_until"])
        metric = group_metric(recipe.metric, group)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{label}: {exc}") from None
    return group, metric


def from_first_format(
    recipe: Recipe,
    generator: torch.Generator,
    extra: Any,
    saved_groups: list[dict[str, Any]],
    groups: list[dict[str, Any]],
    metrics: list[Metric],
) -> dict[int, dict[str, Tensor]]:
    """Today's per-parameter ``state`` from the first format's flat group states: each is loaded
    into a fresh state of its group, whose entries are then published, as that optimizer would
    have continued (a group never stepped draws its Philox key at the load, as the first
    format did at its first step; the generator then is the one that drew it)."""
    if not isinstance(extra, dict) or not {"generator", "groups"} <= set(extra):
        raise ValueError("not an sgrld optimizer state dict (no valid 'sgrld' entry)")
    if not isinstance(extra["groups"], list) or len(extra["groups"]) != len(groups):
        raise ValueError("the state dict's sgrld entry does not match its parameter groups")
    check_generator_state(generator, extra["generator"], "the state dict")
    generator = torch.Generator(generator.device)
    generator.set_state(extra["generator"])
    out: dict[int, dict[str, Tensor]] = {}
    for index, (saved, metric) in enumerate(zip(extra["groups"], metrics, strict=True)):
        label = f"param group {index}"
        chain = recipe.chain(groups[index], index, generator, metric)
        state = chain.state
        if saved is not None:
            shapes = saved.get("shapes") if isinstance(saved, dict) else None
            mine = [list(s) for s in state.layout.shapes]
            if shapes is not None and shapes != mine:
                raise ValueError(
                    f"{label}: the state dict is for parameters of shapes {shapes}, these are "
                    f"{mine}"
                )
            state.validate_state_dict(saved, label)
            state.apply_state_dict(saved)
        noise = chain.sampler.noise
        if saved is None or noise != "philox":
            state.keys.copy_(new_key(noise, generator, state.keys.device))
        entries = publish_group(metric, state, chain.standins)
        out.update(zip(saved_groups[index]["params"], entries, strict=True))
    out[saved_groups[0]["params"][0]][GENERATOR] = generator.get_state()
    return out
