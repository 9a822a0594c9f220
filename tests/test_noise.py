"""The noise sources: Philox4x32-10 against its published answers, the normals' law, and the
samplers' contract (reproducibility, resume, stationary moments) with ``noise="philox"``."""

from __future__ import annotations

import math
import random
import warnings

import pytest
import torch
from scipy import stats as sps

import sgrld
from conftest import check_resume_is_bit_identical
from sgrld.core import noise as noise_mod
from sgrld.core._compile import quiet_compile
from sgrld.core.noise import (
    NoiseBuffer,
    _mulhilo,
    _mulhilo32,
    _philox_normal,
    _to_int32,
    keys_from_seeds,
    philox4x32,
)

KEY = torch.tensor([[0x12345678, 0x9ABCDEF0]], dtype=torch.int64)


def _step(t: int) -> torch.Tensor:
    return torch.tensor(t, dtype=torch.int64)


Z = 5.0  # thresholds in Monte-Carlo standard errors, as in test_stationary

# Known-answer vectors of Random123 (kat_vectors, philox4x32 with 10 rounds).
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize("int32_lanes", [False, True])
@pytest.mark.parametrize(("counter", "key", "expected"), KAT)
def test_philox_known_answers(
    counter: tuple[int, ...], key: tuple[int, int], expected: tuple[int, ...], int32_lanes: bool
) -> None:
    c = [torch.tensor([v], dtype=torch.int64) for v in counter]
    k = [torch.tensor(v, dtype=torch.int64) for v in key]
    out = philox4x32(*c, *k, int32_lanes=int32_lanes)
    assert tuple(int(w) & 0xFFFFFFFF for w in out) == expected


WORDS = [0, 1, 0x7FFF, 0x8000, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, 0xFFFF0000, 0xFFFFFFFF]


def test_mulhilo_matches_integer_arithmetic() -> None:
    rng = random.Random(0)
    values = WORDS + [rng.getrandbits(32) for _ in range(2000)]
    a = torch.tensor(values, dtype=torch.int64)
    for m in (0xD2511F53, 0xCD9E8D57, 0xFFFFFFFF, 1):
        hi, lo = _mulhilo(a, m)
        assert hi.tolist() == [(v * m) >> 32 for v in values]
        assert lo.tolist() == [(v * m) & 0xFFFFFFFF for v in values]
    # the int32-lane products (Philox's two multipliers), on the int32 holding each word's bits
    a32 = _to_int32(a)
    assert a32.dtype == torch.int32 and [v & 0xFFFFFFFF for v in a32.tolist()] == values
    for m in (0xD2511F53, 0xCD9E8D57):
        hi, lo = _mulhilo32(a32, m)
        assert [v & 0xFFFFFFFF for v in hi.tolist()] == [(v * m) >> 32 for v in values]
        assert [v & 0xFFFFFFFF for v in lo.tolist()] == [(v * m) & 0xFFFFFFFF for v in values]


