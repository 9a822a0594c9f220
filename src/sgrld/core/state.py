"""Sampler state: everything a step depends on, so that save → load → continue is exact."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from sgrld.core.layout import FlatLayout
from sgrld.core.noise import NoiseBuffer
from sgrld.core.warmup import Arrival


@dataclass
class Workspace:
    """Preallocated flat scratch buffers (not part of the state: recreated on demand)."""

    grad: Tensor
    noise: NoiseBuffer
    layout: FlatLayout
    # parameter-shaped views of the two buffers (by: is it ``grad``), made once (an eager step's
    # Python overhead)
    _views: dict[bool, list[Tensor]] = field(default_factory=dict, repr=False)

    @staticmethod
    def for_layout(layout: FlatLayout, like: Tensor) -> Workspace:
        shape = (*layout.batch_shape, layout.size)
        shards = layout.shards
        # sharded: each shard's noise at its elements' global indices (sgrld.core.shards)
        segments = None if shards is None else list(zip(shards.starts, layout.numels, strict=True))
        return Workspace(
            layout.empty(like.dtype, like.device),
            NoiseBuffer(shape, like.dtype, like.device, segments),
            layout,
        )

    def gather(self, tensors: Sequence[Tensor]) -> Tensor:
        """Copy the parameter-shaped ``tensors`` into ``grad`` and return it (eagerly one
        ``_foreach_copy_``: parallel, where ``cat`` copies on one thread).
        """
        if torch.compiler.is_compiling():  # a traced step: the one cat node inductor fuses
            return self.layout.gather(tensors, self.grad)
        torch._foreach_copy_(self.views(self.grad), list(tensors))
        return self.grad

    def views(self, flat: Tensor) -> list[Tensor]:
        """``layout.views(flat)``, cached for this workspace's own buffers."""
        # a traced step: views are free, the cache is not
        if torch.compiler.is_compiling() or not (flat is self.grad or flat is self.noise.flat):
            return self.layout.views(flat)
        is_grad = flat is self.grad
        if is_grad not in self._views:
            self._views[is_grad] = self.layout.views(flat)
        return self._views[is_grad]


