"""Sharded parameters (FSDP2's DTensors, split along dim 0 as ``torch.chunk``): one chain whose
elements are spread over the ranks, exactly the one-process chain: elementwise work on the
local shards, sums over the mesh (:meth:`ShardSpec.sum_`), ξ at global indices.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor


def is_sharded(t: object) -> bool:
    """Whether ``t`` is a DTensor (an FSDP2 parameter or its gradient)."""
    # by name: importing torch.distributed.tensor costs a second, and builds without
    # torch.distributed have no DTensor at all
    return type(t).__name__ == "DTensor" or type(getattr(t, "data", None)).__name__ == "DTensor"


def local(t: Tensor) -> Tensor:
    """The rank's shard of a DTensor (the same storage); any other tensor as it is."""
    return t.to_local() if is_sharded(t) else t  # type: ignore[attr-defined]


def rows_of(size: int, world: int, coordinate: int) -> tuple[int, int]:
    """(first row, row count) of rank ``coordinate``'s shard of ``size`` rows (``torch.chunk``'s
    split).
    """
    chunk = -(-size // world)
    start = min(coordinate * chunk, size)
    return start, min(size, start + chunk) - start


@runtime_checkable
class SumsAhead(Protocol):
    """A metric whose sums over the parameters can be taken before its step runs: the engine
    all-reduces them with the finite check (one collective per step), and the metric's
    ``layout.sum_(local, name)`` then takes the sum named ``name``.
    """

    def sums_ahead(
        self, stats: dict[str, Tensor], layout: Any, grad: Tensor, noise: Tensor | None, adapt: bool
    ) -> dict[str, Tensor]:
        """This rank's shares of the step's sums, by name, as ``update`` (if ``adapt``), ``inverse``
        and ``inverse_sqrt`` (if ``noise``) would compute them."""
        ...


@dataclass(frozen=True)
class ShardSpec:
    """Where one group's local shards lie in the one-process chain's flat buffer.

    Attributes:
        names: the parameters' names (for messages).
        full_shapes: the parameters' global shapes.
        starts: per parameter, the global flat index of the shard's first element (a run of rows).
        rank: the rank's coordinate in the mesh.
        world: the mesh's size W.
        mesh: the device mesh (its process group carries the sums).
        placements: the parameters' placements, ``(Shard(0),)``.
    """

    names: tuple[str, ...]
    full_shapes: tuple[tuple[int, ...], ...]
    starts: tuple[int, ...]
    rank: int
    world: int
    mesh: Any = field(compare=False, repr=False)
    placements: tuple[Any, ...] = field(compare=False, repr=False)
    #: parameters whose shards are not ``torch.chunk``'s split (masked ones): their per-element
    #: state is the rank's own (:func:`~sgrld.core.param_state.shard_key`), not a global view
    uneven: tuple[int, ...] = field(default=(), compare=False)
    #: this step's sums, summed ahead by the engine (:class:`SumsAhead`), by name; consumed
    #: by :meth:`sum_`, emptied at the end of each step
    ahead: dict[str, Tensor] = field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def of(names: Sequence[str], params: Sequence[Tensor]) -> ShardSpec | None:
        """The spec of a group, ``None`` if no parameter is sharded; refuses mixed groups, meshes of
        more than one dimension and placements other than ``Shard(0)``."""
        from torch.distributed.tensor import Shard

        sharded = [is_sharded(p) for p in params]
        if not any(sharded):
            return None
        if not all(sharded):
            whole = next(n for n, s in zip(names, sharded, strict=True) if not s)
            raise ValueError(
                f"parameter {whole!r} is a plain tensor in a group of sharded (DTensor) "
                "parameters: a chain's group must be sharded as a whole (shard the module that "
                "holds it too, or put it in a group of its own)"
            )
        mesh = params[0].device_mesh  # type: ignore[attr-defined]
        full_shapes, starts, offset = [], [], 0
        for name, p in zip(names, params, strict=True):
            placements = tuple(p.placements)  # type: ignore[attr-defined]
            if p.device_mesh != mesh or mesh.ndim != 1 or placements != (Shard(0),):  # type: ignore[attr-defined]
                raise NotImplementedError(
                    f"parameter {name!r} is placed {placements} on {p.device_mesh}: sgrld steps "  # type: ignore[attr-defined]
                    "DTensors sharded along dim 0 over one one-dimensional mesh (FSDP2's "
                    "fully_shard); tensor parallelism and HSDP meshes are not supported"
                )
            shape = tuple(p.shape)
            row = math.prod(shape[1:])
            first, count = rows_of(shape[0], mesh.size(), mesh.get_coordinate()[0])
            if tuple(local(p).shape) != (count, *shape[1:]):
                raise NotImplementedError(
                    f"parameter {name!r}'s shard has shape {tuple(local(p).shape)}, not the rows "
                    f"{first}:{first + count} that torch.chunk gives rank "
                    f"{mesh.get_coordinate()[0]}: only FSDP2's even split is supported"
                )
            full_shapes.append(shape)
            starts.append(offset + first * row)
            offset += math.prod(shape)
        rank, world = mesh.get_coordinate()[0], mesh.size()
        return ShardSpec(
            tuple(names), tuple(full_shapes), tuple(starts), rank, world, mesh, (Shard(0),)
        )

    @property
    def full_numels(self) -> tuple[int, ...]:
        return tuple(math.prod(s) for s in self.full_shapes)

    def restrict(self, active: Sequence[int]) -> ShardSpec:
        """The spec of the parameters ``active`` (global indices unchanged)."""
        return replace(
            self,
            names=tuple(self.names[i] for i in active),
            full_shapes=tuple(self.full_shapes[i] for i in active),
            starts=tuple(self.starts[i] for i in active),
            uneven=tuple(j for j, i in enumerate(active) if i in self.uneven),
            ahead={},
        )

    def sum_(self, partial: Tensor, name: str | None = None) -> Tensor:
        """Sum ``partial`` over the mesh in place (one ``all_reduce``), unless the engine summed it
        ahead under ``name`` this step."""
        import torch.distributed as dist

        if name is not None and name in self.ahead:
            return partial.copy_(self.ahead.pop(name))
        dist.all_reduce(partial, group=self.mesh.get_group())
        return partial

    def global_view(self, shard: Tensor, index: int) -> Tensor:
        """A DTensor of parameter ``index``'s global shape over ``shard`` (no copy), so that
        ``torch.distributed.checkpoint`` saves and reshards per-element state as the parameter.
        """
        from torch.distributed.tensor import DTensor

        shape = self.full_shapes[index]
        stride = tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))
        return DTensor.from_local(
            shard, self.mesh, self.placements, run_check=False, shape=torch.Size(shape),
            stride=stride,
        )  # fmt: skip