def test_int32_lanes_give_the_same_words_compiled() -> None:
    """The compiled int32-lane kernel (C++: where signed overflow would be undefined) computes
    the int64 lanes' words, on counters that reach every 16-bit digit's extremes; 4099 rows
    leave a scalar tail after the vectorised loop."""
    rng = random.Random(1)
    rows = [rng.choice(WORDS) if rng.random() < 0.2 else rng.getrandbits(32) for _ in range(4099)]
    words = torch.tensor(rows, dtype=torch.int64).view(-1, 1).expand(-1, 4).contiguous()
    words[:, 1:] = torch.tensor(rows[::-1], dtype=torch.int64).view(-1, 1)
    c = [words[:, i] for i in range(4)]
    k = [torch.tensor([v], dtype=torch.int64) for v in (0xFFFFFFFF, 0x80000000)]

    def lanes32(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return philox4x32(*args, int32_lanes=True)

    with quiet_compile():
        compiled = torch.compile(lanes32, fullgraph=True, dynamic=True)(*c, *k)
    expected = philox4x32(*c, *k)
    for got, want in zip(compiled, expected, strict=True):
        assert torch.equal(got.to(torch.int64) & 0xFFFFFFFF, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_philox_normals_have_the_standard_normal_law(dtype: torch.dtype) -> None:
    n = 1 << 20
    buf = NoiseBuffer((n,), dtype, torch.device("cpu"))
    x = buf.draw(torch.Generator(), "philox", KEY, _step(7)).double()
    # Sample moments of N(0, 1) with their exact Monte-Carlo standard errors.
    moments = {  # statistic: (value, expectation, variance of one term)
        "mean": (x.mean(), 0.0, 1.0),
        "var": ((x**2).mean(), 1.0, 2.0),
        "skew": ((x**3).mean(), 0.0, 15.0),
        "kurt": ((x**4).mean(), 3.0, 96.0),
    }
    for name, (value, expected, var) in moments.items():
        err = abs(float(value) - expected) / math.sqrt(var / n)
        assert err < Z, f"{name} off by {err:.1f} s.e."
    # Kolmogorov–Smirnov against Φ at a false-alarm rate of 1e-6.
    assert sps.kstest(x.numpy(), "norm").pvalue > 1e-6
    # The four (float32) or two (float64) values of one counter are uncorrelated.
    lanes = buf.blocks[0].double()
    corr = torch.corrcoef(lanes.T)
    off = corr - torch.eye(lanes.shape[1], dtype=torch.float64)
    assert float(off.abs().max()) < Z / math.sqrt(lanes.shape[0])


def test_philox_draws_are_a_function_of_key_and_step() -> None:
    def draw(keys: torch.Tensor, step: int, chains: int = 3) -> torch.Tensor:
        buf = NoiseBuffer((chains, 1001), torch.float32, torch.device("cpu"))
        return buf.draw(torch.Generator(), "philox", keys, _step(step)).clone()

    keys = keys_from_seeds([5, 6, 7], torch.device("cpu"))
    a = [draw(keys, t) for t in range(3)]
    assert torch.equal(a[0], draw(keys, 0))  # same (key, step): same numbers
    assert not torch.equal(a[0], a[1])  # another step: other numbers
    # chain k's numbers depend on its key alone, not on the number of chains or its position
    assert torch.equal(draw(keys[1:2], 2, chains=1)[0], a[2][1])
    assert torch.equal(draw(keys.flip(0), 2)[2], a[2][0])
    # steps and chains are independent: correlation within the Monte-Carlo band
    for x, y in ((a[0][0], a[1][0]), (a[0][0], a[0][1])):
        r = torch.corrcoef(torch.stack([x, y]).double())[0, 1]
        assert abs(float(r)) < Z / math.sqrt(x.numel())


def _bound(dtype: torch.dtype) -> float:
    """The largest |ξ| Box–Muller can give: radius √(−2 log u) at the smallest uniform."""
    bits = 53 if dtype == torch.float64 else 24
    return math.sqrt(-2.0 * math.log(0.5 * 2.0**-bits))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_philox_tails_are_gaussian(dtype: torch.dtype) -> None:
    """P(|ξ| > k) = erfc(k/√2) for k up to 4.5 (7 expected exceedances in 2²⁰ draws), each
    count tested as a binomial at a false-alarm rate of 1e-6; nothing beyond the bound."""
    n = 1 << 20
    buf = NoiseBuffer((n,), dtype, torch.device("cpu"))
    x = buf.draw(torch.Generator(), "philox", KEY, _step(11)).abs()
    for k in (1.0, 2.0, 3.0, 4.0, 4.5):
        count = int((x > k).sum())
        assert sps.binomtest(count, n, math.erfc(k / math.sqrt(2.0))).pvalue > 1e-6, (k, count)
    assert float(x.max()) <= _bound(dtype)


def _equiprobable_cells(x: torch.Tensor, cells: int) -> torch.Tensor:
    """The index of the N(0, 1)-equiprobable cell (of ``cells``) that each value falls in."""
    edges = torch.tensor(sps.norm.ppf([i / cells for i in range(1, cells)]), dtype=x.dtype)
    return torch.bucketize(x, edges)


def _independence_pvalue(x: torch.Tensor, y: torch.Tensor, cells: int = 8) -> float:
    """χ² test that the pairs (x_i, y_i) have the product law N(0, 1) ⊗ N(0, 1): counts in
    ``cells``² equiprobable cells against n / cells² each."""
    joint = _equiprobable_cells(x, cells) * cells + _equiprobable_cells(y, cells)
    counts = torch.bincount(joint.reshape(-1), minlength=cells * cells).double().numpy()
    return float(sps.chisquare(counts).pvalue)


def test_philox_draws_are_independent_across_steps_and_chains() -> None:
    """Joint law of ξ at consecutive steps, and of neighbouring chains' ξ (consecutive seeds,
    the weak spot of a counter-based generator keyed by them), is the product of N(0, 1)s: a χ²
    test on 8 × 8 equiprobable cells (p > 1e-6), and the correlations of ξ and of ξ² at lag 1
    within their Monte-Carlo band (5 s.e.)."""
    steps, chains, size = 64, 8, 4096
    keys = keys_from_seeds(list(range(chains)), torch.device("cpu"))
    buf = NoiseBuffer((chains, size), torch.float32, torch.device("cpu"))
    x = torch.stack(
        [buf.draw(torch.Generator(), "philox", keys, _step(t)).clone() for t in range(steps)]
    )
    x = x.double()  # (steps, chains, size)
    pairs = {
        "steps": (x[:-1], x[1:]),
        "chains": (x[:, :-1].contiguous(), x[:, 1:].contiguous()),
    }
    for name, (a, b) in pairs.items():
        assert _independence_pvalue(a, b) > 1e-6, name
        se = 1.0 / math.sqrt(a.numel())
        assert abs(float((a * b).mean())) < Z * se, name
        # (ξ² − 1) has variance 2: the products of two independent ones have variance 4
        assert abs(float(((a**2 - 1) * (b**2 - 1)).mean())) < Z * 2.0 * se, name


@pytest.mark.slow  # compiles the kernel once more (inductor specialises on the thread count)
def test_philox_draws_do_not_depend_on_the_thread_count() -> None:
    """The kernel is elementwise in (key, step, index): 1 and 2 threads give the same bits."""
    keys = keys_from_seeds([3, 4], torch.device("cpu"))
    previous = torch.get_num_threads()
    draws = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            buf = NoiseBuffer((2, 100_003), torch.float32, torch.device("cpu"))
            draws.append(buf.draw(torch.Generator(), "philox", keys, _step(5)).clone())
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(draws[0], draws[1])


def test_step_fills_the_counters_high_words() -> None:
    step = 2**33 + 3
    blocks = torch.empty(1, 2, 4, dtype=torch.float32)
    _philox_normal(KEY, blocks, step=_step(step))
    w = _philox_reference([1, 0, step & 0xFFFFFFFF, step >> 32], [0x12345678, 0x9ABCDEF0])
    u = [((x >> 8) + 0.5) * 2.0**-24 for x in w]
    radius = math.sqrt(-2.0 * math.log(u[0]))
    assert math.isclose(float(blocks[0, 1, 0]), radius * math.cos(2 * math.pi * u[1]), rel_tol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_int32_lanes_draw_the_same_normals(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lane width is the CPU's choice (``INT32_LANES``), never the chain's numbers."""
    drawn = []
    for int32_lanes in (False, True):
        monkeypatch.setattr(noise_mod, "INT32_LANES", int32_lanes)
        blocks = torch.empty(2, 1025, noise_mod.values_per_counter(dtype), dtype=dtype)
        _philox_normal(torch.cat([KEY, KEY + 1]), blocks, step=_step(2**32 + 5))
        drawn.append(blocks)
    assert torch.equal(*drawn)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compiled_kernel_equals_eager_arithmetic(dtype: torch.dtype) -> None:
    buf = NoiseBuffer((4099,), dtype, torch.device("cpu"))
    buf.draw(torch.Generator(), "philox", KEY, _step(3))
    eager = torch.empty_like(buf.blocks)
    _philox_normal(KEY, eager, step=_step(3))
    # Same integers; log/cos/sin may differ in the last ulp between inductor and eager.
    torch.testing.assert_close(buf.blocks, eager, rtol=4 * torch.finfo(dtype).eps, atol=0.0)
    assert buf.flat.shape == (4099,) and buf.flat.data_ptr() == buf.blocks.data_ptr()


def test_compile_failure_warns_and_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> None:
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(noise_mod, "_kernel", broken)
    monkeypatch.setattr(noise_mod, "_compile_failed", False)
    buf = NoiseBuffer((10,), torch.float32, torch.device("cpu"))
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler"):
        buf.draw(torch.Generator(), "philox", KEY, _step(0))
    expected = torch.empty_like(buf.blocks)
    _philox_normal(KEY, expected, step=_step(0))
    assert torch.equal(buf.blocks, expected)
    with warnings.catch_warnings():  # warned once, then silently eager
        warnings.simplefilter("error")
        buf.draw(torch.Generator(), "philox", KEY, _step(1))


def test_unknown_noise_source_is_refused() -> None:
    p = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match="noise"):
        sgrld.SGLD(p, lr=0.1, num_data=10, noise="numpy")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="noise"):
        sgrld.build("identity", lr=0.1, num_data=10, noise="box")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "make",
    [
        lambda p, g: sgrld.SGLD(p, lr=0.05, num_data=10, generator=g, noise="philox"),
        lambda p, g: sgrld.MongeSGLD(p, lr=0.05, num_data=10, generator=g, noise="philox"),
        lambda p, g: sgrld.ShampooSGLD(
            p, lr=0.05, num_data=10, generator=g, noise="philox", block_size=4, update_interval=3
        ),
    ],
    ids=["sgld", "monge", "shampoo"],
)
def test_philox_resume_is_bit_identical(make: object) -> None:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(5, 3), (3,), (7,)]]

    def run(opt: torch.optim.Optimizer, ps: list[torch.nn.Parameter], steps: range) -> None:
        for t in steps:
            for i, p in enumerate(ps):
                p.grad = torch.sin(p.detach() * (t + 1) + i)
            opt.step()

    check_resume_is_bit_identical(make, params, run, 4, 9)  # type: ignore[arg-type]


def _philox_reference(counter: list[int], key: list[int]) -> list[int]:
    """Philox4x32-10 on Python integers (independent of the tensor code)."""
    mask = 0xFFFFFFFF
    c, k = list(counter), list(key)
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k[0], p1 & mask, (p0 >> 32) ^ c[3] ^ k[1], p0 & mask]
        k = [(k[0] + 0x9E3779B9) & mask, (k[1] + 0xBB67AE85) & mask]
    return c


def test_rows_beyond_2_to_the_32_use_the_counters_high_word() -> None:
    key = torch.tensor([0x12345678, 0x9ABCDEF0], dtype=torch.int64)
    out = torch.empty(3, 4, dtype=torch.float64)  # float64 math on 4-lane (float32) words
    first = 2**32 + 5
    blocks = torch.empty(3, 4, dtype=torch.float32)
    _philox_normal(key, blocks, first_row=first)
    for r in range(3):
        i = first + r
        w = _philox_reference([i & 0xFFFFFFFF, i >> 32, 0, 0], [0x12345678, 0x9ABCDEF0])
        u = [((x >> 8) + 0.5) * 2.0**-24 for x in w]
        for j, (a, b) in enumerate(((0, 1), (2, 3))):
            radius = math.sqrt(-2.0 * math.log(u[a]))
            out[r, 2 * j] = radius * math.cos(2 * math.pi * u[b])
            out[r, 2 * j + 1] = radius * math.sin(2 * math.pi * u[b])
    torch.testing.assert_close(blocks.double(), out, rtol=1e-5, atol=1e-5)
    # and the high word matters: row 2³² + 5 is not row 5
    low = torch.empty(1, 4)
    _philox_normal(key, low, first_row=5)
    assert not torch.equal(low[0], blocks[0])


def test_kernel_ignores_the_default_dtype() -> None:
    """A caller running with float64 as default dtype gets the same numbers and no second
    compile of the kernel (dynamo guards on the default dtype)."""
    from torch._dynamo.utils import counters

    from sgrld.core.noise import keys_from_seeds, philox_normal_

    keys = keys_from_seeds([5], torch.device("cpu"))
    blocks = torch.empty(1, 16, 4)
    philox_normal_(blocks, keys)
    expected = blocks.clone()
    graphs = counters["stats"]["unique_graphs"]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        philox_normal_(blocks, keys)
    finally:
        torch.set_default_dtype(previous)
    assert torch.equal(blocks, expected)
    assert counters["stats"]["unique_graphs"] == graphs


_AFTER_BLOCK_RUNNER = """
import sys, torch, sgrld
from sgrld.core.multistep import BlockRunner
from sgrld.core.noise import keys_from_seeds, philox_normal_

if sys.argv[1] == "after":  # a compiled multi-step run first, as the funnel does
    sampler = sgrld.build("identity", lr=0.01, num_data=1.0, adapt_until=None)
    state = sampler.init({"theta": torch.zeros(2, 2, dtype=torch.float64)}, num_chains=2)
    runner = BlockRunner(
        sampler, state, lambda theta, noise: theta + noise,
        grad_generator=torch.Generator().manual_seed(0), block=2, chunk=4,
    )
    runner.run(4, lambda start, chunk: None)
    assert runner.compile_error is None
for dtype, width in ((torch.float32, 4), (torch.float64, 2)):
    blocks = torch.empty(2, 64, width, dtype=dtype)
    philox_normal_(blocks, keys_from_seeds([1, 2], torch.device("cpu")))
    print(repr(blocks.sum().item()), repr(blocks.abs().max().item()))
"""


@pytest.mark.slow
def test_kernel_is_right_after_a_compiled_block_runner() -> None:
    """Regression: BlockRunner once compiled with ``cpp.vec_isa_ok=False``, which left inductor's
    cached SIMD state inconsistent for the process: the Philox kernel compiled after it failed to
    build, or (with that cache cleared) built and returned garbage (up to 2.6e38 off)."""
    import subprocess
    import sys

    def draw(mode: str) -> str:
        done = subprocess.run(
            [sys.executable, "-c", _AFTER_BLOCK_RUNNER, mode],
            capture_output=True,
            text=True,
            check=True,
            timeout=600,
        )
        return done.stdout

    assert draw("after") == draw("alone")


@pytest.mark.slow  # a dozen compilations of the kernel
def test_the_kernel_compiles_every_dtype_and_size_one_dimension_in_one_process() -> None:
    """Dynamo compiles the kernel once per dtype and per size-1 dimension (one chain, one
    counter) even with ``dynamic=True``: 3 dtypes × 1 or 3 chains × 1 or 5 counters are 12
    forms, beyond torch's default recompile limit of 8, and none may fall back to eager."""
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        for chains in (1, 3):
            for size in (1, 5):
                buf = NoiseBuffer((chains, 4 * size), dtype, torch.device("cpu"))
                keys = keys_from_seeds(list(range(chains)), torch.device("cpu"))
                assert torch.isfinite(buf.draw(torch.Generator(), "philox", keys, _step(1))).all()
    assert not noise_mod._compile_failed
