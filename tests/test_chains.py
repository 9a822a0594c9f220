"""sgrld.Chains: chain s of a K-chain run is the single run with seed s (float64, every sampler)."""

from __future__ import annotations

import io
import math
import re
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

import sgrld
from conftest import REPO, SAMPLERS, SamplerSpec
from sgrld.chains import Chains, chain_batches
from sgrld.evaluation.chain_ensemble import ChainEnsemble, evaluate_chains
from sgrld.evaluation.ensemble import EnsemblePredictive
from sgrld.models import BayesianModel, potential
from sgrld.models.fc import FullyConnected
from sgrld.models.resnet20 import ResNet20

N = 200  # n of the potential
K, STEPS, BATCH = 4, 50, 6
SEEDS = [11, 3, 2**40 + 7, 0]
WENZEL_EVERY = 10  # Wenzel's explicit refresh ("epoch end")


def make_mlp(seed: int) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    net = FullyConnected(8, in_features=6, num_classes=3)
    return BayesianModel(net, "horseshoe", generator=gen).double()


def make_resnet(seed: int) -> nn.Module:
    """ResNet-20 (3 stages of 3 BasicBlocks, BatchNorm everywhere) at widths 2-3-4."""
    gen = torch.Generator().manual_seed(seed)
    net = ResNet20(num_classes=3, in_channels=2, widths=(2, 3, 4))
    return BayesianModel(net, "gaussian", generator=gen).double()


MODELS = {"mlp": (make_mlp, (6,)), "resnet20": (make_resnet, (2, 6, 6))}
# ℓ of the equivalence runs. Batched (vmap) and single kernels round differently (1e-16 after one
# step); the dynamics amplify that. Through BatchNorm on 6-image batches of this 2-channel net at
# ℓ = 0.02 it grows to ~2e-10 in 50 steps (measured), at ℓ = 0.01 to < 1e-11: the test takes
# the latter so that 1e-10 tests the bookkeeping, not the chaos of the chain.
LR = {"mlp": 0.02, "resnet20": 0.01}


