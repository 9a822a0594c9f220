"""Sources of the Gaussian noise ξ ~ N(0, I) of the SGRLD step (``docs/performance.md``).

``"torch"`` (default): ``Tensor.normal_(generator=...)``. ``"philox"``: the counter-based
Philox4x32-10 generator (Salmon et al., SC'11) with Box–Muller, one ``torch.compile``d kernel
(eager after a warning without a compiler). ξ is a pure function of (the chain's key, step,
index): no generator state (a step can be captured or traced), a chain's noise does not depend
on the chains beside it, and resume is exact. The words are computed in int64 lanes, or in
int32 lanes on CPUs without AVX-512 (:func:`_mulhilo32`), bit-identically.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Literal

import torch
from torch import Tensor

from sgrld.core._compile import announce, failure_reason, quiet_compile

NoiseSource = Literal["torch", "philox"]
NOISE_SOURCES: tuple[str, ...] = ("torch", "philox")

_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # Philox4x32 multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # Weyl key increments
_MASK32 = 0xFFFFFFFF
ROUNDS = 10
#: whether CPU kernels compute the words in int32 lanes (see the module's docstring)
INT32_LANES = torch.backends.cpu.get_cpu_capability() != "AVX512"


def _mulhilo(a: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """(high, low) 32-bit words of a·m for 0 ≤ a, m < 2³², without int64 overflow."""
    hi16, lo16 = m >> 16, m & 0xFFFF
    p_lo = a * lo16  # < 2⁴⁸
    p_hi = a * hi16  # < 2⁴⁸; a·m = p_hi·2¹⁶ + p_lo
    low = (((p_hi & 0xFFFF) << 16) + p_lo) & _MASK32
    high = (p_hi + (p_lo >> 16)) >> 16
    return high, low


def _digits(m: int) -> tuple[int, int]:
    """(h, l) with m = h·2¹⁶ + l + 2³² and -2¹⁵ ≤ h, l < 2¹⁵: signed 16-bit digits of m ≥ 2³¹."""
    low = m & 0xFFFF
    low -= (low >= 0x8000) << 16
    high = (m - low) >> 16
    assert 0x8000 <= high < 0x10000
    return high - 0x10000, low


def _mulhilo32(a: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """(high, low) words of a·m for a uint32 ``a`` held in int32 lanes (its bits; so are the
    results) and Philox's multipliers m (2³¹ ≤ m < 2³², digits |h| < 2¹⁴, |l| < 2¹⁵).

    With a = a₁·2¹⁶ + a₀ and m = h·2¹⁶ + l + 2³² every product and sum stays below 2³¹ in
    magnitude, and a·m = (p00 mod 2¹⁶) + 2¹⁶·(r mod 2¹⁶) + 2³²·s + 2⁴⁸·a₁.
    """
    high, low = _digits(m)
    assert high > -0x4000 and -0x8000 < low < 0x8000
    a0 = a & 0xFFFF
    a1 = (a >> 16) & 0xFFFF
    p00, p01, p10, p11 = a0 * low, a0 * high, a1 * low, a1 * high
    r = (p00 >> 16) + p01 + (p10 & 0xFFFF)
    s = p11 + a0 + (p10 >> 16) + (r >> 16)
    return (((s >> 16) + a1) << 16) | (s & 0xFFFF), (r << 16) | (p00 & 0xFFFF)


def _to_int32(x: Tensor) -> Tensor:
    """The int32 whose bits are the word 0 ≤ x < 2³² (int64), without an overflowing cast."""
    return ((x ^ 0x80000000) - 0x80000000).to(torch.int32)


def philox4x32(
    c0: Tensor,
    c1: Tensor,
    c2: Tensor,
    c3: Tensor,
    k0: Tensor,
    k1: Tensor,
    *,
    int32_lanes: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Philox4x32-10 of the counter (c0..c3) under the key (k0, k1), int64 words in [0, 2³²); the
    result's words are int64 too, or (``int32_lanes``) int32 holding their bits.
    """
    mulhilo = _mulhilo32 if int32_lanes else _mulhilo
    if int32_lanes:
        c0, c1, c2, c3 = (_to_int32(c) for c in (c0, c1, c2, c3))
    for _ in range(ROUNDS):
        hi0, lo0 = mulhilo(c0, _M0)
        hi1, lo1 = mulhilo(c2, _M1)
        key0, key1 = (_to_int32(k0), _to_int32(k1)) if int32_lanes else (k0, k1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ key0, lo1, hi0 ^ c3 ^ key1, lo0
        k0 = (k0 + _W0) & _MASK32
        k1 = (k1 + _W1) & _MASK32
    return c0, c1, c2, c3


def _box_muller(u1: Tensor, u2: Tensor) -> tuple[Tensor, Tensor]:
    radius = torch.sqrt(-2.0 * torch.log(u1))
    angle = (2.0 * math.pi) * u2
    return radius * torch.cos(angle), radius * torch.sin(angle)


def values_per_counter(dtype: torch.dtype) -> int:
    """Normals per Philox counter: 4 at ≤ 32-bit precision, 2 in float64 (53-bit uniforms)."""
    return 2 if dtype == torch.float64 else 4


def _philox_normal(
    key: Tensor, out: Tensor, first_row: int = 0, step: Tensor | None = None
) -> None:
    """Fill ``out`` (..., n, values_per_counter) with N(0, 1) under ``key`` (..., 2) at ``step``
    (0-d int64, the counter's high words; None: 0), row i from counter ``first_row`` + i.
    """
    index = torch.arange(out.shape[-2], dtype=torch.int64, device=out.device) + first_row
    out.copy_(_normals(key, index, step, out.dtype))


def _philox_normal_at(
    key: Tensor, out: Tensor, counters: Tensor, picks: Tensor, step: Tensor
) -> None:
    """Fill the 1-d ``out`` with value ``picks[j]`` of the flattened normals of ``counters`` (a
    shard's noise: :class:`NoiseBuffer`); ``key`` is (1, 2)."""
    values = _normals(key, counters, step, out.dtype).reshape(-1)
    out.copy_(values.index_select(0, picks))


def _normals(key: Tensor, index: Tensor, step: Tensor | None, dtype: torch.dtype) -> Tensor:
    """The normals of counters ``index`` (n,) under ``key`` (..., 2): (..., n, width)."""
    zero = torch.zeros_like(index)
    t_lo = zero if step is None else zero + (step & _MASK32)
    t_hi = zero if step is None else zero + (step >> 32)
    k0, k1 = key[..., 0:1], key[..., 1:2]  # (..., 1): broadcast over the rows
    int32_lanes = INT32_LANES and index.device.type == "cpu"
    # counter (i mod 2³², ⌊i / 2³²⌋, t mod 2³², ⌊t / 2³²⌋): every word stays below 2³²
    w: Sequence[Tensor] = philox4x32(
        index & _MASK32, index >> 32, t_lo, t_hi, k0, k1, int32_lanes=int32_lanes
    )
    if dtype == torch.float64:
        if int32_lanes:
            w = [x.to(torch.int64) & _MASK32 for x in w]
        # 53-bit uniforms from pairs of words; one Box–Muller pair per counter.
        u1, u2 = (
            (((hi << 21) | (lo >> 11)).to(torch.float64) + 0.5) * 2.0**-53
            for hi, lo in ((w[0], w[1]), (w[2], w[3]))
        )
        return torch.stack(_box_muller(u1, u2), dim=-1)
    # 24-bit uniforms, as torch's own float32 sampling; two Box–Muller pairs per counter.
    u = [(((x >> 8) & 0xFFFFFF).to(torch.float32) + 0.5) * 2.0**-24 for x in w]
    return torch.stack([*_box_muller(u[0], u[1]), *_box_muller(u[2], u[3])], dim=-1)


def philox_normals(
    shape: tuple[int, ...], dtype: torch.dtype, keys: Tensor, step: Tensor
) -> Tensor:
    """A new (*batch, D) tensor of the numbers :class:`NoiseBuffer` draws with ``keys`` at ``step``,
    for a traced step that fuses the draw (``compile=True``: :mod:`sgrld.core.compiled`).
    """
    numel = shape[-1]
    width = values_per_counter(dtype)
    rows = -(-numel // width)
    index = torch.arange(rows, dtype=torch.int64, device=keys.device)
    blocks = _normals(keys.reshape(-1, 2), index, step, dtype)  # (chains, rows, width)
    return blocks.reshape(-1, rows * width)[:, :numel].reshape(shape)


_compiled: dict[Callable[..., None], Callable[..., None]] = {}
_compile_failed = False


def _kernel(fn: Callable[..., None] = _philox_normal) -> Callable[..., None]:
    if fn not in _compiled:
        announce("compiling the Philox noise kernel for the first step (once per process, "
                 "about 10 s on a CPU; noise='torch' needs none)")  # fmt: skip
        _compiled[fn] = torch.compile(fn, fullgraph=True, dynamic=True)
    return _compiled[fn]


#: Recompiles the kernel may need in one process (one per dtype and size-1 dimension, even with
#: ``dynamic=True``): torch's default of 8 would leave it eager for good.
RECOMPILE_LIMIT = 64


@contextlib.contextmanager
def _kernel_context() -> Iterator[None]:
    """The kernel's call: quiet, no autograd, room to recompile, float32 default dtype."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    limit = max(getattr(config, name), RECOMPILE_LIMIT)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with quiet_compile(), torch.no_grad(), config.patch({name: limit}):
            yield
    finally:
        torch.set_default_dtype(previous)


def _compiled_call(kernel: Callable[[], Callable[..., None]], *args: object) -> bool:
    """Run the compiled ``kernel()``; ``False`` (warned once) where compiling fails."""
    global _compile_failed
    if _compile_failed or torch.compiler.is_compiling():
        return False
    try:
        with _kernel_context():
            kernel()(*args)
        return True
    except Exception as exc:
        _compile_failed = True
        warnings.warn(
            f"sgrld: compiling the Philox noise kernel failed ({failure_reason(exc)}); "
            "drawing it eagerly, which is much slower than noise='torch'",
            RuntimeWarning,
            stacklevel=4,
        )
        return False


def philox_normal_(
    blocks: Tensor, key: Tensor, step: Tensor | None = None, *, compile: bool = True
) -> None:
    """Fill ``blocks`` (..., n, values_per_counter) with N(0, 1) under ``key`` (..., 2) at
    ``step`` (see :func:`_philox_normal`); inside a traced step the arithmetic is traced."""
    if compile and not torch.compiler.is_compiling():
        # One input form for the one compiled kernel (blocks (chains, n, width) detached from
        # the caller's buffer, keys (chains, 2), a 0-d step): only dtype and device recompile.
        blocks3 = blocks.view(-1, *blocks.shape[-2:]).detach()
        steps = torch.zeros((), dtype=torch.int64, device=blocks.device) if step is None else step
        if _compiled_call(_kernel, key.reshape(-1, 2), blocks3, 0, steps):
            return
    _philox_normal(key, blocks, 0, step)


def philox_normal_at_(
    flat: Tensor, key: Tensor, counters: Tensor, picks: Tensor, step: Tensor
) -> None:
    """:func:`_philox_normal_at`, compiled as :func:`philox_normal_` is."""
    key = key.reshape(1, 2)
    kernel = functools.partial(_kernel, _philox_normal_at)
    if not _compiled_call(kernel, key, flat.detach(), counters, picks, step):
        _philox_normal_at(key, flat, counters, picks, step)


def keys_from_generator(
    batch_shape: tuple[int, ...], generator: torch.Generator, device: torch.device
) -> Tensor:
    """Fresh Philox keys, one (2 words) per chain, drawn from ``generator``."""
    keys = torch.randint(
        0, 2**32, (*batch_shape, 2), generator=generator, dtype=torch.int64, device=generator.device
    )
    return keys.to(device)


def keys_from_seeds(seeds: Tensor | list[int], device: torch.device) -> Tensor:
    """Philox keys from integer seeds (0 ≤ seed < 2⁶⁴): the key words are the seed's halves."""
    values = [int(s) for s in (seeds.tolist() if isinstance(seeds, Tensor) else seeds)]
    for s in values:
        if not 0 <= s < 2**64:
            raise ValueError(f"invalid seed: {s} (expected 0 <= seed < 2**64)")
    return torch.tensor([[s & _MASK32, s >> 32] for s in values], dtype=torch.int64, device=device)


class NoiseBuffer:
    """The flat noise buffer of a layout, padded per chain so that Philox fills whole counters.

    ``flat`` (*batch, D) is what the metric sees; ``blocks`` views the same storage as
    (chains, n, values_per_counter), one row range per chain.
    """

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        segments: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        *batch, numel = shape
        chains = math.prod(batch)
        width = values_per_counter(dtype)
        rows = -(-numel // width)
        storage = torch.empty(chains, rows * width, dtype=dtype, device=device)
        # contiguous unless several chains each need padding (then a view with a row stride)
        self.flat = storage[:, :numel].view(*batch, numel)
        self.blocks = storage.view(chains, rows, width)
        # sharded (one chain): this buffer holds the (start, count) runs of the one-process
        # buffer (sgrld.core.shards); it draws the counters that cover each run, and picks the
        # run's values out of them (one index per element)
        self.picks: Tensor | None = None
        if segments is not None:
            if batch:
                raise ValueError("sharded noise is for one chain")
            counters, picks, drawn = [], [], 0
            for start, count in segments:
                if count == 0:
                    continue
                first, last = start // width, (start + count - 1) // width
                counters.append(torch.arange(first, last + 1, dtype=torch.int64, device=device))
                skip = drawn + start - first * width
                picks.append(torch.arange(skip, skip + count, dtype=torch.int64, device=device))
                drawn += (last + 1 - first) * width
            none = torch.zeros(0, dtype=torch.int64, device=device)
            self.counters = torch.cat(counters) if counters else none
            self.picks = torch.cat(picks) if picks else none

    def draw(
        self,
        generator: torch.Generator,
        source: NoiseSource,
        keys: Tensor | None = None,
        step: Tensor | None = None,
    ) -> Tensor:
        """Fill with fresh N(0, I) and return the layout-shaped buffer: from ``generator``
        (``"torch"``) or from the chains' ``keys`` (*batch, 2) and the ``step`` (0-d int64 tensor,
        ``"philox"``)."""
        if source == "torch":
            if self.picks is not None:
                raise ValueError(
                    "sharded parameters need noise='philox': a generator's stream cannot be "
                    "drawn at a shard's global indices, so the ranks would not form one chain"
                )
            return self.flat.normal_(generator=generator)
        if keys is None or step is None:
            raise ValueError("philox noise needs the chains' keys and the step count")
        if self.picks is not None:
            philox_normal_at_(self.flat, keys, self.counters, self.picks, step)
            return self.flat
        philox_normal_(self.blocks, keys.reshape(-1, 2), step)
        return self.flat
