"""The funnel experiment: target, exact draws, distances, fast path, CLI."""

from __future__ import annotations

import argparse
import io
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import sgrld
from sgrld.cli import main
from sgrld.core.multistep import BlockRunner
from sgrld.data.funnel import FunnelTarget
from sgrld.evaluation.distances import ks_normal, wasserstein1_normal
from sgrld.experiments.base.progress import Progress
from sgrld.experiments.funnel import run as funnel

TARGET = FunnelTarget()


def _points(n: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, generator=g, dtype=torch.float64) * torch.tensor([3.0, 6.0])
    return x.double()


# ---------------------------------------------------------------------- target


def test_log_prob_is_the_papers_funnel() -> None:
    x = torch.tensor([[0.5, -1.5], [4.0, 3.0]], dtype=torch.float64)
    var = torch.nn.functional.softplus(x[:, 1])  # the VARIANCE of θ₁
    normal = torch.distributions.Normal
    zero = torch.zeros((), dtype=torch.float64)
    expected = normal(zero + 2.0, var.sqrt()).log_prob(x[:, 0]) + normal(
        zero, zero + math.sqrt(80.0)
    ).log_prob(x[:, 1])
    torch.testing.assert_close(TARGET.log_prob(x), expected, rtol=1e-12, atol=1e-12)


def test_gradient_matches_autograd() -> None:
    x = _points().requires_grad_(True)
    (auto,) = torch.autograd.grad(TARGET.log_prob(x).sum(), x)
    torch.testing.assert_close(TARGET.grad_log_prob(x.detach()), auto, rtol=1e-10, atol=1e-12)


def test_hvp_matches_autograd() -> None:
    x = _points(16)
    w = _points(16, seed=1)
    for xi, wi in zip(x, w, strict=True):
        hess = torch.autograd.functional.hessian(lambda z: TARGET.log_prob(z), xi)
        torch.testing.assert_close(TARGET.hvp_log_prob(xi, wi), hess @ wi, rtol=1e-9, atol=1e-12)


def test_gradient_is_clipped_by_norm_in_the_neck() -> None:
    x = torch.tensor([[10.0, -40.0], [2.0, 0.0]], dtype=torch.float64)
    g = TARGET.grad_log_prob(x)
    assert torch.linalg.vector_norm(g[0]).item() == pytest.approx(1e11, rel=1e-12)
    raw = torch.tensor([-(10.0 - 2.0), 0.0])  # direction: ∂θ₁ dominates, −(θ₁−μ)/sp(v) < 0
    assert g[0, 0] < 0 and abs(g[0, 1]) > abs(raw[1])
    assert torch.linalg.vector_norm(g[1]) < 1.0  # unclipped elsewhere


def test_potential_gradient_flips_the_sign_and_adds_noise() -> None:
    x, noise = _points(4), _points(4, seed=3)
    torch.testing.assert_close(
        TARGET.potential_grad(x, noise), -(TARGET.grad_log_prob(x) + noise), rtol=0, atol=0
    )


def test_exact_draws_have_the_right_marginals() -> None:
    draws = TARGET.sample(20_000, generator=torch.Generator().manual_seed(0))
    v, t1 = draws[:, 1], draws[:, 0]
    # KS critical value at the 0.1% level: 1.95/sqrt(n)
    crit = 1.95 / math.sqrt(v.numel())
    assert ks_normal(v, 0.0, math.sqrt(80.0)) < crit
    z = (t1 - 2.0) / torch.nn.functional.softplus(v).sqrt()
    assert ks_normal(z) < crit
    assert TARGET.prob_v_below(-5.0) == pytest.approx(0.2881, abs=1e-4)
    assert float((v < -5).double().mean()) == pytest.approx(0.2881, abs=0.015)


# ---------------------------------------------------------------------- distances


def test_ks_matches_scipy() -> None:
    stats = pytest.importorskip("scipy.stats")
    x = np.random.default_rng(0).normal(0.3, 2.0, size=101)
    assert ks_normal(x, 0.0, 2.0) == pytest.approx(
        stats.kstest(x, "norm", (0.0, 2.0)).statistic, abs=1e-14
    )