def loss_fn(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return potential(model, x, y, N)  # type: ignore[arg-type]


def data(shape: tuple[int, ...], steps: int = STEPS, k: int = K) -> tuple[Tensor, Tensor]:
    """Each chain its own minibatches: (K, steps, B, ...)."""
    gen = torch.Generator().manual_seed(42)
    x = torch.randn(k, steps, BATCH, *shape, generator=gen, dtype=torch.float64)
    return x, torch.randint(0, 3, (k, steps, BATCH), generator=gen)


def single_run(
    make: Callable[[int], nn.Module],
    sampler: sgrld.Sampler,
    seed: int,
    x: Tensor,
    y: Tensor,
    poison_at: int | None = None,
) -> tuple[nn.Module, sgrld.SamplerState]:
    """The reference: one model, one sampler state keyed by ``seed``, autograd, no vmap."""
    model = make(seed).train()
    params = dict(model.named_parameters())
    state = sampler.init(params, seeds=[seed])
    for t in range(x.shape[0]):
        grads = torch.autograd.grad(loss_fn(model, x[t], y[t]), list(params.values()))
        with torch.no_grad():
            sampler.step(state, dict(zip(params, grads, strict=True)))
        if sampler.metric.name == "wenzel" and (t + 1) % WENZEL_EVERY == 0:
            sampler.refresh(state)
    return model, state


def run_chains(chains: Chains, x: Tensor, y: Tensor) -> None:
    for t in range(x.shape[1]):
        chains.step(loss_fn, x[:, t], y[:, t])
        if chains.groups[0].sampler.metric.name == "wenzel" and (t + 1) % WENZEL_EVERY == 0:
            chains.refresh()


def assert_close(a: Tensor, b: Tensor, what: str) -> None:
    """≤ 1e-10 relative to the tensor's scale (exact for integer buffers)."""
    if not a.is_floating_point():
        assert torch.equal(a, b), what
        return
    scale = max(float(b.abs().max()), 1e-300)
    err = float((a - b).abs().max()) / scale
    assert err <= 1e-10, f"{what}: relative error {err:.3g}"


def assert_chain_is_single(chains: Chains, k: int, model: nn.Module, state: sgrld.SamplerState):
    for name, p in model.named_parameters():
        assert_close(chains.params[name][k], p.detach(), f"chain {k} parameter {name}")
    for name, b in model.named_buffers():
        assert_close(chains.buffers[name][k], b, f"chain {k} buffer {name}")
    for key, v in chains.stats().items():
        assert_close(v[k], state.stats[key], f"chain {k} statistic {key}")


def _model_cases() -> list[object]:
    return [
        pytest.param(name, marks=[pytest.mark.slow] if name == "resnet20" else [])
        for name in MODELS
    ]


@pytest.mark.parametrize("model_name", _model_cases())
def test_chain_s_of_a_k_chain_run_is_the_single_run_with_seed_s(
    spec: SamplerSpec, model_name: str
) -> None:
    make, shape = MODELS[model_name]
    x, y = data(shape)
    sampler = spec.make_sampler(lr=LR[model_name], num_data=N, noise="philox")
    chains = Chains(make, sampler, SEEDS)
    run_chains(chains, x, y)
    assert chains.step_count == STEPS and chains.failures() == {}
    if model_name == "resnet20":  # the running statistics moved, per chain
        mean = chains.buffers["net.stem.1.running_mean"]
        assert not torch.equal(mean[0], mean[1]) and bool((mean != 0).all())
    for k, seed in enumerate(SEEDS):
        model, state = single_run(make, sampler, seed, x[k], y[k])
        assert_chain_is_single(chains, k, model, state)


def test_narrow_resnet20_batchnorm_buffers_follow_each_chain() -> None:
    """Fast check of stacked BatchNorm statistics under vmap (the full case is slow)."""
    x, y = data((2, 6, 6), steps=3)
    sampler = sgrld.build("identity", lr=0.02, num_data=N, noise="philox")
    chains = Chains(make_resnet, sampler, SEEDS)
    run_chains(chains, x, y)
    assert int(chains.buffers["net.stem.1.num_batches_tracked"][2]) == 3
    model, state = single_run(make_resnet, sampler, SEEDS[2], x[2], y[2])
    assert_chain_is_single(chains, 2, model, state)
    chains.eval()  # eval mode: each chain's own running statistics, no update
    before = {n: b.clone() for n, b in chains.buffers.items()}
    out = chains(x[:, 0, :2])
    model.eval()
    torch.testing.assert_close(out[2], model(x[2, 0, :2]), rtol=1e-12, atol=1e-14)
    assert all(torch.equal(b, before[n]) for n, b in chains.buffers.items())


@pytest.mark.parametrize("chain_batch", [1, 3])
def test_chain_batch_splits_the_calls_and_changes_no_chain(chain_batch: int) -> None:
    """Chains in groups of ``chain_batch`` (ResNet-20: BatchNorm buffers through the slices)."""
    x, y = data((2, 6, 6), steps=6)
    sampler = sgrld.build("monge", lr=0.01, num_data=N, noise="philox", alpha2=1.0)
    chains = Chains(make_resnet, sampler, SEEDS, chain_batch=chain_batch)
    assert [g.stop - g.start for g in chains.groups] == ([1] * 4 if chain_batch == 1 else [3, 1])
    run_chains(chains, x, y)
    for k, seed in enumerate(SEEDS):
        model, state = single_run(make_resnet, sampler, seed, x[k], y[k])
        assert_chain_is_single(chains, k, model, state)
    chains.eval()
    out = chains(x[:, 0])
    torch.testing.assert_close(out[3], model.eval()(x[3, 0]), rtol=1e-12, atol=1e-14)
    losses, grads = chains.grads(loss_fn, x[:, 0], y[:, 0])
    assert losses.shape == (4,) and grads["net.head.2.weight"].shape == (4, 3, 4)


def test_per_chain_lr_and_alpha2_equal_single_runs_with_those_values() -> None:
    """ℓ and α² per chain; α² in three runs (2, 1, 1 chains: non-adjacent equal values too)."""
    lrs, alphas = [0.01, 0.03, 0.02, 0.04], [0.5, 0.5, 2.0, 0.5]
    x, y = data((6,))
    sampler = sgrld.build("monge", lr=0.02, num_data=N, noise="philox", decay=0.8)
    chains = Chains(make_mlp, sampler, SEEDS, lr=lrs, alpha2=alphas)
    assert [(g.start, g.stop) for g in chains.groups] == [(0, 2), (2, 3), (3, 4)]
    run_chains(chains, x, y)
    for k, seed in enumerate(SEEDS):
        one = sgrld.build(
            "monge", lr=lrs[k], num_data=N, noise="philox", decay=0.8, alpha2=alphas[k]
        )
        model, state = single_run(make_mlp, one, seed, x[k], y[k])
        assert_chain_is_single(chains, k, model, state)


@pytest.mark.parametrize("spec_", SAMPLERS, ids=[s.name for s in SAMPLERS])
def test_per_chain_lr_from_the_sampler_equals_single_runs(spec_: SamplerSpec) -> None:
    lrs = [0.01, 0.03, 0.02, 0.04]
    x, y = data((6,), steps=12)
    sampler = spec_.make_sampler(
        lr=torch.tensor(lrs, dtype=torch.float64), num_data=N, noise="philox"
    )
    chains = Chains(make_mlp, sampler, SEEDS)
    run_chains(chains, x, y)
    for k in (0, 3):
        one = spec_.make_sampler(lr=lrs[k], num_data=N, noise="philox")
        model, state = single_run(make_mlp, one, SEEDS[k], x[k], y[k])
        assert_chain_is_single(chains, k, model, state)


@pytest.mark.parametrize("model_name", ["mlp", "resnet20"])
@pytest.mark.parametrize("sync_checks", [None, False], ids=["host-check", "deferred"])
@pytest.mark.parametrize("chain_batch", [None, 2])
def test_a_broken_chain_is_frozen_and_reported_and_the_others_go_on(
    model_name: str, sync_checks: bool | None, chain_batch: int | None
) -> None:
    """Chain 1 gets a NaN input at step 5. On CPU the default reads one sum per chain and steps
    unchecked while all are finite; ``sync_checks=False`` takes the deferred path every step."""
    make, shape = MODELS[model_name]
    x, y = data(shape, steps=8)
    bad = x.clone()
    bad[1, 4, 0] = math.nan  # chain 1's 5th minibatch
    sampler = sgrld.build(
        "monge", lr=0.02, num_data=N, noise="philox", alpha2=1.0, sync_checks=sync_checks
    )
    chains = Chains(make, sampler, SEEDS, chain_batch=chain_batch)
    run_chains(chains, bad[:, :4], y[:, :4])
    frozen = {n: t[1].clone() for n, t in {**chains.params, **chains.buffers}.items()}
    frozen_stats = {n: v[1].clone() for n, v in chains.stats().items()}
    run_chains(chains, bad[:, 4:], y[:, 4:])
    assert chains.failures() == {1: 5}
    for n, t in {**chains.params, **chains.buffers}.items():
        assert torch.equal(t[1], frozen[n]), n
    for n, v in chains.stats().items():
        assert torch.equal(v[1], frozen_stats[n]), n
    for k in (0, 2, 3):
        model, state = single_run(make, sampler, SEEDS[k], x[k], y[k])
        assert_chain_is_single(chains, k, model, state)
    with pytest.raises(sgrld.NonFiniteGradientError, match=r"chain 1 \(seed 3\) at step 5"):
        chains.check()


def test_sync_checks_raise_at_once_and_move_no_chain() -> None:
    x, y = data((6,), steps=2)
    x[2, 1, 0] = math.inf
    sampler = sgrld.build("monge", lr=0.02, num_data=N, noise="philox", sync_checks=True)
    chains = Chains(make_mlp, sampler, SEEDS, alpha2=[1.0, 1.0, 2.0, 3.0])  # three calls
    chains.step(loss_fn, x[:, 0], y[:, 0])
    before = {n: p.clone() for n, p in chains.params.items()}
    with pytest.raises(sgrld.NonFiniteGradientError, match=r"chain 2 \(seed 1099511627783\)"):
        chains.step(loss_fn, x[:, 1], y[:, 1])
    assert all(torch.equal(p, before[n]) for n, p in chains.params.items())
    assert chains.step_count == 1


def test_a_broken_chain_stays_frozen_after_resume() -> None:
    x, y = data((6,), steps=3)
    x[1, 1, 0] = math.nan
    sampler = sgrld.build("identity", lr=0.02, num_data=N, noise="philox")
    chains = Chains(make_mlp, sampler, SEEDS)
    run_chains(chains, x[:, :2], y[:, :2])
    resumed = Chains(make_mlp, sampler, SEEDS)
    resumed.load_state_dict(chains.state_dict())
    frozen = {n: p[1].clone() for n, p in resumed.params.items()}
    resumed.step(loss_fn, x[:, 2], y[:, 2])  # every gradient finite this step
    assert resumed.failures() == {1: 2}
    assert all(torch.equal(p[1], frozen[n]) for n, p in resumed.params.items())


def test_noise_seeds_key_the_noise_and_seeds_the_initialisation() -> None:
    x, y = data((6,), steps=3, k=2)
    sampler = sgrld.build("rmsprop", lr=0.02, num_data=N, noise="philox")
    chains = Chains(make_mlp, sampler, [5, 6], noise_seeds=[70, 80])
    run_chains(chains, x, y)
    for k, (seed, key) in enumerate(((5, 70), (6, 80))):
        model = make_mlp(seed).train()
        params = dict(model.named_parameters())
        state = sampler.init(params, seeds=[key])
        for t in range(3):
            grads = torch.autograd.grad(loss_fn(model, x[k, t], y[k, t]), list(params.values()))
            with torch.no_grad():
                sampler.step(state, dict(zip(params, grads, strict=True)))
        assert_chain_is_single(chains, k, model, state)


def test_chains_from_a_module_start_every_chain_there() -> None:
    template = make_mlp(5)
    chains = Chains(template, sgrld.build("identity", lr=0.01, num_data=N, noise="philox"), [0, 1])
    for name, p in template.named_parameters():
        assert torch.equal(chains.params[name][0], p) and torch.equal(chains.params[name][1], p)
    x, y = data((6,), steps=1, k=2)
    chains.step(loss_fn, x[:, 0], y[:, 0])
    w = chains.params["net.fc1.weight"]
    assert not torch.equal(w[0], w[1])  # their own noise
    assert torch.equal(template.net.fc1.weight, make_mlp(5).net.fc1.weight)  # copied, not moved


def test_state_dict_resume_is_bit_identical() -> None:
    x, y = data((2, 6, 6), steps=6)
    make = lambda: Chains(  # noqa: E731
        make_resnet,
        sgrld.build(
            "shampoo", lr=0.02, num_data=N, noise="philox", block_size=4, update_interval=3
        ),
        SEEDS,
    )
    straight = make()
    run_chains(straight, x, y)
    first = make()
    run_chains(first, x[:, :2], y[:, :2])
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    resumed = make()
    resumed.load_state_dict(torch.load(buf, weights_only=False))
    run_chains(resumed, x[:, 2:], y[:, 2:])
    for kind in ("params", "buffers"):
        for n, t in getattr(straight, kind).items():
            assert torch.equal(t, getattr(resumed, kind)[n]), n
    other = Chains(
        make_resnet,
        sgrld.build(
            "shampoo", lr=0.02, num_data=N, noise="philox", block_size=4, update_interval=3
        ),
        [1, 2, 3, 4],
    )
    with pytest.raises(ValueError, match="other chains"):
        other.load_state_dict(first.state_dict())


def test_chain_batches_follow_each_chains_generator() -> None:
    gens = [torch.Generator().manual_seed(s) for s in (4, 9)]
    batches = list(chain_batches(10, 4, gens))
    assert [tuple(b.shape) for b in batches] == [(2, 4), (2, 4), (2, 2)]
    for k, s in enumerate((4, 9)):
        ref = torch.randperm(10, generator=torch.Generator().manual_seed(s))
        assert torch.equal(torch.cat([b[k] for b in batches]), ref)


def test_chain_ensemble_equals_one_ensemble_per_chain() -> None:
    x, y = data((2, 6, 6), steps=2)
    chains = Chains(
        make_resnet, sgrld.build("identity", lr=0.02, num_data=N, noise="philox"), SEEDS
    )
    test_x = torch.randn(
        7, 2, 6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1)
    )
    labels = torch.tensor([0, 1, 2, 0, 1, 2, 0])
    ensemble = ChainEnsemble(K, 7, 3)
    singles = [EnsemblePredictive(7, 3) for _ in range(K)]
    for t in range(2):
        chains.train().step(loss_fn, x[:, t], y[:, t])
        chains.eval()
        evaluate_chains(lambda v: chains(v, shared=True), ensemble, test_x, batch_size=3)
        for k in range(K):
            with torch.no_grad():
                singles[k].add(chains.module(k).eval()(test_x))
    got = ensemble.metrics(labels)
    for k in range(K):
        want = singles[k].metrics(labels)
        assert got[k]["num_samples"] == want["num_samples"] == 2
        for key in ("lp", "accuracy", "ece", "confidence"):
            assert got[k][key] == pytest.approx(want[key], rel=1e-12, abs=1e-14), key
    restored = ChainEnsemble(K, 7, 3)
    restored.load_state_dict(ensemble.state_dict())
    assert restored.metrics(labels) == got


