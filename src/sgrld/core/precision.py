"""Low-precision parameters (bfloat16, float16): a chain that keeps its moves
(``docs/precision.md``).

Moves below half an ulp are rounded away, silently. ``"master"`` steps a ``master_dtype`` copy
(the parameter its rounded image); ``"stochastic"`` rounds each move without bias, from
counter-based uniforms (reproducible, capturable); ``"nearest"`` is plain arithmetic, and warns.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from sgrld.core.layout import FlatLayout
from sgrld.core.noise import NoiseBuffer, philox_normal_
from sgrld.core.shards import ShardSpec, is_sharded, local, rows_of

LowPrecision = Literal["master", "stochastic", "nearest"]
LOW_PRECISION_MODES: tuple[str, ...] = ("master", "stochastic", "nearest")

#: XOR-ed into the chain's first key word: the rounding's uniforms are another stream than ξ
_ROUNDING_KEY = 0x5BD1E995


def is_low_precision(dtype: torch.dtype, master_dtype: torch.dtype) -> bool:
    """Whether parameters of ``dtype`` are stepped through ``master_dtype`` (fewer bits)."""
    return dtype.is_floating_point and torch.finfo(dtype).bits < torch.finfo(master_dtype).bits


def check_low_precision(mode: str, master_dtype: object) -> None:
    if mode not in LOW_PRECISION_MODES:
        raise ValueError(
            f"invalid low_precision: {mode!r} (expected one of {', '.join(LOW_PRECISION_MODES)})"
        )
    if not isinstance(master_dtype, torch.dtype) or not master_dtype.is_floating_point:
        raise ValueError(f"invalid master_dtype: {master_dtype!r} (expected a floating dtype)")


def stochastic_round_(out: Tensor, x: Tensor, uniform: Tensor) -> None:
    """``out`` ← x rounded to ``out``'s dtype up with probability (x − lower)/gap, else down:
    E[out] = x. ``uniform`` ~ U(0, 1) of x's shape.
    """
    near = x.to(out.dtype)
    near_x = near.to(x.dtype)
    towards = torch.where(near_x < x, torch.inf, -torch.inf).to(out.dtype)
    other = torch.nextafter(near, towards)
    gap = other.to(x.dtype) - near_x
    p = torch.where(gap != 0, (x - near_x) / gap, torch.zeros_like(x))
    out.copy_(torch.where(uniform < p, other, near))


class Rounding:
    """The uniforms of stochastic rounding for one group's flat layout (sharded: at global
    indices).
    """

    def __init__(
        self,
        numel: int,
        dtype: torch.dtype,
        device: torch.device,
        segments: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        width = torch.float32 if dtype != torch.float64 else dtype
        self.buffer = NoiseBuffer((numel,), width, device, segments)

    def uniforms(self, keys: Tensor, step: Tensor) -> Tensor:
        """U(0, 1) as Φ of counter-based normals under the derived key (no generator state)."""
        key = keys.clone()
        key[..., 0] = key[..., 0] ^ _ROUNDING_KEY
        if self.buffer.picks is not None:
            return torch.special.ndtr(self.buffer.draw(None, "philox", key, step))  # type: ignore[arg-type]
        philox_normal_(self.buffer.blocks, key, step)
        return torch.special.ndtr(self.buffer.flat)


class StandIns:
    """The tensors a group's step moves in place of its parameters, and the way back.

    A low-precision parameter's is a ``master_dtype`` copy (kept in ``"master"`` mode, refilled each
    step in ``"stochastic"`` mode); a masked one's its selected elements (1-d; the others stay fixed
    bit for bit). Sharded parameters get DTensor stand-ins of the same mesh and placement, so the
    layout and the noise at global indices are the one-process chain's.
    """

    def __init__(
        self,
        params: Sequence[Tensor],
        masks: Sequence[Tensor | None],
        mode: LowPrecision,
        master_dtype: torch.dtype,
    ) -> None:
        self.params, self.mode = list(params), mode
        self.low = mode != "nearest" and is_low_precision(params[0].dtype, master_dtype)
        self.dtype = master_dtype if self.low else params[0].dtype
        self.spec: ShardSpec | None = None  # the stand-ins' shards (masked ones: their own)
        if any(is_sharded(p) for p in params):
            self.spec = _masked_spec(params, masks)
        # a sharded parameter's mask is of its global shape: each rank selects in its rows
        self.masks = [
            m if m is None or not is_sharded(p) else _rows(m, p) for p, m in zip(params, masks,
                                                                                  strict=True)
        ]  # fmt: skip
        self.work = [
            self._values(p, m).to(self.dtype, copy=True)
            for p, m in zip(params, self.masks, strict=True)
        ]
        self.rounding = None
        if self.low and mode == "stochastic":
            shards = [local(w) for w in self.work]
            segments = None
            if self.spec is not None:  # the rounding's uniforms at global indices, as ξ's
                segments = list(zip(self.spec.starts, (s.numel() for s in shards), strict=True))
            numel = sum(s.numel() for s in shards)
            self.rounding = Rounding(numel, self.dtype, shards[0].device, segments)

    def layout(self, names: Sequence[str]) -> FlatLayout:
        """The flat layout of the stand-ins (sharded: :attr:`spec`, named ``names``)."""
        if self.spec is None:
            return FlatLayout.from_tensors(names, self.work)
        spec = dataclasses.replace(self.spec, names=tuple(names))
        return FlatLayout(tuple(names), tuple(tuple(local(w).shape) for w in self.work), (), spec)

    @staticmethod
    def needed(params: Sequence[Tensor], masks: Sequence[Tensor | None], mode: str,
               master_dtype: torch.dtype) -> bool:  # fmt: skip
        low = mode != "nearest" and is_low_precision(params[0].dtype, master_dtype)
        return low or any(m is not None for m in masks)

    @staticmethod
    def _values(p: Tensor, mask: Tensor | None) -> Tensor:
        return p.detach() if mask is None else local(p.detach())[mask]

    @property
    def masters(self) -> list[Tensor] | None:
        """The master copies (state to save), or ``None`` when the stand-ins are scratch."""
        return self.work if self.low and self.mode == "master" else None

    def pull(self) -> None:
        """Before a step: masters keep their elements unless the parameter is no longer their
        rounded image (the user assigned it); scratch is refilled. No host read."""
        for p, m, w in zip(self.params, self.masks, self.work, strict=True):
            values, w = local(self._values(p, m)), local(w)
            if self.masters is not None:
                torch.where(values == w.to(values.dtype), w, values.to(w.dtype), out=w)
            else:
                w.copy_(values)

    def grads(self, grads: Sequence[Tensor | None]) -> list[Tensor | None]:
        """The gradients of the stand-ins (selected elements, in their dtype)."""
        return [
            None if g is None else self._values(g, m).to(self.dtype)
            for g, m in zip(grads, self.masks, strict=True)
        ]

    def push(self, keys: Tensor, step: Tensor) -> None:
        """After a step: write the stand-ins into the parameters (rounded to nearest, or
        stochastically).
        """
        uniforms = None if self.rounding is None else self.rounding.uniforms(keys, step)
        offset = 0
        for p, m, w in zip(self.params, self.masks, self.work, strict=True):
            p, w = local(p), local(w)  # the rank's shards: a DTensor copy would communicate
            value = w
            if uniforms is not None:
                value = torch.empty(w.shape, dtype=p.dtype, device=w.device)
                stochastic_round_(value, w, uniforms[offset : offset + w.numel()].view_as(w))
            offset += w.numel()
            with torch.no_grad():
                if m is None:
                    p.copy_(value)
                else:
                    p[m] = value.to(p.dtype)


def _rows(mask: Tensor, p: Tensor) -> Tensor:
    """The rows of a global-shape ``mask`` that the rank holds of the sharded ``p``."""
    first, count = rows_of(p.shape[0], p.device_mesh.size(), p.device_mesh.get_coordinate()[0])  # type: ignore[attr-defined]
    return mask[first : first + count]


def _masked_spec(params: Sequence[Tensor], masks: Sequence[Tensor | None]) -> ShardSpec:
    """Where each rank's stand-ins lie in the one-process stand-ins' buffer: a masked shard's
    selected elements are one run, starting at the count selected in the rows before."""
    names = [str(i) for i in range(len(params))]
    base = ShardSpec.of(names, params)
    assert base is not None
    full_shapes, starts, uneven, offset = [], [], [], 0
    for i, (p, m) in enumerate(zip(params, masks, strict=True)):
        if m is None:
            full_shapes.append(tuple(p.shape))
            starts.append(offset + base.starts[i] - sum(base.full_numels[:i]))
            offset += p.numel()
            continue
        first, _ = rows_of(p.shape[0], base.world, base.rank)
        selected = int(m.sum())  # once, at construction
        full_shapes.append((selected,))
        starts.append(offset + int(m[:first].sum()))
        uneven.append(i)
        offset += selected
    return dataclasses.replace(
        base, full_shapes=tuple(full_shapes), starts=tuple(starts), uneven=tuple(uneven)
    )
