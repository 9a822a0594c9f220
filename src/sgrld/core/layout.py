"""Flat layout of a group of parameter tensors: one contiguous ``(*batch, D)`` buffer holds them
back to back (``batch`` = ``()`` or ``(K,)`` for K chains), so global reductions are single
kernels and noise is one draw.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from sgrld.core.shards import ShardSpec, local


@dataclass(frozen=True)
class FlatLayout:
    """Where each parameter tensor lives inside a flat buffer.

    Attributes:
        names: parameter names, in order.
        shapes: per-parameter shapes *without* the chain dimension.
        batch_shape: ``()`` for one chain, ``(K,)`` for K chains in a leading dimension.
        shards: for sharded parameters (FSDP2), where the local shards lie in the whole tensors
            (:mod:`sgrld.core.shards`); ``None`` for whole tensors.
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    batch_shape: tuple[int, ...] = ()
    shards: ShardSpec | None = field(default=None, compare=False)

    @staticmethod
    def from_tensors(
        names: Sequence[str], tensors: Sequence[Tensor], num_chains: int | None = None
    ) -> FlatLayout:
        """Build a layout; with ``num_chains`` the first dim of every tensor is the chain dim."""
        if num_chains is None:
            shards = ShardSpec.of(names, tensors)
            shapes = tuple(tuple(local(t).shape) for t in tensors)
            return FlatLayout(tuple(names), shapes, (), shards)
        for name, t in zip(names, tensors, strict=True):
            if t.dim() == 0 or t.shape[0] != num_chains:
                raise ValueError(
                    f"parameter {name!r} has shape {tuple(t.shape)}; with num_chains={num_chains} "
                    "every tensor needs a leading chain dimension of that size"
                )
        return FlatLayout(tuple(names), tuple(tuple(t.shape[1:]) for t in tensors), (num_chains,))

    @property
    def numels(self) -> tuple[int, ...]:
        return tuple(math.prod(s) for s in self.shapes)

    @property
    def offsets(self) -> tuple[int, ...]:
        out, acc = [], 0
        for n in self.numels:
            out.append(acc)
            acc += n
        return tuple(out)

    @property
    def size(self) -> int:
        """Number of parameters D of one chain."""
        return sum(self.numels)

    def empty(self, dtype: torch.dtype, device: torch.device | str) -> Tensor:
        return torch.empty((*self.batch_shape, self.size), dtype=dtype, device=device)

    def sum_(self, partial: Tensor, name: str | None = None) -> Tensor:
        """``partial`` summed over the ranks that hold the shards (in place, by ``name`` if summed
        ahead); itself when the tensors are whole."""
        return partial if self.shards is None else self.shards.sum_(partial, name)

    @property
    def full_numels(self) -> tuple[int, ...]:
        """Elements of each whole tensor (of the local shard's tensor when sharded)."""
        return self.numels if self.shards is None else self.shards.full_numels

    def zeros(self, dtype: torch.dtype, device: torch.device | str) -> Tensor:
        return torch.zeros((*self.batch_shape, self.size), dtype=dtype, device=device)

    def segments(self, flat: Tensor) -> list[Tensor]:
        """Views of ``flat`` (``(*batch, D)``), one ``(*batch, numel)`` slice per parameter."""
        return list(flat.split(self.numels, dim=-1))

    def views(self, flat: Tensor) -> list[Tensor]:
        """Views of ``flat`` shaped like the parameters (chain dimension first)."""
        return [
            seg.view((*self.batch_shape, *shape))
            for seg, shape in zip(self.segments(flat), self.shapes, strict=True)
        ]

    def gather(self, tensors: Sequence[Tensor], out: Tensor) -> Tensor:
        """Copy parameter-shaped tensors into the flat buffer ``out`` (one kernel)."""
        nb = len(self.batch_shape)
        torch.cat([t.reshape(*t.shape[:nb], -1) for t in tensors], dim=-1, out=out)
        return out


def check_one_buffer(names: Sequence[str], tensors: Sequence[Tensor], hint: str = "") -> None:
    """Tensors stepped as one flat buffer: one dtype and device, floating point."""
    first = tensors[0]
    for name, t in zip(names, tensors, strict=True):
        if t.dtype != first.dtype or t.device != first.device:
            raise ValueError(
                f"parameter {name!r} is {t.dtype} on {t.device}, {names[0]!r} {first.dtype} "
                f"on {first.device}: the parameters are stepped as one flat buffer, so they "
                f"must share dtype and device{hint}"
            )
        if not t.is_floating_point():
            raise ValueError(f"parameter {name!r} is {t.dtype}: expected floating point")