@dataclass
class SamplerState:
    """State of one group of parameters under one sampler.

    Attributes:
        params: the parameters (updated in place by :meth:`sgrld.core.sampler.Sampler.step`).
        stats: the metric's statistics (see :mod:`sgrld.core.contract`).
        step: number of steps taken so far (host counter: schedules read it without a sync).
        generator: the random generator that drives ``noise="torch"``.
        layout: the flat layout of ``params``.
        keys: ``(*batch, 2)`` int64 Philox keys, one per chain (zeros unless ``noise="philox"``).
        device_step: the step count as a 0-d int64 tensor on the parameters' device.
        flags: ``(*batch, 2)`` int64 deferred-check flags per chain: the first step whose gradient
            was non-finite (0: none) and the index of its first bad tensor.
        center: the localisation's centre θ₀, copies of the parameters at ``init`` (or ``None``).
    """

    params: dict[str, Tensor]
    stats: dict[str, Tensor]
    step: int
    generator: torch.Generator
    layout: FlatLayout
    keys: Tensor = field(default=None)  # type: ignore[assignment]  # set in __post_init__
    device_step: Tensor = field(default=None)  # type: ignore[assignment]
    flags: Tensor = field(default=None)  # type: ignore[assignment]
    workspace: Workspace | None = field(default=None, repr=False, compare=False)
    #: how its steps run (:class:`sgrld.core.engine.Plan`), decided at the first step
    plan: object = field(default=None, repr=False, compare=False)
    center: list[Tensor] | None = None
    #: whether the warm-up waits for the chain (:class:`sgrld.core.warmup.Arrival`; ``None``: no)
    warmup: Arrival | None = None

    def __post_init__(self) -> None:
        device = next(iter(self.params.values())).device
        batch = self.layout.batch_shape
        if self.keys is None:
            self.keys = torch.zeros((*batch, 2), dtype=torch.int64, device=device)
        if self.device_step is None:
            self.device_step = torch.tensor(self.step, dtype=torch.int64, device=device)
        if self.flags is None:
            self.flags = torch.zeros((*batch, 2), dtype=torch.int64, device=device)

    def state_dict(self) -> dict[str, Any]:
        """Statistics, step, generator state, Philox keys, check flags and the localisation's
        centre if any (not the parameters, which the caller saves)."""
        sd = {
            "stats": {k: v.clone() for k, v in self.stats.items()},
            "step": self.step,
            "generator": self.generator.get_state(),
            "keys": self.keys.clone(),
            "flags": self.flags.clone(),
        }
        if self.center is not None:
            sd["center"] = [c.clone() for c in self.center]
        if self.warmup is not None:
            warmup: dict[str, Any] = {
                "sums": self.warmup.sums.clone(),
                "extensions": self.warmup.extensions,
            }
            if self.warmup.count.dim():  # K chains: each one's windows (a frozen one's fewer)
                warmup["chains"] = self.warmup.count.clone()
            sd["warmup"] = warmup
        return sd

    def validate_state_dict(self, sd: Any, label: str = "state dict") -> None:
        """Refuse ``sd`` unless it fits this state exactly (keys, shapes, dtypes, finite statistics,
        ``step`` an int >= 0, a generator state this generator accepts); changes nothing.
        """
        if not isinstance(sd, dict) or not {"stats", "step", "generator"} <= set(sd):
            raise ValueError(f"{label} is not a sampler state (needs stats, step and generator)")
        stats = sd["stats"]
        if not isinstance(stats, dict) or set(stats) != set(self.stats):
            got = set(stats) if isinstance(stats, dict) else set()
            diff = sorted(set(self.stats) ^ got)
            raise ValueError(f"{label} does not match this sampler (statistics {diff})")
        for k, v in stats.items():
            mine = self.stats[k]
            if not isinstance(v, Tensor) or v.shape != mine.shape:
                shape = tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__
                raise ValueError(
                    f"{label}: statistic {k!r} has shape {shape}, expected {tuple(mine.shape)}"
                )
            if v.dtype != mine.dtype:
                raise ValueError(f"{label}: statistic {k!r} is {v.dtype}, expected {mine.dtype}")
            if v.is_floating_point() and not bool(torch.isfinite(v).all()):
                raise ValueError(f"{label}: statistic {k!r} holds NaN or Inf (damaged state)")
        step = sd["step"]
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"{label}: step is {step!r}, expected an integer >= 0")
        for name in ("keys", "flags"):
            if name in sd:
                v, mine = sd[name], getattr(self, name)
                if not isinstance(v, Tensor) or v.shape != mine.shape or v.dtype != mine.dtype:
                    raise ValueError(f"{label}: {name} do not match this sampler's chains")
        if (self.center is None) != ("center" not in sd) or (
            self.center is not None
            and [(c.shape, c.dtype) for c in sd["center"]]
            != [(c.shape, c.dtype) for c in self.center]
        ):
            raise ValueError(f"{label}: the localisation's centre does not match this sampler")
        if self.warmup is not None and "warmup" in sd:
            saved = sd["warmup"]
            sums = saved.get("sums") if isinstance(saved, dict) else None
            ext = saved.get("extensions") if isinstance(saved, dict) else None
            if not isinstance(sums, Tensor) or sums.shape != self.warmup.sums.shape:
                raise ValueError(f"{label}: the warm-up's statistics do not match this sampler")
            if not isinstance(ext, int) or isinstance(ext, bool) or ext < 0:
                raise ValueError(f"{label}: the warm-up's extensions are {ext!r}")
            chains = saved.get("chains", None)
            if chains is not None and (
                not isinstance(chains, Tensor)
                or chains.shape != self.warmup.count.shape
                or chains.dtype != torch.int64
                or (chains.numel() and not 0 <= int(chains.min()) <= int(chains.max()) == ext)
            ):
                raise ValueError(f"{label}: the warm-up's per-chain windows do not match")
        check_generator_state(self.generator, sd["generator"], label)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Validate everything, then restore in place (buffers and views of them stay valid)."""
        self.validate_state_dict(sd)
        self.apply_state_dict(sd)

    def apply_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore a validated state dict (cannot fail)."""
        for k, v in sd["stats"].items():
            self.stats[k].copy_(v)
        self.step = int(sd["step"])
        self.device_step.fill_(self.step)
        self.generator.set_state(sd["generator"])
        if "keys" in sd:
            self.keys.copy_(sd["keys"])
        if "flags" in sd:
            self.flags.copy_(sd["flags"])
        if self.center is not None:
            torch._foreach_copy_(self.center, sd["center"])
        if self.warmup is not None:
            if "warmup" in sd:
                self.warmup.sums.copy_(sd["warmup"]["sums"])
                if "chains" in sd["warmup"]:
                    self.warmup.count.copy_(sd["warmup"]["chains"])
                else:  # saved before each chain froze on its own: all of them wait alike
                    self.warmup.count.fill_(sd["warmup"]["extensions"])
            else:  # a state dict from before the warm-up waited: its windows, as they were
                self.warmup = None


def check_generator_state(generator: torch.Generator, saved: Any, label: str) -> None:
    """Refuse a saved state that ``generator`` would not accept (tried on a scratch one)."""
    probe = torch.Generator(device=generator.device)
    try:
        probe.set_state(saved)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{label}: invalid generator state ({exc})") from None


def new_generator(
    device: torch.device | str, seed_from: torch.Generator | None = None
) -> torch.Generator:
    """A private generator seeded from ``seed_from`` (default: torch's global generator)."""
    seed = int(torch.randint(0, 2**62, (), generator=seed_from).item())
    return torch.Generator(device=device).manual_seed(seed)
