"""Low-precision parameters (bfloat16, float16): a chain that keeps its moves.

bfloat16 keeps 8 significant bits. A Langevin move whose drift and noise are below half a unit
in the last place (ulp) of θ is rounded away to nearest: the drift is lost first (it is the
smaller term near the mode), the noise partly kept, and the chain becomes a random walk with the
wrong variance — silently (measured in ``docs/precision.md``). Two remedies:

* ``"master"`` (the default): the chain lives in a copy of the parameters in ``master_dtype``
  (float32), held in the optimizer state; the parameter is its image rounded to nearest, which
  the model's forward pass sees. Statistics are kept in the master dtype too.
* ``"stochastic"``: no copy; each move is computed in ``master_dtype`` and written back with
  unbiased stochastic rounding (E[round(x)] = x), its uniforms drawn by the counter-based
  generator under a key derived from the chain's, so the step stays reproducible and capturable.
  Unbiased is not exact: the rounding adds variance of up to ulp²/4 per step, which matters when
  the Langevin noise per step is smaller than an ulp (``docs/precision.md``).

``"nearest"`` is plain arithmetic in the parameter's dtype, the behaviour of torch's optimizers;
it warns, as moves below half an ulp are lost.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from sgrld.core.noise import NoiseBuffer, philox_normal_

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
    """``out`` ← x rounded to ``out``'s dtype up or down, up with probability equal to x's
    distance from the lower neighbour over the gap: E[out] = x. ``uniform`` ~ U(0, 1) of x's
    shape."""
    near = x.to(out.dtype)
    near_x = near.to(x.dtype)
    towards = torch.where(near_x < x, torch.inf, -torch.inf).to(out.dtype)
    other = torch.nextafter(near, towards)
    gap = other.to(x.dtype) - near_x
    p = torch.where(gap != 0, (x - near_x) / gap, torch.zeros_like(x))
    out.copy_(torch.where(uniform < p, other, near))


class Rounding:
    """The uniforms of stochastic rounding for one group's flat layout (a scratch buffer)."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.buffer = NoiseBuffer((numel,), torch.float32 if dtype != torch.float64 else dtype,
                                  device)  # fmt: skip

    def uniforms(self, keys: Tensor, step: Tensor) -> Tensor:
        """U(0, 1) as Φ of counter-based normals under the derived key (no generator state)."""
        key = keys.clone()
        key[..., 0] = key[..., 0] ^ _ROUNDING_KEY
        philox_normal_(self.buffer.blocks, key, step)
        return torch.special.ndtr(self.buffer.flat)


def write_back(
    params: Sequence[Tensor],
    work: Sequence[Tensor],
    mode: LowPrecision,
    uniforms: Tensor | None = None,
) -> None:
    """Write the stepped ``work`` tensors (master dtype) into the low-precision ``params``."""
    if mode == "master":
        torch._foreach_copy_(list(params), list(work))
        return
    assert uniforms is not None
    offset = 0
    for p, w in zip(params, work, strict=True):
        n = p.numel()
        stochastic_round_(p, w, uniforms[offset : offset + n].view_as(p))
        offset += n


def resync_masters(params: Sequence[Tensor], masters: Sequence[Tensor]) -> None:
    """Keep a master element unless its parameter no longer is its rounded image (the user
    assigned the parameter, e.g. loaded weights): then the master takes the parameter's value.
    Element-wise, with no host read."""
    for p, m in zip(params, masters, strict=True):
        torch.where(p == m.to(p.dtype), m, p.to(m.dtype), out=m)