def test_wasserstein_matches_numerical_integration() -> None:
    integrate = pytest.importorskip("scipy.integrate")
    stats = pytest.importorskip("scipy.stats")
    x = np.sort(np.random.default_rng(1).normal(0.5, 1.5, size=6))
    law = stats.norm(0.0, 1.5)
    n = x.size
    # W1 = ∫|F_n − F| dx, piecewise, with the kink of |i/n − F| at the quantile F⁻¹(i/n).
    total = integrate.quad(law.cdf, -np.inf, x[0])[0]
    total += integrate.quad(law.sf, x[-1], np.inf)[0]
    for i in range(n - 1):
        q = law.ppf((i + 1) / n)
        kink = [q] if x[i] < q < x[i + 1] else None
        part = integrate.quad(
            lambda t, i=i: abs((i + 1) / n - law.cdf(t)), x[i], x[i + 1], points=kink
        )
        total += part[0]
    assert wasserstein1_normal(x, 0.0, 1.5) == pytest.approx(total, rel=1e-10)


def test_distances_of_a_shifted_normal() -> None:
    shift = 0.7
    x = torch.randn(400_000, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    x = x * 3.0 + shift
    # W1 between N(δ, σ²) and N(0, σ²) is δ; KS is 2Φ(δ/2σ) − 1.
    assert wasserstein1_normal(x, 0.0, 3.0) == pytest.approx(shift, abs=0.02)
    ks = math.erf(shift / 2 / 3.0 / math.sqrt(2))
    assert ks_normal(x, 0.0, 3.0) == pytest.approx(ks, abs=0.004)


def test_distances_at_the_quantiles_are_small() -> None:
    n = 1000
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    x = torch.special.ndtri(u)
    assert ks_normal(x) == pytest.approx(0.5 / n, rel=1e-9)
    assert wasserstein1_normal(x) < 5.0 / n


def test_distances_reject_bad_input() -> None:
    with pytest.raises(ValueError, match="empty"):
        ks_normal([])
    with pytest.raises(ValueError, match="NaN"):
        wasserstein1_normal([0.0, float("nan")])
    with pytest.raises(ValueError, match="std"):
        ks_normal([0.0], 0.0, 0.0)


# ---------------------------------------------------------------------- the fast path


def _funnel_state(
    name: str, chains: int = 1, seed: int = 0, noise: str = "torch"
) -> tuple[sgrld.Sampler, sgrld.SamplerState]:
    s = funnel.SETTINGS[name]
    sampler = sgrld.build(
        s.metric, lr=s.lr, num_data=1.0, noise=noise, adapt_until=None, **s.options
    )
    start = torch.ones(chains, 2, dtype=torch.float64)
    state = sampler.init(
        {"theta": start}, num_chains=chains, generator=torch.Generator().manual_seed(seed)
    )
    return sampler, state


def _eager_reference(
    name: str, steps: int, chunk: int, chains: int = 1, noise: str = "torch", adapt: bool = True
) -> torch.Tensor:
    """``sampler.step`` in a loop, with the gradient noise drawn as BlockRunner draws it."""
    sampler, state = _funnel_state(name, chains, noise=noise)
    grad_gen = torch.Generator().manual_seed(1)
    noise = torch.empty(chunk, chains, 2, dtype=torch.float64)
    theta = state.params["theta"]
    out = []
    for k in range(steps):
        if k % chunk == 0:
            noise[: min(chunk, steps - k)].normal_(generator=grad_gen)
        grad = TARGET.potential_grad(theta, noise[k % chunk])
        sampler.step(state, {"theta": grad}, adapt=adapt)
        out.append(theta.clone())
    return torch.stack(out)


def _fast(
    name: str,
    steps: int,
    *,
    compile: bool,
    chains: int = 1,
    block: int = 4,
    noise: str = "torch",
    adapt: bool = True,
) -> torch.Tensor:
    sampler, state = _funnel_state(name, chains, noise=noise)
    out: list[torch.Tensor] = []
    runner = BlockRunner(
        sampler,
        state,
        TARGET.potential_grad,
        grad_generator=torch.Generator().manual_seed(1),
        block=block,
        compile=compile,
        noise="exact",
        chunk=40,
        adapt=adapt,
    )
    runner.run(steps, lambda first, it: out.append(it.clone()))
    assert state.step == steps
    assert runner.compile_error is None
    return torch.cat(out)


@pytest.mark.parametrize("name", list(funnel.SETTINGS))
def test_block_runner_is_the_library_step(name: str) -> None:
    """Eagerly, the fast path's block function is bit-for-bit ``sampler.step`` (exact noise)."""
    steps = 103  # chunks of 40 and a partial block
    torch.testing.assert_close(
        _fast(name, steps, compile=False, chains=2),
        _eager_reference(name, steps, 40, 2),
        rtol=0,
        atol=0,
    )


@pytest.mark.parametrize(("name", "adapt"), [("rmsprop", True), ("monge", True), ("monge", False)])
def test_block_runner_philox_and_frozen_metric_are_the_library_step(name: str, adapt: bool) -> None:
    """Counter-based noise draws the eager stream in blocks; adapt=False freezes G as in step."""
    steps = 50
    torch.testing.assert_close(
        _fast(name, steps, compile=False, chains=2, noise="philox", adapt=adapt),
        _eager_reference(name, steps, 40, 2, noise="philox", adapt=adapt),
        rtol=0,
        atol=0,
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", list(funnel.SETTINGS))
def test_compiled_block_runner_matches_the_library_step(name: str) -> None:
    steps = 203
    torch.testing.assert_close(
        _fast(name, steps, compile=True), _eager_reference(name, steps, 40), rtol=1e-10, atol=1e-12
    )


def test_block_runner_rejects_bad_arguments() -> None:
    sampler, state = _funnel_state("identity")
    gen = torch.Generator()
    with pytest.raises(ValueError, match="block"):
        BlockRunner(sampler, state, TARGET.potential_grad, grad_generator=gen, block=0)
    with pytest.raises(ValueError, match="noise"):
        BlockRunner(sampler, state, TARGET.potential_grad, grad_generator=gen, noise="x")  # type: ignore[arg-type]


# ---------------------------------------------------------------------- the experiment


def test_stationarity_check_from_exact_draws() -> None:
    """Chains started from exact draws stay close to N(0, 80) (short run, pooled over chains)."""
    config = funnel.FunnelConfig(steps=300, chains=256, start="exact", compile=False, scatter=10)
    run = funnel.run_sampler("monge", config)
    assert run.thinned.shape == (30, 2)
    assert len(run.distances["ks"]) == 256
    # 300 steps barely move a chain, so the pooled sample is worth about 256 draws: the 0.1%
    # KS critical value is 1.95/16. Starting at (1, 1) instead is far off (KS ≈ 0.5).
    assert run.pooled is not None
    assert run.pooled["ks"] < 1.95 / 16
    assert run.pooled["frac_v_below_minus5"] == pytest.approx(0.2881, abs=0.1)


def test_sampler_order_and_shared_noise_streams() -> None:
    config = funnel.FunnelConfig(steps=50, compile=False, scatter=5)
    a = funnel.run_funnel(["monge", "identity"], config, progress=False)
    b = funnel.run_funnel(["identity"], config, progress=False)
    assert list(a) == ["monge", "identity"]
    np.testing.assert_array_equal(a["identity"].thinned, b["identity"].thinned)


def test_cli_writes_all_three_outputs(tmp_path: Path) -> None:
    out = tmp_path / "run"
    code = main(
        [
            "funnel",
            "--out",
            str(out),
            "--steps",
            "200",
            "--chains",
            "2",
            "--no-compile",
            "--jobs",
            "1",
            "--no-progress",
        ]
    )
    assert code == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(funnel.OUTPUT_FILES)
    result = json.loads((out / "funnel.json").read_text())
    assert result["config"]["steps"] == 200 and result["config"]["chains"] == 2
    assert result["target"]["truth"]["frac_v_below_minus5"] == pytest.approx(0.2881, abs=1e-4)
    assert list(result["samplers"]) == ["identity", "rmsprop", "monge", "shampoo"]
    for name, entry in result["samplers"].items():
        assert entry["settings"] == funnel.SETTINGS[name].as_dict()
        assert entry["wall_seconds"] > 0
        for key in ("wasserstein1", "ks", "frac_v_below_minus5", "min_v"):
            d = entry["distances"][key]
            assert set(d) == {"mean", "std", "min", "max", "per_chain"}
            assert len(d["per_chain"]) == 2
    assert result["samplers"]["monge"]["settings"]["fallback_threshold"] == 1000.0
    with np.load(out / "funnel_samples.npz") as npz:
        assert sorted(npz.files) == sorted(funnel.SETTINGS)
        assert all(npz[k].shape == (20, 2) for k in npz.files)
    assert (out / "funnel.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("steps", ["0", "-3", "1.5", "many"])
def test_cli_rejects_bad_steps(
    tmp_path: Path, steps: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["funnel", "--out", str(tmp_path / "o"), "--steps", steps])
    assert exc.value.code == 2
    assert "positive integer" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_cli_rejects_unknown_samplers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["funnel", "--out", str(tmp_path / "o"), "--samplers", "identity,hmc"])
    assert code == 2
    assert "unknown sampler(s) 'hmc'" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_cli_rejects_an_unwritable_out_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    code = main(["funnel", "--out", str(blocker / "sub"), "--steps", "10"])
    assert code == 74  # EX_IOERR, as sample and every command
    assert "cannot write to --out" in capsys.readouterr().err


def test_failed_outputs_leave_nothing_half_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_plot(runs: object, path: object, **options: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(funnel, "plot_funnel", broken_plot)
    code = main(
        [
            "funnel",
            "--out",
            str(tmp_path),
            "--steps",
            "20",
            "--samplers",
            "identity",
            "--no-compile",
            "--jobs",
            "1",
            "--no-progress",
        ]
    )
    assert code == 74  # EX_IOERR: an output could not be written
    assert list(tmp_path.iterdir()) == []


def test_progress_bar() -> None:
    quiet = io.StringIO()
    with Progress(10, "x", stream=quiet) as bar:
        bar.update(4)
        bar.update(6)
    assert quiet.getvalue().startswith("x: 10/10 in ")
    live = io.StringIO()
    with Progress(10, "y", stream=live, enabled=True, min_interval=0.0) as bar:
        bar.update(5)
    assert "\r" in live.getvalue() and "50.0%" in live.getvalue()
    silent = io.StringIO()
    with Progress(10, "z", stream=silent, enabled=False) as bar:
        bar.update(10)
    assert silent.getvalue() == ""


def test_demo_is_the_shortened_funnel(tmp_path: Path) -> None:
    args = ["demo", "--out", str(tmp_path), "--steps", "30", "--samplers", "identity,monge"]
    assert main([*args, "--no-compile", "--jobs", "1", "--no-progress", "--no-plot"]) == 0
    result = json.loads((tmp_path / "funnel.json").read_text())
    assert result["config"]["steps"] == 30 and list(result["samplers"]) == ["identity", "monge"]
    assert not (tmp_path / "funnel.png").exists()


def test_demo_runs_eagerly_explains_its_columns_and_why_no_wenzel(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from sgrld.cli import build_parser

    args = build_parser().parse_args(["demo"])
    assert (args.steps, args.chains, args.compile) == (20_000, 32, False)  # no compile: no pay-off
    assert build_parser().parse_args(["funnel", "--out", "x"]).compile is True
    argv = ["demo", "--out", str(tmp_path), "--steps", "30", "--samplers", "sgld"]
    assert main([*argv, "--jobs", "1", "--no-progress", "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert "eager (no compilation)" in out and "Wenzel is Identity here step for step" in out
    for column in ("W1(v), KS(v)", "P(v<-5)", "KSD(v)", "ESS/s", "run s"):
        assert column in out.split("How to read it")[1]
    assert "lower is better" in out and "higher is" in out and "(0.288)" in out
    assert re.search(r"s wall for the samplers \(1 at a time\); .* 0\.0 s compiling", out)
    assert main(["demo", "--out", str(tmp_path / "w"), "--samplers", "wenzel"]) == 2
    assert "Wenzel is Identity here" in capsys.readouterr().err


def _demo_help(parser: argparse.ArgumentParser) -> str:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return str(action.choices["demo"].format_help())


def test_demo_says_per_sampler_what_its_chains_show(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One line per sampler against the truth (with its spread), one naming the longer run;
    the help names the samplers that run and the chains."""
    from sgrld.cli import build_parser

    argv = ["demo", "--out", str(tmp_path), "--steps", "60", "--chains", "3", "--jobs", "1"]
    assert main([*argv, "--samplers", "identity,monge", "--no-progress", "--no-plot"]) == 0
    words = capsys.readouterr().out.split("What the numbers show")[1].splitlines()
    assert "over 3 chains" in words[0]
    assert words[1].lstrip().startswith("identity: ") and "(truth 29%)" in words[1]
    assert words[2].lstrip().startswith("monge: ") and "identity" in words[2]
    assert "±" in words[1] and "±" in words[2]
    assert "Longer: sgrld funnel --out DIR" in words[3]  # 60 steps cannot rank them
    text = " ".join(_demo_help(build_parser()).split())
    assert "all of them" not in text and "but wenzel" in text and "(default 32)" in text


def _chains(neck: list[float], depth: list[float], w1: list[float]) -> dict[str, list[float]]:
    return {"frac_v_below_minus5": neck, "min_v": depth, "wasserstein1": w1}


def test_verdicts_weigh_each_sampler_against_the_truth_with_its_spread() -> None:
    from sgrld.experiments.funnel.verdict import verdicts

    runs = {
        "identity": _chains(
            [0.02, 0.05, 0.04, 0.03], [-3.0, -4.0, -3.5, -4.5], [6.0, 6.2, 5.8, 6.1]
        ),
        "monge": _chains([0.2, 0.35, 0.3, 0.28], [-12.0, -15.0, -9.0, -11.0], [2.0, 2.1, 1.9, 2.2]),
        "shampoo": _chains([0.6, 0.5, 0.55, 0.7], [-4.0, -3.0, -4.5, -3.5], [6.0, 6.3, 5.9, 6.1]),
    }
    lines = verdicts(runs, 0.288, baseline="identity", longer="LONGER")
    assert lines[0].startswith("identity: under-visits the neck: 4% ± ")
    assert lines[1].startswith("monge: its mass in the neck agrees with the truth: 28% ± ")
    assert lines[1].endswith("(deeper than identity: the paper's Figure 2)")
    assert "over-visits the neck" in lines[2] and "not separated from identity's" in lines[2]
    assert lines[3].startswith("W1 to N(0, 80) (0 is exact): closest monge, 2.05 ± ")
    assert "farther beyond 2 standard errors: identity 6.03" in lines[3]
    assert "shampoo 6.08" in lines[3] and "LONGER" not in lines[3]
    runs["monge"]["wasserstein1"] = [6.0, 4.0, 8.0, 5.0]  # overlapping spreads: says so
    last = verdicts(runs, 0.288, baseline="identity", longer="LONGER")[-1]
    assert "Not shown by this run: which of monge, identity, shampoo" in last
    assert last.endswith("best (their spreads overlap). Longer: LONGER")
    one = verdicts({"monge": _chains([0.3], [-9.0], [2.0])}, 0.288, baseline=None, longer="L")
    assert "one chain has no spread to judge by" in one[0]


def test_funnel_figure_names_every_line_it_draws() -> None:
    from sgrld.experiments.funnel.figure import funnel_figure

    runs = {}
    for name, neck in (("identity", 0.05), ("monge", 0.3)):
        draws = FunnelTarget().sample(500, generator=torch.Generator().manual_seed(1)).numpy()
        density, edges = np.histogram(draws[:, 1], bins=30, density=True)
        runs[name] = funnel.SamplerRun(
            name=name,
            settings={},
            wall_seconds=1.0,
            compile_seconds=0.0,
            distances=_chains([neck, neck + 0.01, neck - 0.01], [-5.0, -6.0, -7.0], [1, 2, 3]),
            thinned=draws,
            scatter=draws[:100],
            hist_density=density,
            hist_edges=edges,
        )
    fig = funnel_figure(runs, title="3 chains")
    labels: set[str] = set()
    for ax in fig.get_axes():
        if ax.get_visible() and (ax.lines or ax.collections or ax.patches):
            legend = ax.get_legend()
            assert legend is not None, ax.get_title()
            labels |= {t.get_text() for t in legend.get_texts()}
    expected = {"log-density contours (−10 … −2.5)", "100 iterates of 3 chains"}
    expected |= {"v = −5: below it, the neck", "v, 3 chains pooled", "exact N(0, 80)"}
    expected |= {"one chain", "mean ± 2 standard errors", "truth (0.288)"}
    assert labels == expected