def test_bad_arguments_are_refused_clearly() -> None:
    with pytest.raises(ValueError, match="noise='philox'"):
        Chains(make_mlp, sgrld.build("identity", lr=0.1, num_data=N), [0, 1])
    philox = sgrld.build("identity", lr=0.1, num_data=N, noise="philox")
    with pytest.raises(ValueError, match="lr: 3 values for 2 chains"):
        Chains(make_mlp, philox, [0, 1], lr=[0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match="alpha2 per chain needs"):
        Chains(make_mlp, philox, [0, 1], alpha2=[1.0, 2.0])
    with pytest.raises(ValueError, match="seeds is empty"):
        Chains(make_mlp, philox, [])
    with pytest.raises(ValueError, match="invalid seed"):
        Chains(make_mlp, philox, [0, -1])
    with pytest.raises(ValueError, match="invalid chain_batch"):
        Chains(make_mlp, philox, [0, 1], chain_batch=0)
    with pytest.raises(ValueError, match="noise_seeds: 1 for 2"):
        Chains(make_mlp, philox, [0, 1], noise_seeds=[3])


def test_documented_example_runs() -> None:
    text = (REPO / "docs" / "chains.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S)
    assert code is not None
    namespace: dict[str, object] = {}
    exec(compile(code.group(1), "docs/chains.md", "exec"), namespace)
    assert namespace["chains"].failures() == {}  # type: ignore[attr-defined]


@pytest.mark.parametrize(("dtype", "bound"), [(torch.float64, 1e-13), (torch.float32, 1e-5)])
def test_chains_equal_single_runs_to_rounding_of_their_precision(
    dtype: torch.dtype, bound: float
) -> None:
    """What docs/chains.md claims: the same chain up to rounding, in either precision. Batched
    kernels add in another order than single ones, so the last bits differ from the first step
    (measured: float64 ~1e-16, float32 ~1e-7 relative after 50 steps); the bound is the
    precision's, with room for the amplification a short run adds."""

    def make(seed: int) -> nn.Module:
        gen = torch.Generator().manual_seed(seed)
        net = FullyConnected(8, in_features=6, num_classes=3)
        return BayesianModel(net, "horseshoe", generator=gen).to(dtype)

    x, y = data((6,))
    x = x.to(dtype)
    sampler = sgrld.build("monge", lr=LR["mlp"], num_data=N, noise="philox", alpha2=1.0)
    chains = Chains(make, sampler, SEEDS)
    run_chains(chains, x, y)
    for k, seed in enumerate(SEEDS):
        model, _ = single_run(make, sampler, seed, x[k], y[k])
        for name, p in model.named_parameters():
            chain = chains.params[name][k]
            assert chain.dtype == dtype
            err = float((chain - p.detach()).abs().max()) / float(p.detach().abs().max())
            assert err <= bound, f"chain {k} {name}: relative error {err:.3g}"


class _Point(nn.Module):
    def __init__(self, start: float) -> None:
        super().__init__()
        self.x = nn.Parameter(torch.full((2,), start, dtype=torch.float64))


@pytest.mark.slow  # 1,050 vmapped steps and the first Philox step's compile
def test_each_chain_freezes_its_metric_when_it_has_arrived() -> None:
    """Two chains of one group, one at the mode and one 60 away: the near one's G freezes at the
    default warm-up's 950 and stays so, the far one's waits (a window to 1,950 at least)."""
    prec = torch.tensor([[3.0, 1.0], [1.0, 2.0]], dtype=torch.float64)
    sampler = sgrld.build("rmsprop", lr=0.05, num_data=1.0, noise="philox")
    chains = Chains(lambda seed: _Point(60.0 * seed), sampler, [0, 1])
    state = chains.groups[0].state

    def loss(model: nn.Module) -> Tensor:
        return 0.5 * model.x @ prec @ model.x

    for _ in range(950):
        chains.step(loss)
    near = state.stats["inv_sqrt"][0].clone()
    for _ in range(100):
        chains.step(loss)
    assert state.warmup is not None and state.warmup.freeze_steps() == [950, 1950]
    assert torch.equal(state.stats["inv_sqrt"][0], near)
    assert chains.adapting
